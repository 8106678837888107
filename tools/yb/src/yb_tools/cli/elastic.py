"""`yb up --elastic`: the launcher carries out the planner's decisions.

With `--elastic --max-instances N`, `yb up` starts the `--prefill`/`--decode` split,
turns the conductor's planner on (`conductor.planner`, `planner_max_instances` N) and
carries out every action of each `PoolPlanned` made from then on (the launcher's
`ClusterWatcher` reads them from the log and hands each over once):

- `add`: a new engine process of that role, under an id never used before in this run
  (`prefill-<k>`, `decode-<k>`), on the host the topology would give it (a prefill
  beside a kvstore), supervised like the others (a crash is restarted);
- `drain`: the instance leaves the supervisor's care first (its exit is not a crash),
  then gets SIGTERM: it publishes `InstanceDraining`, finishes what it holds within
  `engine.drain_timeout_s`, hands off the rest and exits. It is reaped when it exits,
  and killed if it still runs `DRAIN_MARGIN_S` after its drain timeout;
- `move`: a drain, then, once that process has exited, a new instance in the other
  role.

The launcher never runs more than N engine processes, starting and draining ones
included. It counts the instances on their way as the planner counts them, from
the same log (an add or a move counts as starting until an instance of its role
comes up that was not up before, or `planner_start_timeout_s` passes), and starts a
process only for a start the planner still expects that no instance on its way
fills:

- An engine the cluster started with that had not announced itself when the
  planner decided (the first decision can come before the engines are up), or one
  being restarted after a crash, is on its way: an add of its role takes it, no
  process starts, and the planner counts its announcement against that add.
- An add that finds no room (a drained process is down for the planner before it
  has exited) waits for a slot, until an announcement fills it or it expires as
  the planner's does.

The bookkeeping (`PoolBook`) is pure and tested without processes; `ElasticPools`
applies it to the cluster at each tick of `yb up`'s main loop.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from yb_core import events as ev
from yb_tools.cli.cluster_watch import Announced, PlannedAction, WentDown
from yb_tools.cli.supervision import Supervisor, describe_exit

if TYPE_CHECKING:
    from yb_tools.cli.launcher import Cluster, Topology

#: How long a drained engine may take beyond its `drain_timeout_s` to stop (the steps
#: after the drain: handing off, closing) before it is killed.
DRAIN_MARGIN_S = 10.0


def refusal(
    *,
    elastic: bool,
    max_instances: int | None,
    engines: int,
    prefill_groups: Sequence[int],
    gpus: Sequence[int] | None,
) -> str | None:
    """Why `yb up`'s elastic flags cannot be used as given (None: they can). `engines`
    is the initial prefill and decode instances."""
    if not elastic:
        return "--max-instances needs --elastic" if max_instances is not None else None
    if max_instances is None:
        return "--elastic needs --max-instances N (the most engine instances at once)"
    if max_instances < engines:
        return (
            f"--max-instances {max_instances} is below the {engines} engine instances it "
            "starts with (--prefill + --decode)"
        )
    if max_instances < 2:
        return f"--max-instances {max_instances}: at least 2 (a prefill and a decode)"
    if prefill_groups:
        return "--prefill-groups is not supported with --elastic yet"
    if gpus is not None:
        return "--gpus is not supported with --elastic yet"
    return None


def engine_host(topology: Topology, role: ev.PoolRole, index: int) -> str:
    """The host of engine `<role>-<index>`, as the topology would place it: prefill k
    beside kvstore k mod (kvstores), decode k over the topology's hosts."""
    if role == "prefill":
        return f"host-{index % max(1, topology.kvstore)}"
    return f"host-{index % max(topology.prefill, topology.kvstore, 1)}"


@dataclass(frozen=True, slots=True)
class StartEngine:
    """Start engine `instance_id` in `role`; `why`: "add", or "move <instance>"."""

    role: ev.PoolRole
    instance_id: str
    index: int
    why: str


@dataclass(frozen=True, slots=True)
class DrainEngine:
    """Drain engine `instance_id`; `then`: the role it comes back in (a move), if any."""

    instance_id: str
    then: ev.PoolRole | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """No process for this start of `role`: `on_way`, instances of the role that are
    not up yet (started with the cluster, or restarting), fill it when they come up."""

    role: ev.PoolRole
    on_way: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """A start of `role` waiting for room (a process to exit)."""

    role: ev.PoolRole
    why: str


@dataclass(frozen=True, slots=True)
class Skipped:
    """An action not carried out (or a wait given up), and why."""

    reason: str


Step = StartEngine | DrainEngine | Claimed | Waiting | Skipped


