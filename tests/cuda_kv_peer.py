"""The receiving process of `test_cuda.py`'s KV transfer; holds no tests itself.

    python cuda_kv_peer.py '<json spec>'

Reserves `sizes` bytes in CUDA tensors on `device`, prints `address <peer address>`,
waits for the commit, then prints `received <sha256 of each buffer>` and
`staged <bytes the receiver staged through host memory>`, or `error TYPE MESSAGE`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any


def say(line: str) -> None:
    print(line, flush=True)


async def receive(spec: dict[str, Any]) -> None:
    import torch

    from yb_dataplane.transport import KVReceiver, TransferError

    device = torch.device(spec["device"])
    receiver = KVReceiver()
    address = await receiver.start()
    buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for size in spec["sizes"]]
    reservation = receiver.reserve(spec["request_id"], buffers, deadline_s=spec["deadline_s"])
    say(f"address {address}")
    try:
        await reservation.wait_committed()
        torch.cuda.synchronize(device)
        digests = [hashlib.sha256(b.cpu().numpy().tobytes()).hexdigest() for b in buffers]
        say("received " + " ".join(digests))
        say(f"staged {receiver.staged_bytes}")
    except TransferError as exc:
        say(f"error {type(exc).__name__} {exc}")
    finally:
        await receiver.close()


if __name__ == "__main__":
    asyncio.run(receive(json.loads(sys.argv[1])))
