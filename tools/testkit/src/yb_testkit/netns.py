"""Network namespaces as hosts: a few "machines" on one box, joined by a real link.

`HostNetwork` makes one Linux network namespace per host, each with its own `eth0`
(one end of a veth pair) and address, and plugs the other ends into a bridge in the
root namespace, which has the first address of the subnet:

    root namespace                      network namespaces
    bridge P-br 10.77.0.1/24 ─┬─ P-h0 ══ eth0 10.77.0.10   (netns P-h0)
                              ├─ P-h1 ══ eth0 10.77.0.11   (netns P-h1)
                              └─ ...                        (P: the prefix)

Traffic between hosts, and between a host and the root namespace, crosses the host's
veth and shows in its counters (`Host.counters`, read from the root side: bytes the
host sent arrive at its switch port). `Host.cut()` takes the host's switch port down,
as if its cable were pulled; `Host.restore()` plugs it in again.

Forwarding through the bridge. With bridge netfilter on (`br_netfilter`, which Docker
loads), frames crossing the bridge between two hosts traverse the root namespace's
iptables FORWARD chain; Docker sets its policy to DROP, so hosts would silently not
reach each other. `create()` therefore inserts ACCEPT rules at the top of FORWARD for
traffic in and out of its own bridge (`-i BR -o BR`, and by subnet for the bridge's
own routed traffic), each tagged with the comment `yb-netns:<prefix>`; `destroy()`
and `remove_stale()` delete exactly the rules carrying that comment (a crashed run's
too), nothing else. Where the FORWARD chain cannot be changed (no `iptables`, no
permission) while bridge netfilter is on, `unavailable_reason()` says so.

Faults between hosts: `Host.cut()` pulls the cable (the port goes down, both ends see
it), `Host.blackhole(peer, direction)` silently drops packets to and/or from one peer
(iptables rules *inside* the host's namespace, as a firewall would: nothing is told,
TCP just stops getting answers), `Host.heal()` removes them.

Only one network of a given prefix exists at a time on a machine: `create()` takes a
lock file, removes whatever a crashed run left under the same prefix, and `destroy()`
(idempotent, also called when `create()` fails half way) removes every namespace,
link, forwarding rule and the bridge again. Needs root (or CAP_NET_ADMIN and
CAP_SYS_ADMIN) and the `ip` command; `unavailable_reason()` says why not, for a test
to skip.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import ipaddress
import os
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

#: The interface of a host inside its namespace.
HOST_DEVICE = "eth0"
LOCK_DIR = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
#: Set when bridge netfilter is on: bridged frames then go through iptables' FORWARD.
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
#: The comment that tags a network's FORWARD rules (then `:<prefix>`).
RULE_TAG = "yb-netns"
#: The comment that tags a host's blackhole rules inside its namespace.
BLACKHOLE_TAG = "yb-blackhole"


class NetnsError(RuntimeError):
    """An `ip` command failed, or the network could not be made."""


def ip(*args: str, netns: str = "") -> str:
    """Run `ip ARGS` (inside `netns` when given); its output. Raises `NetnsError`."""
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def iptables(*args: str, netns: str = "") -> str:
    """Run `iptables -w ARGS` (inside `netns` when given); its output. Raises
    `NetnsError` (also when iptables is not installed)."""
    enter = ["ip", "netns", "exec", netns] if netns else []
    # -w: wait for the xtables lock (another helper or Docker may hold it) instead of
    # failing at once; bounded by the subprocess timeout.
    command = [*enter, "iptables", "-w", "10", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise NetnsError(f"{command[0]} is not installed: {exc}") from None
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def bridge_netfilter() -> bool:
    """True when bridged frames go through iptables (br_netfilter loaded and on)."""
    try:
        return BRIDGE_NF.read_text().strip() == "1"
    except OSError:
        return False


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ('' when they can): not root, no `ip`, the
    kernel refuses (a container without CAP_SYS_ADMIN), or bridge netfilter is on and
    the FORWARD chain cannot be changed (no `iptables`, or no permission), so hosts
    might silently not reach each other."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"yb-probe-{uuid.uuid4().hex[:8]}"
    try:
        ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(NetnsError, OSError, subprocess.SubprocessError):
        ip("netns", "del", probe)
    if bridge_netfilter():
        if shutil.which("iptables") is None:
            return (
                "bridge netfilter is on (Docker?) and `iptables` is not installed: "
                "forwarding between the test hosts cannot be allowed"
            )
        try:
            iptables("-S", "FORWARD")
        except (NetnsError, OSError, subprocess.SubprocessError) as exc:
            return f"bridge netfilter is on and the FORWARD chain cannot be read: {exc}"
    return ""


def forward_policy() -> str:
    """The root namespace's FORWARD policy (ACCEPT or DROP); raises NetnsError."""
    for line in iptables("-S", "FORWARD").splitlines():
        if line.startswith("-P FORWARD "):
            return line.split()[2]
    raise NetnsError("iptables -S FORWARD printed no policy")


