"""Prefill's reuse path through real services: two hosts, real bus, real UCX, tiny model.

Host h0 runs prefill-0 and kvstore-0, host h1 prefill-1 and kvstore-1, plus one decode
instance. The conductor's part is played by hand: each job carries a decision whose
reuse plan the test writes, and is sent to the prefill instance over the bus as a
gateway would. What is checked is what the cluster sees: the tokens on the request's
token stream, `reused_tokens` in the progress events, the block events of the engine
tier and of the kvstores, and `TransferFailed` when a planned fetch cannot happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from yb_core import events as ev
from yb_core import protocol as pr
from yb_core.bus import Bus
from yb_core.config import (
    DecodeEngineConfig,
    KVStoreConfig,
    ModelConfig,
    NatsConfig,
    PrefillEngineConfig,
    TelemetryConfig,
    YbConfig,
)
from yb_core.hashing import block_hashes, model_identity
from yb_core.service import Service
from yb_decode.service import DecodeService
from yb_kvstore.service import KVStoreService
from yb_prefill.service import PrefillService

BLOCK = 16
#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
DEADLINE_S = 60.0
MODEL = ModelConfig(source="tiny-random", name="tiny", block_size=BLOCK, max_model_len=1024)


def cfg(nats: NatsConfig, instance: str, host: str, tmp: Path, **engine: object) -> YbConfig:
    prefill = PrefillEngineConfig(
        num_kv_pages=64, threads=1, chunk_size=32, load_report_interval_s=0.5, **engine
    )  # type: ignore[arg-type]
    return YbConfig(
        instance_id=instance,
        host=host,
        nats=nats,
        model=MODEL,
        prefill=prefill,
        decode=DecodeEngineConfig(num_kv_pages=128, threads=1, load_report_interval_s=0.5),
        kvstore=KVStoreConfig(
            dram_blocks=32, ssd_blocks=64, ssd_dir=str(tmp / instance), load_report_interval_s=0.5
        ),
        telemetry=TelemetryConfig(log_json=False),
    )


@dataclass
class Cluster:
    """Services in this process and everything the log says."""

    bus: Bus
    services: dict[str, Service]
    events: list[ev.AnyEvent] = field(default_factory=list)

    def prefill(self, name: str) -> PrefillService:
        service = self.services[name]
        assert isinstance(service, PrefillService)
        return service

    async def wait_for(
        self, what: str, found: Callable[[ev.AnyEvent], bool], timeout_s: float = DEADLINE_S
    ) -> ev.AnyEvent:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in self.events:
                if found(event):
                    return event
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {what} in the log: {[type(e).__name__ for e in self.events]}")

    async def run(
        self,
        prefill: str,
        tokens: list[int],
        reuse: list[ev.ReusePlan] | None = None,
        max_tokens: int = 4,
    ) -> tuple[list[int], ev.RequestProgress]:
        """Send a job as a gateway would; the generated tokens and prefill's progress."""
        rid = f"req-{uuid.uuid4().hex[:8]}"
        subject = pr.token_subject("gw", rid)
        chunks: asyncio.Queue[pr.TokenChunk] = asyncio.Queue()

        async def on_chunk(msg: Msg) -> None:
            chunks.put_nowait(pr.token_decoder.decode(msg.data))

        sub = await self.bus.subscribe(subject, cb=on_chunk)
        job = pr.PrefillJob(
            request_id=rid,
            token_ids=tokens,
            block_hashes=block_hashes(tokens, BLOCK, model_identity(MODEL.name)),
            sampling=pr.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            decision=ev.RequestScheduled(
                request_id=rid,
                gateway_id="gw",
                prefill_instance=prefill,
                decode_instance="decode-0",
                reuse=reuse or [],
                time=time.time(),
            ),
            token_subject=subject,
            deadline=time.time() + 2 * DEADLINE_S,
        )
        try:
            reply = await self.bus.request(
                pr.prefill_job_subject(prefill), pr.encode(job), timeout_s=DEADLINE_S
            )
            assert isinstance(pr.job_reply_decoder.decode(reply.data), pr.JobAccepted)
            out: list[int] = []
            async with asyncio.timeout(DEADLINE_S):
                while True:
                    chunk = await chunks.get()
                    assert not chunk.error, chunk.error
                    out += chunk.token_ids
                    if chunk.finished:
                        break
        finally:
            await sub.unsubscribe()
        done = await self.wait_for(
            "prefill_done",
            lambda e: (
                isinstance(e, ev.RequestProgress)
                and e.request_id == rid
                and e.stage == "prefill_done"
            ),
        )
        assert isinstance(done, ev.RequestProgress)
        return out, done

    def block_events(self, instance: str) -> list[ev.AnyEvent]:
        return [
            e for e in self.events if isinstance(e, ev.BlockEvent) and e.instance_id == instance
        ]

    def stored(self, instance: str, tier: ev.Tier) -> set[int]:
        keys: set[int] = set()
        for event in self.block_events(instance):
            if isinstance(event, ev.BlockStored) and event.tier == tier:
                keys.update(event.block_hashes)
            elif isinstance(event, ev.BlockEvicted):
                keys.difference_update(event.block_hashes)
        return keys


