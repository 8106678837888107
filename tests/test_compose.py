"""docker-compose.yml (and its three-node NATS variant, docker-compose.cluster.yml) is
checked here because no Docker engine runs on CI machines.

The checks are what `docker compose up` would trip over first: build contexts and
Dockerfiles that exist, commands that name real entry points, environments that the
configuration schema accepts, ports and hostnames that agree with that configuration,
health checks, and volumes that are declared.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from yb_core.config import NatsConfig, load_config
from yb_core.nats_auth import USERS, password_env_var, render_compose_authorization
from yb_core.netaddr import is_loopback
from yb_tools.cli import main as yb_main
from yb_tools.natsserver import (
    CLUSTER_DECISION_TIMEOUT_S,
    CLUSTER_FAILOVER_S,
    CLUSTER_REQUEST_TIMEOUT_S,
    nats_server_binary,
    sync_interval_value,
)

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


# --- authentication and authorization -------------------------------------------------

REQUIRED_VAR = re.compile(r"\$\{(\w+):\?[^}]*\}")


def _nats_roles() -> dict[str, str]:
    """Compose service name -> the NATS user (role) it connects as."""
    return {
        name: _entry_module(_dockerfile(s)).removeprefix("yb_")
        for name, s in SERVICES.items()
        if name != "model-init" and "build" in s
    }


def test_every_service_connects_to_nats_as_its_role() -> None:
    nats_env = _env(SERVICES["nats"])
    for name, role in _nats_roles().items():
        env = _env(SERVICES[name])
        assert env["YB_NATS__USER"] == role, name
        # The password is required from the environment, never written here.
        password = env["YB_NATS__PASSWORD"]
        required = REQUIRED_VAR.fullmatch(password)
        assert required and required.group(1) == password_env_var(role), (name, password)
        # nats-server gets the same variable to check it against.
        assert nats_env[password_env_var(role)] == password


def test_nats_auth_conf_is_generated_from_this_compose_file() -> None:
    nats = SERVICES["nats"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in nats["volumes"] if v.startswith("./"))
    assert mounts["./deploy/nats-auth.conf"] == "/etc/nats/nats-auth.conf"
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert re.search(r'^include "nats-auth.conf"', conf, re.M)
    auth = (ROOT / "deploy" / "nats-auth.conf").read_text()
    assert auth == render_compose_authorization(COMPOSE), (
        "deploy/nats-auth.conf is stale: python -m yb_core.nats_auth --compose "
        "docker-compose.yml > deploy/nats-auth.conf"
    )
    # Every user's password variable is given to the nats container, and required.
    nats_env = _env(nats)
    for user in USERS:
        assert f"password: ${password_env_var(user)}" in auth
        assert REQUIRED_VAR.fullmatch(nats_env[password_env_var(user)]), user
    # The monitor has no authentication of its own: it stays inside the container.
    monitor = re.search(r"^http:\s*([\d.]+):\d+", conf, re.M)
    assert monitor and monitor.group(1) == "127.0.0.1"


def test_the_real_nats_server_accepts_the_deploy_config() -> None:
    env = {**os.environ, **{password_env_var(u): f"pw-{u}" for u in USERS}}
    check = subprocess.run(
        [nats_server_binary(), "-c", "nats.conf", "-t"],
        cwd=ROOT / "deploy",
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Without a password in the environment, the server does not start at all.
    env.pop(password_env_var("gateway"))
    check = subprocess.run(
        [nats_server_binary(), "-c", "nats.conf", "-t"],
        cwd=ROOT / "deploy",
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode != 0
    assert password_env_var("gateway") in check.stdout + check.stderr


def test_gateway_keys_and_metrics_token_are_required() -> None:
    gateway = _env(SERVICES["gateway"])
    keys = REQUIRED_VAR.fullmatch(gateway["YB_GATEWAY__API_KEYS"])
    assert keys and keys.group(1) == "YB_API_KEYS"
    cfg = load_config(env=gateway)
    assert cfg.gateway.resolved_api_keys() and not cfg.gateway.allow_unauthenticated
    for name, service in SERVICES.items():
        if "build" not in service or name == "model-init":
            continue
        cfg = load_config(env=_env(service))
        if not is_loopback(cfg.telemetry.metrics_host):
            token = _env(service)["YB_TELEMETRY__METRICS_TOKEN"]
            assert REQUIRED_VAR.fullmatch(token), name
        if name != "gateway":  # the gateway's check is /healthz, open by design
            # Each service scrapes itself with the token, as Prometheus must.
            test = " ".join(service["healthcheck"]["test"])
            assert "YB_TELEMETRY__METRICS_TOKEN" in test and "Bearer" in test, name


def test_make_env_writes_every_secret_compose_requires(tmp_path: Path) -> None:
    required = set(REQUIRED_VAR.findall((ROOT / "docker-compose.yml").read_text()))
    assert {"YB_API_KEYS", "YB_METRICS_TOKEN", "YB_NATS_PASSWORD_GATEWAY"} <= required
    # And what the three-node variant adds (the route password).
    required |= set(REQUIRED_VAR.findall((ROOT / "docker-compose.cluster.yml").read_text()))
    assert "YB_NATS_ROUTE_PASSWORD" in required
    out = tmp_path / ".env"
    script = ROOT / "deploy" / "make-env.sh"
    subprocess.run(["sh", str(script), str(out)], check=True, capture_output=True, timeout=30)
    assert out.stat().st_mode & 0o077 == 0
    values = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert set(values) == required
    assert all(len(v) >= 32 for v in values.values())
    assert len(set(values.values())) == len(values)
    # A second run keeps the secrets (keys handed out stay valid).
    subprocess.run(["sh", str(script), str(out)], check=True, capture_output=True, timeout=30)
    assert dict(line.split("=", 1) for line in out.read_text().splitlines()) == values


# --- the three-node NATS variant (docker-compose.cluster.yml) ------------------------

CLUSTER_FILE = ROOT / "docker-compose.cluster.yml"
CLUSTER_OVERRIDE = yaml.safe_load(CLUSTER_FILE.read_text())
NATS_NODES = ("nats", "nats-2", "nats-3")


def _merge_service(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """One service of `docker compose -f base -f override`, by compose's merge rules
    for the keys used here: mappings merge key by key, volumes merge by their target
    path, and sequences such as `command` or a health check's `test` are replaced."""
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        if key == "volumes" and isinstance(old, list):
            by_target = {v.split(":")[1]: v for v in old}
            by_target.update({v.split(":")[1]: v for v in value})
            out[key] = list(by_target.values())
        elif isinstance(old, dict) and isinstance(value, dict):
            out[key] = {**old, **value}
        else:
            out[key] = value
    return out


