"""A log bounded by bytes, against a real nats-server and real conductors.

The stream is shrunk to 64 KiB and filled several times over with admissions while
a conductor decides them: the cluster keeps deciding, the conductor snapshots often
enough that the retained log reaches back to its latest snapshot, a restarted
conductor starts from that snapshot, and `yb replay` verifies what remains from it
(or refuses, naming the first retained sequence, when no snapshot covers the gap).
Also: two resyncs back to back both reach the conductor's index.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from yb_conductor.service import SNAPSHOT_BYTES_FRACTION, ConductorService
from yb_core import events as ev
from yb_core.block_events import BlockEventPublisher, BlockLog
from yb_core.bus import Bus
from yb_core.config import MIN_EVENT_LOG_BYTES, ConductorConfig, NatsConfig, YbConfig
from yb_tools.cli import replay as replay_cli

SMALL = MIN_EVENT_LOG_BYTES  # 64 KiB
CHAIN = 48  # block hashes per admission: about 600 bytes per event


@pytest.fixture
def small_nats(nats_config: NatsConfig) -> NatsConfig:
    """The test server's settings with the stream bounded at 64 KiB."""
    return msgspec.structs.replace(nats_config, max_bytes=SMALL)


@pytest.fixture
async def small_bus(small_nats: NatsConfig) -> AsyncIterator[Bus]:
    """A bus whose stream is bounded at 64 KiB (created or brought to it)."""
    bus = await Bus.connect(small_nats, "test-small", timeout_s=10)
    await bus.ensure_stream()
    try:
        yield bus
    finally:
        await bus.close()


def _config(name: str, nats: NatsConfig, **conductor: Any) -> YbConfig:
    conductor.setdefault("lease_ttl_s", 1.0)
    # Bytes, not events, decide when to snapshot here.
    conductor.setdefault("snapshot_every_events", 1_000_000)
    return YbConfig(instance_id=name, nats=nats, conductor=ConductorConfig(**conductor))


def _admitted(rid: str, n: int) -> ev.RequestAdmitted:
    chain = [(n << 16) + i + 1 for i in range(CHAIN)]
    return ev.RequestAdmitted(
        request_id=rid,
        gateway_id="g",
        model="m",
        block_size=16,
        block_hashes=chain,
        prompt_tokens=16 * CHAIN + 3,
        max_tokens=4,
    )


async def _cluster(bus: Bus) -> None:
    for e in (
        ev.InstanceUp(instance_id="p0", role="prefill", host="h0", model="m"),
        ev.InstanceUp(instance_id="kv0", role="kvstore", host="h0", model="m"),
        ev.InstanceUp(instance_id="d0", role="decode", host="h0", model="m"),
    ):
        await bus.publish(e)


async def _decision_for(bus: Bus, rid: str, after_seq: int, timeout_s: float = 30.0) -> ev.AnyEvent:
    """The decision for `rid`, read from `after_seq` on (it is newer than that)."""
    reader = await bus.read_ordered("yb.ev.decision.>", start_seq=after_seq)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while loop.time() < deadline:
            item = await reader.next(timeout_s=0.5)
            if isinstance(item and item.event, ev.Decision):
                assert item is not None
                if item.event.request_id == rid:  # type: ignore[union-attr]
                    return item.event
    finally:
        await reader.close()
    raise AssertionError(f"no decision for {rid} within {timeout_s}s")


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _sample(service: ConductorService, name: str) -> float:
    return service.registry.get_sample_value(name) or 0.0


