"""A prefill instance told to stop drains first: real prefill and decode services, a
real bus, UCX and the tiny model.

The conductor and the gateway are played by hand: each job carries a decision with
the log position of its admission (`admitted_seq`). A job is parked between the
chunks of its prompt (failpoint `prefill.chunk`), so the instance provably holds work
while it drains, until the test lets it go. While it drains it runs the job it holds
and a job the conductor decided before the drain reached the log (placed before it
could know), and refuses one decided after.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

from nats.aio.msg import Msg

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus
from yb_core.config import (
    DecodeEngineConfig,
    ModelConfig,
    NatsConfig,
    PrefillEngineConfig,
    TelemetryConfig,
    YbConfig,
)
from yb_core.failpoints import safe_name
from yb_core.hashing import block_hashes, model_identity
from yb_decode.service import DecodeService
from yb_prefill.service import PrefillService

BLOCK = 16
#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
DEADLINE_S = 60.0
MODEL = ModelConfig(source="tiny-random", name="tiny", block_size=BLOCK, max_model_len=1024)
PROMPT = [10 + i % 200 for i in range(80)]  # three chunks of 32 tokens


class Job:
    """A job sent as a gateway sends it, with its token stream."""

    def __init__(self, bus: Bus, admitted_seq: int) -> None:
        self.bus = bus
        self.request_id = f"req-{uuid.uuid4().hex[:8]}"
        self.chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()
        self.job = pr.PrefillJob(
            request_id=self.request_id,
            token_ids=PROMPT,
            block_hashes=block_hashes(PROMPT, BLOCK, model_identity(MODEL.name)),
            sampling=pr.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
            decision=ev.RequestScheduled(
                request_id=self.request_id,
                gateway_id="gw",
                prefill_instance="prefill-0",
                decode_instance="decode-0",
                admitted_seq=admitted_seq,
                time=time.time(),
            ),
            token_subject=pr.token_subject("gw", self.request_id),
            deadline=time.time() + 2 * DEADLINE_S,
        )

    async def send(self) -> pr.JobReply:
        async def on_chunk(msg: Msg) -> None:
            self.chunks.put_nowait(pr.token_decoder.decode(msg.data))

        await self.bus.subscribe(self.job.token_subject, cb=on_chunk)
        reply = await self.bus.request(
            pr.prefill_job_subject("prefill-0"), pr.encode(self.job), timeout_s=DEADLINE_S
        )
        return pr.job_reply_decoder.decode(reply.data)

    async def tokens(self) -> list[int]:
        """Every token of the stream, which must end without an error."""
        out: list[int] = []
        async with asyncio.timeout(DEADLINE_S):
            while True:
                chunk = await self.chunks.get()
                assert not chunk.error, chunk.error
                out += chunk.token_ids
                if chunk.finished:
                    return out


def config(nats: NatsConfig, instance: str, gate: Path) -> YbConfig:
    return YbConfig(
        instance_id=instance,
        nats=nats,
        model=MODEL,
        prefill=PrefillEngineConfig(
            num_kv_pages=64, threads=1, chunk_size=32, load_report_interval_s=0.5
        ),
        decode=DecodeEngineConfig(num_kv_pages=128, threads=1, load_report_interval_s=0.5),
        telemetry=TelemetryConfig(log_json=False),
        failpoints=f"gate={gate};timeout=300;prefill.chunk=once:hold(1)",
    )


def arm(gate: Path) -> None:
    gate.mkdir(parents=True, exist_ok=True)
    (gate / "prefill.chunk.arm").touch()


async def held(gate: Path, job: Job) -> None:
    reached = gate / f"prefill.chunk.{safe_name(job.request_id)}.reached"
    async with asyncio.timeout(DEADLINE_S):
        while not reached.exists():
            await asyncio.sleep(0.02)


async def started(stack: AsyncExitStack, service: PrefillService | DecodeService) -> None:
    await service.start()
    stack.push_async_callback(service.stop)


async def test_a_draining_prefill_runs_what_was_decided_before_and_refuses_the_rest(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    draining = await bus.read_ordered("yb.ev.instance.instance_draining.prefill-0", new_only=True)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(draining.close)
        await started(stack, DecodeService(config(nats_config, "decode-0", gate)))
        prefill = PrefillService(config(nats_config, "prefill-0", gate))
        await started(stack, prefill)

        arm(gate)
        running = Job(bus, admitted_seq=0)
        assert isinstance(await running.send(), pr.JobAccepted)
        await held(gate, running)
        stopping = asyncio.create_task(prefill.stop())
        item = await draining.next(timeout_s=DEADLINE_S)
        assert item is not None and isinstance(item.event, ev.InstanceDraining), item

        # Decided before the drain reached the log: the conductor could not know.
        before = Job(bus, admitted_seq=item.seq - 1)
        assert isinstance(await before.send(), pr.JobAccepted)
        after = Job(bus, admitted_seq=item.seq + 1)
        refused = await after.send()
        assert isinstance(refused, pr.JobRefused), refused
        assert refused.reason == "prefill instance shutting down"
        assert not stopping.done()  # the parked job holds the drain open

        (gate / f"prefill.chunk.{safe_name(running.request_id)}.release").touch()
        assert len(await running.tokens()) == 4
        assert len(await before.tokens()) == 4
        await asyncio.wait_for(stopping, DEADLINE_S)
