"""The launcher's view of its cluster on the bus, and its voice there.

`yb up` is synchronous; `ClusterWatcher` is a thread of its own with its own event
loop and one NATS connection as the operator's user. It

- follows `InstanceUp`/`InstanceDown` on the instance stream and the launcher's
  running children (instance id -> when the process started), and keeps the
  Prometheus file_sd file current (`yb_tools.cli.prometheus_files`): rewritten when
  the set of targets changes, empty once the cluster stopped;
- tells the supervisor which children announced themselves since their process
  started (`announced`, from the instance stream it follows; `confirm_announced`,
  asked of the log itself when a child exits before that stream showed it): a
  process that never did and exits failed at start;
- publishes the launcher's verdict when one of its processes exits (`declare_down`):
  the launcher knows at once what a heartbeat timeout would tell everyone else only
  seconds later, so the requests the process held are re-planned now;
- for `yb up --elastic`, follows the planner's decisions (`PoolPlanned`) and the
  instances' `InstanceUp`/`InstanceDown` made since the launcher started its
  services, in log order, and hands them to the launcher's main loop through a
  thread-safe queue (`pool_log`; `yb_tools.cli.elastic` carries the actions out,
  keeping the planner's count of the instances on their way as the planner keeps
  it). They are read from the log's start and what is older than the launcher's
  start skipped, so nothing made after it is missed, however late the log is
  created.

`stop()` ends the thread and empties the targets file; it is safe to call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import nats.js.errors

from yb_core import events as ev
from yb_core.bus import Bus, BusError
from yb_core.config import NatsConfig
from yb_core.telemetry import get_logger
from yb_tools.cli.prometheus_files import ScrapeTarget, TargetFold, write_file_sd

log = get_logger(__name__)

#: The instance events the watcher folds: announcements and their ends.
_INSTANCE_SUBJECTS = ["yb.ev.instance.instance_up.>", "yb.ev.instance.instance_down.>"]
#: The planner's decisions (`events.subject_for(PoolPlanned)`), any conductor's, and
#: the instance events the planner counts instances by.
POOL_LOG = ["yb.ev.decision.pool.>", *_INSTANCE_SUBJECTS]
# How often the watcher checks the launcher's children between events.
_POLL_S = 0.5
# How long one verdict may take to publish (it is a hint: heartbeats still decide).
_VERDICT_TIMEOUT_S = 2.0
# How long the supervisor may wait for the log to confirm an announcement.
_CONFIRM_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class PlannedAction:
    """One action of a `PoolPlanned`: the decision's time (log time) and the action's
    index in it identify it, so that it is carried out once however often it is read."""

    time: float
    index: int
    action: ev.PoolAction

    @property
    def key(self) -> tuple[float, int]:
        return (self.time, self.index)


@dataclass(frozen=True, slots=True)
class Announced:
    """An engine's `InstanceUp`: decisions after it in the log count the instance."""

    instance_id: str
    role: ev.PoolRole


@dataclass(frozen=True, slots=True)
class WentDown:
    """An instance's `InstanceDown` (an engine's or not: the log does not say)."""

    instance_id: str


PoolLogItem = PlannedAction | Announced | WentDown


