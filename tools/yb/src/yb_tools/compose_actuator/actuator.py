"""Carries out the planner's actions on a compose project's engine containers.

The decisions are `PoolBook`'s (`yb_tools.cli.elastic`), the same bookkeeping as
`yb up --elastic`: never more than `max_instances` engine containers, starting and
draining ones included; ids never reused; a start claimed by an engine on its way;
a drain's slot free only once its container is gone. This module applies its steps
to containers through the Docker Engine API:

- `add` (`StartEngine`): a clone of a container of that role (`clone.clone_request`),
  created and started;
- `drain` (`DrainEngine`): `stop` with the container's stop grace (SIGTERM: the engine
  publishes `InstanceDraining`, finishes or hands off its work, exits), then the
  exited container is removed and its slot freed; a `move` starts its instance in
  the other role then.

Everything it does or cannot do is said on stdout, one line each (`planner: ...`):
an action that cannot be carried out is reported as skipped, with Docker's reason.

The log is read as `ClusterWatcher.pool_log` reads it for `yb up` (the same subjects,
`cluster_watch.POOL_LOG`, and the same items), by an asyncio task of this process
rather than the launcher's thread, from the log's start, so that an actuator
restarted beside a running cluster knows which engines are up and which ids were
used (a new id counts on past every one the log named). An action decided before it
started is counted as the planner counts it (`PoolBook.missed`); once the history is
read (`CaughtUp`), what the planner still counts on is carried out
(`PoolBook.catch_up`): a drain of an engine that still runs and has not gone down
since, and each start the planner expects that no instance up or on its way fills.
So a restart of the actuator (or one that was down) neither repeats what was done
nor leaves the planner waiting for what was not.

Every `RECONCILE_S` it compares its book with the containers Docker lists for the
project (`reconcile`): an engine container it did not start (`docker compose up`
again, `--scale`, by hand) is adopted and counts against the cap; an engine of the
book that no live container runs at two checks in a row (removed, or stopped, by
hand) frees its slot, and a start it was to fill (one that went down is on its way,
as if restarting) is made. Two checks, so that a container between Docker's
restarts is not taken for gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors

from yb_core import events as ev
from yb_core.bus import Bus, BusError
from yb_core.config import NatsConfig
from yb_tools.cli.cluster_watch import POOL_LOG, Announced, PlannedAction, PoolLogItem, WentDown
from yb_tools.cli.elastic import (
    Claimed,
    DrainEngine,
    PoolBook,
    Skipped,
    StartEngine,
    Step,
    Waiting,
    no_start_line,
)
from yb_tools.compose_actuator.clone import (
    ADDED_BY_LABEL,
    INSTANCE_LABEL,
    PROJECT_LABEL,
    SERVICE_LABEL,
    Engine,
    NotAnEngine,
    clone_request,
    engine_of,
    env_value,
)
from yb_tools.compose_actuator.docker_api import ContainerInspect, DockerApi, DockerError

#: How often the main loop wakes without news (to check its reader, mark itself alive).
TICK_S = 1.0
#: How often the book is compared with the containers Docker runs (`reconcile`).
RECONCILE_S = 10.0
#: Containers Docker lists as these still hold a slot.
LIVE_STATES = ("created", "running", "restarting", "paused")


@dataclass(frozen=True, slots=True)
class Gone:
    """A drained engine's container is gone (or given up on): its slot is free."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class Missed:
    """An action of a `PoolPlanned` made before the actuator started."""

    planned: PlannedAction


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The log's history is read: what comes next was decided while it runs."""


ActuatorItem = PoolLogItem | Missed | CaughtUp | Gone


@dataclass(frozen=True, slots=True)
class ActuatorSettings:
    """`project`: the compose project; `max_instances`: the most engine containers at
    once; `start_timeout_s`: the planner's `planner_start_timeout_s`;
    `drain_grace_s`: the stop grace of a container that sets none (compose's
    `stop_grace_period` sets `StopTimeout`); `alive_file`: touched while it follows
    the log (the container's health check reads its age)."""

    project: str
    max_instances: int
    start_timeout_s: float = 600.0
    drain_grace_s: int = 30
    alive_file: Path | None = None


@dataclass(frozen=True, slots=True)
class ProjectView:
    """The project's containers as the actuator starts: its engines (with their
    inspections), a template per role, and the logical hosts of its kvstores."""

    engines: dict[str, tuple[Engine, ContainerInspect]]
    templates: dict[ev.PoolRole, ContainerInspect]
    kvstore_hosts: list[str]


