"""Instance announcements outlive the event log's byte limit.

The log (`YB_EVENTS`) trims its oldest events, announcements included; the instance
stream beside it sources the instance subjects and keeps the newest message of
each, so a process started after the trim (a `PeerDirectory`, `yb status`, the
gateway's readiness view in the gateway's tests) still learns every live instance,
and none that was declared down. Everything here runs against a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import nats.js.errors
import pytest

from yb_core import events as ev
from yb_core.bus import INSTANCE_SUBJECTS, Bus, BusError
from yb_core.config import INSTANCE_LOG_BYTES, MIN_EVENT_LOG_BYTES, NatsConfig
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.transport import PeerAddress
from yb_testkit.fixtures import AuthNats, flood_log
from yb_tools.cli.status import collect
from yb_tools.natsserver import CLUSTER_FAILOVER_S, NatsServer

#: Every wait in this module; each ends as soon as its condition holds.
WAIT_S = 30.0


def announcement(instance_id: str, role: ev.Role, host: str = "host-0") -> ev.InstanceUp:
    address = PeerAddress("127.0.0.1", 7000, instance_id.encode()).to_wire()
    return ev.InstanceUp(
        instance_id=instance_id, role=role, host=host, model="m", ucx_address=address
    )


async def announce_then_flood(bus: Bus) -> int:
    """Announce a small cluster (decode-1 goes down again), then publish far more than
    the log holds; returns the sequence of the last announcement, which the log has
    trimmed by then."""
    cluster: list[tuple[str, ev.Role]] = [
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
        ("kvstore-0", "kvstore"),
    ]
    for iid, role in cluster:
        await bus.publish(announcement(iid, role))
    await bus.publish(announcement("decode-1", "decode"))
    last = await bus.publish(ev.InstanceDown(instance_id="decode-1", reason="crashed"))
    # Announced long ago: copied by the time the log trims them. (A 64 KiB log
    # flooded at full speed could trim them before the copy, a real 4 GiB one not.)
    await bus.sync_instances(WAIT_S)
    await flood_log(bus, 4 * MIN_EVENT_LOG_BYTES)
    extent = await bus.log_extent()
    assert not extent.reaches(last), "the log still holds the announcements"
    return last


@pytest.fixture
async def small_bus(nats_config: NatsConfig) -> AsyncIterator[Bus]:
    """A bus whose event log holds 64 KiB."""
    cfg = msgspec.structs.replace(nats_config, max_bytes=MIN_EVENT_LOG_BYTES)
    bus = await Bus.connect(cfg, "small", timeout_s=10)
    await bus.ensure_stream()
    try:
        yield bus
    finally:
        await bus.close()


async def test_a_fresh_reader_learns_every_live_instance_after_the_log_trimmed_them(
    small_bus: Bus, nats_config: NatsConfig
) -> None:
    await announce_then_flood(small_bus)
    small = msgspec.structs.replace(nats_config, max_bytes=MIN_EVENT_LOG_BYTES)
    fresh = await Bus.connect(small, "fresh", timeout_s=10)
    try:
        # `yb status`: caught up with the log first, so the fold is complete by
        # construction (no waiting for "nothing more").
        rows = await collect(fresh, timeout_s=WAIT_S)
        assert sorted(rows) == ["decode-0", "decode-1", "kvstore-0", "prefill-0"]
        assert [i for i, row in rows.items() if row.down] == ["decode-1"]
        assert rows["decode-1"].down == "crashed"

        # A PeerDirectory: every live instance, and the down one gone once an
        # announcement published after its InstanceDown has been applied.
        await fresh.publish(announcement("marker-0", "gateway"))
        peers = PeerDirectory(fresh)
        await peers.open()
        follow = asyncio.create_task(peers.run())
        try:
            assert await peers.wait_for("marker-0", timeout_s=WAIT_S) is not None
            for iid in ("prefill-0", "decode-0", "kvstore-0"):
                assert peers.get(iid) is not None, iid
            assert peers.get("decode-1") is None
            assert peers.address("kvstore-0") == PeerAddress("127.0.0.1", 7000, b"kvstore-0")
            assert peers.kvstore_on("host-0") is not None
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
    finally:
        await fresh.close()


async def test_a_reader_follows_each_instance_to_its_newest_event(small_bus: Bus) -> None:
    reader = await small_bus.read_instances()
    try:
        await small_bus.publish(announcement("prefill-7", "prefill"))
        for queued in range(5):
            report = ev.LoadReport(instance_id="prefill-7", role="prefill", queued_requests=queued)
            await small_bus.publish(report)
        # A compacted view: a report replaced before it was delivered is skipped, but
        # what is delivered comes in order and ends with the newest.
        got: list[ev.AnyEvent] = []
        while not got or getattr(got[-1], "queued_requests", -1) != 4:
            item = await reader.next(timeout_s=WAIT_S)
            assert item is not None, got
            got.append(item.event)
        assert isinstance(got[0], ev.InstanceUp)
        queued_seen = [e.queued_requests for e in got[1:] if isinstance(e, ev.LoadReport)]
        assert queued_seen == sorted(set(queued_seen)) and len(queued_seen) == len(got) - 1
    finally:
        await reader.close()
    await small_bus.sync_instances(WAIT_S)
    info = await small_bus.jetstream.stream_info(small_bus.instance_stream)
    assert info.state.messages == 2  # the announcement and the newest report
    assert info.config.max_msgs_per_subject == 1
    assert info.config.max_bytes == INSTANCE_LOG_BYTES
    assert not info.config.subjects  # only the server's sourcing writes to it


async def test_without_the_instance_stream_readers_say_so(nats_config: NatsConfig) -> None:
    bus = await Bus.connect(nats_config, "bare", timeout_s=10)
    try:
        with pytest.raises(BusError, match="no stream YB_EVENTS_INSTANCES"):
            await bus.read_instances()
        with pytest.raises(BusError, match="no stream YB_EVENTS"):
            await bus.sync_instances(WAIT_S)
        with pytest.raises(ValueError, match="new_only"):
            await bus.read_ordered(INSTANCE_SUBJECTS, new_only=True, stream="YB_EVENTS_INSTANCES")
    finally:
        await bus.close()


async def test_every_role_may_create_and_read_the_instance_stream(
    auth_nats_server: AuthNats,
) -> None:
    roles: tuple[ev.Role, ...] = ("gateway", "prefill", "decode", "kvstore", "conductor")
    for role in roles:
        bus = await Bus.connect(auth_nats_server.config(role), role, timeout_s=10)
        try:
            await bus.ensure_stream()
            iid = f"{role}-0"
            await bus.publish(announcement(iid, role))
            reader = await bus.read_instances()
            try:
                while True:
                    item = await reader.next(timeout_s=WAIT_S)
                    assert item is not None, (role, list(bus.permission_errors))
                    if getattr(item.event, "instance_id", "") == iid:
                        break
            finally:
                await reader.close()
            assert not bus.permission_errors, list(bus.permission_errors)
        finally:
            await bus.close()


@pytest.fixture
def nodes(nats_cluster: list[NatsServer]) -> list[NatsServer]:
    return nats_cluster


async def test_on_a_cluster_the_instance_stream_has_the_logs_replicas(
    nodes: list[NatsServer],
) -> None:
    cfg = NatsConfig(
        url=",".join(n.url for n in nodes),
        replicas=3,
        max_bytes=MIN_EVENT_LOG_BYTES,
        request_timeout_s=3 * CLUSTER_FAILOVER_S,
        reconnect_wait_s=0.05,
        max_reconnect_wait_s=0.5,
    )
    bus = await Bus.connect(cfg, "test", timeout_s=WAIT_S)
    try:
        # A fresh cluster answers JetStream requests once it has a meta leader.
        deadline = time.monotonic() + 6 * CLUSTER_FAILOVER_S
        while True:
            try:
                await asyncio.wait_for(bus.ensure_stream(), timeout=5.0)
                break
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                assert time.monotonic() < deadline, "the cluster's JetStream never came up"
                await asyncio.sleep(0.2)
        info = await bus.jetstream.stream_info(bus.instance_stream)
        assert info.config.num_replicas == 3
        await announce_then_flood(bus)
        rows = await collect(bus, timeout_s=6 * CLUSTER_FAILOVER_S)
        assert sorted(i for i, row in rows.items() if not row.down) == [
            "decode-0",
            "kvstore-0",
            "prefill-0",
        ]
    finally:
        await bus.close()
