"""The prefill instance's queue of jobs: larger `priority` first, then arrival, and
how a job gets into it (`take_job`).

One engine runs one job at a time, so the order of this queue is the order in which
requests get their first token: a high-priority request that arrives behind a
hundred low-priority ones waits only for the job already running, and, when that is
a batch line's (`PrefillJob.preemptible`), only for the chunk it is computing: the
job pauses there and resumes after it (`yb_prefill.preemption`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg

from yb_core import protocol as pr
from yb_core.telemetry import get_logger, trace_carrier

log = get_logger(__name__)


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
        self._put: asyncio.Future[None] | None = None
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
        if self._put is not None and not self._put.done():
            self._put.set_result(None)
        return sum(1 for other in self._heap if other[:2] <= entry[:2])

    def next_put(self) -> asyncio.Future[None]:
        """A future that resolves at the next `put_nowait` (shared by its waiters:
        stop waiting on it, do not cancel it)."""
        if self._put is None or self._put.done():
            self._put = asyncio.get_running_loop().create_future()
        return self._put

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


class Liveness:
    """Whether a job is still wanted: not cancelled (the cancellations heard, the
    oldest forgotten past `limit`: most are of requests this instance never saw) and
    within its deadline."""

    def __init__(self, limit: int = 10_000) -> None:
        self._cancelled: dict[str, str] = {}
        self._limit = limit

    def cancel(self, request_id: str, reason: str) -> None:
        """Note a request's cancellation."""
        self._cancelled[request_id] = reason or "cancelled"
        if len(self._cancelled) > self._limit:
            for key in list(self._cancelled)[: self._limit // 2]:
                del self._cancelled[key]

    @staticmethod
    def remaining_s(job: pr.PrefillJob) -> float:
        """Seconds left before the job's deadline (600 without one)."""
        return job.deadline - time.time() if job.deadline else 600.0

    def over(self, job: pr.PrefillJob) -> bool:
        """Cancelled, or past its deadline."""
        return job.request_id in self._cancelled or self.remaining_s(job) <= 0

    def check(self, job: pr.PrefillJob) -> None:
        """Raise `JobFailed` for a cancelled job (499) or one past its deadline (504)."""
        if job.request_id in self._cancelled:
            raise pr.JobFailed(f"cancelled: {self._cancelled[job.request_id]}", status=499)
        if self.remaining_s(job) <= 0:
            raise pr.JobFailed("request deadline passed during prefill", status=504)


SHUTTING_DOWN = "prefill instance shutting down"
QUEUE_FULL = "prefill queue full"
#: Refusals another instance would not make: the gateway may re-plan the request
#: (`JobRefused.retryable`). The others (a job planned elsewhere, or past its
#: deadline) would fail anywhere.
RETRYABLE = frozenset({SHUTTING_DOWN, QUEUE_FULL})


def refusal(job: pr.PrefillJob, instance_id: str, queue: JobQueue, *, draining: bool) -> str:
    """Why an instance will not queue `job` ('' if it will), whatever it is;
    `draining`: it refuses the job because it is stopping."""
    if draining:
        return SHUTTING_DOWN
    if queue.full():
        return QUEUE_FULL
    if job.decision.prefill_instance != instance_id:
        return f"job is planned for {job.decision.prefill_instance}"
    if job.deadline and job.deadline < time.time():
        return "deadline passed before the job arrived"
    return ""


async def take_job(
    msg: Msg,
    instance_id: str,
    queue: JobQueue,
    refuse: Callable[[pr.PrefillJob], str],
) -> QueuedJob | None:
    """Decode a job sent to `instance_id` and queue it, answering `JobAccepted` with
    its position, or `JobRefused` saying why not (`refuse(job)`: the reason, '' to
    take it; a malformed job is refused as not retryable). The queued job, or None."""
    try:
        job = pr.job_decoder.decode(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("malformed_job", error=str(exc))
        await respond(
            msg,
            pr.JobRefused(
                request_id="",
                instance_id=instance_id,
                reason=f"malformed job: {exc}",
                retryable=False,
            ),
        )
        return None
    if reason := refuse(job):
        await respond(
            msg,
            pr.JobRefused(
                request_id=job.request_id,
                instance_id=instance_id,
                reason=reason,
                retryable=reason in RETRYABLE,
            ),
        )
        return None
    # The trace context comes in the NATS headers (the job's copy is the fallback).
    queued = QueuedJob(job, trace_carrier(msg.headers) or dict(job.trace_headers))
    position = queue.put_nowait(queued)
    await respond(
        msg,
        pr.JobAccepted(request_id=job.request_id, instance_id=instance_id, queue_position=position),
    )
    return queued


async def respond(msg: Msg, reply: pr.JobReply | pr.StageReply) -> None:
    """Answer a request; the asker may be gone (its deadline passed), which is its
    business."""
    with contextlib.suppress(Exception):
        await msg.respond(pr.encode(reply))
