"""Routes the conductor's decisions to the requests waiting for them.

The gateway reads decisions through ONE ordered consumer on
`yb.ev.decision.<gateway id>.>`, opened before any request is admitted, rather than
one consumer per request: a consumer per request costs a JetStream API round trip
each and would race with a fast conductor. Each admitted request registers a future
before its `RequestAdmitted` is published; the follower resolves it by request id.
Decisions for ids nobody waits for (a request that timed out, or a replay after the
consumer reset itself) are dropped.
"""

from __future__ import annotations

import asyncio

from yb_core import events as ev
from yb_core.bus import EventReader
from yb_core.telemetry import get_logger

log = get_logger(__name__)


class DecisionRouter:
    """Per-request futures, resolved by the decision follower."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[ev.Decision]] = {}
        self.ready = False

    def expect(self, request_id: str) -> asyncio.Future[ev.Decision]:
        """Register interest in `request_id`'s decision; call before admitting it."""
        future: asyncio.Future[ev.Decision] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def forget(self, request_id: str) -> None:
        """Stop waiting for `request_id` (decided, timed out or cancelled)."""
        future = self._waiting.pop(request_id, None)
        if future is None:
            return
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()  # mark an abort's exception as seen: nobody will await it

    @property
    def waiting(self) -> int:
        """How many requests wait for a decision now."""
        return len(self._waiting)

    def deliver(self, event: ev.AnyEvent) -> bool:
        """Resolve the future of the request the decision is for; False if nobody waits."""
        if not isinstance(event, ev.Decision):
            return False
        future = self._waiting.pop(event.request_id, None)
        if future is None or future.done():
            log.debug("decision_for_unknown_request", request_id=event.request_id)
            return False
        future.set_result(event)
        return True

    async def follow(self, reader: EventReader) -> None:
        """Deliver every decision from the reader until it ends (bus closed)."""
        async for logged in reader:
            self.deliver(logged.event)
