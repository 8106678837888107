"""Events a worker logs on the side of its requests, published in order off their path.

A prefill or decode instance tells the log how its requests go (`RequestProgress`,
`RequestFinished`, `TransferFailed`). Nothing on a request's path needs those events
to be acknowledged: the gateway hears from the engines directly, and the conductor
only folds them. Awaiting each JetStream acknowledgement where the event arises put a
round trip on the path (before decode streamed a first token, before prefill reserved
decode's pages) and held an engine loop while a batch's outcomes were logged one by
one. An `Outbox` takes them off that path with the same best-effort promise as
`Bus.try_publish`: a publish that fails past its deadline is logged and dropped.
"""

from __future__ import annotations

import asyncio
import collections
import time

from yb_core.bus import Bus, BusError
from yb_core.events import AnyEvent
from yb_core.telemetry import get_logger

log = get_logger(__name__)


class Outbox:
    """Publishes the events `put` to it, in the order put, from its own task.

    `run()` is the owned task: it publishes what is queued in batches, writing a
    batch's events in order and awaiting their acknowledgements together, and starts
    the next batch only once they are in. So the log holds one outbox's events in the
    order they were put, with one exception: a publish retried after a reconnect may
    land behind a later event of its own batch (its first copy was lost with the
    connection, and the log de-duplicates a copy that was not). `flush()` publishes
    what is left from the caller's task, for a worker going down (its tasks
    cancelled, its bus still open).
    """

    def __init__(self, bus: Bus, *, max_batch: int = 64) -> None:
        self._bus = bus
        self._max_batch = max_batch
        self._queue: collections.deque[AnyEvent] = collections.deque()
        self._wake = asyncio.Event()
        # Held while a batch is being published, by `run()` or `flush()`: batches
        # never overlap, which is what keeps the order.
        self._publishing = asyncio.Lock()

    @property
    def pending(self) -> int:
        """Events put and not yet published."""
        return len(self._queue)

    def put(self, event: AnyEvent) -> None:
        """Queue `event` for the log; it is stamped with the time it arose, not the
        time its publish starts."""
        if not event.time:
            event.time = time.time()
        self._queue.append(event)
        self._wake.set()

    async def run(self) -> None:
        """Publish what is put, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            async with self._publishing:
                while self._queue:
                    await self._publish_batch()

    async def flush(self, timeout_s: float) -> None:
        """Publish everything put so far, within `timeout_s`; what is still queued
        then is logged and dropped."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._publishing:
                    while self._queue:
                        await self._publish_batch()
        except TimeoutError:
            log.warning("outbox_flush_timed_out", dropped=len(self._queue))
            self._queue.clear()

    async def _publish_batch(self) -> None:
        batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]
        if len(batch) == 1:
            outcomes: list[BaseException | int] = [await _attempt(self._bus, batch[0])]
        else:
            outcomes = await asyncio.gather(*(_attempt(self._bus, e) for e in batch))
        for event, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.warning("event_publish_failed", type=type(event).__name__, error=str(outcome))


async def _attempt(bus: Bus, event: AnyEvent) -> BaseException | int:
    """The event's log sequence, or why it could not be published (never raises but
    for a cancellation: one event's failure must not stop the others)."""
    try:
        return await bus.publish(event)
    except BusError as exc:
        return exc
    except Exception as exc:  # an API error for this event alone
        log.exception("event_publish_crashed", type=type(event).__name__)
        return exc