class ClusterWatcher:
    """Follows the cluster's instances for the launcher (module docstring).

    `running()` is the launcher's live children (instance id -> start, wall clock);
    `targets_path` the file_sd file it keeps current. `pool_log_since` (wall
    clock; None: not followed) follows the planner's decisions and the instance
    events made from then on (`pool_log`). `verdict_timeout_s` bounds the publish of
    one verdict (`declare_down`).
    """

    def __init__(
        self,
        nats: NatsConfig,
        targets_path: Path,
        running: Callable[[], Mapping[str, float]],
        *,
        pool_log_since: float | None = None,
        verdict_timeout_s: float = _VERDICT_TIMEOUT_S,
    ) -> None:
        self._nats = nats
        self._verdict_timeout_s = verdict_timeout_s
        self.path = targets_path
        self._running = running
        self._pool_since = pool_log_since
        # Filled by the watcher's thread, emptied by the launcher's.
        self._pool_log: queue.SimpleQueue[PoolLogItem] = queue.SimpleQueue()
        self.fold = TargetFold()
        # instance id -> its last announcement
        self._ups: dict[str, ev.InstanceUp] = {}
        self._written: list[ScrapeTarget] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bus: Bus | None = None
        self._stop_requested: asyncio.Event | None = None
        # Verdicts being published: owned by the watcher's loop, cancelled at its end.
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = threading.Event()
        # The fold is written by the watcher's thread and read by the launcher's.
        self._lock = threading.Lock()

    def announcements(self) -> dict[str, ev.InstanceUp]:
        """The announcements of the launcher's running children made since they
        started, by instance id. Safe to call from another thread."""
        running = self._running()
        with self._lock:
            return {
                instance: up
                for instance, started in running.items()
                if (up := self._ups.get(instance)) is not None and up.time >= started
            }

    def pool_log(self) -> list[PoolLogItem]:
        """The planner's actions and the instance events read since the last call, in
        log order. Safe to call from another thread."""
        out: list[PoolLogItem] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._pool_log.get_nowait())
        return out

    def announced(self) -> set[str]:
        """The launcher's running children that announced themselves since they
        started. Safe to call from another thread."""
        return set(self.announcements())

    def confirm_announced(
        self, instance_id: str, since: float, timeout_s: float = _CONFIRM_TIMEOUT_S
    ) -> bool:
        """Whether `instance_id` announced itself at or after `since` (wall clock),
        asked of the log itself: the instance stream `announced` follows is a copy of
        it, a moment behind. False when the log cannot answer within `timeout_s`. Call
        from another thread than the watcher's (it blocks until the answer)."""
        loop, bus = self._loop, self._bus
        if loop is None or bus is None:
            return False
        subject = f"yb.ev.instance.instance_up.{ev.subject_token(instance_id)}"
        asked = asyncio.run_coroutine_threadsafe(bus.last_event(subject, timeout_s=timeout_s), loop)
        try:
            found = asked.result(timeout_s + 1.0)
        except Exception as exc:  # no answer is "not seen": the exit counts as at start
            asked.cancel()
            log.warning("announcement_not_confirmed", instance_id=instance_id, why=repr(exc))
            return False
        up = found.event if found is not None else None
        if not isinstance(up, ev.InstanceUp) or up.time < since:
            return False
        with self._lock:
            self._ups[instance_id] = up
        return True

    def declare_down(self, instance_id: str, reason: str) -> None:
        """Publish `InstanceDown` for a process of the launcher's that exited, without
        waiting for it (a verdict that cannot be published now is left to the
        conductor's heartbeat timeout and the restarted process's own notice). Safe to
        call from another thread."""
        loop, bus = self._loop, self._bus
        if loop is None or bus is None:
            log.warning("verdict_not_published", instance_id=instance_id, why="not connected")
            return
        verdict = ev.InstanceDown(instance_id=instance_id, reason=reason)

        def publish() -> None:
            task = loop.create_task(self._publish(bus, verdict), name="cluster-watch-verdict")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        with contextlib.suppress(RuntimeError):  # its loop already ended
            loop.call_soon_threadsafe(publish)

    async def _publish(self, bus: Bus, verdict: ev.InstanceDown) -> None:
        try:
            await bus.publish(verdict, timeout_s=self._verdict_timeout_s)
        except BusError as exc:
            log.warning("verdict_not_published", instance_id=verdict.instance_id, why=str(exc))

    def start(self) -> None:
        """Write an empty targets file and start following the cluster."""
        self._write([])
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._serve()),
            name="yb-cluster-watch",
            daemon=True,  # a safety net: `stop()` ends it
        )
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop following (within `timeout_s`) and leave an empty targets file."""
        thread, self._thread = self._thread, None
        if thread is not None:
            if self._started.wait(timeout_s) and self._loop is not None:
                stop = self._stop_requested
                assert stop is not None
                with contextlib.suppress(RuntimeError):  # its loop already ended
                    self._loop.call_soon_threadsafe(stop.set)
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("cluster_watcher_did_not_stop")
        self._write([])

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_requested = stop = asyncio.Event()
        self._started.set()
        follow = asyncio.create_task(self._follow(), name="cluster-watch")
        halt = asyncio.create_task(stop.wait(), name="cluster-watch-stop")
        try:
            await asyncio.wait({follow, halt}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending = [follow, halt, *self._tasks]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if follow.done() and not follow.cancelled() and follow.exception() is not None:
                log.error("cluster_watch_failed", error=repr(follow.exception()))

    async def _follow(self) -> None:
        bus = await Bus.connect(self._nats, "yb-up-cluster-watch")
        self._bus = bus
        decisions: asyncio.Task[None] | None = None
        if self._pool_since is not None:
            decisions = asyncio.create_task(
                self._follow_pool_log(bus, self._pool_since), name="cluster-watch-pool"
            )
        try:
            reader = None
            while True:
                if reader is None:
                    try:
                        reader = await bus.read_instances(_INSTANCE_SUBJECTS)
                    except BusError:
                        # No service has created the instance stream yet.
                        await asyncio.sleep(_POLL_S)
                        self.refresh()
                        continue
                item = await reader.next(timeout_s=_POLL_S)
                if item is not None:
                    event = item.event
                    with self._lock:
                        self.fold.apply(event)
                        if isinstance(event, ev.InstanceUp):
                            self._ups[event.instance_id] = event
                if decisions is not None and decisions.done():
                    decisions.result()  # re-raises what ended it
                self.refresh()
        finally:
            if decisions is not None:
                decisions.cancel()
                await asyncio.gather(decisions, return_exceptions=True)
            self._bus = None
            await bus.close()

    async def _follow_pool_log(self, bus: Bus, since: float) -> None:
        """Queue every action of each `PoolPlanned`, every engine's `InstanceUp` and
        every `InstanceDown`, made at or after `since`, in log order."""
        reader = None
        while reader is None:
            try:
                reader = await bus.read_ordered(POOL_LOG)
            except (BusError, nats.js.errors.NotFoundError):
                # No service has created the log yet.
                await asyncio.sleep(_POLL_S)
        try:
            while True:
                item = await reader.next(timeout_s=_POLL_S)
                event = item.event if item is not None else None
                if event is None or event.time < since:
                    continue
                match event:
                    case ev.PoolPlanned(actions=actions):
                        for index, action in enumerate(actions):
                            self._pool_log.put(PlannedAction(event.time, index, action))
                    case ev.InstanceUp(role="prefill" | "decode" as role):
                        self._pool_log.put(Announced(event.instance_id, role))
                    case ev.InstanceDown():
                        self._pool_log.put(WentDown(event.instance_id))
                    case _:
                        pass
        finally:
            await reader.close()

    def refresh(self) -> None:
        """Rewrite the targets file if the targets changed since the last write."""
        running = self._running()
        with self._lock:
            targets = self.fold.targets(running)
        self._write(targets)

    def _write(self, targets: list[ScrapeTarget]) -> None:
        if targets == self._written:
            return
        write_file_sd(self.path, targets)
        self._written = targets
