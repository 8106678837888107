"""`yb up`: the whole cluster on this machine, started and stopped as one.

The launcher prepares the model (once, with progress), starts nats-server with
JetStream under the data directory, then each service as its own process with its
configuration passed in `YB_*` variables, waits for the gateway's `/readyz`, and
prints the URL. Children run in their own sessions, so Ctrl-C reaches only the
launcher, which stops them in order (gateway, engines, stores, conductor, NATS) and
kills what does not stop in time; a child also dies with the launcher if the launcher
itself is killed (PR_SET_PDEATHSIG), so no process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

from yb_shared.config import YbConfig, dump_env
from yb_shared.natsserver import NatsServer, die_with_parent, env_without_proxies, free_port


@dataclass(frozen=True)
class ProcessSpec:
    """One service process of the cluster."""

    role: str
    instance_id: str
    host: str


@dataclass(frozen=True)
class Topology:
    """How many of each service, and on which logical host.

    Prefill instance i and kvstore i share logical host `host-i`, so each prefill has
    a kvstore on its own host; decode instances are spread over the hosts too.
    """

    prefill: int = 2
    decode: int = 1
    kvstore: int = 2

    def processes(self) -> list[ProcessSpec]:
        """Processes in start order (what others depend on first)."""
        hosts = max(self.prefill, self.kvstore, 1)
        specs = [ProcessSpec("conductor", "conductor-0", "host-0")]
        specs += [ProcessSpec("kvstore", f"kvstore-{i}", f"host-{i}") for i in range(self.kvstore)]
        specs += [ProcessSpec("prefill", f"prefill-{i}", f"host-{i}") for i in range(self.prefill)]
        specs += [
            ProcessSpec("decode", f"decode-{i}", f"host-{i % hosts}") for i in range(self.decode)
        ]
        specs.append(ProcessSpec("gateway", "gateway-0", "host-0"))
        return specs


class ClusterInfo(msgspec.Struct):
    """What `yb up` writes to `<data dir>/cluster.json` for `yb status` and tools."""

    nats_url: str
    nats_monitor_url: str
    gateway_url: str
    pid: int
    started_at: float
    # Every process of the cluster by instance id (nats-server included), so tools and
    # tests can check that a stop leaves none behind.
    pids: dict[str, int] = msgspec.field(default_factory=dict)


@dataclass
class Cluster:
    """A running local cluster."""

    cfg: YbConfig
    topology: Topology
    say: Callable[[str], None] = print
    nats: NatsServer | None = None
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        """The data directory (NATS store, logs, SSD tier, model cache when configured)."""
        return self.cfg.resolved_data_dir()

    @property
    def gateway_url(self) -> str:
        """Base URL of the gateway."""
        return f"http://{self.cfg.gateway.host}:{self.cfg.gateway.port}"

    def prepare_model(self) -> None:
        """Convert and cache the model before any engine starts (they would wait)."""
        from yb_shared.models import resolve_model_dir

        if self.cfg.model.source in ("tiny-random",):
            return
        started = time.monotonic()
        self.say(f"preparing model {self.cfg.model.name} ({self.cfg.model.source}) ...")
        path = resolve_model_dir(
            self.cfg.model, self.cfg.model_cache_dir(), lambda m: self.say(f"  {m}")
        )
        self.say(f"model ready at {path} ({time.monotonic() - started:.1f}s)")

    def start_nats(self) -> None:
        """Start nats-server with JetStream, its store under the data directory."""
        port = _port_of(self.cfg.nats.url)
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(
            store_dir=self.data_dir / "nats",
            port=port,
            log_file=self.data_dir / "logs" / "nats-server.log",
            monitor_port=free_port(),
        )
        self.nats.start()
        self.cfg.nats.url = self.nats.url
        self.say(f"nats-server with JetStream at {self.nats.url}")

    def start_services(self) -> None:
        """Start every service process in dependency order."""
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for spec in self.topology.processes():
            self._spawn(spec, logs)
        pids = {name: proc.pid for name, proc in self.children.items()}
        if self.nats is not None and self.nats.process is not None:
            pids["nats-server"] = self.nats.process.pid
        monitor = self.nats.monitor_port if self.nats else 0
        info = ClusterInfo(
            nats_url=self.cfg.nats.url,
            nats_monitor_url=f"http://127.0.0.1:{monitor}" if monitor else "",
            gateway_url=self.gateway_url,
            pid=os.getpid(),
            started_at=time.time(),
            pids=pids,
        )
        (self.data_dir / "cluster.json").write_bytes(msgspec.json.encode(info))

    def _spawn(self, spec: ProcessSpec, logs: Path) -> None:
        env = env_without_proxies()
        env.update(dump_env(self.cfg))
        env["YB_INSTANCE_ID"] = spec.instance_id
        env["YB_HOST"] = spec.host
        if spec.role == "kvstore" and not self.cfg.kvstore.ssd_dir:
            env["YB_KVSTORE__SSD_DIR"] = str(self.data_dir / "ssd" / spec.instance_id)
        # Two cores: give each engine a thread and let the OS share them.
        env.setdefault("OMP_NUM_THREADS", "1")
        log_path = logs / f"{spec.instance_id}.log"
        with open(log_path, "ab") as out:
            self.children[spec.instance_id] = subprocess.Popen(
                [sys.executable, "-m", f"yb_{spec.role}"],
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.say(f"started {spec.instance_id:<12} ({spec.role}, {spec.host}) log: {log_path}")

    def wait_ready(self, timeout_s: float, stop: Callable[[], bool]) -> bool:
        """Poll `/readyz` until 200; False on timeout, a dead child or a stop request."""
        deadline = time.monotonic() + timeout_s
        last_reason = ""
        headers = _auth_headers(self.cfg)
        while time.monotonic() < deadline and not stop():
            dead = self.dead_children()
            if dead:
                for name in dead:
                    self.say(f"{name} exited with {self.children[name].returncode}")
                    self.say(_tail(self.data_dir / "logs" / f"{name}.log"))
                return False
            try:
                r = httpx.get(f"{self.gateway_url}/readyz", timeout=2.0, headers=headers)
                if r.status_code == 200:
                    return True
                reason = r.text[:200]
            except httpx.HTTPError as exc:
                reason = f"gateway not answering yet ({type(exc).__name__})"
            if reason != last_reason:
                self.say(f"waiting: {reason}")
                last_reason = reason
            time.sleep(0.5)
        return False

    def dead_children(self) -> list[str]:
        """Instances whose process has exited."""
        return [name for name, p in self.children.items() if p.poll() is not None]

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every child (reverse start order), then NATS; idempotent."""
        for name in reversed(list(self.children)):
            proc = self.children[name]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.children.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{name} did not stop in time: killing it")
                proc.kill()
                proc.wait(timeout=5)
        self.children.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        with contextlib.suppress(OSError):
            (self.data_dir / "cluster.json").unlink()


def read_cluster_info(data_dir: Path) -> ClusterInfo | None:
    """The running cluster's addresses, if `yb up` is running with this data dir."""
    try:
        return msgspec.json.decode((data_dir / "cluster.json").read_bytes(), type=ClusterInfo)
    except (OSError, msgspec.DecodeError, json.JSONDecodeError):
        return None


def _port_of(url: str) -> int:
    try:
        return int(url.split(",")[0].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 0


def _auth_headers(cfg: YbConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.gateway.api_keys[0]}"} if cfg.gateway.api_keys else {}


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
