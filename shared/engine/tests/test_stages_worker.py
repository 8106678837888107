"""A pipeline stage in its own process, for `test_stages_ucx.py`; holds no tests itself.

Run as a script: `python test_stages_worker.py '<json spec>'`. The stage holds layers
`spec["layers"]` of `tiny_random_model(seed, num_layers)`, takes chunks on its own
`KVReceiver` and sends its output to the address read from stdin (the next stage, or the
driver). It speaks to its parent through stdout lines: `address ADDR` once started,
`waiting N` before it waits for chunk N of a request, `served REQUEST` after one, and
`error TYPE MESSAGE` when a request fails (it then goes on to the next).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


def say(line: str) -> None:
    print(line, flush=True)


async def serve(spec: dict[str, Any]) -> None:
    import torch

    from yb_dataplane.activations import ActivationReceiver, ActivationSender
    from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress
    from yb_engine.architecture import LayerRange
    from yb_engine.loader import LoadedStage, tiny_random_model
    from yb_engine.stages import HiddenHeader, StageRunner, serve_stage_request, stage_cache

    torch.set_num_threads(1)
    model = tiny_random_model(seed=spec["seed"], num_layers=spec["num_layers"])
    stage = LoadedStage.of_model(model, LayerRange(*spec["layers"]))
    runner = StageRunner(stage, stage_cache(stage, spec["pages"], spec["block"]))
    table = list(range(spec["pages"]))
    wait_s: float = spec["wait_s"]

    receiver = KVReceiver()
    say(f"address {await receiver.start()}")
    inbound = ActivationReceiver(receiver, HiddenHeader)
    line = await asyncio.to_thread(sys.stdin.readline)
    sender = KVSender(connect_timeout_s=20.0)  # a loaded host may connect slowly
    outbound = ActivationSender[HiddenHeader](sender, PeerAddress.parse(line))

    class Announcing:
        """The inbound side, saying on stdout which chunk it is about to wait for."""

        async def receive(
            self, request_id: str, chunk_index: int, *, deadline_s: float
        ) -> tuple[HiddenHeader, Any]:
            say(f"waiting {chunk_index}")
            return await inbound.receive(request_id, chunk_index, deadline_s=deadline_s)

        async def wait_closed(self, request_id: str, *, deadline_s: float) -> bool:
            return await inbound.wait_closed(request_id, deadline_s=deadline_s)

        def forget(self, request_id: str) -> None:
            inbound.forget(request_id)

    while True:
        request_id = await inbound.next_request(deadline_s=wait_s)
        try:
            await serve_stage_request(
                runner, request_id, table, Announcing(), outbound, wait_s=wait_s
            )
        except Exception as exc:
            say(f"error {type(exc).__name__} {exc}")
        else:
            say(f"served {request_id}")


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
