"""The conductor service against a real nats-server: decisions land in the log, a
restart neither re-decides nor forgets, a standby takes over a crashed leader with
no decision lost or doubled, and snapshots shorten the catch-up."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from yb_conductor import snapshot
from yb_conductor.conductor import Conductor
from yb_conductor.cost_model import load_cost_model
from yb_conductor.replay import LogRecord, replay
from yb_conductor.service import SNAPSHOT_OBJECT, ConductorService, read_snapshot
from yb_conductor.settings import RecordedSettingsError
from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import ConductorConfig, NatsConfig, YbConfig

#: How long any wait below may take before the test fails. Generous on purpose: each
#: wait ends as soon as its condition holds, so a fast machine never waits it out.
DEADLINE_S = 60.0


def _config(name: str, nats_config: NatsConfig, **conductor: Any) -> YbConfig:
    # The instances here never send a load report: a heartbeat timeout far past any
    # test's length keeps them alive in event time however slowly the test runs. The
    # lease outlives any stall of the event loop on a loaded machine, so a lone
    # conductor never loses it (and goes live twice) mid-test.
    conductor.setdefault("heartbeat_timeout_s", 1e6)
    conductor.setdefault("lease_ttl_s", 30.0)
    return YbConfig(instance_id=name, nats=nats_config, conductor=ConductorConfig(**conductor))


def _admitted(rid: str, chain: list[int] | None = None) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=rid,
        gateway_id="g",
        model="m",
        block_size=16,
        block_hashes=chain or [],
        prompt_tokens=10 + 16 * len(chain or []),
        max_tokens=4,
    )


async def _cluster(bus: Bus) -> None:
    for e in (
        ev.InstanceUp(instance_id="p0", role="prefill", host="h0", model="m"),
        ev.InstanceUp(instance_id="kv0", role="kvstore", host="h0", model="m"),
        ev.InstanceUp(instance_id="d0", role="decode", host="h", model="m"),
    ):
        await bus.publish(e)


async def _read_log(bus: Bus) -> list[LogRecord]:
    """The whole log up to its end as of now (every event of it, or the test fails)."""
    last = await bus.last_sequence()
    reader = await bus.read_ordered()
    records: list[LogRecord] = []
    try:
        while not records or records[-1].seq < last:
            item = await reader.next(timeout_s=DEADLINE_S)
            assert item is not None, f"the log ends at {records[-1:]}, not at {last}"
            records.append(LogRecord(seq=item.seq, event=item.event, subject=item.subject))
    finally:
        await reader.close()
    return records


def _is_decision(event: ev.AnyEvent) -> bool:
    # Load predictions share the decision subjects; only decisions count here.
    return isinstance(event, ev.Decision)


async def _decisions(
    bus: Bus, want: int, deciding: ConductorService | None = None
) -> list[ev.AnyEvent]:
    """The first `want` decisions in the log, waiting for them; fails at the deadline,
    saying what state `deciding` (the conductor that should decide them) is in."""
    reader = await bus.read_ordered("yb.ev.decision.>")
    found: list[ev.AnyEvent] = []
    try:
        async with asyncio.timeout(DEADLINE_S):
            while len(found) < want:
                item = await reader.next(timeout_s=DEADLINE_S)
                if item is not None and _is_decision(item.event):
                    found.append(item.event)
    except TimeoutError:
        ids = [d.request_id for d in found]  # type: ignore[union-attr]
        state = ""
        if deciding is not None:
            state = (
                f"; {deciding.instance_id}: active={deciding.active}, lease held="
                f"{deciding.lease is not None and deciding.lease.held}, folded to seq "
                f"{deciding.conductor.last_seq}, failed tasks {deciding.tasks.failures()}"
            )
        raise AssertionError(f"{want} decisions wanted, the log has {ids}{state}") from None
    finally:
        await reader.close()
    return found


async def _every_decision(bus: Bus) -> list[str]:
    """The request id of every decision in the whole log. Called once every conductor
    is stopped (`stop` waits for the publishes in flight) or crashed, so nothing can
    follow: the log is complete, with no "nothing more came for a while" guess."""
    return [
        r.event.request_id  # type: ignore[union-attr]
        for r in await _read_log(bus)
        if _is_decision(r.event)
    ]


async def _eventually(check: Callable[[], bool], what: str) -> None:
    """Wait until `check()` holds; fail naming `what` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not check():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.02)


