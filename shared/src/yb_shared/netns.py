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

Only one network of a given prefix exists at a time on a machine: `create()` takes a
lock file, removes whatever a crashed run left under the same prefix, and `destroy()`
(idempotent, also called when `create()` fails half way) removes every namespace,
link and the bridge again. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and the
`ip` command; `unavailable_reason()` says why not, for a test to skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
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


class NetnsError(RuntimeError):
    """An `ip` command failed, or the network could not be made."""


def ip(*args: str, netns: str = "") -> str:
    """Run `ip ARGS` (inside `netns` when given); its output. Raises `NetnsError`."""
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ('' when they can): not root, no `ip`, or
    the kernel refuses (a container without CAP_SYS_ADMIN)."""
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
    return ""


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