@pytest.fixture
async def cluster(bus: Bus, nats_config: NatsConfig, tmp_path: Path) -> AsyncIterator[Cluster]:
    reader = await bus.read_ordered()
    state = Cluster(bus, {})

    async def follow() -> None:
        async for item in reader:
            state.events.append(item.event)

    follower = asyncio.get_running_loop().create_task(follow())
    specs: list[tuple[type[Service], str, str, dict[str, object]]] = [
        (KVStoreService, "kvstore-0", "h0", {}),
        (KVStoreService, "kvstore-1", "h1", {}),
        (DecodeService, "decode-0", "h0", {}),
        (PrefillService, "prefill-0", "h0", {"prefix_cache_pages": 16}),
        (PrefillService, "prefill-1", "h1", {"prefix_cache_pages": 16}),
    ]
    try:
        for kind, name, host, engine in specs:
            service = kind(cfg(nats_config, name, host, tmp_path, **engine))
            state.services[name] = service
            await service.start()
        yield state
    finally:
        for service in reversed(list(state.services.values())):
            with contextlib.suppress(Exception):
                await service.stop()
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await reader.close()


def prompt(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def plan(source: str, tier: ev.Tier, first: int, count: int) -> ev.ReusePlan:
    return ev.ReusePlan(source_instance=source, tier=tier, first_block=first, num_blocks=count)


async def test_reuse_from_every_tier_gives_the_same_tokens(cluster: Cluster) -> None:
    shared_prefix = prompt(1, 5 * BLOCK)
    tokens = [*shared_prefix, *prompt(2, 7)]  # 5 full blocks and a partial one
    keys = block_hashes(tokens, BLOCK, model_identity(MODEL.name))
    assert len(keys) == 5

    # 1. Computed from scratch on host h0: its blocks stay in prefill-0's pages and go
    #    to h0's kvstore.
    reference, done = await cluster.run("prefill-0", tokens)
    assert (done.reused_tokens, done.computed_tokens) == (0, len(tokens))
    await cluster.wait_for(
        "engine blocks", lambda e: cluster.stored("prefill-0", "engine") >= set(keys)
    )
    await cluster.wait_for(
        "kvstore-0 blocks", lambda e: cluster.stored("kvstore-0", "dram") >= set(keys)
    )

    # 2. The same prompt on the other host, pulled from h0's kvstore as planned: the
    #    whole prefix is reused, the tokens are the same, and h1 keeps a replica.
    out, done = await cluster.run("prefill-1", tokens, [plan("kvstore-0", "dram", 0, 5)])
    assert out == reference
    assert (done.reused_tokens, done.computed_tokens) == (5 * BLOCK, 7)
    await cluster.wait_for(
        "replica on kvstore-1", lambda e: cluster.stored("kvstore-1", "dram") >= set(keys)
    )
    # Published by another process than kvstore-1's: waited for, not assumed in yet.
    await cluster.wait_for(
        "prefill-1 engine blocks", lambda e: cluster.stored("prefill-1", "engine") >= set(keys)
    )

    # 3. From prefill-0's own pages (no copy, no fetch), with a longer suffix.
    longer = [*tokens, *prompt(3, 20)]
    out_long, done = await cluster.run("prefill-0", longer, [plan("prefill-0", "engine", 0, 5)])
    assert done.reused_tokens == 5 * BLOCK
    assert cluster.prefill("prefill-0").worker.cache.hits >= 5
    recomputed, done = await cluster.run("prefill-1", longer)  # prefill-1 ignores its cache
    assert done.reused_tokens == 0 and out_long == recomputed

    # 4. A plan that cannot be fetched (kvstore-1 does not hold the first blocks of this
    #    new prompt): TransferFailed, recomputed, same answer.
    other = prompt(4, 3 * BLOCK + 5)
    expected, _ = await cluster.run("prefill-0", other)
    out, done = await cluster.run("prefill-1", other, [plan("kvstore-1", "dram", 0, 3)])
    assert out == expected and done.reused_tokens == 0
    failed = await cluster.wait_for(
        "TransferFailed",
        lambda e: isinstance(e, ev.TransferFailed) and e.request_id == done.request_id,
    )
    assert isinstance(failed, ev.TransferFailed)
    assert (failed.source_instance, failed.target_instance) == ("kvstore-1", "prefill-1")
    assert "not held" in failed.reason


async def test_short_prompts_queued_together_compute_together(cluster: Cluster) -> None:
    """Jobs that queued while the engine was busy start as one group and compute in one
    forward pass, each giving the tokens it gives alone."""
    worker = cluster.prefill("prefill-0").worker
    prompts = [prompt(30 + i, 2 + 2 * i) for i in range(5)]  # the last four: 30 tokens
    alone = [(await cluster.run("prefill-0", p))[0] for p in prompts]

    def batches_of(most: int) -> float:
        value = worker.metrics.batch_jobs.collect()[0].samples
        return next(s.value for s in value if s.labels.get("le") == f"{float(most)}")

    solo, up_to_four = batches_of(1), batches_of(4)
    release = threading.Event()
    held = worker.engine.submit(release.wait, DEADLINE_S)
    try:
        # The first job starts alone (its compute waits behind the held engine); the
        # others arrive meanwhile and wait in the queue.
        runs = [asyncio.ensure_future(cluster.run("prefill-0", prompts[0]))]
        await wait_until(lambda: len(worker._jobs) == 1 and worker._queue.empty())
        runs += [asyncio.ensure_future(cluster.run("prefill-0", p)) for p in prompts[1:]]
        await wait_until(lambda: worker._queue.qsize() == len(prompts) - 1)
    finally:
        release.set()
    await held
    together = [out for out, _ in await asyncio.gather(*runs)]
    assert together == alone
    # One group of one, then one of four.
    assert batches_of(1) == solo + 1
    assert batches_of(4) == up_to_four + 2


async def wait_until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.01)


