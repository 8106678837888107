"""`yb_testkit.netns` for real: namespaces, a bridge, a cut cable, nothing left behind.

Needs root (the multi-host test's hosts are made the same way); skipped otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from yb_testkit.netns import (
    Host,
    HostNetwork,
    NetnsError,
    forward_policy,
    ip,
    set_forward_policy,
    unavailable_reason,
)

PREFIX = "ybnt"
SUBNET = "10.78.0.0/24"
SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 7000)); s.settimeout(10); "
    "c, _ = s.accept(); d = b''\n"
    "while (b := c.recv(65536)): d += b\n"
    "c.sendall(d); c.close()"
)
# The connect's short timeout is what a cut link hits; once connected, the echo has
# all the time a busy machine may take.
SEND = (
    "import socket, sys; c = socket.create_connection((sys.argv[1], 7000), timeout=2); "
    "c.settimeout(30); c.sendall(b'x' * 200000); c.shutdown(socket.SHUT_WR); n = 0\n"
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
                timeout=60,
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


@pytest.fixture
def forward_drop() -> Iterator[None]:
    """FORWARD's policy DROP for the test (as Docker sets it), the previous one after."""
    before = forward_policy()
    set_forward_policy("DROP")
    try:
        yield
    finally:
        set_forward_policy(before)


def _foreign_forward_rules() -> list[str]:
    """FORWARD's rules that no HostNetwork added (Docker's, the machine's own)."""
    listing = subprocess.run(
        ["iptables", "-w", "10", "-S", "FORWARD"], capture_output=True, text=True, check=True
    )
    return [line for line in listing.stdout.splitlines() if "yb-netns:" not in line]


def test_hosts_talk_under_a_drop_forward_policy_and_leave_no_rule(
    forward_drop: None, network: HostNetwork
) -> None:
    foreign = _foreign_forward_rules()
    # A crashed run's rule under the same prefix is removed by the next create().
    stale = ["-m", "comment", "--comment", network.rule_tag, "-j", "ACCEPT"]
    subprocess.run(["iptables", "-w", "10", "-I", "FORWARD", "1", *stale], check=True)
    assert len(network.forwarding_rules()) == 1
    a, b = network.create(["host-0", "host-1"])
    assert forward_policy() == "DROP"
    assert len(network.forwarding_rules()) == 3  # its own, the stale one gone
    assert _echo(a, b) == 200000
    # Another network removes its own rules only.
    other = HostNetwork(prefix="ybnu", subnet="10.79.0.0/24", lock_timeout_s=30)
    try:
        other.create(["host-0"])
        assert len(other.forwarding_rules()) == 3
    finally:
        other.destroy()
    assert other.forwarding_rules() == []
    assert len(network.forwarding_rules()) == 3
    assert _echo(a, b) == 200000
    network.destroy()
    assert network.forwarding_rules() == []
    assert _foreign_forward_rules() == foreign  # nothing else touched


CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 7000), timeout=1).close()"
LISTEN = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 7000)); print('up', flush=True)\n"
    "while True: s.accept()[0].close()"
)


def test_a_blackhole_drops_silently_one_way_or_both_and_heals(network: HostNetwork) -> None:
    a, b = network.create(["host-0", "host-1"])
    server = subprocess.Popen(
        b.command(sys.executable, "-c", LISTEN, b.address), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"

        def connects() -> bool:
            done = subprocess.run(
                a.command(sys.executable, "-c", CONNECT, b.address),
                capture_output=True,
                text=True,
                timeout=30,
            )
            # A blackhole answers nothing: the connect times out (never "refused").
            assert done.returncode == 0 or "timed out" in done.stderr, done.stderr
            return done.returncode == 0

        assert connects()
        for host, peer, direction in (
            (a, b, "out"),  # host-0's SYN never leaves
            (a, b, "in"),  # the SYN-ACK never gets in
            (a, b, "both"),
            (b, a, "in"),  # the same fault, made on the other host
        ):
            host.blackhole(peer, direction)
            assert host.blackholes(), direction
            assert not connects(), (host.name, direction)
            host.heal()
            assert host.blackholes() == []
            assert connects(), (host.name, direction)
        with pytest.raises(ValueError):
            a.blackhole(b, "sideways")
    finally:
        server.kill()
        server.wait()
