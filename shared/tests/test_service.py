"""Service lifecycle: owned tasks, first failure noticed, shutdown cancels everything."""

from __future__ import annotations

import asyncio

import pytest

from yb_shared.service import Supervisor


async def test_first_failure_is_raised_and_shutdown_cancels_the_rest() -> None:
    sup = Supervisor("t")
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def crash() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("boom")

    sup.spawn("forever", forever())
    sup.spawn("crash", crash())
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(sup.wait_failure(), timeout=5)
    await sup.shutdown(timeout_s=2)
    assert cancelled.is_set()
    await sup.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="after shutdown"):
        sup.spawn("late", asyncio.sleep(0))


async def test_tasks_that_end_normally_are_not_failures() -> None:
    sup = Supervisor("t")
    sup.spawn("quick", asyncio.sleep(0))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sup.wait_failure(), timeout=0.5)
    await sup.shutdown()


async def test_finished_and_cancelled_tasks_leave_the_table() -> None:
    sup = Supervisor("t")
    done = sup.spawn("quick", asyncio.sleep(0))
    given_up = sup.spawn("slow", asyncio.sleep(60))
    await done
    given_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await given_up
    assert sup._tasks == {}
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(sup.wait_failure(), timeout=0.3)  # cancelling is no failure
    await sup.shutdown()