def _merged_compose() -> dict[str, Any]:
    services = {name: dict(s) for name, s in SERVICES.items()}
    for name, service in CLUSTER_OVERRIDE["services"].items():
        services[name] = _merge_service(services.get(name, {}), service)
    volumes = {**COMPOSE["volumes"], **(CLUSTER_OVERRIDE.get("volumes") or {})}
    return {**COMPOSE, "services": services, "volumes": volumes}


MERGED = _merged_compose()
MERGED_SERVICES: dict[str, Any] = MERGED["services"]


def _node_env(node: str) -> dict[str, str]:
    return _env(MERGED_SERVICES[node])


def _server_name(node: str) -> str:
    command = [str(c) for c in MERGED_SERVICES[node]["command"]]
    return command[command.index("--server_name") + 1]


def test_cluster_variant_runs_three_nodes_with_their_own_stores() -> None:
    assert [n for n in MERGED_SERVICES if n.startswith("nats")] == list(NATS_NODES)
    assert [_server_name(n) for n in NATS_NODES] == ["nats-1", "nats-2", "nats-3"]
    data = []
    for node in NATS_NODES:
        service = MERGED_SERVICES[node]
        command = [str(c) for c in service["command"]]
        assert command[:2] == ["-c", "/etc/nats/nats-cluster.conf"]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert mounts["/etc/nats/nats-cluster.conf"] == "./deploy/nats-cluster.conf"
        assert mounts["/etc/nats/nats-auth.conf"] == "./deploy/nats-auth.conf"
        data.append(mounts["/data"])
        assert "/healthz" in " ".join(service["healthcheck"]["test"])
    assert len(set(data)) == 3, f"nodes share a JetStream store: {data}"
    for volume in data:
        assert volume in MERGED["volumes"]


