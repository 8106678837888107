"""What every engine and store instance does on the bus besides its own work.

- `Presence` announces the instance (`InstanceUp`), reports its load every interval
  (the `LoadReport` doubles as its heartbeat: the conductor declares it dead when
  reports stop) and says goodbye (`InstanceDown`) on a clean stop.
- `CancellationFollower` follows `RequestCancelled` events so an engine can drop a
  request whose client went away, wherever it is in its pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from yb_shared import events as ev
from yb_shared.bus import Bus, BusError, EventReader
from yb_shared.telemetry import get_logger

log = get_logger(__name__)

CANCELLED_SUBJECT = "yb.ev.req.request_cancelled"


class Presence:
    """Announce, heartbeat with load reports, and retire one instance."""

    def __init__(
        self,
        bus: Bus,
        announcement: ev.InstanceUp,
        report: Callable[[], ev.LoadReport],
        interval_s: float,
    ) -> None:
        self._bus = bus
        self.announcement = announcement
        self._report = report
        self._interval_s = interval_s
        self._was_connected = True

    async def announce(self) -> None:
        """Publish `InstanceUp` (again: after a reconnect the log may have moved on)."""
        self.announcement.time = 0.0  # a fresh timestamp, hence a fresh message id
        await self._bus.publish(self.announcement)

    async def run(self) -> None:
        """Report load every interval until cancelled; survives NATS outages."""
        while True:
            await asyncio.sleep(self._interval_s)
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

    async def retire(self, reason: str) -> None:
        """Publish `InstanceDown` (best effort, bounded)."""
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
