"""Configuration: defaults < file < environment, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_core import config as config_module
from yb_core.config import (
    CPU_BLOCK_SIZE,
    CUDA_BLOCK_SIZE,
    FLEX_TTFT_FACTOR,
    ConfigError,
    ModelConfig,
    ServiceTier,
    dump_env,
    load_config,
    nvidia_gpu_visible,
)


def test_file_then_env_override(tmp_path: Path) -> None:
    path = tmp_path / "yb.toml"
    path.write_text('host = "h1"\n[gateway]\nport = 9000\napi_keys = ["k1"]\n')
    cfg = load_config(path, env={"YB_GATEWAY__PORT": "9100", "YB_DECODE__MAX_BATCH_SIZE": "4"})
    assert cfg.host == "h1"
    assert cfg.gateway.port == 9100
    assert cfg.gateway.api_keys == ["k1"]
    assert cfg.decode.max_batch_size == 4
    assert cfg.prefill.max_batch_size == 1  # a prefill engine's own default
    assert cfg.prefill.chunk_size == 512


def test_yaml_and_lists_from_env(tmp_path: Path) -> None:
    path = tmp_path / "yb.yaml"
    path.write_text("nats:\n  url: nats://x:1\n")
    cfg = load_config(path, env={"YB_GATEWAY__API_KEYS": "a, b", "YB_TELEMETRY__LOG_JSON": "no"})
    assert cfg.nats.url == "nats://x:1"
    assert cfg.gateway.api_keys == ["a", "b"]
    assert cfg.telemetry.log_json is False


def test_round_trip_through_env() -> None:
    cfg = load_config(env={"YB_GATEWAY__API_KEYS": '["x"]', "YB_HOST": "h2"})
    assert load_config(env=dump_env(cfg)) == cfg


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"YB_GATEWAY__PORT": "eighty"}, "gateway.port"),
        ({"YB_NOPE__X": "1"}, "no configuration section"),
        ({"YB_GATEWAY__NOPE": "1"}, "has no field"),
        ({"YB_TELEMETRY__LOG_JSON": "ture"}, "not a boolean"),
        ({"YB_CONDUCTOR__LEARN_SPEED": ""}, "not a boolean"),
        ({"YB_GATEWAY_PORT": "9000"}, "YB_GATEWAY__PORT"),
        ({"YB_DECODE_PIGGYBACK": "true"}, "YB_DECODE__PIGGYBACK"),
    ],
)
def test_bad_values_are_clear_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(env=env)


def test_booleans_take_the_usual_spellings() -> None:
    for text, expected in (("1", True), ("Yes", True), (" on ", True), ("0", False)):
        cfg = load_config(env={"YB_TELEMETRY__LOG_JSON": text, "YB_DECODE__PIGGYBACK": "off"})
        assert cfg.telemetry.log_json is expected, text
        assert cfg.decode.piggyback is False


def test_other_yb_variables_are_left_to_the_tools() -> None:
    # Not a section's field with one underscore: the compose files' secrets, test
    # switches.
    env = {"YB_NATS_PASSWORD_PREFILL": "x", "YB_FAULT_NOTES": "/tmp", "YB_GATEWAY_X": "1"}
    assert load_config(env=env) == load_config(env={})


def test_unknown_file_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "yb.json"
    path.write_text('{"gatewy": {}}')
    with pytest.raises(ConfigError, match="gatewy"):
        load_config(path, env={})


# --- model.device, model.dtype, model.block_size ---------------------------------------


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_settings_that_validate(device: str) -> None:
    cfg = load_config(env={"YB_MODEL__DEVICE": device})
    assert cfg.model.device == device
    assert load_config(env=dump_env(cfg)) == cfg


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "mps", "cuda0", ""])
def test_a_device_typo_stops_at_load(device: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.device"):
        load_config(env={"YB_MODEL__DEVICE": device})


def test_dtype_auto_is_bf16_on_cuda_and_fp32_elsewhere() -> None:
    auto = ModelConfig(device="cpu")
    assert (auto.dtype_for("cpu"), auto.dtype_for("cuda")) == ("float32", "bfloat16")
    fixed = load_config(env={"YB_MODEL__DTYPE": "float16"}).model
    assert (fixed.dtype_for("cpu"), fixed.dtype_for("cuda")) == ("float16", "float16")
    with pytest.raises(ConfigError, match="dtype"):
        load_config(env={"YB_MODEL__DTYPE": "fp8"})


def test_block_size_auto_follows_the_device_and_an_explicit_size_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ModelConfig(device="cpu").block_size == CPU_BLOCK_SIZE == 64
    assert ModelConfig(device="cuda:1").block_size == CUDA_BLOCK_SIZE == 256
    assert ModelConfig(device="cuda", block_size=128).block_size == 128
    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: True)
    assert ModelConfig().block_size == 256
    monkeypatch.setattr(config_module, "nvidia_gpu_visible", lambda: False)
    assert ModelConfig().block_size == 64
    # Resolved once: what a launcher hands its children is the number, whatever
    # their own machine would have chosen.
    env = dump_env(load_config(env={"YB_MODEL__DEVICE": "cuda"}))
    assert env["YB_MODEL__BLOCK_SIZE"] == "256"
    assert load_config(env={**env, "YB_MODEL__DEVICE": "cpu"}).model.block_size == 256
    with pytest.raises(ConfigError, match="block_size"):
        load_config(env={"YB_MODEL__BLOCK_SIZE": "-64"})


def test_nvidia_gpu_visible_reads_the_driver_and_honours_cuda_visible_devices(
    tmp_path: Path,
) -> None:
    assert not nvidia_gpu_visible({}, root=tmp_path)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()  # the control node alone is no GPU
    assert not nvidia_gpu_visible({}, root=tmp_path)
    (tmp_path / "dev" / "nvidia0").touch()
    assert nvidia_gpu_visible({}, root=tmp_path)
    assert not nvidia_gpu_visible({"CUDA_VISIBLE_DEVICES": ""}, root=tmp_path)
    assert not nvidia_gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"}, root=tmp_path)
    assert nvidia_gpu_visible({"CUDA_VISIBLE_DEVICES": "0"}, root=tmp_path)
    other = tmp_path / "other"
    (other / "proc" / "driver" / "nvidia" / "gpus" / "0000:3b:00.0").mkdir(parents=True)
    assert nvidia_gpu_visible({}, root=other)


# --- engine KV sizing settings ---------------------------------------------------------


def test_kv_pages_default_to_auto_with_overrides_from_env() -> None:
    cfg = load_config(env={})
    assert (cfg.decode.num_kv_pages, cfg.decode.kv_memory_bytes) == (0, 0)
    assert cfg.decode.gpu_memory_utilization == 0.9
    # On the CPU: a prefill holds one longest prompt (its prefix cache in those pages
    # while idle), a decode batch shares one longest sequence's room; only a prefill
    # keeps a prefix cache.
    assert (cfg.prefill.kv_sequences, cfg.decode.kv_sequences) == (1, 1)
    assert cfg.prefill.prefix_cache_pages == 64
    assert not hasattr(cfg.decode, "prefix_cache_pages")
    # A prefill engine runs one job at a time: its auto size is one request's pages.
    assert (cfg.prefill.max_batch_size, cfg.decode.max_batch_size) == (1, 32)
    cfg = load_config(
        env={
            "YB_DECODE__NUM_KV_PAGES": "512",
            "YB_PREFILL__KV_MEMORY_BYTES": "1000000000",
            "YB_PREFILL__GPU_MEMORY_UTILIZATION": "0.45",
            "YB_DECODE__KV_SEQUENCES": "6",
        }
    )
    assert cfg.decode.kv_sequences == 6
    assert cfg.decode.num_kv_pages == 512
    assert cfg.prefill.kv_memory_bytes == 10**9
    assert cfg.prefill.gpu_memory_utilization == 0.45
    assert load_config(env=dump_env(cfg)) == cfg


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"YB_DECODE__GPU_MEMORY_UTILIZATION": "1.5"}, "gpu_memory_utilization"),
        ({"YB_DECODE__GPU_MEMORY_UTILIZATION": "0"}, "gpu_memory_utilization"),
        ({"YB_DECODE__KV_SEQUENCES": "0"}, "kv_sequences"),
        ({"YB_DECODE__PREFIX_CACHE_PAGES": "8"}, "prefix_cache_pages"),
        ({"YB_DECODE__NUM_KV_PAGES": "-1"}, "num_kv_pages"),
        ({"YB_PREFILL__KV_MEMORY_BYTES": "-1"}, "kv_memory_bytes"),
    ],
)
def test_kv_sizing_settings_out_of_range_are_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(env=env)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"YB_GATEWAY__DECISION_TIMEOUT_S": "0"}, "decision_timeout_s"),
        ({"YB_GATEWAY__JOB_TIMEOUT_S": "-1"}, "job_timeout_s"),
        ({"YB_GATEWAY__FIRST_TOKEN_TIMEOUT_S": "0"}, "first_token_timeout_s"),
        ({"YB_GATEWAY__TOKEN_IDLE_TIMEOUT_S": "-5"}, "token_idle_timeout_s"),
        ({"YB_GATEWAY__REQUEST_TIMEOUT_S": "0"}, "request_timeout_s"),
        ({"YB_GATEWAY__BUS_GRACE_S": "-0.5"}, "bus_grace_s"),
        ({"YB_GATEWAY__DEFAULT_MAX_TOKENS": "0"}, "default_max_tokens"),
        ({"YB_GATEWAY__MAX_MAX_TOKENS": "0"}, "max_max_tokens"),
        ({"YB_GATEWAY__MAX_BODY_BYTES": "0"}, "max_body_bytes"),
        ({"YB_GATEWAY__TTFT_SLO_S": "0"}, "ttft_slo_s"),
        ({"YB_GATEWAY__TBT_SLO_S": "-1"}, "tbt_slo_s"),
        ({"YB_GATEWAY__PORT": "70000"}, "port"),
        ({"YB_GATEWAY__PORT": "-1"}, "port"),
    ],
)
def test_gateway_deadlines_and_limits_out_of_range_are_errors(
    env: dict[str, str], needle: str
) -> None:
    # Each would start a gateway that times out, or refuses, every request.
    with pytest.raises(ConfigError, match=rf"gateway\.{needle}"):
        load_config(env=env)


def test_gateway_bus_grace_and_port_may_be_zero() -> None:
    cfg = load_config(env={"YB_GATEWAY__BUS_GRACE_S": "0", "YB_GATEWAY__PORT": "0"})
    assert (cfg.gateway.bus_grace_s, cfg.gateway.port) == (0.0, 0)


# --- gateway.service_tiers -------------------------------------------------------------


def test_the_built_in_tiers_follow_the_gateway_slos() -> None:
    gateway = load_config(env={"YB_GATEWAY__TTFT_SLO_S": "8", "YB_GATEWAY__TBT_SLO_S": "0.1"})
    tiers = gateway.gateway.resolved_service_tiers()
    assert tiers == {
        "default": ServiceTier(ttft_slo_s=8.0, tbt_slo_s=0.1, priority=0),
        "priority": ServiceTier(ttft_slo_s=8.0, tbt_slo_s=0.1, priority=1),
        "flex": ServiceTier(ttft_slo_s=8.0 * FLEX_TTFT_FACTOR, tbt_slo_s=0.1, priority=-1),
    }


def test_tiers_are_set_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "yb.toml"
    path.write_text(
        "[gateway]\nttft_slo_s = 20\n"
        "[gateway.service_tiers.default]\n"
        "[gateway.service_tiers.gold]\npriority = 2\nttft_slo_s = 5\n"
    )
    cfg = load_config(path, env={})
    # A tier's SLO left out is the gateway's; the configured tiers replace the built-in.
    assert cfg.gateway.resolved_service_tiers() == {
        "default": ServiceTier(ttft_slo_s=20.0, tbt_slo_s=2.0, priority=0),
        "gold": ServiceTier(ttft_slo_s=5.0, tbt_slo_s=2.0, priority=2),
    }
    assert load_config(env=dump_env(cfg)) == cfg
    # The environment's JSON is merged into the file's tiers.
    env = {"YB_GATEWAY__SERVICE_TIERS": '{"gold": {"tbt_slo_s": 0.2}, "flex": {"priority": -3}}'}
    tiers = load_config(path, env=env).gateway.resolved_service_tiers()
    assert list(tiers) == ["default", "gold", "flex"]
    assert tiers["gold"] == ServiceTier(ttft_slo_s=5.0, tbt_slo_s=0.2, priority=2)


@pytest.mark.parametrize(
    ("tiers", "needle"),
    [
        ('{"gold": {"priority": 2}}', "no `default` tier"),
        ('{"default": {"ttft_slo_s": 3}}', r"default\.ttft_slo_s 3 differs from gateway\.ttft"),
        ('{"default": {}, "auto": {}}', "'auto' is not a tier name"),
        ('{"default": {}, "a b": {}}', "'a b' is not a tier name"),
        ('{"default": {"ttft": 3}}', "unknown field `ttft`"),
        ('{"default": {}, "gold": {"tbt_slo_s": -1}}', "tbt_slo_s"),
        ('{"default": {}, "gold": {"priority": 18446744073709551616}}', "priority"),
        ("default", "not a JSON object"),
    ],
)
def test_bad_tiers_are_clear_errors(tiers: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(env={"YB_GATEWAY__SERVICE_TIERS": tiers})


def test_a_config_file_without_a_default_tier_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "yb.toml"
    path.write_text("[gateway.service_tiers.gold]\npriority = 2\n")
    with pytest.raises(ConfigError, match="names gold but no `default` tier"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"YB_PREFILL__CHUNK_SIZE": "0"}, r"prefill\.chunk_size"),
        ({"YB_DECODE__MAX_BATCH_SIZE": "0"}, r"decode\.max_batch_size"),
        ({"YB_PREFILL__MAX_BATCH_SIZE": "0"}, r"prefill\.max_batch_size"),
        ({"YB_DECODE__THREADS": "-1"}, r"decode\.threads"),
        ({"YB_PREFILL__UCX_PORT": "65536"}, r"prefill\.ucx_port"),
        ({"YB_DECODE__TRANSFER_TIMEOUT_S": "0"}, r"decode\.transfer_timeout_s"),
        ({"YB_PREFILL__FETCH_TIMEOUT_S": "-2"}, r"prefill\.fetch_timeout_s"),
        ({"YB_DECODE__LOAD_REPORT_INTERVAL_S": "0"}, r"decode\.load_report_interval_s"),
        ({"YB_PREFILL__PREFIX_CACHE_PAGES": "-1"}, r"prefill\.prefix_cache_pages"),
        ({"YB_KVSTORE__DRAM_BLOCKS": "0"}, r"kvstore\.dram_blocks"),
        ({"YB_KVSTORE__SSD_BLOCKS": "-1"}, r"kvstore\.ssd_blocks"),
        ({"YB_KVSTORE__EVICTION_POLICY": "mru"}, r"kvstore\.eviction_policy"),
        ({"YB_KVSTORE__DRAM_HEADROOM_BLOCKS": "-2"}, r"kvstore\.dram_headroom_blocks"),
        ({"YB_KVSTORE__SSD_IO_THREADS": "0"}, r"kvstore\.ssd_io_threads"),
        ({"YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "-1"}, r"kvstore\.load_report_interval_s"),
    ],
)
def test_engine_and_kvstore_settings_out_of_range_are_errors(
    env: dict[str, str], needle: str
) -> None:
    # Each would start a service that fails its first request (a chunk of 0 tokens,
    # a deadline already past) or never reports: refused at load, where it is named.
    with pytest.raises(ConfigError, match=needle):
        load_config(env=env)


def test_engine_and_kvstore_settings_keep_their_off_values() -> None:
    cfg = load_config(
        env={
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            "YB_PREFILL__THREADS": "0",
            "YB_KVSTORE__SSD_BLOCKS": "0",
            "YB_KVSTORE__DRAM_HEADROOM_BLOCKS": "-1",
            "YB_KVSTORE__EVICTION_POLICY": "fifo",
        }
    )
    assert cfg.prefill.prefix_cache_pages == 0 and cfg.prefill.threads == 0
    assert cfg.kvstore.ssd_blocks == 0 and cfg.kvstore.dram_headroom_blocks == -1
    assert cfg.kvstore.eviction_policy == "fifo"