class PoolBook:
    """What the actuator holds and may do: pure bookkeeping, no processes.

    `engines` are the engine processes the launcher holds (running, restarting or
    draining) by id, with their role; never more than `max_instances` (but for
    engines found running that it did not start: `adopt`). Ids are `<role>-<k>`, k
    counting on past the highest the cluster started with and the highest the log
    named, so none is ever used twice. Feed it the log in order (`announced`,
    `went_down`, `apply`: each planned action once, by its key); `gone` when a
    drained process has exited (or one was given up on). `expected` mirrors the
    planner's starting instances, so a process starts only for a start no instance
    on its way fills (module docstring). A drain's slot frees only at `gone`, and only
    then does a move start its instance in the other role. An actuator that reads the
    log's history (the compose actuator, restarted) feeds the actions decided before
    it started to `missed`, then calls `catch_up` once.
    """

    def __init__(
        self,
        max_instances: int,
        engines: Mapping[str, ev.PoolRole],
        start_timeout_s: float = 600.0,
    ) -> None:
        if len(engines) > max_instances:
            raise ValueError(f"{len(engines)} engines over the cap of {max_instances}")
        self.max_instances = max_instances
        self.start_timeout_s = start_timeout_s
        self.engines: dict[str, ev.PoolRole] = dict(engines)
        # Draining engines -> the role a move brings them back in (None: a drain).
        self.draining: dict[str, ev.PoolRole | None] = {}
        # The engines up as the log says, and the starts the planner counts (its
        # `starting`: role, decided at), as the planner keeps them.
        self.up: dict[str, ev.PoolRole] = {}
        self.expected: list[tuple[ev.PoolRole, float]] = []
        self.waiting: deque[Waiting] = deque()
        # Drains (and moves: the role they come back in) decided while no actuator
        # ran, that the planner still counts on: carried out at `catch_up`.
        self.missed_drains: dict[str, ev.PoolRole | None] = {}
        self._applied: set[tuple[float, int]] = set()
        self._next: dict[ev.PoolRole, int] = {"prefill": 0, "decode": 0}
        for instance_id in engines:
            self._reserve(instance_id)

    def _reserve(self, instance_id: str) -> None:
        """An id in use or used before (`<role>-<k>`): new ids count on past it."""
        stem, _, number = instance_id.rpartition("-")
        if stem in self._next and number.isdigit():
            role: ev.PoolRole = "prefill" if stem == "prefill" else "decode"
            self._next[role] = max(self._next[role], int(number) + 1)

    def adopt(self, instance_id: str, role: ev.PoolRole) -> None:
        """An engine found running that the book did not hold (started outside the
        planner): it counts against the cap from now on, and its id is never reused.
        It may take the book over the cap; nothing starts until it is back under."""
        self.engines[instance_id] = role
        self._reserve(instance_id)

    def on_way(self, role: ev.PoolRole) -> list[str]:
        """The engines of `role` the launcher holds that are not up (starting, or
        restarting) and not draining."""
        return [
            i
            for i, r in self.engines.items()
            if r == role and i not in self.up and i not in self.draining
        ]

    def short(self, role: ev.PoolRole) -> int:
        """Starts of `role` the planner expects that nothing fills yet: not an
        instance on its way, a start waiting for room, or a move's, which starts
        once its drain is over."""
        expected = sum(1 for r, _ in self.expected if r == role)
        waiting = sum(1 for w in self.waiting if w.role == role)
        moving = sum(1 for then in self.draining.values() if then == role)
        return expected - len(self.on_way(role)) - waiting - moving

    def announced(self, notice: Announced) -> list[Step]:
        """An engine's `InstanceUp`: one that was not up fills a start of its role."""
        if self.up.get(notice.instance_id) == notice.role:
            return []  # seen up already (the planner counts it once too)
        self._reserve(notice.instance_id)
        self.up[notice.instance_id] = notice.role
        for i, (role, _) in enumerate(self.expected):
            if role == notice.role:
                del self.expected[i]
                break
        return self._prune()

    def went_down(self, notice: WentDown) -> list[Step]:
        """An `InstanceDown`: an engine of the launcher's that is not draining is on its
        way again (being restarted)."""
        self._reserve(notice.instance_id)
        self.missed_drains.pop(notice.instance_id, None)  # the planner's drain is over
        if self.up.pop(notice.instance_id, None) is None:
            return []
        return self._prune()

    def apply(self, planned: PlannedAction) -> list[Step]:
        """The steps that carry out one planned action (none when it was applied
        already)."""
        if not self._count(planned):
            return []
        steps = self._prune()
        action = planned.action
        if action.action == "add":
            return steps + self._deliver(action.role, "add")
        then = action.role if action.action == "move" else None
        return steps + self._drain(action.instance_id, then, action.action)

    def missed(self, planned: PlannedAction) -> None:
        """An action decided while no actuator ran, read from the log's history: the
        book counts it as the planner does (its start as expected, its drain as
        outstanding until the instance goes down), and carries out nothing until
        `catch_up`, once the whole history is read."""
        if not self._count(planned):
            return
        action = planned.action
        if action.action in ("drain", "move"):
            self.missed_drains[action.instance_id] = (
                action.role if action.action == "move" else None
            )

    def catch_up(self, now: float) -> list[Step]:
        """The history is read (at `now`, the log's clock): carry out what the
        planner still counts on. A missed drain of an engine the book holds that has
        not gone down since; then each start the planner expects that nothing fills
        (an instance that came up, or is on its way, fills a start as it does for the
        planner; one decided over `start_timeout_s` ago is forgotten)."""
        horizon = now - self.start_timeout_s
        self.expected = [(r, at) for r, at in self.expected if at >= horizon]
        steps: list[Step] = self._prune()
        missed, self.missed_drains = self.missed_drains, {}
        for instance_id, then in missed.items():
            if instance_id in self.engines and instance_id not in self.draining:
                steps += self._drain(instance_id, then, "move" if then else "drain")
        for role in ("prefill", "decode"):
            while self.short(role) > 0:
                steps += self._deliver(role, "catch-up start")
        return steps

    def _count(self, planned: PlannedAction) -> bool:
        """Count a planned action once (False: counted already); an add or a move is
        a start the planner expects from then on."""
        if planned.key in self._applied:
            return False
        self._applied.add(planned.key)
        # The planner forgets starts older than its timeout when it plans.
        horizon = planned.time - self.start_timeout_s
        self.expected = [(r, at) for r, at in self.expected if at >= horizon]
        if planned.action.action in ("add", "move"):
            self.expected.append((planned.action.role, planned.time))
        return True

    def _drain(self, instance_id: str, then: ev.PoolRole | None, verb: str) -> list[Step]:
        if instance_id not in self.engines:
            return [Skipped(f"{verb} {instance_id}: not an engine this actuator runs; skipped")]
        if instance_id in self.draining:
            return [Skipped(f"{verb} {instance_id}: draining already; skipped")]
        self.draining[instance_id] = then
        return [DrainEngine(instance_id, then)]

    def gone(self, instance_id: str, refill: bool = False) -> list[Step]:
        """`instance_id`'s process has exited for good (drained, or given up on): its
        slot is free. A move starts its instance in the other role there; then
        waiting starts take what room is left. With `refill` (an engine removed
        outside the planner, not one that failed), the starts of its role that it
        was to fill, on its way, are made."""
        role = self.engines.pop(instance_id, None)
        if role is None:
            return []
        drained = instance_id in self.draining
        then = self.draining.pop(instance_id, None)
        steps: list[Step] = []
        if then is not None:
            steps += self._deliver(then, f"move {instance_id}")
        while self.waiting and len(self.engines) < self.max_instances:
            waiting = self.waiting.popleft()
            steps += self._start(waiting.role, waiting.why)
        if refill and not drained:
            while self.short(role) > 0:
                steps += self._deliver(role, f"add ({instance_id} gone)")
        return steps

    def _deliver(self, role: ev.PoolRole, why: str) -> list[Step]:
        """A start the planner now expects: a process, a wait for room, or none."""
        if self.short(role) <= 0:
            return [Claimed(role, tuple(self.on_way(role)), why)]
        if len(self.engines) < self.max_instances:
            return self._start(role, why)
        waiting = Waiting(role, why)
        self.waiting.append(waiting)
        return [waiting]

    def _prune(self) -> list[Step]:
        """Give up waits that the planner no longer expects to be filled."""
        steps: list[Step] = []
        for role in ("prefill", "decode"):
            while self.short(role) < 0 and any(w.role == role for w in self.waiting):
                waiting = next(w for w in reversed(self.waiting) if w.role == role)
                self.waiting.remove(waiting)
                why = f"{waiting.why} {role}: no longer waiting"
                steps.append(Skipped(f"{why}: an instance up or on its way fills it"))
        return steps

    def _start(self, role: ev.PoolRole, why: str) -> list[Step]:
        index = self._next[role]
        self._next[role] = index + 1
        instance_id = f"{role}-{index}"
        self.engines[instance_id] = role
        return [StartEngine(role, instance_id, index, why)]


