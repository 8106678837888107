"""The prefill queue: larger priority first, then arrival; bounded; counts right."""

from __future__ import annotations

import asyncio

import pytest

from yb_core import events as ev
from yb_core import protocol as pr
from yb_prefill.job_queue import JobQueue, QueuedJob, QueueFull


def job(rid: str, priority: int, tokens: int = 3) -> QueuedJob:
    decision = ev.RequestScheduled(
        request_id=rid, gateway_id="gw", prefill_instance="p", decode_instance="d"
    )
    return QueuedJob(
        pr.PrefillJob(
            request_id=rid,
            token_ids=list(range(tokens)),
            block_hashes=[],
            sampling=pr.SamplingParams(),
            decision=decision,
            token_subject="t",
            deadline=0.0,
            priority=priority,
        ),
        {},
    )


async def test_jobs_leave_by_priority_then_arrival() -> None:
    queue = JobQueue(maxsize=8)
    positions = [
        queue.put_nowait(job(rid, priority))
        for rid, priority in (("a", 0), ("b", 2), ("c", 0), ("d", 2), ("e", -1), ("f", 1))
    ]
    # Where each landed at its arrival: behind the ones of its priority or higher.
    assert positions == [1, 1, 3, 2, 5, 3]
    assert queue.qsize() == 6 and queue.queued_tokens == 18
    order = [queue.get_nowait().job.request_id for _ in range(6)]
    assert order == ["b", "d", "f", "a", "c", "e"]
    assert queue.empty() and queue.queued_tokens == 0


async def test_full_queue_refuses_and_get_waits_for_a_job() -> None:
    queue = JobQueue(maxsize=1)
    waiter = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    queue.put_nowait(job("a", 0, tokens=5))
    assert queue.full()
    with pytest.raises(QueueFull):
        queue.put_nowait(job("b", 9))
    got = await asyncio.wait_for(waiter, timeout=10)
    assert got.job.request_id == "a" and queue.queued_tokens == 0
