"""A batch line's prefill yields the engine within a layer to a job of a higher
priority: real prefill and decode services, a real bus, UCX and the tiny model.

The gateway is played by hand. A long preemptible job (priority -1, a batch line's)
is parked between its first and second chunk (failpoint `prefill.chunk`), so the
other jobs are provably queued behind it while it computes; released, its engine
call holds after the first layer of its second chunk for a queued job of a higher
priority, and only for one, which computes inside it. What the engine computed, and
in which order, is read off the engine's own calls (`Calls`, which wraps the real
runner's `prefill` and notes where each call begins and ends): the outcome holds by
construction, not by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import structlog
from nats.aio.msg import Msg
from structlog.testing import capture_logs

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
from yb_prefill import preemption
from yb_prefill.job_queue import Liveness
from yb_prefill.preemption import EngineTurn, Pauses
from yb_prefill.service import PrefillService
from yb_prefill.worker import PrefillWorker

BLOCK = 16
CHUNK = 32
#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
DEADLINE_S = 60.0
MODEL = ModelConfig(source="tiny-random", name="tiny", block_size=BLOCK, max_model_len=1024)
#: Five chunks: the batch line's prompt.
LONG = [10 + (i * 7) % 200 for i in range(5 * CHUNK)]
#: One chunk each, of different lengths (the engine's calls tell them apart by it).
SHORT = [20 + i for i in range(20)]
SHORTER = [30 + i for i in range(12)]
#: The batch line's calls when it is parked after its first chunk: that chunk, then
#: the rest (prompt so far, cached).
FIRST, REST = (CHUNK, 0), (len(LONG), CHUNK)
SAMPLING = pr.SamplingParams(
    max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
)


def prefill_job(
    request_id: str, prompt: list[int], *, priority: int, preemptible: bool, pair: str
) -> pr.PrefillJob:
    """A job as a gateway builds it, planned for the instances of `pair`."""
    return pr.PrefillJob(
        request_id=request_id,
        token_ids=prompt,
        block_hashes=block_hashes(prompt, BLOCK, model_identity(MODEL.name)),
        sampling=SAMPLING,
        decision=ev.RequestScheduled(
            request_id=request_id,
            gateway_id="gw",
            prefill_instance=f"prefill-{pair}",
            decode_instance=f"decode-{pair}",
            time=time.time(),
        ),
        token_subject=pr.token_subject("gw", request_id),
        deadline=time.time() + 2 * DEADLINE_S,
        priority=priority,
        preemptible=preemptible,
    )


class Job:
    """A job sent as a gateway sends it, with its token stream."""

    def __init__(
        self,
        bus: Bus,
        prompt: list[int],
        *,
        priority: int = 0,
        preemptible: bool = False,
        pair: str = "0",
    ) -> None:
        self.bus = bus
        self.prefill = f"prefill-{pair}"
        self.request_id = f"req-{uuid.uuid4().hex[:8]}"
        self.chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()
        self.job = prefill_job(
            self.request_id, prompt, priority=priority, preemptible=preemptible, pair=pair
        )

    async def send(self) -> None:
        async def on_chunk(msg: Msg) -> None:
            self.chunks.put_nowait(pr.token_decoder.decode(msg.data))

        await self.bus.subscribe(self.job.token_subject, cb=on_chunk)
        reply = await self.bus.request(
            pr.prefill_job_subject(self.prefill), pr.encode(self.job), timeout_s=DEADLINE_S
        )
        assert isinstance(pr.job_reply_decoder.decode(reply.data), pr.JobAccepted)

    async def stream(self) -> list[pr.TokenChunk]:
        """Every chunk of the stream, up to the finished one or an error."""
        out: list[pr.TokenChunk] = []
        async with asyncio.timeout(DEADLINE_S):
            while True:
                chunk = await self.chunks.get()
                out.append(chunk)
                if chunk.finished or chunk.error:
                    return out


def outcome(chunks: Sequence[pr.TokenChunk]) -> tuple[list[int], list[Any], list[Any]]:
    """A stream that ended well: its tokens, their logprobs, the prompt's logprobs."""
    assert not any(c.error for c in chunks), chunks[-1].error
    return (
        [t for c in chunks for t in c.token_ids],
        [lp for c in chunks for lp in c.logprobs],
        [lp for c in chunks for lp in c.prompt_logprobs],
    )


def assert_same_outcome(got: tuple[list[int], list[Any], list[Any]], want: Any) -> None:
    """The same tokens, and what the prefill computed bit for bit: the prompt's
    logprobs (every chunk's logits: the same KV) and the first token's. The later
    tokens' logprobs come from decode steps, whose batch (alone, or beside another
    request) changes their last bits: those are compared to a tolerance."""
    tokens, logprobs, prompt = got
    assert tokens == want[0]
    assert prompt == want[2]
    assert logprobs[0] == want[1][0]
    for mine, theirs in zip(logprobs[1:], want[1][1:], strict=True):
        assert mine.token_id == theirs.token_id
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


