"""A peer behind a firewall that drops packets: transfers to it fail, nothing else stops.

The receiver runs in a network namespace (`yb_testkit.netns`, one host on a bridge),
with UCX over TCP only, so that its packets cross the host's link; this process is
the sender, bound to the bridge. A blackhole (iptables DROP inside the host's
namespace) makes the peer silently unreachable, the everyday firewall fault.

What must hold, as outcomes and order (never as elapsed times): a transfer over the
existing connection and a new connection to the blackholed peer both end with a
transfer error within their deadlines, while this process's event loop keeps running
and its UCX keeps moving bytes to a healthy receiver meanwhile; once healed, the same
peer is served again. Before `UCX_TCP_CONN_NB=y` and endpoint creation off the loop's
thread, UCX's blocking `connect()` froze this process's UCX and event loop until the
blackhole was healed. Needs root; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from yb_dataplane.transport import (
    KVReceiver,
    KVSender,
    PeerAddress,
    PeerUnreachable,
    TransferError,
)
from yb_testkit.netns import Host, HostNetwork, unavailable_reason

PREFIX = "ybtb"
SUBNET = "10.81.0.0/24"
#: A receiver that takes any request (a store's reservation factory) and says which
#: ones it committed on stdout.
SINK = """
import asyncio, sys
import numpy as np
from yb_dataplane.transport import KVReceiver

async def main():
    rx = KVReceiver(host=sys.argv[1])
    def factory(request_id, header):
        return [np.zeros(n, np.uint8) for n in header.sizes]
    def watch(res):
        async def report():
            try:
                await res.wait_committed()
                print("committed", res.request_id, flush=True)
            except Exception as exc:
                print("failed", res.request_id, type(exc).__name__, flush=True)
        tasks.add(asyncio.get_running_loop().create_task(report()))
    tasks = set()
    rx.set_reservation_factory(factory, deadline_s=60, on_reserved=watch)
    print("address", (await rx.start()).to_wire(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""
PAGE = 1 << 20


@dataclass
class Remote:
    host: Host
    address: PeerAddress
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def network() -> Iterator[HostNetwork]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    net = HostNetwork(prefix=PREFIX, subnet=SUBNET, lock_timeout_s=60)
    # UCX's TCP transport skips bridge devices unless told: this process reaches the
    # host through the bridge. Read when a UCX context is made (each test makes its
    # own), so setting it for this module's tests only is enough.
    before = os.environ.get("UCX_TCP_BRIDGE_ENABLE")
    os.environ["UCX_TCP_BRIDGE_ENABLE"] = "y"
    try:
        net.create(["host-0"])
        yield net
    finally:
        net.destroy()
        if before is None:
            os.environ.pop("UCX_TCP_BRIDGE_ENABLE", None)
        else:
            os.environ["UCX_TCP_BRIDGE_ENABLE"] = before


@pytest.fixture
def remote(network: HostNetwork) -> Iterator[Remote]:
    host = network.hosts[0]
    env = dict(os.environ, UCX_TLS="tcp")  # only the network: no shm, no cma
    proc = subprocess.Popen(
        host.command(sys.executable, "-c", SINK, host.address),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["address"], line
        yield Remote(host, PeerAddress.parse(line[1]), proc)
    finally:
        host.heal()
        proc.kill()
        proc.wait()


@pytest.fixture
async def local(network: HostNetwork) -> AsyncIterator[KVReceiver]:
    # The first UCX user of this process binds it: to the bridge, which the host
    # reaches (its hello's answer comes back to this address).
    rx = KVReceiver(host=network.gateway_address)
    await rx.start()
    try:
        yield rx
    finally:
        await rx.close()


class Ticker:
    """Counts turns of the event loop's clock: proof that the loop ran meanwhile."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.ticks += 1

    async def wait_ticks(self, n: int) -> None:
        start = self.ticks
        async with asyncio.timeout(60):
            while self.ticks < start + n:
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def healthy_transfer(tx: KVSender, rx: KVReceiver, rid: str) -> None:
    """A whole transfer to the healthy receiver, committed and verified."""
    src = np.full(PAGE, 7, np.uint8)
    res = rx.reserve(rid, [np.zeros(PAGE, np.uint8)], deadline_s=60)
    await tx.send_segments(rx.address, rid, [[(0, src)]], deadline_s=60)
    await res.wait_committed()


async def survived(
    stuck: asyncio.Task[None], tx: KVSender, rx: KVReceiver, ticker: Ticker, rid: str
) -> None:
    """`stuck` (a transfer to the blackholed peer) ends with a transfer error, and
    neither while it is pending nor after it ended (its goodbye to the blackholed
    peer then under way) do the loop or UCX stop: a transfer to the healthy receiver
    completes each time.

    Outcomes, not timings: a frozen loop or UCX fails the healthy transfers (their
    generous bound passes, or they never end), whatever the machine's speed.
    """
    await asyncio.wait_for(healthy_transfer(tx, rx, f"{rid}-meanwhile"), 60)
    with pytest.raises(TransferError):
        await asyncio.wait_for(stuck, 60)  # "it ended" (its own deadline is shorter)
    await ticker.wait_ticks(5)
    await asyncio.wait_for(healthy_transfer(tx, rx, f"{rid}-after"), 60)


@pytest.mark.asyncio
async def test_a_blackholed_peer_costs_its_transfers_only(
    network: HostNetwork, remote: Remote, local: KVReceiver
) -> None:
    tx = KVSender(connect_timeout_s=8)
    ticker = Ticker()
    pages = [(i, np.full(PAGE, i + 1, np.uint8)) for i in range(4)]
    try:
        # The path works: one transfer makes the connection.
        await tx.send_segments(remote.address, "put:before", [pages], deadline_s=30)

        for direction in ("both", "out"):
            remote.host.blackhole(network.gateway_address, direction)
            # 1. Over the connection that exists: ends at its deadline.
            stuck = asyncio.create_task(
                tx.send_segments(remote.address, f"put:old-{direction}", [pages], deadline_s=8)
            )
            await survived(stuck, tx, local, ticker, f"healthy-old-{direction}")
            # 2. A new connection (the dropped one's goodbye goes out meanwhile): the
            # connect fails within connect_timeout_s, as unreachable.
            stuck = asyncio.create_task(
                tx.send_segments(remote.address, f"put:new-{direction}", [pages], deadline_s=30)
            )
            await survived(stuck, tx, local, ticker, f"healthy-new-{direction}")
            # 3. Healed: the same peer is served again (a fresh connection).
            remote.host.heal()
            await tx.send_segments(remote.address, f"put:after-{direction}", [pages], deadline_s=30)
    finally:
        await ticker.stop()
        await tx.close()


@pytest.mark.asyncio
async def test_connecting_to_a_blackholed_peer_fails_as_unreachable(
    network: HostNetwork, remote: Remote, local: KVReceiver
) -> None:
    remote.host.blackhole(network.gateway_address, "both")
    tx = KVSender(connect_timeout_s=5)
    ticker = Ticker()
    try:
        stuck = asyncio.create_task(
            tx.send_segments(
                remote.address, "put:never", [[(0, np.ones(PAGE, np.uint8))]], deadline_s=30
            )
        )
        await ticker.wait_ticks(5)
        await asyncio.wait_for(healthy_transfer(tx, local, "healthy"), 60)
        with pytest.raises(PeerUnreachable):
            await asyncio.wait_for(stuck, 60)
        await asyncio.wait_for(healthy_transfer(tx, local, "healthy-after"), 60)
    finally:
        await ticker.stop()
        await tx.close()