def _divergences(service: ConductorService) -> float:
    """Every divergence the service found (the fold's own list is cleared once logged)."""
    value = service.registry.get_sample_value("yb_conductor_divergences_total")
    return (value or 0.0) + len(service.conductor.divergences)


async def _crash(service: ConductorService) -> None:
    """Stop a conductor the hard way: no InstanceDown, no lease handed back."""
    await service.tasks.shutdown()
    assert service.bus is not None
    await service.bus.client.close()
    service.bus = None
    service.lease = None
    service._reader = None


async def test_decides_from_the_log_and_does_not_redecide_after_restart(
    bus: Bus, nats_config: NatsConfig
) -> None:
    for e in (
        ev.InstanceUp(instance_id="p0", role="prefill", host="h", model="m"),
        ev.InstanceUp(instance_id="d0", role="decode", host="h", model="m"),
    ):
        await bus.publish(e)
    service = ConductorService(_config("cond-1", nats_config))
    await service.start()
    try:
        await bus.publish(_admitted("r1"))
        (decision,) = await _decisions(bus, 1)
        assert isinstance(decision, ev.RequestScheduled)
        assert (decision.prefill_instance, decision.decode_instance) == ("p0", "d0")
    finally:
        await service.stop()
        await service.stop()

    # A new conductor replays the log: the decision is reproduced, not published twice.
    again = ConductorService(_config("cond-2", nats_config))
    await again.start()
    try:
        await bus.publish(_admitted("r2"))
        await _decisions(bus, 2)
        assert _divergences(again) == 0
    finally:
        await again.stop()
    # Both conductors are stopped: the log holds every decision either ever made.
    assert await _every_decision(bus) == ["r1", "r2"]


async def test_the_live_log_replays_and_carries_settings_and_predictions(
    bus: Bus, nats_config: NatsConfig
) -> None:
    await _cluster(bus)
    await bus.publish(
        ev.BlockStored(instance_id="kv0", epoch=5, event_id=1, block_hashes=[1, 2, 3], tier="dram")
    )
    service = ConductorService(_config("cond-1", nats_config, admission="predicted"))
    await service.start()
    metric = service.registry.get_sample_value
    try:
        await bus.publish(_admitted("r1", [1, 2, 3, 4]))
        # A gap in kv0's block events: the conductor asks for its inventory.
        await bus.publish(
            ev.BlockStored(instance_id="kv0", epoch=5, event_id=3, block_hashes=[9], tier="dram")
        )
        await bus.publish(_admitted("r2"))
        decisions = await _decisions(bus, 2)
        assert [type(d).__name__ for d in decisions] == ["RequestScheduled"] * 2
        first = decisions[0]
        assert isinstance(first, ev.RequestScheduled) and first.reused_blocks == 3
        assert first.reuse[0].source_instance == "kv0"
        # A completion: its measured TTFT is compared with the estimate and exported.
        await bus.publish(
            ev.RequestFinished(
                request_id="r1",
                instance_id="d0",
                outcome="completed",
                output_tokens=4,
                ttft_s=first.estimates.ttft_s * 2,
                tbt_mean_s=first.estimates.tbt_s,
            )
        )
        await _eventually(
            lambda: metric("yb_conductor_ttft_actual_over_estimate_count") == 1,
            "the completion folded",
        )
        assert metric("yb_conductor_ttft_actual_over_estimate_sum") == 2.0
        assert metric("yb_conductor_branch_total", {"branch": "local"}) == 1
        assert metric("yb_conductor_reused_blocks_total") == 3
    finally:
        await service.stop()
    # Read once the conductor is stopped: everything it published is in the log.
    records = await _read_log(bus)
    kinds = Counter(type(r.event).__name__ for r in records)
    assert kinds["ConductorConfigured"] == 1
    assert kinds["LoadPrediction"] == 2
    assert kinds["ResyncRequested"] == 1
    # Anyone can replay the stream, with the settings the log carries.
    assert replay(records).divergences == []


