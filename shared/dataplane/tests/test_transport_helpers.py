"""The other process of the transport's process tests; holds no tests itself.

Run as a script: `python test_transport_helpers.py sender|receiver '<json spec>'`. The
process speaks to its parent through stdout lines (`ready`, `posting N`, `sent N`,
`committed`, `address HOST:PORT`, `error TYPE MESSAGE`), which the tests wait for
before killing, stopping or checking it; a sender asked to (`wait_for_go`) connects,
says `ready` and sends nothing until a line comes on its stdin. Buffer contents
derive from (seed, index), so the parent knows what must arrive without any bytes
crossing the pipe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def payload(seed: int, index: int, size: int, pattern: str = "random") -> np.ndarray:
    """The bytes of buffer `index`: random for small ones, a fill for big ones (fast)."""
    if pattern == "fill":
        return np.full(size, (seed * 31 + index) % 251, dtype=np.uint8)
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, 256, size, dtype=np.uint8)


def say(line: str) -> None:
    print(line, flush=True)


async def run_sender(spec: dict[str, Any]) -> None:
    from yb_dataplane.transport import KVSender, PeerAddress, TransferError

    peer = PeerAddress.parse(spec["peer"])
    request_id: str = spec["request_id"]
    sizes: list[int] = spec["sizes"]
    pattern: str = spec.get("pattern", "random")
    seed: int = spec.get("seed", 0)
    deadline_s: float = spec.get("deadline_s", 30.0)
    pause_after: int | None = spec.get("pause_after")
    segment_no = 0

    def announce(request: str, items: Sequence[tuple[int, Any]]) -> None:
        del request, items
        say(f"posting {segment_no}")  # checksums done; the bytes move next

    # The tests that run this helper are about what arrives and what fails, not how
    # fast a loaded machine connects: the production default (3 s) only bounds a
    # handshake, and a busy host can take longer.
    sender = KVSender(connect_timeout_s=20.0, after_checksum=announce)
    try:
        if spec.get("wait_for_go"):
            # Started, imported and connected: the parent starts its clock only now.
            if not await sender.preconnect(peer):
                say("error PeerUnreachable pre-connect failed")
                raise SystemExit(1)
            say("ready")
            await asyncio.to_thread(sys.stdin.readline)
        for segment_no, indices in enumerate(spec["segments"]):
            items = [(i, payload(seed, i, sizes[i], pattern)) for i in indices]
            await sender.send(peer, request_id, items, deadline_s=deadline_s)
            say(f"sent {segment_no}")
            if pause_after is not None and segment_no == pause_after:
                say("paused")
                await asyncio.sleep(3600)  # the parent kills or stops us here
        if spec.get("commit", True):
            await sender.commit(peer, request_id, deadline_s=deadline_s)
            say("committed")
    except TransferError as exc:
        say(f"error {type(exc).__name__} {exc}")
        raise SystemExit(1) from None
    finally:
        await sender.close()


async def run_receiver(spec: dict[str, Any]) -> None:
    from yb_dataplane.transport import KVReceiver, TransferError, checksum

    receiver = KVReceiver()
    address = await receiver.start()
    buffers = [np.zeros(size, dtype=np.uint8) for size in spec["sizes"]]
    reservation = receiver.reserve(
        spec["request_id"], buffers, deadline_s=spec.get("deadline_s", 30.0)
    )
    say(f"address {address}")
    try:
        await reservation.wait_committed()
        say("committed " + " ".join(str(checksum(b)) for b in buffers))
    except TransferError as exc:
        say(f"error {type(exc).__name__} {exc}")
    finally:
        await receiver.close()


def main(argv: list[str]) -> None:
    # The parent's test output carries this stderr: the steps of a handshake that hangs.
    logging.basicConfig(level=logging.DEBUG, format="helper %(name)s: %(message)s")
    role, spec = argv[1], json.loads(argv[2])
    asyncio.run(run_sender(spec) if role == "sender" else run_receiver(spec))


if __name__ == "__main__":
    main(sys.argv)