def test_cluster_variant_routes_join_every_node_with_the_route_password() -> None:
    conf = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    route_port = re.search(r"^\s*listen:\s*[\d.]+:(\d+)", conf.split("cluster {")[1], re.M)
    assert route_port
    assert re.search(r"authorization \{ user: route, password: \$YB_NATS_ROUTE_PASSWORD \}", conf)
    variables = re.findall(r"\$(YB_NATS_ROUTE_\d)", conf.split("routes:")[1].split("]")[0])
    for node in NATS_NODES:
        env = _node_env(node)
        assert REQUIRED_VAR.fullmatch(env["YB_NATS_ROUTE_PASSWORD"])
        targets = []
        for var in variables:
            url = env[var]
            match = re.fullmatch(r"nats-route://route:\$\{(\w+):\?[^}]*\}@([\w-]+):(\d+)", url)
            assert match and match.group(1) == "YB_NATS_ROUTE_PASSWORD", url
            assert match.group(3) == route_port.group(1)
            targets.append(match.group(2))
        assert sorted(targets) == sorted(NATS_NODES), f"{node} does not route to every node"
        # Every user's password reaches every node (nats-auth.conf reads them).
        for user in USERS:
            assert REQUIRED_VAR.fullmatch(env[password_env_var(user)]), (node, user)


def test_cluster_variant_services_use_every_node_and_r3() -> None:
    nodes = {f"nats://{n}:4222" for n in NATS_NODES}
    clients = [n for n, s in MERGED_SERVICES.items() if "YB_NATS__USER" in _env(s)]
    assert sorted(clients) == sorted(_nats_roles())
    for name in clients:
        service = MERGED_SERVICES[name]
        cfg = load_config(env=_env(service))
        assert set(cfg.nats.servers()) == nodes, name
        assert cfg.nats.replicas == 3, name
        assert cfg.nats.storage == "file"
        # Waits that outlast a leader election, as `yb up --nats-cluster` sets them.
        assert cfg.nats.request_timeout_s >= CLUSTER_REQUEST_TIMEOUT_S, name
        assert cfg.conductor.heartbeat_timeout_s > CLUSTER_FAILOVER_S, name
        if name == "gateway":
            assert cfg.gateway.decision_timeout_s >= CLUSTER_DECISION_TIMEOUT_S
        for node in NATS_NODES:
            assert service["depends_on"][node]["condition"] == "service_healthy", (name, node)
    # The single-node file keeps one server and one replica.
    for name in clients:
        cfg = load_config(env=_env(SERVICES[name]))
        assert cfg.nats.servers() == ["nats://nats:4222"] and cfg.nats.replicas == 1


def test_cluster_variant_runs_the_same_users_and_permissions() -> None:
    # The nodes include the deploy/nats-auth.conf generated from docker-compose.yml:
    # the cluster runs the same services, so the grants must be the same.
    assert render_compose_authorization(MERGED) == (ROOT / "deploy" / "nats-auth.conf").read_text()


def test_jetstream_settings_match_the_configuration_defaults() -> None:
    expected = sync_interval_value(NatsConfig().sync_interval_s)
    for name in ("nats.conf", "nats-cluster.conf"):
        conf = (ROOT / "deploy" / name).read_text()
        jetstream = conf.split("jetstream {")[1].split("}")[0]
        match = re.search(r"^\s*sync_interval:\s*(\S+)", jetstream, re.M)
        assert match and match.group(1) == expected, (name, expected)
        assert re.search(r"^\s*store_dir:\s*/data/", jetstream, re.M), name


@pytest.mark.parametrize("node", NATS_NODES)
def test_the_real_nats_server_accepts_the_cluster_config(node: str) -> None:
    env = {**os.environ, **{password_env_var(u): f"pw-{u}" for u in USERS}}
    env["YB_NATS_ROUTE_PASSWORD"] = "route-pw"
    for i, peer in enumerate(NATS_NODES, 1):
        env[f"YB_NATS_ROUTE_{i}"] = f"nats-route://route:route-pw@{peer}:6222"
    command = [str(c) for c in MERGED_SERVICES[node]["command"]]
    command[1] = "nats-cluster.conf"  # the mount point's file, here beside nats-auth.conf
    check = subprocess.run(
        [nats_server_binary(), *command, "-t"],
        cwd=ROOT / "deploy",
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # Without the route password the node does not start at all.
    env.pop("YB_NATS_ROUTE_PASSWORD")
    check = subprocess.run(
        [nats_server_binary(), *command, "-t"],
        cwd=ROOT / "deploy",
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode != 0
    assert "YB_NATS_ROUTE_PASSWORD" in check.stdout + check.stderr
