"""Reservations that wait for pages: the queue and its turn rule.

The conductor admits a request on a prediction of the pages its decode instance will
have free when the request's prefill starts. A prediction runs short now and then (a
burst of prompts, outputs longer than expected), and a refusal then fails a request
whose prefill has already been computed. So a reservation that finds too few pages
free may wait for some to free (`ReserveKV.wait_s`): the requests decoding end within
their `max_tokens`, and those whose KV is on its way start decoding, so pages come
back. A waiting reservation holds nothing, so waiting cannot deadlock.

Waiters are served highest priority first, then in arrival order; a new reservation
does not take pages ahead of one waiting, and only the head of the queue is granted.
A waiter is granted only while each request in the batch would still find a page
for its next token (`needed + running <= free`): a reservation that took the last
pages would cut a running request short (`kv_exhausted`), trading a late request for
a truncated one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field


@dataclass(order=True, frozen=True, slots=True)
class Ticket:
    """A place in the queue: higher priority first, then first come."""

    rank: tuple[int, int]
    request_id: str = field(compare=False)


class PageQueue:
    """The reservations waiting for pages, and the signal that pages were freed."""

    def __init__(self) -> None:
        self._waiting: list[Ticket] = []
        self._order = itertools.count()
        #: Counts `notify` calls: a waiter that saw generation g and finds it moved
        #: on has missed a notice while it looked, and looks again at once.
        self.generation = 0
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._waiting)

    def join(self, request_id: str, priority: int) -> Ticket:
        ticket = Ticket((-priority, next(self._order)), request_id)
        self._waiting.append(ticket)
        self._waiting.sort()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Out of the queue (granted, refused or given up); the next head looks."""
        if ticket in self._waiting:
            self._waiting.remove(ticket)
            self.notify()

    def is_head(self, ticket: Ticket) -> bool:
        return bool(self._waiting) and self._waiting[0] is ticket

    def notify(self) -> None:
        """Pages may have been freed (or the instance started to drain): every waiter
        looks again."""
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, since: int, timeout_s: float) -> None:
        """Wait until a `notify` after generation `since`, or `timeout_s` passed."""
        if self.generation != since:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=max(timeout_s, 0.001))


def may_grant(needed: int, free: int, running: int) -> bool:
    """Whether a waiting reservation of `needed` pages may take them while `running`
    requests decode with `free` pages free: each of those keeps a page for its next
    token."""
    return needed + running <= free
