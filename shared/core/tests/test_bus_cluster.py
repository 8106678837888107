"""The bus against a real three-node NATS cluster: the event stream at R3 survives a node.

Three nats-server processes with routes between them (authenticated with a route
password) and JetStream on each; the bus connects with all three URLs. Losing the
stream's leader (SIGKILL) must cost no acknowledged event and no duplicate: the
publishes around the kill all land once, in order, and a retried publish is still
recognised by its `Nats-Msg-Id` on the new leader.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors
import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_tools.natsserver import (
    CLUSTER_FAILOVER_S,
    NatsServer,
    route_url,
    sync_interval_value,
)

#: Every wait in this module: several leader elections' worth, so a slow election on a
#: loaded machine is no failure; each wait ends as soon as its condition holds.
WAIT_S = 6 * CLUSTER_FAILOVER_S


@pytest.fixture
def nodes(nats_cluster: list[NatsServer]) -> list[NatsServer]:
    return nats_cluster


@pytest.fixture
async def cluster_bus(nodes: list[NatsServer]) -> AsyncIterator[Bus]:
    cfg = NatsConfig(
        url=",".join(n.url for n in nodes),
        replicas=3,
        # Each publish's own retry budget must outlast a stream leader election
        # (CLUSTER_FAILOVER_S, 4-9 s in nats-server) with room for a loaded machine.
        request_timeout_s=3 * CLUSTER_FAILOVER_S,
        reconnect_wait_s=0.05,
        max_reconnect_wait_s=0.5,
    )
    bus = await Bus.connect(cfg, "test", timeout_s=WAIT_S)
    try:
        # A fresh cluster answers JetStream requests once it has a meta leader; until
        # then they go unanswered, so each try is cut short and tried again.
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                await asyncio.wait_for(bus.ensure_stream(), timeout=5.0)
                break
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                assert time.monotonic() < deadline, "the cluster's JetStream never came up"
                await asyncio.sleep(0.2)
        yield bus
    finally:
        await bus.close()


def test_cluster_config_has_routes_sync_and_route_auth(nodes: list[NatsServer]) -> None:
    text = nodes[0].config_text()
    assert 'sync_interval: "1s"' in text
    assert 'authorization { user: "route", password: "route-secret" }' in text
    others = [route_url(n.host, n.cluster_port, "route-secret") for n in nodes[1:]]
    assert all(f'"{r}"' in text for r in others)
    assert f':{nodes[0].cluster_port}"' not in text.split("routes:")[1]  # not itself
    assert route_url("h", 1, "a/b@c") == "nats-route://route:a%2Fb%40c@h:1"


async def test_stream_at_r3_survives_losing_its_leader(
    cluster_bus: Bus, nodes: list[NatsServer]
) -> None:
    info = await cluster_bus.jetstream.stream_info("YB_EVENTS")
    assert info.config.num_replicas == 3
    assert info.cluster is not None and info.cluster.leader
    assert len(info.cluster.replicas or []) == 2  # the leader plus two followers

    first = ev.RequestCancelled(request_id="before", reason="x")
    seq_first = await cluster_bus.publish(first)
    # A reader that follows the log across the loss (as the conductor does).
    follower = await cluster_bus.read_ordered()
    got = await follower.next(timeout_s=WAIT_S)
    assert got is not None and got.seq == seq_first
    leader = next(n for n in nodes if n.server_name == info.cluster.leader)
    leader.kill()

    # Publishes retry across the election within their deadline; none is lost. (How
    # long the election takes is nats-server's, not asserted here.)
    for i in range(5):
        await cluster_bus.publish(ev.RequestCancelled(request_id=f"after-{i}", reason="x"))
    # The retried first event is recognised as a duplicate by the new leader.
    assert await cluster_bus.publish(first) == seq_first
    last = await cluster_bus.last_sequence()
    assert last == seq_first + 5

    followed = []
    while len(followed) < 5 and (item := await follower.next(timeout_s=WAIT_S)) is not None:
        followed.append(item.event.request_id)  # type: ignore[union-attr]
    await follower.close()
    assert followed == [f"after-{i}" for i in range(5)]

    # The whole log, read to its end (`last`), holds each event once, in order.
    reader = await cluster_bus.read_ordered()
    seen = []
    while len(seen) < 6 and (item := await reader.next(timeout_s=WAIT_S)) is not None:
        seen.append(item.event.request_id)  # type: ignore[union-attr]
        assert item.seq <= last, item
    await reader.close()
    assert seen == ["before", *(f"after-{i}" for i in range(5))]
    info = await cluster_bus.jetstream.stream_info("YB_EVENTS")
    assert info.cluster is not None and info.cluster.leader != leader.server_name


async def test_the_same_event_from_two_services_is_stored_once(
    cluster_bus: Bus, nodes: list[NatsServer]
) -> None:
    # The gateway and the conductor both cancel a request whose decode died, with the
    # same message id. On a replicated stream the second publish can arrive while the
    # first is still being agreed on ("duplicate message id is in process"): both
    # must get the one sequence it is stored at.
    other = await Bus.connect(cluster_bus._cfg, "other", timeout_s=WAIT_S)
    try:
        for i in range(30):
            event = ev.RequestCancelled(request_id=f"r{i}", reason="decode down", time=1.0)
            seqs = await asyncio.gather(cluster_bus.publish(event), other.publish(event))
            assert seqs[0] == seqs[1], (i, seqs)
        assert await cluster_bus.last_sequence() == 30
    finally:
        await other.close()


def test_cluster_urls_and_stream_settings_come_from_the_environment() -> None:
    from yb_core.config import ConfigError, load_config

    cfg = load_config(
        env={
            "YB_NATS__URL": "nats://n1:4222, nats://n2:4222,nats://n3:4222",
            "YB_NATS__REPLICAS": "3",
            "YB_NATS__SYNC_INTERVAL_S": "0",
        }
    )
    assert cfg.nats.servers() == ["nats://n1:4222", "nats://n2:4222", "nats://n3:4222"]
    assert (cfg.nats.replicas, cfg.nats.sync_interval_s) == (3, 0.0)
    # The single-server default is unchanged.
    assert load_config(env={}).nats.servers() == ["nats://127.0.0.1:4222"]
    for bad in ({"YB_NATS__REPLICAS": "0"}, {"YB_NATS__SYNC_INTERVAL_S": "-1"}):
        with pytest.raises(ConfigError):
            load_config(env=bad)
    # 0 is `always`, the rest a duration nats-server reads.
    assert [sync_interval_value(s) for s in (0, 1, 0.25)] == ["always", '"1s"', '"250ms"']
