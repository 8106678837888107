"""The compose actuator without a Docker engine: the clone of a recorded `docker
inspect` into a create request, its names, labels and aliases, Docker's errors, and
the actuator carrying out the planner's actions against recorded answers; how it
reads the log, from a real nats-server.

The fixture (data/docker_inspect_prefill.json) is `GET /containers/{id}/json` of the
`prefill-0` container of a `docker-compose up` (compose 1.29, Docker 20.10), its
secrets replaced. deploy/compose-smoke.sh runs the actuator on a real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

import httpx
import msgspec
import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_tools.cli.cluster_watch import Announced, PlannedAction, WentDown
from yb_tools.cli.elastic import PoolBook
from yb_tools.compose_actuator.actuator import (
    ActuatorItem,
    ActuatorSettings,
    CaughtUp,
    ComposeActuator,
    Gone,
    Missed,
    follow_pool_log,
    logical_host,
)
from yb_tools.compose_actuator.clone import (
    ADDED_BY_LABEL,
    INSTANCE_LABEL,
    NUMBER_LABEL,
    ONEOFF_LABEL,
    PROJECT_LABEL,
    SERVICE_LABEL,
    NotAnEngine,
    clone_request,
    container_name,
    engine_of,
    env_value,
    instance_id_of,
    with_instance_id,
)
from yb_tools.compose_actuator.docker_api import ContainerInspect, DockerApi, DockerError

FIXTURE = Path(__file__).parent / "data" / "docker_inspect_prefill.json"
RECORDED: dict[str, Any] = json.loads(FIXTURE.read_text())
PROJECT = RECORDED["Config"]["Labels"][PROJECT_LABEL]


def inspected(raw: dict[str, Any]) -> ContainerInspect:
    return msgspec.convert(raw, ContainerInspect)


def test_the_recorded_container_is_engine_prefill_0() -> None:
    engine = engine_of(inspected(RECORDED))
    assert (engine.role, engine.instance_id, engine.service) == (
        "prefill",
        "prefill-0",
        "prefill-0",
    )
    assert engine.number == 1 and engine.host == "host-0"
    assert engine.status == "running" and engine.health == "healthy"


def test_a_clone_is_its_template_but_for_what_makes_an_instance() -> None:
    template = inspected(RECORDED)
    request = clone_request(template, instance_id="prefill-2", number=2, host="host-1")
    body = request.body()
    config = RECORDED["Config"]
    # Its own id: command, UCX address, hostname, its only network alias, the name.
    assert body["Cmd"] == ["--instance-id", "prefill-2"]
    assert body["Hostname"] == "prefill-2"
    assert request.name == f"{PROJECT}_prefill-2"  # compose 1 named the template so
    (network,) = RECORDED["NetworkSettings"]["Networks"]
    assert body["NetworkingConfig"] == {"EndpointsConfig": {network: {"Aliases": ["prefill-2"]}}}
    env = dict(item.split("=", 1) for item in body["Env"])
    assert env["YB_PREFILL__UCX_HOST"] == "prefill-2" and env["YB_HOST"] == "host-1"
    # Everything else of its environment is the template's, secrets included.
    before = dict(item.split("=", 1) for item in config["Env"])
    changed = {k for k in before if before[k] != env[k]}
    assert changed == {"YB_PREFILL__UCX_HOST", "YB_HOST"} and set(env) == set(before)
    # Compose's labels: the same project and service, the next container number.
    labels = body["Labels"]
    assert labels[PROJECT_LABEL] == PROJECT and labels[SERVICE_LABEL] == "prefill-0"
    assert labels[NUMBER_LABEL] == "2" and labels[ONEOFF_LABEL] == "False"
    assert labels[INSTANCE_LABEL] == "prefill-2" and labels[ADDED_BY_LABEL] == "planner-actuator"
    kept = {k: v for k, v in config["Labels"].items() if k not in (NUMBER_LABEL, ONEOFF_LABEL)}
    assert {k: labels[k] for k in kept} == kept  # config hash, working dir, files...
    # The same image, entry point, health check, stop signal and grace.
    assert body["Image"] == config["Image"]
    assert body["Entrypoint"] == config["Entrypoint"]
    assert body["Healthcheck"] == config["Healthcheck"]
    assert body.get("StopTimeout") == config.get("StopTimeout")
    assert body["User"] == config["User"] and body["WorkingDir"] == config["WorkingDir"]
    # The host configuration passes back whole: mounts, restart policy, network mode.
    host = body["HostConfig"]
    assert host["RestartPolicy"] == {"Name": "unless-stopped", "MaximumRetryCount": 0}
    assert host["Binds"] == RECORDED["HostConfig"]["Binds"]
    assert host["NetworkMode"] == network
    assert "PortBindings" not in host
    # What is the template's own alone does not travel.
    assert RECORDED["Id"][:12] not in json.dumps(body)
    assert "prefill-0" not in json.dumps({k: v for k, v in body.items() if k != "Labels"})


def test_a_clone_drops_published_ports_and_joins_every_network() -> None:
    raw = copy.deepcopy(RECORDED)
    raw["HostConfig"]["PortBindings"] = {"9100/tcp": [{"HostIp": "", "HostPort": "9100"}]}
    (network,) = raw["NetworkSettings"]["Networks"]
    raw["NetworkSettings"]["Networks"]["aaa_other"] = {"Aliases": ["x"], "NetworkID": "n2"}
    request = clone_request(inspected(raw), instance_id="prefill-7", number=3, host="host-0")
    assert "PortBindings" not in request.host_config
    # The network of its NetworkMode first (joined at creation), then the others.
    assert request.networks == [(network, ["prefill-7"]), ("aaa_other", ["prefill-7"])]


def test_a_clone_refuses_what_it_cannot_be() -> None:
    template = inspected(RECORDED)
    with pytest.raises(NotAnEngine, match="no prefill instance"):
        clone_request(template, instance_id="decode-3", number=2, host="host-0")
    kvstore = copy.deepcopy(RECORDED)
    kvstore["Config"]["Env"] = [
        "YB_NATS__USER=kvstore" if e.startswith("YB_NATS__USER=") else e
        for e in kvstore["Config"]["Env"]
    ]
    with pytest.raises(NotAnEngine, match="role 'kvstore'"):
        engine_of(inspected(kvstore))
    alone = copy.deepcopy(RECORDED)
    del alone["Config"]["Labels"][PROJECT_LABEL]
    with pytest.raises(NotAnEngine, match="no compose container"):
        clone_request(inspected(alone), instance_id="prefill-2", number=2, host="host-0")


def test_names_ids_and_hosts() -> None:
    assert container_name("yb", "decode-3", "/yb_decode-0_1") == "yb_decode-3"
    assert container_name("yb", "decode-3", "/yb-decode-0-1") == "yb-decode-3"
    assert instance_id_of(["--instance-id", "a-1", "--x"]) == "a-1"
    assert instance_id_of(["--instance-id=a-2"]) == "a-2"
    assert instance_id_of(["--instance-id"]) is None and instance_id_of(None) is None
    assert with_instance_id(["--x", "--instance-id", "a-1", "--y"], "b-4") == [
        "--x",
        "--instance-id",
        "b-4",
        "--y",
    ]
    assert with_instance_id(["--instance-id=a-1"], "b-4") == ["--instance-id=b-4"]
    assert with_instance_id(["--x"], "b-4") == ["--x", "--instance-id", "b-4"]
    assert env_value(["A=1", "B=2=3", "A=4"], "A") == "4"
    assert env_value(["A=1"], "B") is None
    assert env_value(["B=2=3"], "B") == "2=3"
    # Beside kvstore k mod (kvstores), as `yb up` places a prefill.
    hosts = ["host-0", "host-1"]
    assert [logical_host(hosts, k, "h") for k in (2, 3, 4)] == ["host-0", "host-1", "host-0"]
    assert logical_host([], 5, "host-9") == "host-9"


# --- Docker's errors -----------------------------------------------------------------


def answering(status: int, body: bytes) -> DockerApi:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    return DockerApi(transport=httpx.MockTransport(handler))


async def test_docker_errors_say_which_call_and_what_docker_answered() -> None:
    docker = answering(404, b'{"message":"No such container: nope"}')
    with pytest.raises(DockerError) as caught:
        await docker.inspect("nope")
    assert caught.value.status == 404
    assert str(caught.value) == (
        "inspect container nope: Docker answered 404: No such container: nope"
    )
    conflict = b'{"message":"Conflict. The container name \\"/yb_prefill-2\\" is already in use"}'
    docker = answering(409, conflict)
    template = inspected(RECORDED)
    request = clone_request(template, instance_id="prefill-2", number=2, host="host-0")
    with pytest.raises(DockerError, match=r"create container .*_prefill-2: Docker answered 409"):
        await docker.create(request)
    # A body that is no JSON is quoted as it came.
    with pytest.raises(DockerError, match="answered 500: daemon on fire"):
        await answering(500, b"daemon on fire\n").start("abc")
    # A stop that Docker answers 304 (stopped already) is no error.
    await answering(304, b"").stop("abc", 5)


async def test_no_daemon_is_an_error_that_names_the_socket(tmp_path: Path) -> None:
    socket = str(tmp_path / "docker.sock")
    docker = DockerApi(socket)
    try:
        with pytest.raises(DockerError, match="no answer from Docker") as caught:
            await docker.version()
    finally:
        await docker.aclose()
    assert caught.value.status is None and socket in str(caught.value)


# --- the actuator against recorded answers --------------------------------------------


def container_like(template: dict[str, Any], instance_id: str, user: str) -> dict[str, Any]:
    """The recorded container made another of the compose file's (as compose made
    prefill-1, decode-0, kvstore-0 beside it)."""
    raw = copy.deepcopy(template)
    raw["Id"] = uuid.uuid4().hex * 2
    raw["Name"] = f"/{PROJECT}_{instance_id}_1"
    config = raw["Config"]
    config["Cmd"] = ["--instance-id", instance_id]
    config["Labels"][SERVICE_LABEL] = instance_id
    env = [e for e in config["Env"] if not e.startswith(("YB_NATS__USER=", "YB_PREFILL__"))]
    config["Env"] = [*env, f"YB_NATS__USER={user}", f"YB_{user.upper()}__UCX_HOST={instance_id}"]
    return raw


class RecordedDocker:
    """Answers the actuator's calls as Docker answered them, from recorded containers;
    a create builds the new container's inspection from its request. `calls` lists
    every call; `fail` maps an operation ("create", "stop") to a recorded error."""

    def __init__(self, containers: list[dict[str, Any]]) -> None:
        self.containers = {c["Id"]: c for c in containers}
        self.calls: list[str] = []
        self.fail: dict[str, tuple[int, str]] = {}

    def api(self) -> DockerApi:
        return DockerApi(transport=httpx.MockTransport(self.answer))

    def answer(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        self.calls.append(f"{method} {path}?{request.url.query.decode()}".rstrip("?"))
        parts = path.strip("/").split("/")
        operation = parts[-1] if method == "POST" else method
        if operation in self.fail:
            status, message = self.fail[operation]
            return httpx.Response(status, json={"message": message})
        if path == "/version":
            return httpx.Response(200, json={"ApiVersion": "1.41"})
        if path == "/containers/json":
            wanted = json.loads(parse_qs(request.url.query.decode())["filters"][0])["label"]
            rows = [
                {"Id": c["Id"], "Names": [c["Name"]], "Labels": c["Config"]["Labels"]}
                for c in self.containers.values()
                if all(
                    c["Config"]["Labels"].get(k) == v
                    for k, _, v in (w.partition("=") for w in wanted)
                )
            ]
            return httpx.Response(200, json=rows)
        if path == "/containers/create":
            return self.create(request)
        if parts[0] == "networks":
            return httpx.Response(200)
        container = self.containers.get(parts[1]) if len(parts) > 1 else None
        if container is None:
            return httpx.Response(404, json={"message": f"No such container: {parts[1]}"})
        state = container["State"]
        match (method, parts[-1]):
            case ("GET", "json"):
                return httpx.Response(200, json=container)
            case ("POST", "start"):
                state.update(Status="running", Running=True)
            case ("POST", "stop"):
                state.update(Status="exited", Running=False, ExitCode=0)
            case ("DELETE", _):
                del self.containers[container["Id"]]
        return httpx.Response(204)

    def create(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        container_id = uuid.uuid4().hex * 2
        networks = body.pop("NetworkingConfig")["EndpointsConfig"]
        self.containers[container_id] = {
            "Id": container_id,
            "Name": "/" + parse_qs(request.url.query.decode())["name"][0],
            "Config": {k: v for k, v in body.items() if k != "HostConfig"},
            "HostConfig": body["HostConfig"],
            "State": {"Status": "created", "Running": False, "ExitCode": 0},
            "NetworkSettings": {"Networks": networks},
        }
        return httpx.Response(201, json={"Id": container_id, "Warnings": []})

    def of(self, instance_id: str) -> dict[str, Any]:
        """The container that runs `instance_id`."""
        (found,) = (
            c for c in self.containers.values() if instance_id_of(c["Config"]["Cmd"]) == instance_id
        )
        return found

    def running(self) -> list[str]:
        return sorted(
            instance_id_of(c["Config"]["Cmd"]) or ""
            for c in self.containers.values()
            if c["State"]["Status"] == "running"
            and "YB_NATS__USER=kvstore" not in c["Config"]["Env"]
        )


def compose_project() -> RecordedDocker:
    return RecordedDocker(
        [
            RECORDED,
            container_like(RECORDED, "prefill-1", "prefill"),
            container_like(RECORDED, "decode-0", "decode"),
            container_like(RECORDED, "kvstore-0", "kvstore"),
        ]
    )


def planned(
    at: float, action: Literal["add", "drain", "move"], role: ev.PoolRole, instance_id: str = ""
) -> PlannedAction:
    return PlannedAction(at, 0, ev.PoolAction(action=action, role=role, instance_id=instance_id))


async def actuator_on(
    docker: RecordedDocker,
    max_instances: int,
    announced: tuple[str, ...] = ("prefill-0", "prefill-1", "decode-0"),
) -> tuple[ComposeActuator, PoolBook, list[str]]:
    """An actuator on `docker`'s project, its book, and what it said; the engines
    `announced` have announced themselves."""
    said: list[str] = []
    actuator = ComposeActuator(docker.api(), ActuatorSettings(PROJECT, max_instances), said.append)
    book = await actuator.prepare()
    for instance_id in announced:
        await actuator.handle(book, Announced(instance_id, book.engines[instance_id]))
    return actuator, book, said


async def drained(actuator: ComposeActuator) -> None:
    """Wait for the drains in flight, then hand the actuator what they reported."""
    await asyncio.wait_for(asyncio.gather(*actuator._drains.values()), 5.0)
    assert actuator.book is not None
    while not actuator._inbox.empty():
        item = actuator._inbox.get_nowait()
        assert isinstance(item, Gone)
        await actuator.handle(actuator.book, item)


async def test_an_add_creates_a_clone_and_a_drain_stops_and_removes_it() -> None:
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, max_instances=4)
    assert sorted(book.engines) == ["decode-0", "prefill-0", "prefill-1"]
    await actuator.handle(book, planned(100.0, "add", "prefill"))
    assert docker.running() == ["decode-0", "prefill-0", "prefill-1", "prefill-2"]
    created = [c for c in docker.calls if c.startswith("POST /containers/create")]
    assert created == [f"POST /containers/create?name={PROJECT}_prefill-2"]
    assert any(f"started prefill-2 (container {PROJECT}_prefill-2" in line for line in said)
    # At the cap, the next add waits for room.
    await actuator.handle(book, planned(101.0, "add", "decode"))
    assert "waiting" in said[-1] and len(docker.running()) == 4
    # The drain: stopped with the container's grace, then removed; the wait gets room.
    await actuator.handle(book, planned(102.0, "drain", "prefill", "prefill-2"))
    await drained(actuator)
    stop = next(c for c in docker.calls if "/stop" in c)
    assert stop.endswith(f"?t={RECORDED['Config']['StopTimeout']}")
    assert any(c.startswith("DELETE /containers/") for c in docker.calls)
    assert any("prefill-2 drained: exited with code 0" in line for line in said)
    assert docker.running() == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert sorted(book.engines) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]


async def test_a_move_drains_then_starts_in_the_other_role() -> None:
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, max_instances=3)
    # As if compose had made prefill-1's container after the actuator started: found
    # by the instance id in its command.
    del actuator._containers["prefill-1"]
    await actuator.handle(book, planned(100.0, "move", "decode", "prefill-1"))
    assert not any(c.startswith("POST /containers/create") for c in docker.calls)
    await drained(actuator)
    assert docker.running() == ["decode-0", "decode-1", "prefill-0"]
    decode = docker.of("decode-1")
    # Cloned from the decode container, as the next container of its service.
    assert decode["Config"]["Labels"][SERVICE_LABEL] == "decode-0"
    assert decode["Config"]["Labels"][NUMBER_LABEL] == "2"
    assert "YB_DECODE__UCX_HOST=decode-1" in decode["Config"]["Env"]
    assert any("planner: move prefill-1 decode -> started decode-1" in line for line in said)


async def test_a_failed_create_is_reported_skipped_and_frees_its_slot() -> None:
    docker = compose_project()
    docker.fail["create"] = (404, "No such image: yuebing-prefill:latest")
    actuator, book, said = await actuator_on(docker, max_instances=4)
    await actuator.handle(book, planned(100.0, "add", "prefill"))
    assert said[-1] == (
        f"planner: add prefill -> skipped: prefill-2: create container {PROJECT}_prefill-2: "
        "Docker answered 404: No such image: yuebing-prefill:latest"
    )
    assert "prefill-2" not in book.engines and len(docker.running()) == 3
    # The slot is free: the next add starts, under a new id.
    del docker.fail["create"]
    await actuator.handle(book, planned(130.0, "add", "prefill"))
    assert docker.running() == ["decode-0", "prefill-0", "prefill-1", "prefill-3"]


async def test_a_failed_stop_keeps_the_slot_of_a_container_still_running() -> None:
    docker = compose_project()
    docker.fail["stop"] = (500, "cannot kill container: permission denied")
    actuator, book, said = await actuator_on(docker, max_instances=3)
    await actuator.handle(book, planned(100.0, "move", "decode", "prefill-1"))
    await drained(actuator)
    assert said[-1].startswith("planner: move prefill-1 to decode -> failed: stop container ")
    assert said[-1].endswith(
        "Docker answered 500: cannot kill container: permission denied; its slot stays taken"
    )
    assert "prefill-1" in book.engines and len(docker.running()) == 3
    # A drain of an instance no container runs is said, and changes nothing.
    await actuator.handle(book, planned(101.0, "drain", "prefill", "prefill-9"))
    assert "not an engine" in said[-1]


# --- reconciling with what Docker runs ------------------------------------------------


async def test_a_container_removed_by_hand_frees_its_slot_at_the_second_check() -> None:
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, max_instances=3)
    await actuator.handle(book, planned(100.0, "add", "prefill"))
    assert "waiting" in said[-1]
    # decode-0's container is removed outside the planner.
    del docker.containers[docker.of("decode-0")["Id"]]
    await actuator.reconcile(book)
    assert "decode-0" in book.engines, "one check is not enough: it may be restarting"
    assert docker.running() == ["prefill-0", "prefill-1"]
    await actuator.reconcile(book)
    assert "decode-0" not in book.engines
    assert any("decode-0 has had no running container at two checks" in line for line in said)
    # The waiting add takes the freed slot.
    assert docker.running() == ["prefill-0", "prefill-1", "prefill-2"]
    assert "started prefill-2" in said[-1]


async def test_a_start_claimed_by_a_container_stopped_by_hand_is_made_when_it_is_gone() -> None:
    """decode-0 stopped by hand: its `InstanceDown` makes it an engine on its way (it
    may be restarting), which an add of its role waits for; once the checks find it
    gone, the add starts its own container."""
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, max_instances=4)
    decode = docker.of("decode-0")
    decode["State"] = {**decode["State"], "Status": "exited", "Running": False}
    await actuator.handle(book, WentDown("decode-0"))
    await actuator.handle(book, planned(time.time(), "add", "decode"))
    assert "no new container: decode-0 on its way" in said[-1]
    await actuator.reconcile(book)
    await actuator.reconcile(book)
    assert "add (decode-0 gone) decode -> started decode-1" in said[-1]
    assert docker.running() == ["decode-1", "prefill-0", "prefill-1"]


async def test_a_container_back_before_the_second_check_keeps_its_slot() -> None:
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, max_instances=3)
    decode = docker.of("decode-0")
    decode["State"] = {**decode["State"], "Status": "exited", "Running": False}
    await actuator.reconcile(book)
    decode["State"] = {**decode["State"], "Status": "running", "Running": True}
    await actuator.reconcile(book)
    await actuator.reconcile(book)
    assert "decode-0" in book.engines
    assert not any("no running container" in line for line in said)


async def test_an_engine_started_outside_the_planner_is_adopted_and_counted() -> None:
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, max_instances=4)
    # As `docker compose up --scale` or a hand would: a decode container the actuator
    # did not make.
    extra = container_like(RECORDED, "decode-5", "decode")
    docker.containers[extra["Id"]] = extra
    await actuator.reconcile(book)
    assert book.engines["decode-5"] == "decode"
    assert said[-1] == (
        f"planner: found decode-5 (container {PROJECT}_decode-5_1), not started by the "
        "planner: it counts against the cap"
    )
    # It took the last slot: an add waits, and a later decode id counts on past it.
    await actuator.handle(book, planned(100.0, "add", "prefill"))
    assert "waiting" in said[-1] and len(docker.running()) == 4
    await actuator.handle(book, planned(101.0, "drain", "decode", "decode-5"))
    await drained(actuator)
    assert docker.running() == ["decode-0", "prefill-0", "prefill-1", "prefill-2"]
    await actuator.handle(book, planned(102.0, "move", "decode", "prefill-2"))
    await drained(actuator)
    assert docker.running() == ["decode-0", "decode-6", "prefill-0", "prefill-1"]
    # Adopted over the cap: said, and nothing starts until the pools are back under it.
    for instance_id in ("decode-7", "decode-8"):
        extra = container_like(RECORDED, instance_id, "decode")
        docker.containers[extra["Id"]] = extra
    await actuator.reconcile(book)
    assert said[-1].endswith("it counts against the cap, 2 over it")
    await actuator.handle(book, planned(103.0, "add", "prefill"))
    assert "waiting" in said[-1] and len(docker.running()) == 6


async def test_an_id_the_log_named_is_not_used_again() -> None:
    """An actuator restarted after it drained prefill-2 finds no container of it, but
    the log's `InstanceUp` names it: the next prefill is prefill-3."""
    docker = compose_project()
    actuator, book, _ = await actuator_on(docker, max_instances=4)
    await actuator.handle(book, Announced("prefill-2", "prefill"))
    await actuator.handle(book, WentDown("prefill-2"))
    await actuator.handle(book, WentDown("decode-4"))  # down before the restart
    await actuator.handle(book, planned(100.0, "add", "prefill"))
    assert docker.running() == ["decode-0", "prefill-0", "prefill-1", "prefill-3"]
    await actuator.handle(book, planned(101.0, "move", "decode", "prefill-3"))
    await drained(actuator)
    assert docker.running() == ["decode-0", "decode-5", "prefill-0", "prefill-1"]