async def test_reuse_switch_off_ignores_plans(
    bus: Bus, nats_config: NatsConfig, tmp_path: Path
) -> None:
    # One prefill instance with reuse off, one kvstore holding nothing: the plan is not
    # even tried (no TransferFailed), the prompt is computed whole.
    services: list[Service] = []
    try:
        for service in (
            KVStoreService(cfg(nats_config, "kvstore-0", "h0", tmp_path)),
            DecodeService(cfg(nats_config, "decode-0", "h0", tmp_path)),
            PrefillService(cfg(nats_config, "prefill-0", "h0", tmp_path, reuse=False)),
        ):
            services.append(service)
            await service.start()
        cluster = Cluster(bus, {})
        reader = await bus.read_ordered("yb.ev.>")

        async def follow() -> None:
            async for item in reader:
                cluster.events.append(item.event)

        follower = asyncio.get_running_loop().create_task(follow())
        try:
            tokens = prompt(5, 2 * BLOCK + 3)
            _out, done = await cluster.run("prefill-0", tokens, [plan("kvstore-0", "dram", 0, 2)])
            assert done.reused_tokens == 0
            # A tried plan's TransferFailed goes to the log before the job's
            # prefill_done (one outbox, in order), and `run` returned having read
            # prefill_done from the ordered log: had it been tried, the failure would
            # be in `events` now.
            assert not [e for e in cluster.events if isinstance(e, ev.TransferFailed)]
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await reader.close()
    finally:
        for service in reversed(services):
            with contextlib.suppress(Exception):
                await service.stop()