_PLURAL = {"process": "processes", "container": "containers"}


def no_start_line(
    step: Claimed | Waiting | Skipped, max_instances: int, unit: Literal["process", "container"]
) -> str:
    """What an actuator says of a step that starts nothing; `unit` is what it runs an
    engine in."""
    match step:
        case Claimed(role=role, on_way=on_way, why=why):
            return (
                f"planner: {why} {role} -> no new {unit}: {', '.join(on_way)} "
                "on its way (not up when the planner decided)"
            )
        case Waiting(role=role, why=why):
            return (
                f"planner: {why} {role} -> waiting: {max_instances} engine {_PLURAL[unit]} "
                "at most (--max-instances); it starts once one is gone"
            )
        case Skipped(reason=reason):
            return f"planner: {reason}"


@dataclass
class _Drain:
    """A drained engine's process until it is reaped."""

    proc: subprocess.Popen[bytes] | None
    started: float  # monotonic
    deadline: float  # monotonic: killed after this
    killed: bool = False


class ElasticPools:
    """Carries out the planner's actions on the running cluster (module docstring).

    Call `tick()` from `yb up`'s main loop, on the thread that ticks `supervisor`.
    """

    def __init__(
        self,
        cluster: Cluster,
        supervisor: Supervisor,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from yb_tools.cli.launcher import ENGINE_ROLES

        self.cluster = cluster
        self.supervisor = supervisor
        self.say = say
        self.clock = clock
        engines: dict[str, ev.PoolRole] = {
            spec.instance_id: "prefill" if spec.role == "prefill" else "decode"
            for spec in cluster.process_specs()
            if spec.role in ENGINE_ROLES
        }
        start_timeout_s = cluster.cfg.conductor.planner_start_timeout_s
        self.book = PoolBook(cluster.max_engines, engines, start_timeout_s)
        self._drains: dict[str, _Drain] = {}

    def tick(self) -> None:
        """Apply the actions read since the last tick, reap drained engines, and free
        the slots of engines the supervisor gave up on."""
        watcher = self.cluster.watcher
        for item in watcher.pool_log() if watcher is not None else []:
            match item:
                case Announced():
                    self._carry(self.book.announced(item))
                case WentDown():
                    self._carry(self.book.went_down(item))
                case PlannedAction():
                    self._carry(self.book.apply(item))
        self._reap()
        for instance_id in self.supervisor.given_up():
            if instance_id in self.book.engines and instance_id not in self.book.draining:
                self._carry(self.book.gone(instance_id))

    def _carry(self, steps: list[Step]) -> None:
        for step in steps:
            match step:
                case StartEngine():
                    self._start(step)
                case DrainEngine():
                    self._drain(step)
                case Claimed() | Waiting() | Skipped():
                    self.say(no_start_line(step, self.book.max_instances, "process"))

    def _start(self, step: StartEngine) -> None:
        from yb_tools.cli.launcher import ProcessSpec

        host = engine_host(self.cluster.topology, step.role, step.index)
        member = self.cluster.start_engine(ProcessSpec(step.role, step.instance_id, host))
        self.supervisor.add(member)
        self.say(
            f"planner: {step.why} {step.role} -> started {step.instance_id} ({host}, "
            f"log: {member.log_path})"
        )

    def _drain(self, step: DrainEngine) -> None:
        self.supervisor.release(step.instance_id)  # first: its exit is no crash
        proc = self.cluster.children.get(step.instance_id)
        role = self.book.engines[step.instance_id]
        section = self.cluster.cfg.prefill if role == "prefill" else self.cluster.cfg.decode
        grace_s = section.drain_timeout_s + DRAIN_MARGIN_S
        now = self.clock()
        self._drains[step.instance_id] = _Drain(proc, now, now + grace_s)
        verb = f"move {step.instance_id} to {step.then}" if step.then else "drain"
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            then = f"; a {step.then} instance starts once it exited" if step.then else ""
            self.say(
                f"planner: {verb} -> SIGTERM to {step.instance_id} (up to {grace_s:g}s to "
                f"drain and stop{then})"
            )
        else:
            self.say(f"planner: {verb} -> {step.instance_id} is not running")

    def _reap(self) -> None:
        now = self.clock()
        for instance_id, drain in list(self._drains.items()):
            proc = drain.proc
            code = proc.poll() if proc is not None else 0
            if code is None:
                if now >= drain.deadline and not drain.killed:
                    assert proc is not None
                    self.say(f"planner: {instance_id} still runs past its drain: killing it")
                    proc.kill()
                    drain.killed = True
                continue
            del self._drains[instance_id]
            if proc is not None:
                self.say(
                    f"planner: {instance_id} drained: exited with {describe_exit(code)} "
                    f"after {now - drain.started:.1f}s"
                )
            watcher = self.cluster.watcher
            if code != 0 and watcher is not None:
                # A clean stop said `InstanceDown` itself; a killed process could not.
                watcher.declare_down(
                    instance_id, f"drained; its process exited with {describe_exit(code)} (yb up)"
                )
            self.cluster.retire(instance_id)
            self._carry(self.book.gone(instance_id))