async def test_standby_takes_over_a_crashed_leader_without_losing_or_doubling(
    bus: Bus, nats_config: NatsConfig
) -> None:
    await _cluster(bus)
    # A short lease, so the standby's wait for the crashed leader's to expire is short;
    # still long past an event-loop stall (it is renewed every third of it).
    leader = ConductorService(_config("cond-a", nats_config, lease_ttl_s=5.0))
    await leader.start()
    standby = ConductorService(_config("cond-b", nats_config, lease_ttl_s=5.0))
    await standby.start()
    try:
        assert leader._active and not standby._active
        for i in range(3):
            await bus.publish(_admitted(f"before-{i}"))
        assert len(await _decisions(bus, 3)) == 3
        await _crash(leader)
        # Admissions while nobody leads: decided by the standby once it takes over.
        for i in range(3):
            await bus.publish(_admitted(f"during-{i}"))
        await _decisions(bus, 6, standby)
        assert standby.active
        for i in range(2):
            await bus.publish(_admitted(f"after-{i}"))
        await _decisions(bus, 8)
        assert _divergences(standby) == 0
    finally:
        await standby.stop()
        if leader.bus is not None:
            await leader.stop()
    # The leader crashed and the standby stopped (its publishes awaited): a decision
    # made twice would be in the log by now.
    assert sorted(await _every_decision(bus)) == sorted(
        [f"before-{i}" for i in range(3)]
        + [f"during-{i}" for i in range(3)]
        + [f"after-{i}" for i in range(2)]
    )


async def test_a_restart_resumes_from_the_snapshot(bus: Bus, nats_config: NatsConfig) -> None:
    await _cluster(bus)
    first = ConductorService(_config("cond-1", nats_config, snapshot_every_events=3))
    await first.start()
    try:
        for i in range(4):
            await bus.publish(_admitted(f"r{i}"))
        assert len(await _decisions(bus, 4)) == 4
        # Stopping cancels an upload in flight (the object store then keeps the
        # previous one): wait until one snapshot is stored whole. Read as the service
        # reads it: the conductor keeps rewriting it meanwhile, and nats-py's own
        # `get` then waited for ever for chunks the rewrite purged.
        store = await bus.jetstream.object_store(ConductorConfig().snapshot_bucket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while await read_snapshot(store, timeout_s=DEADLINE_S) is None:
            assert loop.time() < deadline, "no snapshot was stored"
            await asyncio.sleep(0.05)
    finally:
        await first.stop()
    second = ConductorService(_config("cond-2", nats_config))
    await second.start()
    try:
        assert second.restored_from_seq > 0
        await bus.publish(_admitted("r4"))
        ids = [d.request_id for d in await _decisions(bus, 5)]  # type: ignore[union-attr]
        assert ids == [f"r{i}" for i in range(5)]
        assert _divergences(second) == 0
        assert second.conductor.quality.decisions >= 1
    finally:
        await second.stop()


def _snapshot_bytes(last_seq: int) -> bytes:
    conductor = Conductor(cfg=ConductorConfig(), cost=load_cost_model(ConductorConfig().cost_model))
    conductor.last_seq = last_seq
    return snapshot.encode(snapshot.take(conductor))


async def test_a_snapshot_rewritten_while_read_is_read_again_not_waited_for(bus: Bus) -> None:
    """The state a read finds when a rewrite lands under it: the meta names a version
    whose chunks the rewrite purged. nats-py's `get` waits for them for ever; the
    service's read gives up on that version once the meta names another, and reads
    that one; with no newer version it gives up at its deadline."""
    bucket = "snapshot_race"
    js = bus.jetstream
    store = await js.create_object_store(bucket=bucket)
    stale = await store.put(SNAPSHOT_OBJECT, _snapshot_bytes(7))
    # What a concurrent put does last: purge the chunks of the version it replaced.
    await js.purge_stream(
        OBJ_STREAM_TEMPLATE.format(bucket=bucket),
        subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=stale.nuid),
    )
    # No newer version comes: the read ends at its deadline, with None (it hung).
    async with asyncio.timeout(DEADLINE_S):
        assert await read_snapshot(store, timeout_s=1.0) is None

    read = asyncio.create_task(read_snapshot(store, timeout_s=DEADLINE_S))
    # The read has subscribed to the purged chunks (its consumer exists) before the
    # new version is written, so it is the stuck read that must notice the rewrite.
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while (await js.stream_info(stream)).state.consumer_count == 0:
        assert loop.time() < deadline and not read.done(), "the read never subscribed"
        await asyncio.sleep(0.02)
    await store.put(SNAPSHOT_OBJECT, _snapshot_bytes(9))
    async with asyncio.timeout(DEADLINE_S):
        restored = await read
    assert restored is not None and restored.last_seq == 9


