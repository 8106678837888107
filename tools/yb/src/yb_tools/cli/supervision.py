"""What `yb up` does when one of its processes exits: restart it, keep going, or stop.

`yb up --on-exit` chooses (`OnExit`):

- `restart` (the default): the process is started again after a back-off that grows
  with each exit in a row (`RestartPolicy.backoff`), and the rest of the cluster keeps
  serving meanwhile. The restarted instance says so on the bus before it announces
  itself (`yb_core.instance.Presence`), so the conductor and the gateways re-plan what
  the dead process held at once, without waiting for its heartbeat to time out. An
  instance that exits `give_up_after` times in a row before it ever announced itself
  (it dies at start: a broken disk, a bad setting) is given up on, with the reason; when
  no instance of a role is left, the cluster stops and `yb up` exits non-zero.
- `keep-going`: an exit is reported and the rest stays up; nothing is restarted (the
  fault tests restart processes themselves).
- `stop`: the first exit stops the whole cluster and `yb up` exits non-zero.

Under `keep-going` and `stop`, an exit before the cluster was first ready fails the
start, as a broken configuration should; under `restart` it is supervised like any.

Every exit is reported with the exit code (or the signal), how long the process ran,
and the last lines of its log; every restart with its delay. The decisions are pure
functions of what was observed (`Incarnation.exited`), so the policy is tested without
processes; `Supervisor` applies them to the launcher's members (`Member`): the service
processes and the NATS nodes. `yb up --elastic` adds members while the cluster runs
(`Supervisor.add`) and releases the ones it drains before it signals them
(`Supervisor.release`): a drained process that exits is not a crash.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

OnExit = Literal["restart", "keep-going", "stop"]
ON_EXIT_CHOICES: tuple[OnExit, ...] = ("restart", "keep-going", "stop")


@dataclass(frozen=True)
class RestartPolicy:
    """When a process that exited is started again.

    The first restart waits `initial_backoff_s`, each further exit in a row doubles the
    wait, up to `max_backoff_s` (a process that crashes at once must not spin the
    machine; one that died once should be back in a second). A process that then stays
    up for `steady_after_s` after announcing itself has recovered: its next exit starts
    from `initial_backoff_s` again. `give_up_after` exits in a row before the process
    ever announced itself is a crash loop that waiting will not mend: it is given up on.
    """

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    steady_after_s: float = 60.0
    give_up_after: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"the restart back-off needs 0 < initial <= max; initial "
                f"{self.initial_backoff_s:g} s, max {self.max_backoff_s:g} s"
            )
        if self.give_up_after < 1:
            raise ValueError("give_up_after must be at least 1")

    def backoff(self, exits_in_a_row: int) -> float:
        """The wait before restarting after the `exits_in_a_row`-th exit in a row (1+)."""
        doublings = min(max(0, exits_in_a_row - 1), 30)
        return min(self.max_backoff_s, self.initial_backoff_s * float(2**doublings))


@dataclass(frozen=True)
class Restart:
    """Start the process again after `delay_s`."""

    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Leave the process down, for `reason`."""

    reason: str


@dataclass
class Incarnation:
    """What the supervisor knows of one member across its restarts.

    `exits_in_a_row` drives the back-off (reset by a steady run); `failed_starts` counts
    the exits in a row before the process announced itself (reset by an announcement).
    """

    exits_in_a_row: int = 0
    failed_starts: int = 0
    restarts: int = 0
    given_up: str = ""

    def exited(self, policy: RestartPolicy, *, announced: bool, up_s: float) -> Restart | GiveUp:
        """Account one exit of the current process; what to do next.

        `announced`: the process announced itself (it had started); `up_s`: seconds
        since it announced itself (0 if it never did).
        """
        if announced and up_s >= policy.steady_after_s:
            self.exits_in_a_row = 0
        self.exits_in_a_row += 1
        self.failed_starts = 0 if announced else self.failed_starts + 1
        if self.failed_starts >= policy.give_up_after:
            self.given_up = (
                f"it exited {self.failed_starts} times in a row before announcing itself"
            )
            return GiveUp(self.given_up)
        return Restart(policy.backoff(self.exits_in_a_row))