@contextlib.contextmanager
def info_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """The structlog lines logged meanwhile at info and above (tests log at warning)."""
    saved = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(wrapper_class=saved)


class Calls:
    """The engine's `prefill` calls, from the real runner, which it still runs: where
    each begins and ends ("begin"/"end", prompt so far, tokens cached), in the order
    the engine thread got there. A call that computes inside another's hold begins
    and ends between the other's begin and end."""

    def __init__(self, worker: PrefillWorker) -> None:
        runner = worker.engine.runner
        real = runner.prefill
        self._lock = threading.Lock()
        self._seen: list[tuple[str, int, int]] = []

        def prefill(token_ids: Sequence[int], *args: Any, **kwargs: Any) -> Any:
            call = (len(token_ids), kwargs.get("num_cached_tokens", 0))
            with self._lock:
                self._seen.append(("begin", *call))
            try:
                return real(token_ids, *args, **kwargs)
            finally:
                with self._lock:
                    self._seen.append(("end", *call))

        runner.prefill = prefill  # type: ignore[method-assign]

    def since(self, start: int) -> list[tuple[str, int, int]]:
        with self._lock:
            return self._seen[start:]

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


def config(nats: NatsConfig, instance: str, gate: Path | None) -> YbConfig:
    return YbConfig(
        instance_id=instance,
        nats=nats,
        model=MODEL,
        prefill=PrefillEngineConfig(
            num_kv_pages=64,
            threads=1,
            chunk_size=CHUNK,
            # Nothing cached: each run of a prompt computes all of it.
            prefix_cache_pages=0,
            store_blocks=False,
            load_report_interval_s=0.5,
        ),
        decode=DecodeEngineConfig(num_kv_pages=128, threads=1, load_report_interval_s=0.5),
        telemetry=TelemetryConfig(log_json=False),
        failpoints=(
            f"gate={gate};timeout=300;prefill.chunk=once:hold(1);prefill.load=once:hold"
            if gate is not None
            else ""
        ),
    )


class Gate:
    """The failpoints' gate directory, as a test steers it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def arm(self, point: str) -> None:
        (self.root / f"{point}.arm").touch()

    async def held(self, point: str, job: Job) -> None:
        await until(lambda: (self.root / f"{point}.{safe_name(job.request_id)}.reached").exists())

    def release(self, point: str, job: Job) -> None:
        (self.root / f"{point}.{safe_name(job.request_id)}.release").touch()


async def until(holds: Callable[[], bool]) -> None:
    """Wait until `holds()`, `DEADLINE_S` at most."""
    async with asyncio.timeout(DEADLINE_S):
        while not holds():
            await asyncio.sleep(0.02)


def preemptions(worker: PrefillWorker) -> float:
    """The instance's `yb_prefill_preemptions_total`."""
    (metric,) = worker.metrics.preemptions.collect()
    (sample,) = [s for s in metric.samples if s.name == "yb_prefill_preemptions_total"]
    return float(sample.value)


async def pages_back(worker: PrefillWorker) -> None:
    """Idle, the engine holds exactly its cached blocks (none here)."""
    await until(lambda: not worker._jobs and worker.engine.allocator.num_used == len(worker.cache))


async def start(
    stack: AsyncExitStack, nats: NatsConfig, gate: Gate | None, pair: str = "0"
) -> PrefillWorker:
    """A decode and a prefill instance (`pair`: their ids' suffix), with the gate's
    failpoints or none; the prefill's worker."""
    root = gate.root if gate is not None else None
    for service in (
        DecodeService(config(nats, f"decode-{pair}", root)),
        prefill := PrefillService(config(nats, f"prefill-{pair}", root)),
    ):
        await service.start()
        stack.push_async_callback(service.stop)
    worker = prefill.worker
    assert isinstance(worker, PrefillWorker)
    return worker


