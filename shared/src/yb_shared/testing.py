"""Pytest fixtures for every package's tests: real nats-server, real bus.

Loaded as a plugin (`-p yb_shared.testing` in the workspace's pytest settings), like
nats.py's own test helpers: each test gets a fresh nats-server on a free port with a
temporary JetStream store, and a connected `Bus` with the event stream set up.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from yb_shared.bus import Bus
from yb_shared.config import NatsConfig, TelemetryConfig
from yb_shared.natsserver import NatsServer
from yb_shared.telemetry import configure_logging


def pytest_configure(config: pytest.Config) -> None:
    """Tests log warnings and worse, as console lines (pytest shows them on failure)."""
    configure_logging("test", "test", TelemetryConfig(log_level="warning", log_json=False))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A running nats-server with JetStream, stopped after the test."""
    server = NatsServer(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_config(nats_server: NatsServer) -> NatsConfig:
    """Client settings pointing at the test's server, with short test timeouts."""
    return NatsConfig(
        url=nats_server.url,
        request_timeout_s=2.0,
        reconnect_wait_s=0.05,
        max_reconnect_wait_s=0.5,
        duplicate_window_s=60.0,
    )


@pytest.fixture
async def bus(nats_config: NatsConfig) -> AsyncIterator[Bus]:
    """A connected bus with the event stream created."""
    connected = await Bus.connect(nats_config, "test", timeout_s=10)
    await connected.ensure_stream()
    try:
        yield connected
    finally:
        await connected.close()


class LocalCluster:
    """`yb up` in a subprocess, as a user runs it, for end-to-end tests and benchmarks.

    `start()` returns once `/readyz` answers; `stop()` sends SIGINT (Ctrl-C) and
    returns the launcher's exit code. `pids` lists every process of the cluster.
    """

    def __init__(self, data_dir: Path, *extra_args: str, env: dict[str, str] | None = None):
        from yb_shared.natsserver import free_port

        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "up",
            "--port",
            str(self.port),
            "--nats-port",
            "0",
            "--data-dir",
            str(data_dir),
            *extra_args,
        ]
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.pids: dict[str, int] = {}
        self.log_path = data_dir / "yb-up.log"

    def start(self, timeout_s: float = 600.0) -> None:
        """Launch and wait for readiness; raises with the launcher's output on failure."""
        import httpx

        from yb_shared.cli.launcher import read_cluster_info
        from yb_shared.natsserver import die_with_parent, env_without_proxies

        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = env_without_proxies()
        # A fresh data dir would otherwise convert the model again (half a minute):
        # tests share the machine's model cache unless told otherwise.
        env.setdefault("YB_MODEL_CACHE", str(Path.home() / ".cache" / "yuebing" / "models"))
        env.update(self.env or {})
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "yb_shared.cli", *self.args],
                stdout=out,
                stderr=out,
                env=env,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"yb up exited with {self.process.returncode}:\n{self.output()}")
            info = read_cluster_info(self.data_dir)
            if info is not None:
                self.pids = dict(info.pids)
                try:
                    if httpx.get(f"{self.url}/readyz", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"cluster not ready within {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        """What the launcher printed."""
        try:
            return self.log_path.read_text(errors="replace")[-20000:]
        except OSError:
            return ""

    def instance_log(self, instance_id: str) -> str:
        """One instance's log."""
        try:
            return (self.data_dir / "logs" / f"{instance_id}.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ctrl-C the launcher and wait for it; returns its exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    """Whether a process exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