async def test_a_reservation_refused_while_computing_fails_the_job_and_frees_its_pages(
    cluster: Cluster,
) -> None:
    # The reservation's round trip runs beside the compute: decode refuses this one
    # (prompt plus max_tokens past max_model_len) while prefill computes. The job ends
    # with decode's refusal on the token stream, prefill's pages are all given back
    # (the engine holds exactly its cached blocks again), and the next job is served.
    worker = cluster.prefill("prefill-0").worker
    with pytest.raises(AssertionError, match="refused: prompt plus max_tokens"):
        await cluster.run("prefill-0", prompt(7, 2 * BLOCK + 3), max_tokens=1024)
    failed = await cluster.wait_for(
        "the refused job's RequestFinished",
        lambda e: isinstance(e, ev.RequestFinished) and e.outcome == "failed",
    )
    assert isinstance(failed, ev.RequestFinished) and "refused" in failed.reason
    assert worker.engine.allocator.num_used == len(worker.cache)
    out, _done = await cluster.run("prefill-0", prompt(8, BLOCK + 1), max_tokens=2)
    assert len(out) == 2


async def test_a_prefix_that_fails_after_its_first_layer_landed_fails_the_job_cleanly(
    cluster: Cluster,
) -> None:
    # The prefill computes on the prefix as it lands (`overlap_prefix_load`, on). Here
    # the first layers land and verify, then a later layer of the first block fails its
    # checksum (its bytes in kvstore-0's slot were overwritten, the stored checksums
    # kept): too late to recompute instead, since the compute has begun on the pages.
    # The job fails on the token stream with a `TransferFailed` in the log, every page
    # is given back, and the next job on the instance is served. The order holds by
    # construction: the store sends layer by layer, the first layer is known to have
    # landed as its buffers verify, and the failure only once the store has answered
    # the corrupt buffer's refusal, a round trip later.
    tokens = prompt(11, 4 * BLOCK + 3)
    keys = block_hashes(tokens, BLOCK, model_identity(MODEL.name))
    reference, _ = await cluster.run("prefill-0", tokens)
    await cluster.wait_for(
        "kvstore-0 blocks", lambda e: cluster.stored("kvstore-0", "dram") >= set(keys)
    )
    store = cluster.services["kvstore-0"]
    assert isinstance(store, KVStoreService)
    slot = store.worker.store.dram.view(keys[0])
    slot[-64:] ^= 0xFF  # the end of the slot: the last layer's page of the block
    worker = cluster.prefill("prefill-1").worker
    with pytest.raises(AssertionError, match="prefix load failed mid-way"):
        await cluster.run("prefill-1", tokens, [plan("kvstore-0", "dram", 0, 4)])
    failed = await cluster.wait_for(
        "TransferFailed",
        lambda e: isinstance(e, ev.TransferFailed) and e.target_instance == "prefill-1",
    )
    assert isinstance(failed, ev.TransferFailed)
    assert failed.source_instance == "kvstore-0" and "checksum" in failed.reason
    finished = await cluster.wait_for(
        "the failed job's RequestFinished",
        lambda e: (
            isinstance(e, ev.RequestFinished)
            and e.instance_id == "prefill-1"
            and e.outcome == "failed"
        ),
    )
    assert isinstance(finished, ev.RequestFinished)
    assert worker.engine.allocator.num_used == len(worker.cache)
    # The same prompt computed whole on that instance gives the reference.
    out, done = await cluster.run("prefill-1", tokens)
    assert out == reference and done.reused_tokens == 0
