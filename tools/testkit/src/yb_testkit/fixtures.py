"""Pytest fixtures for every package's tests: real nats-server, real bus.

Loaded as a plugin (`-p yb_testkit.fixtures` in the workspace's pytest settings), like
nats.py's own test helpers: each test gets a fresh nats-server on a free port with a
temporary JetStream store, and a connected `Bus` with the event stream set up.

`nats_server` accepts anyone (unit tests of one service need no credentials);
`auth_nats_server` runs the same server with the users and permissions `yb up`
generates (`yb_core.nats_auth`), for tests of what each role may do.
`LocalCluster` runs `yb up` and exposes the secrets it generated (API key, metrics
token, the NATS `admin` user), as a client on this machine would read them; given a
`MemoryCgroup`, the whole cluster runs inside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from yb_core.bus import Bus
from yb_core.config import NatsConfig, TelemetryConfig
from yb_core.credentials import LocalSecrets, generate_secret, load_local_secrets
from yb_core.nats_auth import (
    ADMIN_USER,
    USERS,
    cluster_users,
    literal_passwords,
    render_authorization,
)
from yb_core.telemetry import configure_logging
from yb_testkit.cgroup import MemoryCgroup
from yb_tools.natsserver import NatsServer, cluster_nodes

if TYPE_CHECKING:
    from yb_tools.cli.launcher import ClusterInfo


def _cuda_asked(config: pytest.Config) -> bool:
    """The run selects the CUDA suite (`-m cuda`)."""
    expr = config.option.markexpr or ""
    return "cuda" in expr and "not cuda" not in expr


def pytest_configure(config: pytest.Config) -> None:
    """Tests log warnings and worse, as console lines (pytest shows them on failure).

    A run that does not ask for the CUDA suite hides every GPU from itself and from the
    processes it starts (`CUDA_VISIBLE_DEVICES=""`): the CPU suite then tests the same
    CPU configuration on every machine (`device` auto, 64-token blocks, fp32), GPU or
    not, and the CUDA suite (`-m cuda`) is where the GPU path runs.
    """
    configure_logging("test", "test", TelemetryConfig(log_level="warning", log_json=False))
    if not _cuda_asked(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` run only when the run asks for them (`-m cuda`), and then a
    missing GPU is an error, so a GPU run never passes without the GPU path running.
    Elsewhere they skip and say why."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    if not _cuda_asked(config):
        skip = pytest.mark.skip(reason="the CUDA suite runs with -m cuda (GPUs are hidden here)")
        for item in cuda_items:
            item.add_marker(skip)
        return
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f"-m cuda selects {len(cuda_items)} GPU tests, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )


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
def nats_cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    """Three nats-server nodes with routes between them (JetStream elects its leaders
    once they are up), each with its own store; stopped after the test."""
    servers = cluster_nodes(
        tmp_path / "nats", 3, route_password="route-secret", sync_interval_s=1.0, log_dir=tmp_path
    )
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


async def flood_log(bus: Bus, nbytes: int) -> None:
    """Publish filler events (cancellations of requests nobody made) until at least
    `nbytes` of events went into the log: past a small stream's byte limit, its
    oldest events are trimmed."""
    from yb_core import events as ev

    written = 0
    n = 0
    while written < nbytes:
        filler = ev.RequestCancelled(request_id=f"r{n}", reason="x" * 200)
        await bus.publish(filler)
        written += len(ev.encode_event(filler))
        n += 1


#: The instances an `auth_nats_server` grants, one per role.
TEST_INSTANCES: Mapping[str, Sequence[str]] = {
    "conductor": ["conductor-0"],
    "gateway": ["gateway-0"],
    "prefill": ["prefill-0"],
    "decode": ["decode-0"],
    "kvstore": ["kvstore-0"],
}


@dataclass
class AuthNats:
    """A nats-server that knows one user per role (and `admin`), with the
    permissions of `yb_core.nats_auth` for `instances`."""

    server: NatsServer
    passwords: dict[str, str]
    instances: Mapping[str, Sequence[str]] = field(default_factory=lambda: dict(TEST_INSTANCES))

    def config(self, user: str, *, password: str | None = None) -> NatsConfig:
        """Client settings for `user` ('' connects without credentials)."""
        return NatsConfig(
            url=self.server.url,
            user=user,
            password=self.passwords.get(user, "") if password is None else password,
            request_timeout_s=2.0,
            reconnect_wait_s=0.05,
            max_reconnect_wait_s=0.5,
            duplicate_window_s=60.0,
        )


def start_auth_nats(
    store_dir: Path, instances: Mapping[str, Sequence[str]] = TEST_INSTANCES
) -> AuthNats:
    """Start a nats-server with generated passwords and per-role permissions."""
    passwords = {user: generate_secret() for user in USERS}
    server = NatsServer(
        store_dir=store_dir,
        log_file=store_dir.parent / f"{store_dir.name}.log",
        extra_config=render_authorization(cluster_users(instances), literal_passwords(passwords)),
    )
    server.start()
    return AuthNats(server=server, passwords=passwords, instances=instances)


@pytest.fixture
def auth_nats_server(tmp_path: Path) -> Iterator[AuthNats]:
    """A running nats-server that requires credentials and enforces each role's
    permissions (`AuthNats.config(role)` connects as that role)."""
    auth = start_auth_nats(tmp_path / "nats-auth")
    try:
        yield auth
    finally:
        auth.server.stop()


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

    `start()` returns once `yb up` says the cluster is ready (`/readyz` answered it);
    `stop()` sends SIGINT (Ctrl-C) and
    returns the launcher's exit code. `pids` lists every process of the cluster.
    `api_key`/`headers` authenticate to the gateway, `metrics_headers` to any
    `/metrics`, and `nats_config()` connects to its NATS as `admin`, all read from the
    secrets `yb up` keeps in the data directory.
    """

    def __init__(
        self,
        data_dir: Path,
        *extra_args: str,
        env: dict[str, str] | None = None,
        cgroup: MemoryCgroup | None = None,
    ):
        from yb_tools.natsserver import free_port

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
        # The launcher joins it before it execs, so every process of the cluster is in.
        self.cgroup = cgroup
        self.process: subprocess.Popen[bytes] | None = None
        self.pids: dict[str, int] = {}
        self.log_path = data_dir / "yb-up.log"
        self._secrets: LocalSecrets | None = None

    @property
    def secrets(self) -> LocalSecrets:
        """What `yb up` generated in the data dir (there once the cluster started)."""
        if self._secrets is None:
            self._secrets = load_local_secrets(self.data_dir)
            if self._secrets is None:
                raise RuntimeError(f"no secrets under {self.data_dir}: start the cluster first")
        return self._secrets

    @property
    def api_key(self) -> str:
        """The gateway's API key."""
        return self.secrets.api_key

    @property
    def headers(self) -> dict[str, str]:
        """Headers that authenticate a request to the gateway's API."""
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def metrics_headers(self) -> dict[str, str]:
        """Headers that authenticate a scrape of any instance's `/metrics`."""
        return {"Authorization": f"Bearer {self.secrets.metrics_token}"}

    def nats_config(self, user: str = ADMIN_USER) -> NatsConfig:
        """Client settings for the cluster's NATS, as `user` (default: the operator)."""
        from yb_tools.cli.launcher import read_cluster_info

        info = read_cluster_info(self.data_dir)
        if info is None:
            raise RuntimeError("the cluster is not running")
        return NatsConfig(url=info.nats_url, user=user, password=self.secrets.nats_passwords[user])

    def start(self, timeout_s: float = 600.0) -> None:
        """Launch and wait for readiness; raises with the launcher's output on failure."""
        from yb_tools.cli.launcher import read_cluster_info
        from yb_tools.natsserver import die_with_parent, env_without_proxies

        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = env_without_proxies()
        # A fresh data dir would otherwise convert the model again (half a minute):
        # tests share the machine's model cache unless told otherwise.
        env.setdefault("YB_MODEL_CACHE", str(Path.home() / ".cache" / "yuebing" / "models"))
        env.update(self.env or {})
        cgroup = self.cgroup

        def before_exec() -> None:
            if cgroup is not None:
                cgroup.join()
            die_with_parent()

        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "yb_tools.cli", *self.args],
                stdout=out,
                stderr=out,
                env=env,
                preexec_fn=before_exec,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"yb up exited with {self.process.returncode}:\n{self.output()}")
            info = read_cluster_info(self.data_dir)
            # `yb up`'s own verdict, not /readyz: until it has seen the cluster ready,
            # an instance that dies (a test's kill) makes it give up on the cluster.
            if info is not None and info.ready_at:
                self.pids = dict(info.pids)
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"cluster not ready within {timeout_s}s:\n{self.output()}")

    def info(self) -> ClusterInfo:
        """What `yb up` says of its cluster now (cluster.json)."""
        from yb_tools.cli.launcher import read_cluster_info

        info = read_cluster_info(self.data_dir)
        if info is None:
            raise RuntimeError(f"no cluster.json under {self.data_dir}: is the cluster up?")
        return info

    def refresh_pids(self) -> dict[str, int]:
        """Take the pids `yb up` lists now (its supervisor restarts processes under new
        ones); returns them."""
        self.pids = dict(self.info().pids)
        return self.pids

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

    def peak_rss_mb(self) -> dict[str, float]:
        """Each process's peak resident memory so far (VmHWM), MB, by instance id, the
        launcher's as `yb-up`; a process that is gone counts 0."""
        pids = dict(self.pids)
        if self.process is not None:
            pids["yb-up"] = self.process.pid
        return {name: _peak_rss_mb(pid) for name, pid in sorted(pids.items())}

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


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def pid_alive(pid: int) -> bool:
    """Whether a process exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