def set_forward_policy(policy: str) -> None:
    """Set the root namespace's FORWARD policy (ACCEPT or DROP)."""
    if policy not in ("ACCEPT", "DROP"):
        raise ValueError(f"unknown FORWARD policy {policy!r}")
    iptables("-P", "FORWARD", policy)


def tagged_rules(tag: str, chain: str = "FORWARD", netns: str = "") -> list[list[str]]:
    """The rules of `chain` whose comment is exactly `tag`, as `iptables -S` prints
    them (split into arguments, starting with `-A CHAIN`)."""
    found = []
    for line in iptables("-S", chain, netns=netns).splitlines():
        args = shlex.split(line)
        if args[:1] != ["-A"]:
            continue
        comments = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--comment"]
        if tag in comments:
            found.append(args)
    return found


def delete_rules(rules: list[list[str]], netns: str = "") -> None:
    """Delete rules listed by `tagged_rules` (each one by its full specification)."""
    for rule in rules:
        with contextlib.suppress(NetnsError):  # gone already
            iptables("-D", *rule[1:], netns=netns)


class Direction(enum.StrEnum):
    """Which packets a blackhole drops, seen from the host that has it."""

    OUT = "out"  # from this host to the peer
    IN = "in"  # from the peer to this host
    BOTH = "both"


@dataclass(frozen=True)
class LinkCounters:
    """Bytes and packets a host sent and received over its link."""

    sent_bytes: int
    received_bytes: int
    sent_packets: int
    received_packets: int

    def __sub__(self, earlier: LinkCounters) -> LinkCounters:
        return LinkCounters(
            self.sent_bytes - earlier.sent_bytes,
            self.received_bytes - earlier.received_bytes,
            self.sent_packets - earlier.sent_packets,
            self.received_packets - earlier.received_packets,
        )


@dataclass(frozen=True)
class Host:
    """One host: a network namespace with one interface on the shared bridge."""

    name: str
    netns: str
    address: str
    port: str  # the root-side end of its veth pair: its port on the "switch"
    device: str = HOST_DEVICE

    def counters(self) -> LinkCounters:
        """The host's traffic so far. Read at the switch port: what the port received
        the host sent, and the other way round."""
        stats = Path("/sys/class/net") / self.port / "statistics"

        def read(name: str) -> int:
            return int((stats / name).read_text())

        return LinkCounters(
            sent_bytes=read("rx_bytes"),
            received_bytes=read("tx_bytes"),
            sent_packets=read("rx_packets"),
            received_packets=read("tx_packets"),
        )

    def cut(self) -> None:
        """Pull the cable: the host's switch port goes down, so nothing gets in or out
        (its processes keep running and see their connections stall)."""
        ip("link", "set", self.port, "down")

    def restore(self) -> None:
        """Plug it in again."""
        ip("link", "set", self.port, "up")

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def blackhole(self, peer: Host | str, direction: Direction | str = Direction.BOTH) -> None:
        """Silently drop packets between this host and `peer` (a Host or an address).

        A firewall's DROP inside this host's namespace: nobody is told, TCP simply
        stops getting answers (no RST, no ICMP, the link stays up). `direction` is
        seen from this host: `out` drops what it sends to the peer, `in` what it
        receives from the peer, `both` both. Rules add up; `heal()` removes them all.
        """
        address = peer.address if isinstance(peer, Host) else str(ipaddress.ip_address(peer))
        way = Direction(direction)
        tag = ["-m", "comment", "--comment", BLACKHOLE_TAG, "-j", "DROP"]
        if way in (Direction.OUT, Direction.BOTH):
            iptables("-I", "OUTPUT", "1", "-d", address, *tag, netns=self.netns)
        if way in (Direction.IN, Direction.BOTH):
            iptables("-I", "INPUT", "1", "-s", address, *tag, netns=self.netns)

    def heal(self) -> None:
        """Remove every blackhole of this host (idempotent)."""
        for chain in ("INPUT", "OUTPUT"):
            delete_rules(tagged_rules(BLACKHOLE_TAG, chain, self.netns), self.netns)

    def blackholes(self) -> list[list[str]]:
        """This host's blackhole rules (empty once healed)."""
        return [
            rule
            for chain in ("INPUT", "OUTPUT")
            for rule in tagged_rules(BLACKHOLE_TAG, chain, self.netns)
        ]