async def view_project(docker: DockerApi, project: str) -> ProjectView:
    """Inspect every container of `project`. The template of a role is the engine of
    the compose file (not one the actuator added) with the lowest instance id."""
    engines: dict[str, tuple[Engine, ContainerInspect]] = {}
    hosts: set[str] = set()
    for summary in await docker.containers({PROJECT_LABEL: project}):
        info = await docker.inspect(summary.id)
        if env_value(info.config.env, "YB_NATS__USER") == "kvstore":
            hosts.add(env_value(info.config.env, "YB_HOST") or "")
        try:
            engine = engine_of(info)
        except NotAnEngine:
            continue
        if engine.status in LIVE_STATES:
            engines[engine.instance_id] = (engine, info)
    templates: dict[ev.PoolRole, ContainerInspect] = {}
    for instance_id in sorted(engines, key=_id_order):
        engine, info = engines[instance_id]
        if ADDED_BY_LABEL not in info.labels:
            templates.setdefault(engine.role, info)
    return ProjectView(engines, templates, sorted(h for h in hosts if h))


def _id_order(instance_id: str) -> tuple[str, int]:
    stem, _, number = instance_id.rpartition("-")
    return (stem, int(number) if number.isdigit() else -1)


def logical_host(hosts: list[str], index: int, fallback: str) -> str:
    """Engine `<role>-<index>`'s logical host: beside kvstore `index` mod (kvstores),
    as `yb up` places a prefill; the template's host where there is no kvstore."""
    return hosts[index % len(hosts)] if hosts else fallback


async def follow_pool_log(bus: Bus, since: float, put: Callable[[ActuatorItem], None]) -> None:
    """Hand every `InstanceUp` of an engine and every `InstanceDown`, and every action
    of each `PoolPlanned`, from the log's start, to `put`, in log order: an action
    decided before `since` (wall clock) as `Missed`. `CaughtUp` once, when the
    history is read: after the first event the reader had no more behind, or before
    the first action decided at or after `since`. Runs until cancelled."""
    reader = None
    while reader is None:
        try:
            reader = await bus.read_ordered(POOL_LOG)
        except (BusError, nats.js.errors.NotFoundError):
            await asyncio.sleep(TICK_S)  # no service has created the log yet
    caught_up = False
    try:
        while True:
            item = await reader.next(timeout_s=TICK_S)
            if item is None:
                continue
            match item.event:
                case ev.PoolPlanned(actions=actions) as planned:
                    live = planned.time >= since
                    if live and not caught_up:
                        caught_up = True
                        put(CaughtUp())
                    for index, action in enumerate(actions):
                        decided = PlannedAction(planned.time, index, action)
                        put(decided if live else Missed(decided))
                case ev.InstanceUp(role="prefill" | "decode" as role) as up:
                    put(Announced(up.instance_id, role))
                case ev.InstanceDown() as down:
                    put(WentDown(down.instance_id))
                case _:
                    pass
            if item.pending == 0 and not caught_up:
                caught_up = True
                put(CaughtUp())
    finally:
        await reader.close()


