"""`yb_shared.netns` for real: namespaces, a bridge, a cut cable, nothing left behind.

Needs root (the multi-host test's hosts are made the same way); skipped otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from yb_shared.netns import Host, HostNetwork, NetnsError, ip, unavailable_reason

PREFIX = "ybnt"
SUBNET = "10.78.0.0/24"
SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 7000)); s.settimeout(10); "
    "c, _ = s.accept(); d = b''\n"
    "while (b := c.recv(65536)): d += b\n"
    "c.sendall(d); c.close()"
)
SEND = (
    "import socket, sys; c = socket.create_connection((sys.argv[1], 7000), timeout=2); "
    "c.sendall(b'x' * 200000); c.shutdown(socket.SHUT_WR); n = 0\n"
    "while (b := c.recv(65536)): n += len(b)\n"
    "print(n)"
)


@pytest.fixture(scope="module", autouse=True)
def _root_only() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def _leftovers() -> list[str]:
    names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link").splitlines()]
    return [n for n in names + links if n.startswith(f"{PREFIX}-")]


@pytest.fixture
def network() -> Iterator[HostNetwork]:
    net = HostNetwork(prefix=PREFIX, subnet=SUBNET, lock_timeout_s=30)
    try:
        yield net
    finally:
        net.destroy()
        assert _leftovers() == []


def _echo(source: Host, target: Host) -> int:
    """Bytes echoed back by a server in `target` to a client in `source` (0: failed)."""
    server = subprocess.Popen(target.command(sys.executable, "-c", SERVE, target.address))
    try:
        for _ in range(50):  # until the server listens
            done = subprocess.run(
                source.command(sys.executable, "-c", SEND, target.address),
                capture_output=True,
                text=True,
                timeout=10,
            )
            if done.returncode == 0:
                return int(done.stdout)
            if "timed out" in done.stderr:
                return 0
        return 0
    finally:
        server.kill()
        server.wait()


def test_hosts_talk_over_their_links_and_a_cut_stops_them(network: HostNetwork) -> None:
    # A crashed run's leftovers under the same prefix are removed first.
    ip("netns", "add", f"{PREFIX}-host-0")
    ip("link", "add", f"{PREFIX}-br", "type", "bridge")
    a, b = network.create(["host-0", "host-1"])
    assert (a.address, b.address, network.gateway_address) == (
        "10.78.0.10",
        "10.78.0.11",
        "10.78.0.1",
    )

    before = a.counters(), b.counters()
    assert _echo(a, b) == 200000
    sent, received = a.counters() - before[0], b.counters() - before[1]
    assert sent.sent_bytes >= 200000 and sent.received_bytes >= 200000
    assert received.received_bytes >= 200000 and received.sent_bytes >= 200000

    b.cut()
    assert _echo(a, b) == 0
    b.restore()
    assert _echo(a, b) == 200000


def test_a_failed_create_removes_what_it_made(network: HostNetwork) -> None:
    network.create(["host-0"])
    clash = HostNetwork(prefix="ybnu", subnet=SUBNET, lock_timeout_s=30)
    with pytest.raises(NetnsError, match="already used"):
        clash.create(["host-0"])
    assert not [n for n in ip("-o", "link").split() if n.startswith("ybnu-")]
