"""The prefill instance's queue of jobs: larger `priority` first, then arrival.

One engine runs one job at a time, so the order of this queue is the order in which
requests get their first token: a high-priority request that arrives behind a
hundred low-priority ones waits only for the job already running.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field

from yb_core import protocol as pr


@dataclass
class QueuedJob:
    """A job waiting for the engine."""

    job: pr.PrefillJob
    trace_headers: dict[str, str]
    enqueued_at: float = field(default_factory=time.monotonic)


class QueueFull(Exception):
    """The queue holds `maxsize` jobs already."""


class JobQueue:
    """Jobs by priority (larger first), then arrival; bounded; one consumer awaits
    `get`. The counts it reports (`qsize`, `queued_tokens`) are the jobs waiting."""

    def __init__(self, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError("maxsize must be positive")
        self.maxsize = maxsize
        self._heap: list[tuple[int, int, QueuedJob]] = []
        self._arrivals = itertools.count()
        self._nonempty = asyncio.Event()
        self.queued_tokens = 0

    def qsize(self) -> int:
        """Jobs waiting."""
        return len(self._heap)

    def empty(self) -> bool:
        return not self._heap

    def full(self) -> bool:
        return len(self._heap) >= self.maxsize

    def put_nowait(self, queued: QueuedJob) -> int:
        """Queue a job; its position (1 = next). Raises `QueueFull`."""
        if self.full():
            raise QueueFull(f"{self.maxsize} jobs queued")
        entry = (-queued.job.priority, next(self._arrivals), queued)
        heapq.heappush(self._heap, entry)
        self.queued_tokens += len(queued.job.token_ids)
        self._nonempty.set()
        return sum(1 for other in self._heap if other[:2] <= entry[:2])

    def get_nowait(self) -> QueuedJob:
        """The next job; IndexError when none waits."""
        _, _, queued = heapq.heappop(self._heap)
        self.queued_tokens -= len(queued.job.token_ids)
        if not self._heap:
            self._nonempty.clear()
        return queued

    def head(self, n: int) -> list[QueuedJob]:
        """The next `n` jobs (fewer when fewer wait), in the order `get` gives them,
        left in the queue."""
        return [entry[2] for entry in heapq.nsmallest(n, self._heap)]

    async def get(self) -> QueuedJob:
        """The next job, waiting for one."""
        await self.peek()
        return self.get_nowait()

    async def peek(self) -> QueuedJob:
        """The next job, waiting for one, left in the queue."""
        while not self._heap:
            await self._nonempty.wait()
        return self._heap[0][2]
