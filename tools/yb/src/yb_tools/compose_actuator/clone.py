"""A new engine container, cloned from one of its role in the compose project: pure.

Compose knows its containers by their labels (`com.docker.compose.project`,
`.service`, `.container-number`, `.oneoff`), not by their names. A clone is one more
container of its template's service (the next free container number), so that
`docker compose ps` lists it and `docker compose down` stops and removes it as it
does a `--scale`d replica. It differs from its template only where an instance is
its own:

- its instance id, `<role>-<k>`: the value of `--instance-id` in its command;
- its UCX address (`YB_PREFILL__UCX_HOST` / `YB_DECODE__UCX_HOST`), its hostname
  and its one network alias, all that id: peers dial the address it announces, and
  the template's aliases (its service name) stay the template's alone;
- its logical host (`YB_HOST`), chosen by the actuator;
- its name, `<project>_<id>` (compose 1's separator) or `<project>-<id>` (compose 2's),
  after its template's, and the labels `org.yuebing.instance-id` and
  `org.yuebing.added-by`.

The rest is its template's: image, environment, entry point, user, mounts and volumes,
restart policy, health check, stop signal and grace, networks. Published ports are not
copied (a second container cannot publish the same host port; engines publish none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from yb_core import events as ev
from yb_tools.compose_actuator.docker_api import ContainerInspect, CreateRequest

PROJECT_LABEL: Final = "com.docker.compose.project"
SERVICE_LABEL: Final = "com.docker.compose.service"
NUMBER_LABEL: Final = "com.docker.compose.container-number"
ONEOFF_LABEL: Final = "com.docker.compose.oneoff"
#: The instance id a container runs, on every container the actuator creates.
INSTANCE_LABEL: Final = "org.yuebing.instance-id"
#: Marks the containers the actuator created.
ADDED_BY_LABEL: Final = "org.yuebing.added-by"
ADDED_BY: Final = "planner-actuator"

ENGINE_ROLES: Final[tuple[ev.PoolRole, ...]] = ("prefill", "decode")
#: Host configuration a clone must not copy: a host port is published once.
NOT_CLONED: Final = ("PortBindings", "PublishAllPorts")


class NotAnEngine(ValueError):
    """The container is not an engine the actuator can clone (no engine role, no
    `--instance-id` in its command)."""


@dataclass(frozen=True, slots=True)
class Engine:
    """An engine container of the project: what the actuator tells it by."""

    container_id: str
    name: str
    service: str
    number: int
    role: ev.PoolRole
    instance_id: str
    host: str
    status: str  # Docker's: created, running, restarting, exited, ...
    health: str  # healthy, unhealthy, starting, "" (no check)


def env_value(env: list[str], name: str) -> str | None:
    """The value of `name` in a `KEY=VALUE` list (the last one wins, as in Docker)."""
    found = None
    for item in env:
        key, sep, value = item.partition("=")
        if sep and key == name:
            found = value
    return found


def with_env(env: list[str], name: str, value: str) -> list[str]:
    """`env` with `name` set to `value` (replaced where it was, else appended)."""
    out = [item for item in env if item.partition("=")[0] != name]
    return [*out, f"{name}={value}"]


def ucx_host_variable(role: ev.PoolRole) -> str:
    """The setting an engine announces as its UCX address (`<role>.ucx_host`)."""
    return f"YB_{role.upper()}__UCX_HOST"


def instance_id_of(command: list[str] | None) -> str | None:
    """The value of `--instance-id` in a command (`--instance-id X` or `--instance-id=X`)."""
    words = list(command or [])
    for i, word in enumerate(words):
        if word == "--instance-id" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--instance-id="):
            return word.split("=", 1)[1]
    return None


def with_instance_id(command: list[str] | None, instance_id: str) -> list[str]:
    """`command` running `instance_id` instead of the id it names."""
    words = list(command or [])
    for i, word in enumerate(words):
        if word == "--instance-id" and i + 1 < len(words):
            return [*words[: i + 1], instance_id, *words[i + 2 :]]
        if word.startswith("--instance-id="):
            return [*words[:i], f"--instance-id={instance_id}", *words[i + 1 :]]
    return [*words, "--instance-id", instance_id]


def engine_of(info: ContainerInspect) -> Engine:
    """The engine an inspected container runs. Its role is its NATS user
    (`YB_NATS__USER`: every service connects as its role), its id the command's
    `--instance-id`. Raises NotAnEngine otherwise."""
    role = env_value(info.config.env, "YB_NATS__USER")
    instance_id = instance_id_of(info.config.cmd)
    if role not in ENGINE_ROLES or not instance_id:
        raise NotAnEngine(f"{info.name.lstrip('/')}: role {role!r}, instance id {instance_id!r}")
    number = info.labels.get(NUMBER_LABEL, "1")
    return Engine(
        container_id=info.id,
        name=info.name.lstrip("/"),
        service=info.labels.get(SERVICE_LABEL, ""),
        number=int(number) if number.isdigit() else 1,
        role="prefill" if role == "prefill" else "decode",
        instance_id=instance_id,
        host=env_value(info.config.env, "YB_HOST") or "",
        status=info.state.status,
        health=info.state.health_status,
    )


def container_name(project: str, instance_id: str, template_name: str) -> str:
    """The new container's name, with the separator compose used for the template's
    (`ybsmoke_prefill-0_1` under compose 1, `ybsmoke-prefill-0-1` under compose 2)."""
    separator = "_" if template_name.lstrip("/").startswith(f"{project}_") else "-"
    return f"{project}{separator}{instance_id}"


def clone_request(
    template: ContainerInspect,
    *,
    instance_id: str,
    number: int,
    host: str,
) -> CreateRequest:
    """The create request of engine `instance_id` on logical host `host`, one more
    container of `template`'s compose service as container `number` (module
    docstring). Raises NotAnEngine when the template runs no engine, or one of
    another role than `instance_id` names."""
    engine = engine_of(template)
    if instance_id.rpartition("-")[0] != engine.role:
        raise NotAnEngine(f"{instance_id} is no {engine.role} instance ({engine.name})")
    project = template.labels.get(PROJECT_LABEL)
    if not project:
        raise NotAnEngine(f"{engine.name} is no compose container (no {PROJECT_LABEL})")
    env = with_env(template.config.env, ucx_host_variable(engine.role), instance_id)
    env = with_env(env, "YB_HOST", host)
    labels = {
        **template.labels,
        NUMBER_LABEL: str(number),
        ONEOFF_LABEL: "False",
        INSTANCE_LABEL: instance_id,
        ADDED_BY_LABEL: ADDED_BY,
    }
    config = msgspec.structs.replace(
        template.config,
        hostname=instance_id,
        env=env,
        cmd=with_instance_id(template.config.cmd, instance_id),
        labels=labels,
    )
    host_config = {k: v for k, v in template.host_config.items() if k not in NOT_CLONED}
    # Its own id as its only alias: the template's aliases name the template (compose
    # gives each container its service name and short id).
    # The network compose made it join first (its NetworkMode) goes first.
    primary = template.host_config.get("NetworkMode")
    names = sorted(template.network_settings.networks, key=lambda n: (n != primary, n))
    networks = [(name, [instance_id]) for name in names]
    name = container_name(project, instance_id, template.name)
    return CreateRequest(name=name, config=config, host_config=host_config, networks=networks)