async def test_unreadable_recorded_settings_stop_the_conductor(
    bus: Bus, nats_config: NatsConfig
) -> None:
    """Settings in the log that do not read are not replaced by defaults: deciding with
    other settings than recorded would not replay, so the conductor stops there."""
    await _cluster(bus)  # seq 1..3
    await bus.publish(ev.ConductorConfigured(instance_id="old", settings_json='{"seed": "x"}'))
    service = ConductorService(_config("cond-1", nats_config))
    await service.start()
    try:
        await bus.publish(_admitted("r0"))
        with pytest.raises(RecordedSettingsError, match="stream sequence 4"):
            async with asyncio.timeout(DEADLINE_S):
                await service.tasks.wait_failure()
        assert not service.active
    finally:
        await service.stop()
    assert await _every_decision(bus) == []


async def test_a_snapshot_with_unreadable_settings_is_passed_over_for_the_log(
    bus: Bus, nats_config: NatsConfig
) -> None:
    await _cluster(bus)
    store = await bus.jetstream.create_object_store(
        bucket=ConductorConfig().snapshot_bucket, replicas=nats_config.replicas
    )
    broken = msgspec.structs.replace(
        snapshot.decode(_snapshot_bytes(3)), settings_json='{"admission": "sometimes"}'
    )
    await store.put(SNAPSHOT_OBJECT, snapshot.encode(broken))
    found = await read_snapshot(store, timeout_s=DEADLINE_S)
    assert found is not None and found.last_seq == 3  # only its settings are bad
    service = ConductorService(_config("cond-1", nats_config))
    await service.start()
    try:
        assert service.restored_from_seq == 0  # read the log from seq 1 instead
        await bus.publish(_admitted("r0"))
        (decision,) = await _decisions(bus, 1, service)
        assert isinstance(decision, ev.RequestScheduled)
        assert service.conductor.cfg.admission == ConductorConfig().admission
    finally:
        await service.stop()


def _metrics_threads() -> int:
    return sum(t.name == "yb-metrics" for t in threading.enumerate())


async def test_stop_closes_the_metrics_listener(bus: Bus, nats_config: NatsConfig) -> None:
    """A stopped service's /metrics listener and its thread go with it (they were left
    serving for the life of the process, one more per service a test session ran)."""
    before = _metrics_threads()
    service = ConductorService(_config("cond-1", nats_config))
    await service.start()
    try:
        assert _metrics_threads() == before + 1
        with socket.create_connection(("127.0.0.1", service.metrics_port), timeout=DEADLINE_S):
            pass
    finally:
        await service.stop()
    await _eventually(lambda: _metrics_threads() == before, "the metrics thread ended")