# --- what was decided before it started -----------------------------------------------


async def test_what_was_decided_before_it_started_is_carried_out_once_caught_up() -> None:
    """An actuator restarted after the planner decided a drain and an add that no
    actuator carried out (and an add that one did: prefill-1 came up after it)."""
    docker = compose_project()
    actuator, book, said = await actuator_on(docker, 4, announced=("prefill-0", "decode-0"))
    before = time.time() - 60.0
    history = [
        Missed(planned(before, "add", "prefill")),
        Announced("prefill-1", "prefill"),
        Missed(planned(before + 10.0, "drain", "prefill", "prefill-0")),
        Missed(planned(before + 11.0, "add", "decode")),
    ]
    for item in history:
        await actuator.handle(book, item)
    assert docker.running() == ["decode-0", "prefill-0", "prefill-1"], "nothing before"
    await actuator.handle(book, CaughtUp())
    await drained(actuator)
    assert docker.running() == ["decode-0", "decode-1", "prefill-1"]
    assert any("caught up with the log" in line for line in said)
    assert any("catch-up start decode -> started decode-1" in line for line in said)
    assert any("prefill-0 drained: exited with code 0" in line for line in said)


async def test_the_log_is_read_from_its_start_and_caught_up_once(nats_config: NatsConfig) -> None:
    """`follow_pool_log` on a real nats-server: the decisions made before `since` come
    as `Missed`, then `CaughtUp` once, then what is decided after."""
    since = time.time()
    add = ev.PoolAction(action="add", role="decode")
    drain = ev.PoolAction(action="drain", role="prefill", instance_id="prefill-1")
    got: list[ActuatorItem] = []
    bus = await Bus.connect(nats_config, "test")
    try:
        await bus.ensure_stream()
        await bus.publish(_up("prefill-1", "prefill", since - 90.0))
        await bus.publish(_planned(since - 60.0, add, drain))
        await bus.publish(ev.InstanceDown(instance_id="prefill-1", time=since - 50.0))
        async with _following(bus, since, got):
            await _until(lambda: CaughtUp() in got)
            await bus.publish(_planned(since + 1.0, add))
            await _until(lambda: len(got) == 6)
    finally:
        await bus.close()
    assert got == [
        Announced("prefill-1", "prefill"),
        Missed(PlannedAction(since - 60.0, 0, add)),
        Missed(PlannedAction(since - 60.0, 1, drain)),
        WentDown("prefill-1"),
        CaughtUp(),
        PlannedAction(since + 1.0, 0, add),
    ]


