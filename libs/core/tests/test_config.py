"""Configuration: defaults < file < environment, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_core.config import ConfigError, dump_env, load_config


def test_file_then_env_override(tmp_path: Path) -> None:
    path = tmp_path / "yb.toml"
    path.write_text('host = "h1"\n[gateway]\nport = 9000\napi_keys = ["k1"]\n')
    cfg = load_config(path, env={"YB_GATEWAY__PORT": "9100", "YB_DECODE__MAX_BATCH_SIZE": "4"})
    assert cfg.host == "h1"
    assert cfg.gateway.port == 9100
    assert cfg.gateway.api_keys == ["k1"]
    assert cfg.decode.max_batch_size == 4
    assert cfg.prefill.max_batch_size == 32


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
    ],
)
def test_bad_values_are_clear_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(env=env)


def test_unknown_file_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "yb.json"
    path.write_text('{"gatewy": {}}')
    with pytest.raises(ConfigError, match="gatewy"):
        load_config(path, env={})