async def test_a_batch_line_holds_within_a_layer_for_a_higher_priority_job(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    gate = Gate(tmp_path / "gate")
    async with AsyncExitStack() as stack:
        # The batch line alone, on an instance with no failpoint: computed in one
        # call, what it gets unpaused.
        plain = await start(stack, nats_config, None, pair="plain")
        plain_calls = Calls(plain)
        alone = Job(bus, LONG, priority=-1, preemptible=False, pair="plain")
        await alone.send()
        expected = outcome(await alone.stream())
        assert plain_calls.since(0) == [("begin", len(LONG), 0), ("end", len(LONG), 0)]
        assert len(expected[0]) == 4 and len(expected[2]) == len(LONG) - 1

        worker = await start(stack, nats_config, gate)
        calls = Calls(worker)
        gate.arm("prefill.chunk")
        batch = Job(bus, LONG, priority=-1, preemptible=True)
        await batch.send()
        await gate.held("prefill.chunk", batch)
        interactive = Job(bus, SHORT, priority=0)
        await interactive.send()  # accepted: queued behind the batch line
        with info_logs() as logs:
            gate.release("prefill.chunk", batch)
            first = outcome(await interactive.stream())
            paused = outcome(await batch.stream())

        # The interactive job computed inside the batch line's second call, held
        # after the first layer of its second chunk, and the batch line's outcome is
        # the one it gets unpaused.
        short = (len(SHORT), 0)
        assert calls.since(0) == [
            ("begin", *FIRST),
            ("end", *FIRST),
            ("begin", *REST),
            ("begin", *short),
            ("end", *short),
            ("end", *REST),
        ]
        assert_same_outcome(paused, expected)
        assert len(first[0]) == 4
        assert preemptions(worker) == 1
        said = [e for e in logs if e["event"] in ("prefill_paused", "prefill_resumed")]
        assert [e["event"] for e in said] == ["prefill_paused", "prefill_resumed"], said
        assert said[0]["for_request"] == interactive.request_id
        for e in said:
            assert (e["layer"], e["computing"]) == (0, f"{CHUNK}..{2 * CHUNK}"), e
        await pages_back(worker)


async def test_a_batch_line_does_not_pause_for_equal_or_lower_priorities(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    gate = Gate(tmp_path / "gate")
    async with AsyncExitStack() as stack:
        worker = await start(stack, nats_config, gate)
        calls = Calls(worker)

        gate.arm("prefill.chunk")
        batch = Job(bus, LONG, priority=-1, preemptible=True)
        await batch.send()
        await gate.held("prefill.chunk", batch)
        equal = Job(bus, SHORT, priority=-1)
        lower = Job(bus, SHORTER, priority=-2)
        await equal.send()
        await lower.send()
        gate.release("prefill.chunk", batch)
        for job in (batch, equal, lower):
            outcome(await job.stream())

        assert calls.since(0) == [
            (edge, *call)
            for call in (FIRST, REST, (len(SHORT), 0), (len(SHORTER), 0))
            for edge in ("begin", "end")
        ]
        assert preemptions(worker) == 0
        await pages_back(worker)


async def test_a_paused_batch_line_cancelled_ends_cleanly(
    nats_config: NatsConfig, bus: Bus, tmp_path: Path
) -> None:
    gate = Gate(tmp_path / "gate")
    async with AsyncExitStack() as stack:
        worker = await start(stack, nats_config, gate)
        calls = Calls(worker)

        gate.arm("prefill.chunk")
        batch = Job(bus, LONG, priority=-1, preemptible=True)
        await batch.send()
        await gate.held("prefill.chunk", batch)
        # The interactive job parks before its compute: the batch line stays paused.
        gate.arm("prefill.load")
        interactive = Job(bus, SHORT, priority=0)
        await interactive.send()
        gate.release("prefill.chunk", batch)
        await gate.held("prefill.load", interactive)
        await until(lambda: len(worker._pauses) == 1)
        assert preemptions(worker) == 1

        await bus.publish(
            ev.RequestCancelled(request_id=batch.request_id, reason="test"),
            timeout_s=DEADLINE_S,
        )
        ended = await batch.stream()
        assert ended[-1].error_status == 499, ended[-1]
        assert not worker._pauses

        gate.release("prefill.load", interactive)
        outcome(await interactive.stream())
        # The batch line's second call ended where it was held, and the interactive
        # job computed after it.
        short = (len(SHORT), 0)
        assert calls.since(0) == [
            ("begin", *FIRST),
            ("end", *FIRST),
            ("begin", *REST),
            ("end", *REST),
            ("begin", *short),
            ("end", *short),
        ]
        await pages_back(worker)


async def test_a_pause_ends_resumed_or_woken_and_counts_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    pauses = Pauses(Liveness())
    job = prefill_job("req-unit", SHORT, priority=-1, preemptible=True, pair="0")

    turn = EngineTurn(loop)
    pausing = asyncio.ensure_future(pauses.pause(job, turn))
    await asyncio.wait_for(asyncio.shield(turn.left), DEADLINE_S)  # left the engine
    assert len(pauses) == 1 and pauses.top_priority() == -1 and not pauses.top_overdue()
    left = pauses.resume()
    assert left is not None and left is turn.left and not left.done()
    assert await asyncio.wait_for(pausing, DEADLINE_S) is True
    assert not pauses and turn.may_pause()

    pausing = asyncio.ensure_future(pauses.pause(job, turn))
    await asyncio.wait_for(asyncio.shield(turn.left), DEADLINE_S)
    monkeypatch.setattr(preemption, "MAX_PAUSED_S", 0.0)
    assert pauses.top_overdue()
    pauses.wake(job.request_id)  # a cancel
    assert await asyncio.wait_for(pausing, DEADLINE_S) is False
    assert not turn.may_pause()
