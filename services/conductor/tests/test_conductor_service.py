"""The conductor service against a real nats-server: decisions land in the log, a
restart neither re-decides nor forgets, a standby takes over a crashed leader with
no decision lost or doubled, and snapshots shorten the catch-up."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from yb_conductor.replay import LogRecord, replay
from yb_conductor.service import ConductorService
from yb_shared import events as ev
from yb_shared.bus import Bus
from yb_shared.config import ConductorConfig, NatsConfig, YbConfig


def _config(name: str, nats_config: NatsConfig, **conductor: Any) -> YbConfig:
    conductor.setdefault("lease_ttl_s", 1.0)
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


async def _read_log(bus: Bus, until: int | None = None) -> list[LogRecord]:
    last = until or await bus.last_sequence()
    reader = await bus.read_ordered()
    records: list[LogRecord] = []
    try:
        while records[-1:] == [] or records[-1].seq < last:
            item = await reader.next(timeout_s=2.0)
            if item is None:
                break
            records.append(LogRecord(seq=item.seq, event=item.event, subject=item.subject))
    finally:
        await reader.close()
    return records


async def _decisions(bus: Bus, want: int, timeout_s: float = 10.0) -> list[ev.AnyEvent]:
    reader = await bus.read_ordered("yb.ev.decision.>")
    found: list[ev.AnyEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(found) < want and loop.time() < deadline:
        item = await reader.next(timeout_s=0.5)
        # Load predictions share the decision subjects; only decisions count here.
        if item is not None and isinstance(item.event, ev.RequestScheduled | ev.RequestRejected):
            found.append(item.event)
    await reader.close()
    return found


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
        found = await _decisions(bus, 3, timeout_s=3.0)
        assert [d.request_id for d in found] == ["r1", "r2"]  # type: ignore[union-attr]
        assert again.conductor.divergences == []
    finally:
        await again.stop()


async def test_the_live_log_replays_and_carries_settings_and_predictions(
    bus: Bus, nats_config: NatsConfig
) -> None:
    await _cluster(bus)
    await bus.publish(
        ev.BlockStored(instance_id="kv0", epoch=5, event_id=1, block_hashes=[1, 2, 3], tier="dram")
    )
    service = ConductorService(_config("cond-1", nats_config, admission="predicted"))
    await service.start()
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
        await asyncio.sleep(0.5)
        records = await _read_log(bus)
        metric = service.metrics.get_sample_value
        assert metric("yb_conductor_ttft_actual_over_estimate_count") == 1
        assert metric("yb_conductor_ttft_actual_over_estimate_sum") == 2.0
        assert metric("yb_conductor_branch_total", {"branch": "local"}) == 1
        assert metric("yb_conductor_reused_blocks_total") == 3
    finally:
        await service.stop()
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
    leader = ConductorService(_config("cond-a", nats_config))
    await leader.start()
    standby = ConductorService(_config("cond-b", nats_config))
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
        found = await _decisions(bus, 6, timeout_s=15.0)
        assert standby.active
        for i in range(2):
            await bus.publish(_admitted(f"after-{i}"))
        found = await _decisions(bus, 8, timeout_s=10.0)
        await asyncio.sleep(0.5)
        found = await _decisions(bus, 100, timeout_s=1.0)
        ids = [d.request_id for d in found]  # type: ignore[union-attr]
        assert sorted(ids) == sorted(
            [f"before-{i}" for i in range(3)]
            + [f"during-{i}" for i in range(3)]
            + [f"after-{i}" for i in range(2)]
        )
        assert standby.conductor.divergences == []
    finally:
        await standby.stop()
        if leader.bus is not None:
            await leader.stop()


async def test_a_restart_resumes_from_the_snapshot(bus: Bus, nats_config: NatsConfig) -> None:
    await _cluster(bus)
    first = ConductorService(_config("cond-1", nats_config, snapshot_every_events=3))
    await first.start()
    try:
        for i in range(4):
            await bus.publish(_admitted(f"r{i}"))
        assert len(await _decisions(bus, 4)) == 4
        await asyncio.sleep(0.5)  # let the upload finish
    finally:
        await first.stop()
    second = ConductorService(_config("cond-2", nats_config))
    await second.start()
    try:
        assert second.restored_from_seq > 0
        await bus.publish(_admitted("r4"))
        ids = [d.request_id for d in await _decisions(bus, 5)]  # type: ignore[union-attr]
        assert ids == [f"r{i}" for i in range(5)]
        assert second.conductor.divergences == []
        assert second.conductor.quality.decisions >= 1
    finally:
        await second.stop()
