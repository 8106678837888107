"""What every engine and store instance does on the bus besides its own work.

- `Presence` announces the instance (`InstanceUp`), reports its load every interval
  (the `LoadReport` doubles as its heartbeat: the conductor declares it dead when
  reports stop, with an `InstanceDown` of its own) and says goodbye (`InstanceDown`)
  on a clean stop; an engine told to stop says first that it drains
  (`InstanceDraining`), so that nothing more is placed on it while it finishes what
  it holds. An instance that was declared dead while it was only paused
  (SIGSTOP, a long GC, a partition) announces itself again when it sees that
  verdict, or everyone who follows announcements would forget it for good.
  A process that starts under the id of one that died without a goodbye (a
  supervisor's restart, faster than any heartbeat timeout) first says that the
  previous process is down, so that what it held is re-planned at once rather than
  waited for.
- `CancellationFollower` follows `RequestCancelled` events so an engine can drop a
  request whose client went away, wherever it is in its pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import nats.errors

from yb_core import events as ev
from yb_core.bus import Bus, BusError, EventReader
from yb_core.telemetry import get_logger

log = get_logger(__name__)

CANCELLED_SUBJECT = "yb.ev.req.request_cancelled"

#: This process's epoch: the epoch of an announcement that brings none of its own (a
#: block holder's is its block log's), so that two processes under one instance id
#: never announce the same epoch.
PROCESS_EPOCH = time.time_ns()
#: How long the first announcement may spend looking up the previous process.
_PREVIOUS_LOOKUP_S = 2.0


class Presence:
    """Announce, heartbeat with load reports, and retire one instance.

    The announcement's epoch is new in every process (`PROCESS_EPOCH` when it has
    none); that is how the first `announce()` tells a previous process from itself.
    """

    def __init__(
        self,
        bus: Bus,
        announcement: ev.InstanceUp,
        report: Callable[[], ev.LoadReport],
        interval_s: float,
    ) -> None:
        self._bus = bus
        if not announcement.epoch:
            announcement.epoch = PROCESS_EPOCH
        self.announcement = announcement
        self._announced = False
        self._report = report
        self._interval_s = interval_s
        self._was_connected = True
        self._retired = False
        self._verdicts: EventReader | None = None
        # Once it drains: said again after every later announcement.
        self._draining: ev.InstanceDraining | None = None

    async def announce(self) -> None:
        """Publish `InstanceUp` (again: after a reconnect the log may have moved on).
        The first time, end the previous process's presence if it left none."""
        if not self._announced:
            await self._end_previous()
        self.announcement.time = 0.0  # a fresh timestamp, hence a fresh message id
        await self._bus.publish(self.announcement)
        self._announced = True
        if self._draining is not None:
            # Announced again (after a verdict, a reconnect) while draining: without
            # this the log would read as an instance that takes work again.
            await self._publish_draining()

    async def _end_previous(self) -> None:
        """Publish `InstanceDown` for the previous process under this instance id
        when the log's last word on it is an announcement of another epoch: it died
        without a goodbye and nobody has declared it dead yet. Requests it held are
        then re-planned now instead of after the heartbeat timeout. Best effort: if
        the log cannot be asked, the heartbeat timeout still ends it.

        Asked of the instance stream, which keeps each instance's last announcement and
        verdict however long ago the log took them (and trimmed them since)."""
        me = self.announcement
        bus, stream = self._bus, self._bus.instance_stream
        try:
            up = await bus.last_event(
                ev.subject_for(me), timeout_s=_PREVIOUS_LOOKUP_S, stream=stream
            )
            if up is None or not isinstance(up.event, ev.InstanceUp):
                return
            previous = up.event.epoch
            if previous == me.epoch:
                return  # this process announced itself before (another connection)
            down = await bus.last_event(
                ev.instance_down_subject(me.instance_id),
                timeout_s=_PREVIOUS_LOOKUP_S,
                stream=stream,
            )
            if down is not None and down.seq > up.seq:
                return  # it said goodbye, or was declared dead
            await bus.publish(
                ev.InstanceDown(
                    instance_id=me.instance_id,
                    reason=f"restarted: the previous process (epoch {previous}) ended "
                    "without a goodbye",
                )
            )
            log.warning("previous_process_declared_down", epoch=previous)
        except BusError as exc:
            log.warning("previous_process_lookup_failed", error=str(exc))

    async def run(self) -> None:
        """Report load every interval until cancelled; survives NATS outages."""
        try:
            while True:
                await self._wait_interval()
                if not self._bus.connected:
                    self._was_connected = False
                    continue
                try:
                    if not self._was_connected:
                        await self.announce()
                        self._was_connected = True
                    await self._bus.publish(self._report(), timeout_s=self._interval_s * 2)
                except BusError as exc:
                    log.warning("load_report_failed", error=str(exc))
        finally:
            if self._verdicts is not None:
                reader, self._verdicts = self._verdicts, None
                with contextlib.suppress(Exception):
                    await reader.close()

    async def _wait_interval(self) -> None:
        """Sleep one interval, meanwhile re-announcing if declared dead."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self._interval_s
        if self._verdicts is None and self._bus.connected:
            subject = ev.instance_down_subject(self.instance_id)
            try:
                self._verdicts = await self._bus.read_ordered(subject, new_only=True)
            except (BusError, nats.errors.Error, OSError) as exc:
                log.debug("down_follow_failed", error=repr(exc))
        while (left := until - loop.time()) > 0:
            if self._verdicts is None:
                await asyncio.sleep(left)
                return
            item = await self._verdicts.next(timeout_s=left)
            if item is None or self._retired or not isinstance(item.event, ev.InstanceDown):
                continue
            log.warning("declared_down_while_alive", reason=item.event.reason)
            try:
                await self.announce()
            except BusError as exc:
                log.warning("reannounce_failed", error=str(exc))

    @property
    def instance_id(self) -> str:
        """The id this presence announces."""
        return self.announcement.instance_id

    async def drain(self, reason: str, deadline: float) -> int:
        """Publish `InstanceDraining` (best effort, bounded): from that point of the
        log on the conductor places nothing more here. Its stream sequence (0: it did
        not reach the log), which tells work decided before it from work decided
        after (`yb_dataplane.worker.decided_before`)."""
        self._draining = ev.InstanceDraining(
            instance_id=self.instance_id, reason=reason, deadline=deadline
        )
        return await self._publish_draining()

    async def _publish_draining(self) -> int:
        draining = self._draining
        if draining is None:
            return 0
        draining.time = 0.0  # a fresh message id: a repeat must reach the log too
        try:
            return await asyncio.wait_for(self._bus.publish(draining), timeout=2.0)
        except (TimeoutError, BusError) as exc:
            log.warning("draining_publish_failed", error=str(exc) or repr(exc))
            return 0

    async def retire(self, reason: str) -> None:
        """Publish `InstanceDown` (best effort, bounded)."""
        self._retired = True  # our own goodbye is not a verdict to dispute
        with contextlib.suppress(BusError, asyncio.TimeoutError):
            await asyncio.wait_for(
                self._bus.publish(
                    ev.InstanceDown(instance_id=self.announcement.instance_id, reason=reason)
                ),
                timeout=2.0,
            )


class CancellationFollower:
    """Calls `on_cancel(request_id, reason)` for every request cancelled from now on."""

    def __init__(self, bus: Bus, on_cancel: Callable[[str, str], None]) -> None:
        self._bus = bus
        self._on_cancel = on_cancel
        self._reader: EventReader | None = None

    async def start(self) -> None:
        """Subscribe before the instance takes work, so no cancel is missed."""
        self._reader = await self._bus.read_ordered(CANCELLED_SUBJECT, new_only=True)

    async def run(self) -> None:
        """Deliver cancellations until cancelled."""
        assert self._reader is not None, "start() first"
        while True:
            item = await self._reader.next(timeout_s=5.0)
            if item is not None and isinstance(item.event, ev.RequestCancelled):
                self._on_cancel(item.event.request_id, item.event.reason)

    async def close(self) -> None:
        """Unsubscribe; idempotent."""
        if self._reader is not None:
            reader, self._reader = self._reader, None
            await reader.close()