@dataclass
class HostNetwork:
    """Hosts in network namespaces on one bridge (see the module's docstring).

    `subnet` is a /24 whose `.1` goes to the bridge (the root namespace) and `.10`
    onwards to the hosts. Use as a context manager, or `create()` then `destroy()`.
    """

    prefix: str = "ybnet"
    subnet: str = "10.77.0.0/24"
    lock_timeout_s: float = 300.0
    hosts: list[Host] = field(default_factory=list)
    _lock: IO[bytes] | None = None

    @property
    def bridge(self) -> str:
        """The bridge's interface name."""
        return f"{self.prefix}-br"

    @property
    def rule_tag(self) -> str:
        """The comment on this network's FORWARD rules."""
        return f"{RULE_TAG}:{self.prefix}"

    @property
    def gateway_address(self) -> str:
        """The root namespace's address on the bridge (where hosts reach it)."""
        return str(self._network()[1])

    def _network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    def create(self, names: list[str]) -> list[Host]:
        """Make one host per name (after removing a crashed run's leftovers)."""
        if len(self.prefix) > 8:
            raise NetnsError("prefix too long: interface names have 15 characters")
        self._acquire_lock()
        try:
            self.remove_stale()
            self._check_subnet_free()
            network = self._network()
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway_address}/{network.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            self._allow_forwarding()
            for i, name in enumerate(names):
                host = Host(
                    name=name,
                    netns=f"{self.prefix}-{name}",
                    address=str(network[10 + i]),
                    port=f"{self.prefix}-{name}"[:15],
                )
                self._add_host(host, network.prefixlen)
                self.hosts.append(host)
        except BaseException:
            self.destroy()
            raise
        return list(self.hosts)

    def _add_host(self, host: Host, prefixlen: int) -> None:
        ip("netns", "add", host.netns)
        # Created straight into the namespace under its final name: no rename, and no
        # moment where both ends sit in the root namespace.
        ip(
            "link",
            "add",
            host.port,
            "type",
            "veth",
            "peer",
            "name",
            host.device,
            "netns",
            host.netns,
        )
        ip("link", "set", host.port, "master", self.bridge)
        ip("link", "set", host.port, "up")
        ip("addr", "add", f"{host.address}/{prefixlen}", "dev", host.device, netns=host.netns)
        ip("link", "set", host.device, "up", netns=host.netns)
        # Loopback too: a service may listen on 127.0.0.1 inside its host.
        ip("link", "set", "lo", "up", netns=host.netns)

    def _allow_forwarding(self) -> None:
        """ACCEPT this network's traffic at the top of FORWARD (see the module's
        docstring); nothing to do where bridged frames skip iptables and there is no
        iptables to ask."""
        if not bridge_netfilter() and shutil.which("iptables") is None:
            return
        tag = ["-m", "comment", "--comment", self.rule_tag, "-j", "ACCEPT"]
        # Host to host across the bridge; and anything routed to or from the subnet
        # (a host reaching the root namespace's other interfaces, should a test do so).
        iptables("-I", "FORWARD", "1", "-i", self.bridge, "-o", self.bridge, *tag)
        iptables("-I", "FORWARD", "1", "-s", self.subnet, *tag)
        iptables("-I", "FORWARD", "1", "-d", self.subnet, *tag)

    def forwarding_rules(self) -> list[list[str]]:
        """The FORWARD rules this network (or a crashed run of its prefix) added."""
        if shutil.which("iptables") is None:
            return []
        return tagged_rules(self.rule_tag)

    def _check_subnet_free(self) -> None:
        network = self._network()
        for line in ip("-o", "-4", "addr", "show").splitlines():
            parts = line.split()
            address = ipaddress.IPv4Interface(parts[3])
            if address.network.overlaps(network):
                raise NetnsError(f"{network} is already used by {parts[1]}: pick another subnet")

    def remove_stale(self) -> None:
        """Remove namespaces and links of this prefix (a crashed run's leftovers).

        Called with the lock held, so none of them belongs to a live run.
        """
        for line in ip("netns", "list").splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(f"{self.prefix}-"):
                with contextlib.suppress(NetnsError):
                    ip("netns", "del", name)
        for line in ip("-o", "link", "show").splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(f"{self.prefix}-"):
                with contextlib.suppress(NetnsError):
                    ip("link", "del", name)
        with contextlib.suppress(NetnsError):  # no iptables: nothing of ours there
            delete_rules(self.forwarding_rules())

    def destroy(self) -> None:
        """Remove every namespace (its end of each veth goes with it), the bridge and
        whatever is left of this prefix; release the lock. Safe to call twice."""
        try:
            for host in self.hosts:
                with contextlib.suppress(NetnsError):
                    ip("netns", "del", host.netns)
            self.hosts.clear()
            if self._lock is not None:
                self.remove_stale()
        finally:
            self._release_lock()

    def _acquire_lock(self) -> None:
        if self._lock is not None:
            return
        path = LOCK_DIR / f"yb-netns-{self.prefix}.lock"
        lock = open(path, "wb")  # noqa: SIM115  (held until destroy())
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise NetnsError(
                        f"another run holds {path} for more than {self.lock_timeout_s:g}s"
                    ) from None
                time.sleep(0.5)
        self._lock = lock

    def _release_lock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
