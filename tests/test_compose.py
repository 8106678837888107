"""docker-compose.yml is checked here because no Docker engine runs on CI machines.

The checks are what `docker compose up` would trip over first: build contexts and
Dockerfiles that exist, commands that name real entry points, environments that the
configuration schema accepts, ports and hostnames that agree with that configuration,
health checks, and volumes that are declared.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from yb_shared.cli import main as yb_main
from yb_shared.config import load_config

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
ROLES = ("conductor", "prefill", "decode", "kvstore", "gateway")


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def _dockerfile(service: dict[str, Any]) -> Path:
    build = service["build"]
    return ROOT / build["context"] / build["dockerfile"]


def _entry_module(dockerfile: Path) -> str:
    match = re.search(r'^ENTRYPOINT \["python", "-m", "([\w.]+)"\]', dockerfile.read_text(), re.M)
    assert match, f"{dockerfile}: no `python -m` ENTRYPOINT"
    return match.group(1)


@pytest.mark.parametrize("name", sorted(n for n, s in SERVICES.items() if "build" in s))
def test_build_context_dockerfile_and_entry_point_exist(name: str) -> None:
    service = SERVICES[name]
    assert (ROOT / service["build"]["context"]).is_dir()
    dockerfile = _dockerfile(service)
    assert dockerfile.is_file(), dockerfile
    module = _entry_module(dockerfile)
    role = module.removeprefix("yb_")
    assert role in ROLES
    assert (ROOT / "services" / role / "src" / module / "__main__.py").is_file()
    # Everything the Dockerfile copies is in the build context.
    for src in re.findall(r"^COPY (\S+) ", dockerfile.read_text(), re.M):
        assert (ROOT / service["build"]["context"] / src).exists(), src


def test_every_role_runs_and_the_topology_matches_yb_up() -> None:
    roles = [
        _entry_module(_dockerfile(s))
        for n, s in SERVICES.items()
        if n != "model-init" and "build" in s
    ]
    counts = {r: roles.count(f"yb_{r}") for r in ROLES}
    assert counts == {"conductor": 1, "prefill": 2, "decode": 1, "kvstore": 2, "gateway": 1}


@pytest.mark.parametrize("name", sorted(n for n, s in SERVICES.items() if "build" in s))
def test_environment_is_valid_configuration(name: str) -> None:
    service = SERVICES[name]
    env = _env(service)
    cfg = load_config(env=env)  # raises on unknown sections, fields or bad values
    assert cfg.nats.url == "nats://nats:4222"
    role = _entry_module(_dockerfile(service)).removeprefix("yb_")
    if role in ("prefill", "decode", "kvstore") and name != "model-init":
        # Peers dial the announced UCX address: it must be this container's name.
        assert getattr(cfg, role).ucx_host == name


def test_instance_ids_are_unique() -> None:
    ids = []
    for service in SERVICES.values():
        command = service.get("command") or []
        if "--instance-id" in command:
            ids.append(command[command.index("--instance-id") + 1])
    assert len(ids) == len(set(ids)) == 7


def test_model_init_runs_a_real_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    entry = SERVICES["model-init"]["entrypoint"]
    assert entry[0] == "yb"
    with pytest.raises(SystemExit) as exc:
        yb_main([*entry[1:], "--help"])
    assert exc.value.code == 0
    assert "usage: yb prepare" in capsys.readouterr().out


def test_gateway_port_and_health_checks() -> None:
    gateway = SERVICES["gateway"]
    cfg = load_config(env=_env(gateway))
    assert cfg.gateway.host == "0.0.0.0"
    published = [p.rsplit(":", 1)[1] for p in gateway["ports"]]
    assert str(cfg.gateway.port) in published
    for name, service in SERVICES.items():
        if name == "model-init":
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test, f"{name} has no health check"
        text = " ".join(test)
        if name == "gateway":
            assert f":{cfg.gateway.port}/healthz" in text
        elif name != "nats":
            port = load_config(env=_env(service)).telemetry.metrics_port
            assert f":{port}/metrics" in text


def test_nats_config_and_dependencies() -> None:
    nats = SERVICES["nats"]
    conf_src = nats["volumes"][0].split(":")[0]
    conf = (ROOT / conf_src).read_text()
    assert "jetstream" in conf
    monitor = re.search(r"^http:\s*[\d.]+:(\d+)", conf, re.M)
    assert monitor
    assert f":{monitor.group(1)}/healthz" in " ".join(nats["healthcheck"]["test"])
    assert shlex.join(nats["command"]) == "-c /etc/nats/nats.conf"
    for name, service in SERVICES.items():
        if name in ("nats", "model-init"):
            continue
        assert service["depends_on"]["nats"]["condition"] == "service_healthy"


def test_named_volumes_are_declared() -> None:
    declared = set(COMPOSE["volumes"])
    for service in SERVICES.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, source
