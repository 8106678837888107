"""`yb up`: the whole cluster on this machine, started and stopped as one.

The launcher prepares the model (once, with progress), starts nats-server with
JetStream under the data directory, then each service as its own process with its
configuration passed in `YB_*` variables, waits for the gateway's `/readyz`, and
prints the URL. Children run in their own sessions, so Ctrl-C reaches only the
launcher, which stops them in order (gateway, engines, stores, conductor, NATS) and
kills what does not stop in time; a child also dies with the launcher if the launcher
itself is killed (PR_SET_PDEATHSIG), so no process is left behind.

Supervision: while the cluster runs, `yb up --on-exit` decides what a process that
exits means (`yb_tools.cli.supervision`): by default it is restarted with a growing
back-off and the rest keeps serving; `keep-going` leaves it down, `stop` stops all.

Beyond one host: `Topology.nats = 3` (`yb up --nats-cluster 3`) starts a three-node
NATS JetStream cluster instead of one server, with the event stream at R3 and every
service given all three URLs; a `ProcessSpec` with `netns` runs its service inside a
network namespace, which is how tests/test_multihost.py puts instances on "hosts"
joined by a real network path (see `yb_testkit.netns`).

Devices: before anything starts, each engine instance on CUDA is given its own GPUs,
as many as its tensor-parallel degree (`yb_tools.placement`, `yb up --gpus`), and its
process sees only those; on the CPU nothing is placed.

Security: on first start the launcher generates the gateway's API key, the metrics
token and one NATS password per service role under `<data dir>/secrets/` (mode 0600,
reused later; see `yb_core.credentials`). nats-server gets an authorization block
with one user per role and the permissions of `yb_core.nats_auth`; each service
gets its role's user and the *paths* of its secrets in `YB_*` variables. Every
listener binds to loopback by default (gateway, metrics, NATS and its monitor, UCX).

Elastic pools: with `max_engines` (`yb up --elastic --max-instances N`), engine
instances come and go while the cluster runs, as the conductor's planner decides
(`yb_tools.cli.elastic`): `start_engine` and `retire` are how, and the engine roles'
NATS users may take any instance id, since the ids are not known at start.

Metrics: the launcher keeps a Prometheus scrape config and a file_sd targets file in
`<data dir>/prometheus/` (see `yb_tools.cli.prometheus_files`), current as instances
start and stop, and says where they are once the cluster is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import nats.errors
import nats.js.errors

from yb_core.config import (
    DEFAULT_EVENT_LOG_BYTES,
    MIN_EVENT_LOG_BYTES,
    NatsConfig,
    YbConfig,
    dump_env,
)
from yb_core.credentials import LocalSecrets, ensure_local_secrets, ensure_secret_file
from yb_core.nats_auth import (
    ADMIN_USER,
    cluster_users,
    literal_passwords,
    render_authorization,
)
from yb_tools.cli.cluster_watch import ClusterWatcher
from yb_tools.cli.prometheus_files import (
    PROMETHEUS_DIR,
    SCRAPE_CONFIG_FILE,
    TARGETS_FILE,
    scrape_config,
    write_atomically,
    write_scrape_config,
)
from yb_tools.cli.supervision import Member, OnExit, RestartPolicy, Supervisor, describe_exit
from yb_tools.natsserver import (
    CLUSTER_DECISION_TIMEOUT_S,
    CLUSTER_FAILOVER_S,
    CLUSTER_REQUEST_TIMEOUT_S,
    NatsServer,
    cluster_nodes,
    die_with_parent,
    env_without_proxies,
    free_port,
)
from yb_tools.placement import (
    PlacementError,
    engine_env,
    engines_per_gpu,
    machine_gpus,
    place_engines,
)

#: The roles that run the model and hold a KV cache.
ENGINE_ROLES = ("prefill", "decode")


class ModelNotPrepared(RuntimeError):
    """The model could not be prepared (converted and cached) for the engines;
    `unsupported`: it is a model no registered family computes."""

    def __init__(self, message: str, *, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


@dataclass(frozen=True)
class ProcessSpec:
    """One service process of the cluster.

    `netns` runs it inside that network namespace (`ip netns exec`), as if on another
    machine; `env` is set last, over what the launcher derives (per-process settings
    such as its UCX address).
    """

    role: str
    instance_id: str
    host: str
    netns: str = ""
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    """How many of each service, and on which logical host.

    Prefill instance i and kvstore i share logical host `host-i`, so each prefill has
    a kvstore on its own host; decode instances are spread over the hosts too.

    `prefill_groups` adds prefill groups (chunked pipeline parallelism) beside the
    `prefill` whole-model instances: one group of that many stages per entry, group g's
    stage s named `prefill-g<g>-<s>` and set by its environment (`prefill.group`,
    `stage`, `stages`); its stages go to successive hosts, like separate nodes.
    """

    prefill: int = 2
    decode: int = 1
    kvstore: int = 2
    # More than one: the first to take the lease is active, the others stand by.
    conductors: int = 1
    # nats-server nodes: 1, or a JetStream cluster (3: the event stream at R3).
    nats: int = 1
    prefill_groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(size < 2 for size in self.prefill_groups):
            raise ValueError(
                f"prefill groups of {self.prefill_groups} stages: each needs 2 or more"
            )

    def processes(self) -> list[ProcessSpec]:
        """Processes in start order (what others depend on first)."""
        hosts = max(self.prefill, self.kvstore, 1)
        specs = [
            ProcessSpec("conductor", f"conductor-{i}", "host-0")
            for i in range(max(1, self.conductors))
        ]
        specs += [ProcessSpec("kvstore", f"kvstore-{i}", f"host-{i}") for i in range(self.kvstore)]
        specs += [ProcessSpec("prefill", f"prefill-{i}", f"host-{i}") for i in range(self.prefill)]
        for g, size in enumerate(self.prefill_groups):
            specs += [
                ProcessSpec(
                    "prefill",
                    f"prefill-g{g}-{s}",
                    f"host-{s % hosts}",
                    env={
                        "YB_PREFILL__GROUP": f"g{g}",
                        "YB_PREFILL__STAGE": str(s),
                        "YB_PREFILL__STAGES": str(size),
                    },
                )
                for s in range(size)
            ]
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
    # Where clients find the secrets (paths only: cluster.json is not a secret).
    api_key_file: str = ""
    metrics_token_file: str = ""
    # Every NATS node's monitor (one per node of a cluster; the first is above too).
    nats_monitor_urls: list[str] = msgspec.field(default_factory=list)
    # The Prometheus scrape config and the file_sd file it reads (kept current).
    prometheus_config: str = ""
    prometheus_targets: str = ""
    # When `yb up` found the cluster ready (0 while it still waits). Tools that start
    # a cluster wait for this, not for `/readyz` themselves: `yb up` gives up on a
    # cluster whose instance dies before *it* saw it ready, so a second observer of
    # readiness could act (kill an instance, say) in between.
    ready_at: float = 0.0
    # Processes restarted by the supervisor, with how often (`pids` has the new pids),
    # and those given up on, with why.
    restarts: dict[str, int] = msgspec.field(default_factory=dict)
    given_up: dict[str, str] = msgspec.field(default_factory=dict)


@dataclass
class Cluster:
    """A running local cluster."""

    cfg: YbConfig
    topology: Topology
    say: Callable[[str], None] = print
    # The first NATS node; `nats_nodes` holds every node (one unless clustered).
    nats: NatsServer | None = None
    nats_nodes: list[NatsServer] = field(default_factory=list)
    # The interface NATS listens on (its nodes' clients and routes).
    nats_host: str = "127.0.0.1"
    # The processes to run, when not the topology's (tests place them in namespaces).
    placement: list[ProcessSpec] = field(default_factory=list)
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # When each child was started (wall clock): announcements older than that are an
    # earlier process's.
    started_at: dict[str, float] = field(default_factory=dict)
    # Where each child's output begins in its log (logs are appended to across runs).
    log_offsets: dict[str, int] = field(default_factory=dict)
    secrets: LocalSecrets | None = None
    # Follows the instances on the bus: the Prometheus targets file, who announced
    # itself, the launcher's verdicts on processes that exit.
    watcher: ClusterWatcher | None = None
    # What cluster.json says, once the services are started.
    info: ClusterInfo | None = None
    # The GPUs the engines may use (`--gpus`; None: every one the machine shows), and
    # each engine instance's own, once placed (`check_device`; none on the CPU).
    gpus: list[int] | None = None
    devices: dict[str, list[int]] = field(default_factory=dict)
    # `yb up --elastic --max-instances N`: the engine processes it may run at once (0:
    # the topology's, fixed).
    max_engines: int = 0

    @property
    def data_dir(self) -> Path:
        """The data directory (NATS store, logs, SSD tier, model cache when configured)."""
        return self.cfg.resolved_data_dir()

    @property
    def gateway_url(self) -> str:
        """Base URL of the gateway."""
        return f"http://{self.cfg.gateway.host}:{self.cfg.gateway.port}"

    def process_specs(self) -> list[ProcessSpec]:
        """The service processes in start order: `placement`, else the topology's."""
        return list(self.placement) or self.topology.processes()

    def check_device(self) -> None:
        """Refuse `model.device` = cuda[:N] on a machine that shows no NVIDIA GPU before
        anything starts (asked without torch; an engine checks again with torch, which
        also catches a CPU-only torch). Raises `DeviceUnavailable`."""
        from yb_core.config import nvidia_gpu_visible
        from yb_engine.models import DeviceUnavailable

        device = self.cfg.model.device
        if device.startswith("cuda") and not nvidia_gpu_visible():
            raise DeviceUnavailable(
                f"model.device is {device!r} but this machine shows no NVIDIA GPU (no "
                "/dev/nvidiaN, or CUDA_VISIBLE_DEVICES hides them); use --device cpu or auto"
            )
        self.place_engines()

    def place_engines(self) -> None:
        """Give each engine instance its own GPUs (`yb_tools.placement.place_engines`).
        Raises `DeviceUnavailable` for GPUs the machine does not have, and for `--gpus`
        where the engines run on the CPU or are pinned to one device."""
        from yb_engine.models import DeviceUnavailable

        engines = [(s.instance_id, s.role) for s in self.process_specs() if s.role in ENGINE_ROLES]
        try:
            self.devices = place_engines(self.cfg, engines, self.gpus, machine_gpus, self.say)
        except PlacementError as exc:
            raise DeviceUnavailable(str(exc)) from None

    def prepare_model(self) -> None:
        """Convert and cache the model before any engine starts (they would wait).

        In a process of its own (`python -m yb_engine.prepare`), its progress relayed:
        the launcher stays a light process (no torch), and a first conversion's memory
        is given back when it ends. Raises `ModelNotPrepared` when it fails."""
        env = env_without_proxies()
        env.update(dump_env(self.cfg))
        prepare = subprocess.Popen(
            [sys.executable, "-m", "yb_engine.prepare"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        assert prepare.stdout is not None
        last: list[str] = []
        for raw in prepare.stdout:
            line = raw.decode(errors="replace").rstrip()
            last = [*last[-2:], line]
            self.say(f"  {line.removeprefix('[prepare] ')}")
        if code := prepare.wait():
            if code == 2:  # the model is not one the engines compute
                raise ModelNotPrepared(last[-1].removeprefix("prepare: "), unsupported=True)
            raise ModelNotPrepared(
                f"preparing the model failed ({describe_exit(code)}): " + " / ".join(last)
            )

    def ensure_secrets(self) -> LocalSecrets:
        """The cluster's secrets, generated on the first start and reused after."""
        if self.secrets is None:
            fresh = not (self.data_dir / "secrets").exists()
            self.secrets = ensure_local_secrets(self.data_dir)
            verb = "generated" if fresh else "reusing"
            self.say(
                f"{verb} the API key ({self.secrets.api_key_path}), the metrics token "
                f"and the NATS passwords in {self.secrets.root} (mode 0600)"
            )
        return self.secrets

    @property
    def api_key_file(self) -> Path:
        """The file clients read the API key from."""
        configured = self.cfg.gateway.api_keys_file
        return Path(configured) if configured else self.ensure_secrets().api_key_path

    def access_hint(self) -> list[str]:
        """What `yb up` prints once ready: where the key is, a request to paste, and
        the Prometheus files with the command that scrapes the cluster."""
        key = self.api_key_file
        prometheus = self.data_dir / PROMETHEUS_DIR
        return [
            f"API key: {key} (send it as `Authorization: Bearer <key>`)",
            f'try: curl -H "Authorization: Bearer $(cat {key})" {self.gateway_url}/v1/models',
            f"Prometheus: scrape config {prometheus / SCRAPE_CONFIG_FILE}, targets (kept "
            f"current) {prometheus / TARGETS_FILE}",
            f"scrape it: prometheus --config.file={prometheus / SCRAPE_CONFIG_FILE} "
            f"--storage.tsdb.path={prometheus / 'data'} --web.listen-address=127.0.0.1:9090",
        ]

    def start_nats(self) -> None:
        """Start nats-server with JetStream, its store under the data directory, and
        one user per service role with that role's permissions.

        With `topology.nats` > 1, that many nodes form a JetStream cluster (each with
        its own store, the same users, routes that authenticate with a generated
        secret); the services get every node's URL, and the event stream is created
        here with `nats.replicas` copies (3 unless configured) before any service
        starts.
        """
        port = _port_of(self.cfg.nats.url)
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self._size_event_log()
        secrets = self.ensure_secrets()
        instances: dict[str, list[str]] = {}
        for spec in self.process_specs():
            instances.setdefault(spec.role, []).append(spec.instance_id)
        granted: dict[str, list[str] | None] = dict(instances)
        if self.max_engines:  # ids made up as engines are added: any id of the role
            granted.update(dict.fromkeys(ENGINE_ROLES))
        users = cluster_users(
            granted,
            stream=self.cfg.nats.stream,
            snapshot_bucket=self.cfg.conductor.snapshot_bucket,
            batch_bucket=self.cfg.gateway.batch_bucket,
        )
        authorization = render_authorization(users, literal_passwords(secrets.nats_passwords))
        count = max(1, self.topology.nats)
        if count == 1:
            self.nats_nodes = [
                NatsServer(
                    store_dir=self.data_dir / "nats",
                    port=port,
                    host=self.nats_host,
                    log_file=logs / "nats-server.log",
                    monitor_port=free_port(self.nats_host),
                    sync_interval_s=self.cfg.nats.sync_interval_s,
                    extra_config=authorization,
                )
            ]
        else:
            self._settle_for_failover(count)
            self.nats_nodes = cluster_nodes(
                self.data_dir / "nats-cluster",
                count,
                host=self.nats_host,
                ports=[port + i for i in range(count)] if port else None,
                route_password=ensure_secret_file(Path(secrets.root) / "nats_route_password"),
                sync_interval_s=self.cfg.nats.sync_interval_s,
                extra_config=authorization,
                log_dir=logs,
            )
        for node in self.nats_nodes:
            node.start()
        self.nats = self.nats_nodes[0]
        self.cfg.nats.url = ",".join(node.url for node in self.nats_nodes)
        if count > 1:
            self._provision_jetstream(secrets)
            self.say(
                f"NATS cluster of {count} nodes, event stream at R{self.cfg.nats.replicas}: "
                f"{self.cfg.nats.url}"
            )
        else:
            self.say(f"nats-server with JetStream at {self.nats.url}")

    def _size_event_log(self) -> None:
        """Resolve `nats.max_bytes` 0 to a limit this machine's disk can hold.

        The NATS store shares the data dir's disk with the model cache and the
        kvstore's SSD tier: the log gets the default (`DEFAULT_EVENT_LOG_BYTES`) or a
        quarter of the space free there now, whichever is smaller (never below
        `MIN_EVENT_LOG_BYTES`), so a busy cluster trims its oldest events instead of
        filling the disk. Every service then gets the resolved value (in its `YB_*`
        variables), so none brings the stream back to another limit. An explicit
        value is kept as given.
        """
        if self.cfg.nats.max_bytes:
            return
        free = shutil.disk_usage(self.data_dir).free
        chosen = max(MIN_EVENT_LOG_BYTES, min(DEFAULT_EVENT_LOG_BYTES, free // 4))
        self.cfg.nats.max_bytes = chosen
        self.say(
            f"event log bounded at {chosen / 2**30:.2f} GiB "
            f"(a quarter of the {free / 2**30:.1f} GiB free here, at most "
            f"{DEFAULT_EVENT_LOG_BYTES / 2**30:.0f} GiB; set YB_NATS__MAX_BYTES to choose)"
            if chosen < DEFAULT_EVENT_LOG_BYTES
            else f"event log bounded at {chosen / 2**30:.0f} GiB (YB_NATS__MAX_BYTES)"
        )

    def _share_gpu_memory(self) -> None:
        """On CUDA, give each engine its share of the one device they share: each gets
        `gpu_memory_utilization` divided by their number (an engine section with an
        explicit `num_kv_pages` or `kv_memory_bytes` keeps it). On the CPU each engine
        takes what it can use (`engine.kv_sequences`), whatever else the machine runs,
        and `kv_report` says what that came to."""
        engines = [s for s in self.process_specs() if s.role in ENGINE_ROLES]
        if not engines or not self.cfg.model.cuda_expected():
            return
        if self.devices:
            shared = {n: k for n, k in engines_per_gpu(self.devices).items() if k > 1}
            if shared:
                self.say(
                    "KV memory: engines sharing a GPU split gpu_memory_utilization: "
                    + ", ".join(f"{n} 1/{k}" for n, k in shared.items())
                )
            return  # each engine's share goes into its own environment (`service_env`)
        count = max(len(engines), self.max_engines)  # elastic: as many as may run
        sections = {"prefill": self.cfg.prefill, "decode": self.cfg.decode}
        free = {
            role: section
            for role, section in sections.items()
            if not (section.num_kv_pages or section.kv_memory_bytes)
        }
        for section in free.values():
            section.gpu_memory_utilization /= count
        if free:
            shares = ", ".join(f"{r} {s.gpu_memory_utilization:.3f}" for r, s in free.items())
            self.say(
                f"KV memory: {count} engines share one GPU; gpu_memory_utilization each: {shares}"
            )

    def kv_report(self) -> list[str]:
        """What each engine took for its KV cache, from its announcement, with their sum
        (allocated at start, so already resident) and the memory still available; empty
        until every engine has announced itself."""
        from yb_engine.kv_sizing import read_host_memory_available

        watcher = self.watcher
        ups = watcher.announcements() if watcher is not None else {}
        engines = sorted(s.instance_id for s in self.process_specs() if s.role in ENGINE_ROLES)
        if not engines or any(name not in ups for name in engines):
            return []
        block_size = self.cfg.model.block_size
        lines: list[str] = []
        total = 0
        for name in engines:
            up = ups[name]
            nbytes = up.kv_capacity_blocks * up.kv_block_bytes
            total += nbytes
            lines.append(
                f"  {name:<12} {up.kv_capacity_blocks:>6,} pages = "
                f"{up.kv_capacity_blocks * block_size:>9,} tokens, {nbytes / 2**20:>8,.0f} MiB"
            )
        available = read_host_memory_available()
        head = (
            f"KV cache per engine ({total / 2**30:.2f} GiB in all; "
            f"{available / 2**30:.1f} GiB of memory still available; more or less: "
            "YB_PREFILL__KV_SEQUENCES / YB_DECODE__KV_SEQUENCES, or __NUM_KV_PAGES; "
            "docs/engine.md#how-many-pages):"
        )
        specs = {spec for name in engines if (spec := ups[name].kv_spec) is not None}
        per_token = [
            f"  one token keeps {s.bytes_per_token:,} bytes ({' and '.join(s.parts)} of "
            f"{s.heads} x {s.dim} {s.dtype} in each of {s.num_layers} layers)"
            for s in sorted(specs, key=lambda s: s.layout_id)
        ]
        return [head, *lines, *per_token]

    def _settle_for_failover(self, nodes: int) -> None:
        """Settings a cluster needs so that losing a node changes nothing for clients.

        The stream gets 3 replicas unless configured otherwise. Losing the node that
        leads it stalls the log until the others elect a new leader (up to
        `CLUSTER_FAILOVER_S`): publishes and the gateway's wait for a decision get
        budgets that outlast that, instead of failing the requests that arrive
        meanwhile (raised to at least `CLUSTER_REQUEST_TIMEOUT_S` and
        `CLUSTER_DECISION_TIMEOUT_S`).
        """
        nats_cfg, gateway = self.cfg.nats, self.cfg.gateway
        if nats_cfg.replicas == 1:
            nats_cfg.replicas = min(3, nodes)
        if nats_cfg.replicas > nodes:
            raise ValueError(f"nats.replicas={nats_cfg.replicas} needs at least that many nodes")
        nats_cfg.request_timeout_s = max(nats_cfg.request_timeout_s, CLUSTER_REQUEST_TIMEOUT_S)
        gateway.decision_timeout_s = max(gateway.decision_timeout_s, CLUSTER_DECISION_TIMEOUT_S)
        if self.cfg.conductor.heartbeat_timeout_s <= CLUSTER_FAILOVER_S:
            self.say(
                f"warning: conductor.heartbeat_timeout_s={self.cfg.conductor.heartbeat_timeout_s:g}"
                f" is within a NATS leader election ({CLUSTER_FAILOVER_S:g}s): losing a node "
                "may get live instances declared dead"
            )

    def _provision_jetstream(self, secrets: LocalSecrets, timeout_s: float = 60.0) -> None:
        """Wait for the cluster's JetStream and create what must be replicated.

        A fresh cluster answers JetStream requests only once its nodes have elected a
        meta leader; services that started before would fail to set up the log. So
        the operator's user creates the event stream here, with its replicas, and the
        conductor's lease bucket too: the conductor creates that bucket with one
        replica, and a lease on a lost node would stop every decision (it binds to an
        existing bucket whatever its settings).
        """
        from yb_core.bus import Bus, BusError

        ncfg = self._admin_nats(secrets)
        lease_bucket = f"{self.cfg.conductor.snapshot_bucket}_lease"

        async def provision() -> None:
            bus = await Bus.connect(ncfg, "yb-up", timeout_s=timeout_s)
            deadline = time.monotonic() + timeout_s
            try:
                while True:
                    try:
                        await bus.ensure_stream()
                        with contextlib.suppress(nats.js.errors.BadRequestError):  # exists
                            await bus.jetstream.create_key_value(
                                bucket=lease_bucket,
                                ttl=self.cfg.conductor.lease_ttl_s,
                                history=1,
                                replicas=ncfg.replicas,
                            )
                        return
                    except (nats.errors.Error, nats.js.errors.Error) as exc:
                        # No meta leader yet (503, no responders, a timeout).
                        if time.monotonic() > deadline:
                            raise BusError(f"JetStream not ready: {exc!r}") from exc
                        await asyncio.sleep(0.25)
            finally:
                await bus.close()

        asyncio.run(provision())

    def _admin_nats(self, secrets: LocalSecrets) -> NatsConfig:
        """Client settings for the cluster's NATS as the operator's user."""
        return msgspec.structs.replace(
            self.cfg.nats,
            user=ADMIN_USER,
            password=secrets.nats_passwords[ADMIN_USER],
            password_file="",
            creds_file="",
        )

    def start_services(self) -> None:
        """Start every service process in dependency order, then keep the Prometheus
        targets file current."""
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self._share_gpu_memory()
        for spec in self.process_specs():
            self._spawn(spec, logs)
        config_path, targets_path = self.write_prometheus_files()
        pids = self._pids()
        monitors = [
            f"http://{node.host}:{node.monitor_port}"
            for node in self.nats_nodes
            if node.monitor_port
        ]
        info = ClusterInfo(
            nats_url=self.cfg.nats.url,
            nats_monitor_url=monitors[0] if monitors else "",
            nats_monitor_urls=monitors,
            gateway_url=self.gateway_url,
            pid=os.getpid(),
            started_at=time.time(),
            pids=pids,
            api_key_file=str(self.api_key_file),
            metrics_token_file=self._metrics_token_file(),
            prometheus_config=str(config_path),
            prometheus_targets=str(targets_path),
        )
        self.info = info
        self._write_info()

    def mark_ready(self) -> None:
        """Record in cluster.json that the cluster is ready (`ClusterInfo.ready_at`)."""
        if self.info is not None:
            self.info.ready_at = time.time()
            self._write_info()

    def _write_info(self) -> None:
        # Whole or not at all: readers poll this file while it is rewritten.
        path = self.data_dir / "cluster.json"
        partial = path.with_suffix(".json.partial")
        partial.write_bytes(msgspec.json.encode(self.info))
        partial.replace(path)

    def write_prometheus_files(self) -> tuple[Path, Path]:
        """Write the scrape config and start keeping the targets file current (see
        `yb_tools.cli.prometheus_files`); returns both paths."""
        directory = self.data_dir / PROMETHEUS_DIR
        targets_path = directory / TARGETS_FILE
        config_path = directory / SCRAPE_CONFIG_FILE
        config = scrape_config(targets_path, self._prometheus_token_file())
        write_scrape_config(
            config_path,
            config,
            header=(
                f"Written by `yb up` for the cluster in {self.data_dir}; rewritten at each "
                "start.\nTargets: every instance's metrics listener, kept current in "
                f"{TARGETS_FILE}.\nRun: prometheus --config.file={config_path}"
            ),
        )
        if self.watcher is None:
            secrets = self.ensure_secrets()
            # Elastic: the planner's decisions (and instance events) since the first
            # service started.
            since = min(self.started_at.values(), default=time.time())
            self.watcher = ClusterWatcher(
                self._admin_nats(secrets),
                targets_path,
                self.running_instances,
                pool_log_since=since if self.max_engines else None,
            )
            self.watcher.start()
        return config_path, targets_path

    def _prometheus_token_file(self) -> Path:
        """The file Prometheus reads the metrics token from: the services' own token
        file, or, for a token configured as a value, a copy in the secrets directory
        (mode 0600), so that the scrape config never holds the token."""
        if path := self._metrics_token_file():
            return Path(path)
        copy = Path(self.ensure_secrets().root) / "prometheus_metrics_token"
        write_atomically(copy, (self.cfg.telemetry.metrics_token + "\n").encode(), mode=0o600)
        return copy

    def running_instances(self) -> dict[str, float]:
        """The children running now: instance id -> when it was started (wall clock).
        Safe to call from another thread."""
        return {
            name: self.started_at.get(name, 0.0)
            for name, proc in list(self.children.items())
            if proc.poll() is None
        }

    def _metrics_token_file(self) -> str:
        # A token configured explicitly wins (the services resolve it first).
        if self.cfg.telemetry.metrics_token:
            return ""
        configured = self.cfg.telemetry.metrics_token_file
        return configured or str(self.ensure_secrets().metrics_token_path)

    def service_env(self, spec: ProcessSpec) -> dict[str, str]:
        """The environment one service process starts with: the cluster's
        configuration as `YB_*` variables, its identity, the paths of its secrets."""
        secrets = self.ensure_secrets()
        env = env_without_proxies()
        env.update(dump_env(self.cfg))
        env["YB_INSTANCE_ID"] = spec.instance_id
        env["YB_HOST"] = spec.host
        # Its role's NATS user; secrets travel as file paths, not values, so they do
        # not show in the environment of every process.
        env["YB_NATS__USER"] = spec.role
        env["YB_NATS__PASSWORD"] = ""
        env["YB_NATS__PASSWORD_FILE"] = str(secrets.nats_password_path(spec.role))
        env["YB_NATS__CREDS_FILE"] = ""
        env["YB_TELEMETRY__METRICS_TOKEN_FILE"] = self._metrics_token_file()
        if spec.role == "gateway":
            env["YB_GATEWAY__API_KEYS_FILE"] = str(self.api_key_file)
        else:  # API keys are the gateway's business alone
            env["YB_GATEWAY__API_KEYS"] = "[]"
            env["YB_GATEWAY__API_KEYS_FILE"] = ""
        if spec.role == "kvstore" and not self.cfg.kvstore.ssd_dir:
            env["YB_KVSTORE__SSD_DIR"] = str(self.data_dir / "ssd" / spec.instance_id)
        # Every engine `yb up` starts shares this machine's cores: one thread each
        # (more only contend), and a conductor that knows they share (it would
        # otherwise price each as if it ran alone and admit what they cannot serve).
        env.setdefault("OMP_NUM_THREADS", "1")
        if spec.role == "conductor" and self.cfg.conductor.compute_sharing == "none":
            env["YB_CONDUCTOR__COMPUTE_SHARING"] = "all"
        if spec.instance_id in self.devices:
            env.update(engine_env(self.cfg, spec.role, spec.instance_id, self.devices))
        env.update(spec.env)
        return env

    def _spawn(self, spec: ProcessSpec, logs: Path, *, say: bool = True) -> int:
        env = self.service_env(spec)
        # `ip netns exec` enters the namespace and execs the service in place: the pid
        # (and the death signal set below) stay the service's own.
        enter = ["ip", "netns", "exec", spec.netns] if spec.netns else []
        log_path = logs / f"{spec.instance_id}.log"
        self.started_at[spec.instance_id] = time.time()
        with open(log_path, "ab") as out:
            self.log_offsets[spec.instance_id] = out.tell()
            self.children[spec.instance_id] = subprocess.Popen(
                [*enter, sys.executable, "-m", f"yb_{spec.role}"],
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        if say:
            where = f"{spec.host}, netns {spec.netns}" if spec.netns else spec.host
            self.say(f"started {spec.instance_id:<12} ({spec.role}, {where}) log: {log_path}")
        return self.children[spec.instance_id].pid

    def start_engine(self, spec: ProcessSpec) -> Member:
        """Start an engine instance while the cluster runs (`yb up --elastic`); the
        member for the supervisor."""
        logs = self.data_dir / "logs"
        self._spawn(spec, logs, say=False)
        return _ServiceMember(self, spec, logs)

    def retire(self, instance_id: str) -> None:
        """Forget a child that exited for good (a drained engine, reaped): it leaves
        the Prometheus targets and cluster.json."""
        self.children.pop(instance_id, None)
        self.started_at.pop(instance_id, None)
        if self.info is not None and self.info.pids.pop(instance_id, None) is not None:
            self._write_info()

    def wait_ready(
        self, timeout_s: float, stop: Callable[[], bool], check: Callable[[], str | None]
    ) -> bool:
        """Poll `/readyz` until 200; False on timeout, a stop request, or when `check`
        (called at every poll: the supervisor's tick) gives a reason to stop."""
        deadline = time.monotonic() + timeout_s
        last_reason = ""
        while time.monotonic() < deadline and not stop():
            if failure := check():
                self.say(failure)
                return False
            try:
                r = httpx.get(f"{self.gateway_url}/readyz", timeout=2.0)
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

    def supervisor(self, on_exit: OnExit, policy: RestartPolicy | None = None) -> Supervisor:
        """A supervisor of every process of the running cluster (services and NATS
        nodes), applying `on_exit` (see `yb_tools.cli.supervision`)."""
        logs = self.data_dir / "logs"
        members: list[Member] = [_ServiceMember(self, spec, logs) for spec in self.process_specs()]
        members += [_NatsMember(self, i) for i in range(len(self.nats_nodes))]
        nats = {member.name for member in members if member.role == "nats"}
        watcher = self.watcher

        def announced(name: str) -> bool:
            # A NATS node is up once `start()` returned; a service once it said so.
            return name in nats or (watcher is not None and name in watcher.announced())

        def confirm_announced(name: str) -> bool:
            started = self.started_at.get(name)
            if name in nats or watcher is None or started is None:
                return False
            return watcher.confirm_announced(name, since=started)

        def exit_seen(member: Member, code: int) -> None:
            if member.role != "nats" and watcher is not None:
                watcher.declare_down(
                    member.name, f"its process exited with {describe_exit(code)} (yb up)"
                )

        return Supervisor(
            members,
            on_exit,
            announced=announced,
            confirm_announced=confirm_announced,
            say=self.say,
            on_exit_seen=exit_seen,
            policy=policy,
        )

    def _pids(self) -> dict[str, int]:
        """The current process of every service and NATS node, by name."""
        pids = {name: proc.pid for name, proc in self.children.items()}
        for i, node in enumerate(self.nats_nodes):
            if node.process is not None:
                pids[_nats_name(i)] = node.process.pid
        return pids

    def record_supervision(self, supervisor: Supervisor) -> None:
        """Bring cluster.json up to date with the supervisor's restarts (new pids
        included) and the processes it gave up on."""
        info = self.info
        if info is None:
            return
        pids = {**info.pids, **self._pids()}
        restarts, given_up = supervisor.restarts(), supervisor.given_up()
        if (pids, restarts, given_up) != (info.pids, info.restarts, info.given_up):
            info.pids, info.restarts, info.given_up = pids, restarts, given_up
            self._write_info()

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every child (reverse start order), then NATS; idempotent. The
        Prometheus targets file is left empty."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
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
        for node in self.nats_nodes or ([self.nats] if self.nats else []):
            node.stop()
        self.nats_nodes = []
        self.nats = None
        with contextlib.suppress(OSError):
            (self.data_dir / "cluster.json").unlink()


@dataclass
class _ServiceMember:
    """A service process, as the supervisor sees it."""

    cluster: Cluster
    spec: ProcessSpec
    logs: Path

    @property
    def name(self) -> str:
        return self.spec.instance_id

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.spec.instance_id}.log"

    @property
    def log_offset(self) -> int:
        return self.cluster.log_offsets.get(self.spec.instance_id, 0)

    def exit_code(self) -> int | None:
        proc = self.cluster.children.get(self.spec.instance_id)
        return None if proc is None else proc.poll()

    def respawn(self) -> int:
        return self.cluster._spawn(self.spec, self.logs, say=False)


@dataclass
class _NatsMember:
    """A nats-server node, as the supervisor sees it: restarted on its own port and
    store, so the services' reconnects find it where it was."""

    cluster: Cluster
    index: int

    @property
    def node(self) -> NatsServer:
        return self.cluster.nats_nodes[self.index]

    @property
    def name(self) -> str:
        return _nats_name(self.index)

    @property
    def role(self) -> str:
        return "nats"

    @property
    def log_path(self) -> Path:
        return self.node.log_file or self.cluster.data_dir / "logs" / f"{self.name}.log"

    @property
    def log_offset(self) -> int:
        return self.node.log_offset

    def exit_code(self) -> int | None:
        process = self.node.process
        return None if process is None else process.poll()

    def respawn(self) -> int:
        node = self.node
        node.start()
        assert node.process is not None
        return node.process.pid


def _nats_name(index: int) -> str:
    """The name of NATS node `index` in cluster.json and the supervisor's messages."""
    return "nats-server" if index == 0 else f"nats-server-{index}"


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