class ComposeActuator:
    """Applies `PoolBook`'s steps to the engine containers of one compose project
    (module docstring). `run()` until cancelled; it owns every task it starts (the
    log reader, the drains) and cancels and awaits them when it ends."""

    def __init__(
        self,
        docker: DockerApi,
        settings: ActuatorSettings,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.docker = docker
        self.settings = settings
        self.say = say
        self.clock = clock
        self.book: PoolBook | None = None
        self._view: ProjectView | None = None
        self._inbox: asyncio.Queue[ActuatorItem] = asyncio.Queue()
        self._containers: dict[str, str] = {}  # instance id -> container id
        self._started: dict[str, float] = {}  # instance id -> monotonic, until it is up
        self._drains: dict[str, asyncio.Task[None]] = {}
        # Engines of the book that no live container ran at the last `reconcile`.
        self._missing: set[str] = set()

    async def prepare(self) -> PoolBook:
        """Read the project's containers and open the book with its engines."""
        version = await self.docker.version()
        view = await view_project(self.docker, self.settings.project)
        self._view = view
        self._containers = {i: engine.container_id for i, (engine, _) in view.engines.items()}
        engines = {i: engine.role for i, (engine, _) in view.engines.items()}
        for role in ("prefill", "decode"):
            if role not in view.templates:
                self.say(f"planner: no {role} container in project {self.settings.project}")
        self.book = PoolBook(self.settings.max_instances, engines, self.settings.start_timeout_s)
        listed = ", ".join(sorted(engines, key=_id_order)) or "none"
        self.say(
            f"planner-actuator: project {self.settings.project} (Docker API {version}), "
            f"engines {listed}, at most {self.settings.max_instances}"
        )
        return self.book

    async def run(self, nats: NatsConfig) -> None:
        """Follow the planner and carry out its actions until cancelled; raises what
        ends the log reader (the container restarts then)."""
        book = self.book or await self.prepare()
        since = time.time()
        bus = await Bus.connect(nats, "planner-actuator")
        reader = asyncio.create_task(
            follow_pool_log(bus, since, self._inbox.put_nowait), name="actuator-pool-log"
        )
        next_check = self.clock() + RECONCILE_S
        try:
            while True:
                if reader.done():
                    reader.result()  # re-raises what ended it
                    raise RuntimeError("the pool log's reader ended")
                self._mark_alive(bus)
                if self.clock() >= next_check:
                    next_check = self.clock() + RECONCILE_S
                    try:
                        await self.reconcile(book)
                    except DockerError as exc:
                        self.say(f"planner: could not compare the book with Docker: {exc}")
                try:
                    item = await asyncio.wait_for(self._inbox.get(), TICK_S)
                except TimeoutError:
                    continue
                await self.handle(book, item)
        finally:
            pending = [reader, *self._drains.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await bus.close()

    async def handle(self, book: PoolBook, item: ActuatorItem) -> None:
        """One item of the log (or a finished drain): the book's steps, carried out."""
        match item:
            case Missed(planned=planned):
                book.missed(planned)
            case CaughtUp():
                steps = book.catch_up(time.time())
                if steps:
                    self.say(
                        "planner: caught up with the log; carrying out what the planner "
                        "decided before the actuator started and still counts on"
                    )
                await self.carry(steps)
            case Announced(instance_id=instance_id):
                started = self._started.pop(instance_id, None)
                if started is not None:
                    self.say(
                        f"planner: {instance_id} is up {self.clock() - started:.1f}s after "
                        "it was created"
                    )
                await self.carry(book.announced(item))
            case WentDown():
                await self.carry(book.went_down(item))
            case PlannedAction(action=action):
                target = f" {action.instance_id}" if action.instance_id else ""
                self.say(f"planner: decided {action.action}{target} ({action.role})")
                await self.carry(book.apply(item))
            case Gone(instance_id=instance_id):
                await self.carry(book.gone(instance_id))

    async def reconcile(self, book: PoolBook) -> None:
        """Compare the book with the project's live engine containers (module
        docstring). Draining engines are their drains' to settle."""
        view = await view_project(self.docker, self.settings.project)
        for instance_id, (engine, _) in sorted(view.engines.items()):
            if instance_id in book.draining:
                continue
            self._containers[instance_id] = engine.container_id  # recreated by compose
            if instance_id in book.engines:
                continue
            book.adopt(instance_id, engine.role)
            over = len(book.engines) - book.max_instances
            self.say(
                f"planner: found {instance_id} (container {engine.name}), not started by "
                "the planner: it counts against the cap" + (f", {over} over it" if over > 0 else "")
            )
        missing = {i for i in book.engines if i not in view.engines and i not in book.draining}
        for instance_id in sorted(missing & self._missing):
            self.say(
                f"planner: {instance_id} has had no running container at two checks "
                f"{RECONCILE_S:g}s apart (removed or stopped outside the planner): its slot "
                "is free"
            )
            self._containers.pop(instance_id, None)
            self._started.pop(instance_id, None)
            await self.carry(book.gone(instance_id, refill=True))
        self._missing = missing - self._missing

    async def carry(self, steps: list[Step]) -> None:
        for step in steps:
            match step:
                case StartEngine():
                    await self._start(step)
                case DrainEngine():
                    self._drain(step)
                case Claimed() | Waiting() | Skipped():
                    self.say(no_start_line(step, self.settings.max_instances, "container"))

    async def _start(self, step: StartEngine) -> None:
        assert self.book is not None and self._view is not None
        try:
            template = await self._template(step.role)
            number = await self._next_number(template)
            fallback = env_value(template.config.env, "YB_HOST") or ""
            host = logical_host(self._view.kvstore_hosts, step.index, fallback)
            request = clone_request(
                template, instance_id=step.instance_id, number=number, host=host
            )
            container_id = await self.docker.create(request)
            self._containers[step.instance_id] = container_id
            await self.docker.start(container_id)
        except (DockerError, NotAnEngine) as exc:
            self.say(f"planner: {step.why} {step.role} -> skipped: {step.instance_id}: {exc}")
            # Its slot was never taken by a running container.
            with contextlib.suppress(DockerError):
                if step.instance_id in self._containers:
                    await self.docker.remove(self._containers.pop(step.instance_id))
            await self.carry(self.book.gone(step.instance_id))
            return
        self._started[step.instance_id] = self.clock()
        self.say(
            f"planner: {step.why} {step.role} -> started {step.instance_id} "
            f"(container {request.name}, {host}, cloned from {template.name.lstrip('/')})"
        )

    async def _template(self, role: ev.PoolRole) -> ContainerInspect:
        """The role's template as it is now (as it was when last seen, once gone)."""
        assert self._view is not None
        cached = self._view.templates.get(role)
        if cached is None:
            raise NotAnEngine(f"no {role} container in project {self.settings.project} to clone")
        try:
            fresh = await self.docker.inspect(cached.id)
        except DockerError as exc:
            if exc.status != 404:
                raise
            return cached
        self._view.templates[role] = fresh
        return fresh

    async def _next_number(self, template: ContainerInspect) -> int:
        """The next container number of the template's compose service."""
        service = template.labels.get(SERVICE_LABEL, "")
        labels = {PROJECT_LABEL: self.settings.project, SERVICE_LABEL: service}
        numbers = [
            int(n)
            for c in await self.docker.containers(labels)
            if (n := c.labels.get("com.docker.compose.container-number", "")).isdigit()
        ]
        return max(numbers, default=0) + 1

    def _drain(self, step: DrainEngine) -> None:
        task = asyncio.create_task(self._stop_and_remove(step), name=f"drain-{step.instance_id}")
        self._drains[step.instance_id] = task
        task.add_done_callback(lambda _: self._drains.pop(step.instance_id, None))

    async def _container_of(self, instance_id: str) -> str | None:
        known = self._containers.get(instance_id)
        if known is not None:
            return known
        labels = {PROJECT_LABEL: self.settings.project, INSTANCE_LABEL: instance_id}
        found = await self.docker.containers(labels)
        if found:
            return found[0].id
        # One compose made since the actuator started (`up` run again): by its command.
        view = await view_project(self.docker, self.settings.project)
        engine = view.engines.get(instance_id)
        return engine[0].container_id if engine is not None else None

    async def _stop_and_remove(self, step: DrainEngine) -> None:
        """Stop (drain) and remove one engine's container, then free its slot. A
        container still running after a failed stop keeps its slot (never more than
        the cap), and the failure is reported."""
        instance_id = step.instance_id
        verb = f"move {instance_id} to {step.then}" if step.then else f"drain {instance_id}"
        started = self.clock()
        try:
            container = await self._container_of(instance_id)
            if container is None:
                self.say(f"planner: {verb} -> no container runs it; its slot is free")
                self._inbox.put_nowait(Gone(instance_id))
                return
            info = await self.docker.inspect(container)
            grace = info.config.stop_timeout or self.settings.drain_grace_s
            then = f"; a {step.then} instance starts once it is gone" if step.then else ""
            self.say(
                f"planner: {verb} -> stopping {info.name.lstrip('/')} (SIGTERM, up to "
                f"{grace}s to drain{then})"
            )
            await self.docker.stop(container, grace)
            exited = await self.docker.inspect(container)
            await self.docker.remove(container)
        except DockerError as exc:
            if exc.status == 404:
                self.say(f"planner: {verb} -> its container is gone already ({exc})")
                self._inbox.put_nowait(Gone(instance_id))
                return
            still = await self._still_running(instance_id)
            slot = "its slot stays taken" if still else "its slot is free"
            self.say(f"planner: {verb} -> failed: {exc}; {slot}")
            if not still:
                self._inbox.put_nowait(Gone(instance_id))
            return
        self._containers.pop(instance_id, None)
        self.say(
            f"planner: {instance_id} drained: exited with code {exited.state.exit_code} after "
            f"{self.clock() - started:.1f}s; container removed"
        )
        self._inbox.put_nowait(Gone(instance_id))

    async def _still_running(self, instance_id: str) -> bool:
        container = self._containers.get(instance_id)
        if container is None:
            return False
        try:
            info = await self.docker.inspect(container)
        except DockerError as exc:
            return exc.status != 404  # unknown: keep the slot taken
        return info.state.status in LIVE_STATES

    def _mark_alive(self, bus: Bus) -> None:
        path = self.settings.alive_file
        if path is not None and bus.connected:
            path.touch()