async def _replay(cfg: YbConfig, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`yb replay --nats URL`, as a user runs it (in a thread: it runs its own loop)."""
    # Parsed by the command's own parser, so the arguments are the ones `yb` gives.
    parser = argparse.ArgumentParser()
    replay_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", "--nats", cfg.nats.url])
    capsys.readouterr()
    rc = await asyncio.to_thread(replay_cli.run, cfg, args)
    out = capsys.readouterr()
    return rc, out.out, out.err


async def test_fill_past_the_byte_limit_keeps_serving_restarts_from_snapshot_and_replays(
    small_bus: Bus, small_nats: NatsConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    bus = small_bus
    await _cluster(bus)
    first = ConductorService(_config("cond-1", small_nats))
    await first.start()
    try:
        # Fill the log four times over, each admission decided as it comes.
        published = n = 0
        while published < 4 * SMALL:
            admitted = _admitted(f"r{n}", n)
            await bus.publish(admitted)
            published += len(ev.encode_event(admitted))
            n += 1
        seq = await bus.publish(_admitted("tail", n))
        await _decision_for(bus, "tail", seq)  # decided (scheduled, or refused: queues are long)
        extent = await bus.log_extent()
        assert extent.trimmed and extent.bytes <= SMALL, extent
        # Snapshots come often enough that the retained log reaches back to one. Go on
        # admitting, one at a time, until a snapshot covers the latest admission: then
        # what follows it in the log (its decision, and below the restart's settings,
        # one admission and its decision) is far less than the eighth of the log that
        # makes the next snapshot due, so the restarted conductor takes none and the
        # replay below has the decision after the restart to verify.
        for extra in range(1, 4 * SNAPSHOT_BYTES_FRACTION):
            seq = await bus.publish(_admitted(f"settle{extra}", n + extra))
            await _decision_for(bus, f"settle{extra}", seq)
            end = await bus.last_sequence()
            await _until(
                lambda end=end: first.conductor.last_seq >= end and not first.snapshot_uploading,
                "the conductor to read its own decision and store any snapshot it took",
            )
            if _sample(first, "yb_conductor_snapshot_seq") >= seq:
                break
        else:
            raise AssertionError("no snapshot in 4 * 1/8 of the log")
        n += extra
    finally:
        await first.stop()

    # A new conductor starts from the snapshot: nothing it needs is gone.
    again = ConductorService(_config("cond-2", small_nats))
    await again.start()
    try:
        extent = await bus.log_extent()
        assert again.restored_from_seq >= extent.first_seq - 1 > 0
        assert _sample(again, "yb_conductor_log_gap_events_total") == 0
        seq = await bus.publish(_admitted("after-restart", n + 1))
        await _decision_for(bus, "after-restart", seq)
        assert again.conductor.divergences == []
    finally:
        await again.stop()

    # `yb replay` on what remains: from the snapshot, decision for decision.
    rc, out, err = await _replay(_config("replay", small_nats), capsys)
    assert rc == 0, (out, err)
    assert f"starts at seq {(await bus.log_extent()).first_seq}" in out
    snap = re.search(r"replaying from the conductor's snapshot at seq (\d+)", out)
    assert snap and int(snap.group(1)) < seq, (out, seq)  # the admission after the restart
    assert "every recorded decision reproduced" in out
    # At least the decision made after the restart was checked.
    decisions = re.search(r"replayed \d+ events, (\d+) decisions", out)
    assert decisions and int(decisions.group(1)) >= 1, out


async def test_no_snapshot_behind_a_trimmed_head_is_loud_and_asks_for_inventories(
    small_bus: Bus, small_nats: NatsConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    bus = small_bus
    # Heartbeats of an instance nobody follows, until the log has turned over.
    published = 0
    while published < 2 * SMALL:
        beat = ev.LoadReport(instance_id="old", role="gateway", queued_requests=1)
        await bus.publish(beat)
        published += len(ev.encode_event(beat)) + 64
    await _cluster(bus)
    await bus.publish(ev.LoadReport(instance_id="kv0", role="kvstore"))
    extent = await bus.log_extent()
    assert extent.trimmed

    # No conductor ever ran: no snapshot. `yb replay` refuses, naming where it starts.
    rc, _, err = await _replay(_config("replay", small_nats), capsys)
    assert rc == 1
    assert f"starts at seq {extent.first_seq} (seq 1..{extent.first_seq - 1} trimmed" in err
    assert "no conductor snapshot reaches back to it (there is none)" in err

    resyncs = await bus.read_ordered("yb.ev.block.resync_requested.>", new_only=True)
    service = ConductorService(_config("cond-1", small_nats))
    await service.start()
    try:
        # Every event it never saw is counted (the log may have turned over a little
        # more meanwhile: the conductor announced itself).
        assert _sample(service, "yb_conductor_log_gap_events_total") >= extent.first_seq - 1
        # The index missed the holders' history: it asks every one it knows (the
        # kvstore and the prefill's own cache) for an inventory.
        asked: set[str] = set()
        while asked != {"kv0", "p0"}:
            item = await resyncs.next(timeout_s=10.0)
            assert item is not None, f"resyncs asked: {sorted(asked)}"
            assert isinstance(item.event, ev.ResyncRequested)
            asked.add(item.event.instance_id)
    finally:
        await resyncs.close()
        await service.stop()


async def test_two_resyncs_back_to_back_both_update_the_index(
    bus: Bus, nats_config: NatsConfig
) -> None:
    await _cluster(bus)
    block_log = BlockLog("kv0", epoch=3)
    held = [101, 102, 103]
    publisher = BlockEventPublisher(bus, block_log, lambda: block_log.inventory(dram=held))
    await publisher.open()
    tasks = [
        asyncio.create_task(publisher.run_publisher()),
        asyncio.create_task(publisher.run_resyncs()),
    ]
    service = ConductorService(_config("cond-1", nats_config))
    await service.start()
    try:
        publisher.emit(block_log.cleared())
        publisher.emit(block_log.stored(held, "dram"))
        await _until(lambda: service.conductor.state.index.blocks_held("kv0") == 3, "stores")
        for round_ in (1, 2):
            # Make the index stale without a block event: the holder is declared down
            # (its blocks leave the index), then heartbeats again, so the conductor
            # asks for its inventory. Both answers carry identical fields.
            await bus.publish(ev.InstanceDown(instance_id="kv0", reason=f"test {round_}"))
            await _until(
                lambda: service.conductor.state.index.blocks_held("kv0") == 0,
                f"forgotten ({round_})",
            )
            await bus.publish(ev.LoadReport(instance_id="kv0", role="kvstore"))
            await _until(
                lambda: service.conductor.state.index.blocks_held("kv0") == 3,
                f"inventory {round_} in the index",
            )
        assert publisher.published == 4  # cleared, stored, two inventories
    finally:
        await service.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