async def test_a_decision_after_its_start_ends_the_history_at_once(
    nats_config: NatsConfig,
) -> None:
    """The history is over at the first decision made after `since`, however many
    events the reader still has behind it."""
    since = time.time()
    add = ev.PoolAction(action="add", role="decode")
    got: list[ActuatorItem] = []
    bus = await Bus.connect(nats_config, "test")
    try:
        await bus.ensure_stream()
        await bus.publish(_planned(since - 60.0, add))
        await bus.publish(_planned(since + 1.0, add))
        await bus.publish(_up("decode-3", "decode", since + 2.0))
        async with _following(bus, since, got):
            await _until(lambda: len(got) == 4)
    finally:
        await bus.close()
    assert got == [
        Missed(PlannedAction(since - 60.0, 0, add)),
        CaughtUp(),
        PlannedAction(since + 1.0, 0, add),
        Announced("decode-3", "decode"),
    ]


def _planned(at: float, *actions: ev.PoolAction) -> ev.PoolPlanned:
    return ev.PoolPlanned(
        time=at, planner_id="conductor-0", forecast=ev.PoolForecast(), pools=[], actions=[*actions]
    )


def _up(instance_id: str, role: ev.Role, at: float) -> ev.InstanceUp:
    return ev.InstanceUp(instance_id=instance_id, role=role, host="host-0", time=at)


@contextlib.asynccontextmanager
async def _following(bus: Bus, since: float, got: list[ActuatorItem]) -> AsyncIterator[None]:
    """`follow_pool_log` into `got` while the block runs."""
    reader = asyncio.create_task(follow_pool_log(bus, since, got.append))
    try:
        yield
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