class Member(Protocol):
    """One process `yb up` supervises (a service instance or a NATS node)."""

    @property
    def name(self) -> str:
        """Its instance id ("decode-0", "nats-server")."""
        ...

    @property
    def role(self) -> str:
        """Its role ("decode", "nats")."""
        ...

    @property
    def log_path(self) -> Path:
        """Where its output goes (appended to by every process it ran as)."""
        ...

    @property
    def log_offset(self) -> int:
        """Where the current process's output begins in `log_path`."""
        ...

    def exit_code(self) -> int | None:
        """Its exit code once it has exited (negative: the signal), else None."""
        ...

    def respawn(self) -> int:
        """Start it again; its new pid."""
        ...


def describe_exit(code: int) -> str:
    """An exit code in words: "code 1", "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def log_tail(path: Path, lines: int = 12, since: int = 0) -> list[str]:
    """The last `lines` lines a process wrote to its log from offset `since` on, made
    readable: a service's JSON log line becomes "level event key=value ...", and the
    traceback of a crash its last lines (empty when the log cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(since, f.tell() - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines()[-lines:]:
        out += _readable(line)
    return out


# Fields every service log line has, which say nothing about this line.
_ROUTINE_FIELDS = {"timestamp", "service", "instance", "level", "event", "exception"}


def _readable(line: str) -> list[str]:
    try:
        record = json.loads(line)
    except ValueError:
        return [line[:400]]
    if not isinstance(record, dict) or "event" not in record:
        return [line[:400]]
    fields = " ".join(f"{k}={v}" for k, v in record.items() if k not in _ROUTINE_FIELDS)
    head = f"{record.get('level', '')} {record['event']} {fields}".strip()
    trace = str(record.get("exception") or "").splitlines()
    return [head[:400], *(f"  {t}" for t in trace[-6:])]


@dataclass
class _Watched:
    member: Member
    started: float  # monotonic, of the current process
    incarnation: Incarnation = field(default_factory=Incarnation)
    announced_at: float | None = None  # monotonic; None until it announced itself
    restart_at: float | None = None  # monotonic; set while it waits to be restarted
    reported: bool = False  # its exit was reported (keep-going)


class Supervisor:
    """Applies `on_exit` to the members of a running cluster; `tick()` is its step.

    `announced(name)` says whether the member's current process has announced itself
    (its `InstanceUp` since it started; NATS nodes count from their start), as far as
    the launcher has seen so far; `confirm_announced(name)` is asked once when a member
    exits before `announced` said so, and may take a moment: what the launcher follows
    is a copy of the log that can lag behind it (a busy machine, an instance killed
    right after it announced itself), and an exit counts as a failed start, which
    backs off and gives up, only if it never announced itself. `say`
    prints to the user; `on_exit_seen(member, code)` is told of every exit as soon as
    it is seen (the launcher declares the instance down on the bus). Call `tick()`
    every half second or so, from one thread.
    """

    def __init__(
        self,
        members: list[Member],
        on_exit: OnExit,
        *,
        announced: Callable[[str], bool],
        confirm_announced: Callable[[str], bool] = lambda name: False,
        say: Callable[[str], None],
        on_exit_seen: Callable[[Member, int], None] = lambda member, code: None,
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_exit = on_exit
        self.policy = policy or RestartPolicy()
        self._announced = announced
        self._confirm_announced = confirm_announced
        self._say = say
        self._on_exit_seen = on_exit_seen
        self._clock = clock
        now = clock()
        self._watched = {m.name: _Watched(m, now) for m in members}

    def add(self, member: Member) -> None:
        """Supervise a member started while the cluster runs (`yb up --elastic` adds
        instances), from its start now."""
        self._watched[member.name] = _Watched(member, self._clock())

    def release(self, name: str) -> Member | None:
        """Stop supervising `name` (an instance about to be drained: its exit is not a
        crash) and return it; None when it is not supervised. A restart it was waiting
        for is not made."""
        watched = self._watched.pop(name, None)
        return None if watched is None else watched.member

    def restarts(self) -> dict[str, int]:
        """Members restarted so far, with how often."""
        return {
            name: w.incarnation.restarts
            for name, w in self._watched.items()
            if w.incarnation.restarts
        }

    def given_up(self) -> dict[str, str]:
        """Members given up on, with why."""
        return {
            name: w.incarnation.given_up
            for name, w in self._watched.items()
            if w.incarnation.given_up
        }

    def tick(self, *, ready: bool) -> str | None:
        """Look at every member once; a reason to stop the cluster, or None.

        `ready`: the cluster has been ready once (before that, `keep-going` and `stop`
        fail the start on any exit).
        """
        now = self._clock()
        for name, w in self._watched.items():
            if w.incarnation.given_up:
                continue
            if w.restart_at is not None:
                if now >= w.restart_at and (stop := self._restart(w)):
                    return stop
                continue
            code = w.member.exit_code()
            if code is None:
                if w.announced_at is None and self._announced(name):
                    w.announced_at = now
                    if w.incarnation.restarts:
                        self._say(f"{name} is back: it announced itself again")
                continue
            if w.reported:
                continue
            if w.announced_at is None and self._confirm_announced(name):
                w.announced_at = now  # seen only now: how long it was up is not known
            self._report_exit(w, code, now)
            self._on_exit_seen(w.member, code)
            if self.on_exit != "restart":
                w.reported = True
                if self.on_exit == "stop" or not ready:
                    return f"{name} exited ({describe_exit(code)})"
                self._say(f"keeping the rest of the cluster up (--on-exit {self.on_exit})")
                continue
            if stop := self._exited(w, now):
                return stop
        return None

    def _exited(self, w: _Watched, now: float) -> str | None:
        """Apply the policy to an exit of `w`'s process; a reason to stop, or None."""
        announced = w.announced_at is not None
        up_s = now - w.announced_at if w.announced_at is not None else 0.0
        match w.incarnation.exited(self.policy, announced=announced, up_s=up_s):
            case Restart(delay_s=delay):
                w.restart_at = now + delay
                failed = w.incarnation.failed_starts
                self._say(
                    f"restarting {w.member.name} in {delay:g}s (restart "
                    f"{w.incarnation.restarts + 1}"
                    + (f"; {failed} failed start(s) in a row)" if failed else ")")
                )
                return None
            case GiveUp(reason=reason):
                self._say(f"giving up on {w.member.name}: {reason}; its log: {w.member.log_path}")
                return self._role_lost(w.member.role)
        return None

    def _report_exit(self, w: _Watched, code: int, now: float) -> None:
        name = w.member.name
        ran = now - w.started
        before = "" if w.announced_at is not None else ", before it announced itself"
        self._say(
            f"{name} ({w.member.role}) exited with {describe_exit(code)} after {ran:.1f}s{before}"
        )
        tail = log_tail(w.member.log_path, since=w.member.log_offset)
        if tail:
            self._say(f"last lines of {w.member.log_path}:")
            for line in tail:
                self._say(f"  | {line}")

    def _restart(self, w: _Watched) -> str | None:
        """Start `w`'s process again; a reason to stop the cluster, or None."""
        w.restart_at = None
        w.announced_at = None
        w.incarnation.restarts += 1
        try:
            pid = w.member.respawn()
        except Exception as exc:  # a start that fails outright is an exit at start
            self._say(f"could not restart {w.member.name}: {exc!r}")
            w.started = self._clock()
            return self._exited(w, w.started)
        w.started = self._clock()
        self._say(f"restarted {w.member.name} (pid {pid}, restart {w.incarnation.restarts})")
        return None

    def _role_lost(self, role: str) -> str | None:
        """A reason to stop when every member of `role` was given up on."""
        members = [w for w in self._watched.values() if w.member.role == role]
        if all(w.incarnation.given_up for w in members):
            names = ", ".join(w.member.name for w in members)
            return f"no {role} instance is left ({names} given up on)"
        return None
