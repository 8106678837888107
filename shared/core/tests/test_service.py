"""Service lifecycle: owned tasks, first failure noticed, shutdown cancels everything."""

from __future__ import annotations

import asyncio

import pytest

from yb_core.service import Supervisor


async def test_first_failure_is_raised_and_shutdown_cancels_the_rest() -> None:
    sup = Supervisor("t")
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def crash() -> None:
        raise RuntimeError("boom")

    sup.spawn("forever", forever())
    sup.spawn("crash", crash())
    with pytest.raises(RuntimeError, match="boom"):
        await asyncio.wait_for(sup.wait_failure(), timeout=60)
    await sup.shutdown(timeout_s=60)
    assert cancelled.is_set()
    await sup.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="after shutdown"):
        sup.spawn("late", asyncio.sleep(0))


class Marker(Exception):
    """A failure the test causes after the events it checks, to prove they were seen."""


async def test_tasks_that_end_normally_are_not_failures() -> None:
    sup = Supervisor("t")
    waiting = asyncio.create_task(sup.wait_failure())
    await sup.spawn("quick", asyncio.sleep(0))
    assert sup._tasks == {}  # a clean end leaves the table at once
    # A failure after the clean end: the first (and only) one `wait_failure` reports.
    # Had it taken the clean end for a failure, it would have ended before this.
    sup.spawn("marker", _raise(Marker("after quick")))
    with pytest.raises(Marker, match="after quick"):
        await asyncio.wait_for(waiting, timeout=60)
    await sup.shutdown()


async def _raise(exc: Exception) -> None:
    raise exc


async def test_finished_and_cancelled_tasks_leave_the_table() -> None:
    sup = Supervisor("t")
    waiting = asyncio.create_task(sup.wait_failure())
    done = sup.spawn("quick", asyncio.sleep(0))
    given_up = sup.spawn("slow", asyncio.sleep(60))
    await done
    given_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await given_up
    assert sup._tasks == {}
    # Cancelling is no failure: the marker failure that follows is the first one seen.
    sup.spawn("marker", _raise(Marker("after the cancel")))
    with pytest.raises(Marker, match="after the cancel"):
        await asyncio.wait_for(waiting, timeout=60)
    await sup.shutdown()


def test_the_startup_heap_is_frozen_and_young_collections_made_rarer() -> None:
    """Objects alive once a service has started are out of the collector's reach;
    garbage cycles made before are collected first, not frozen with them."""
    import gc

    from yb_core.service import GC_THRESHOLD_AFTER_START, freeze_startup_heap

    class Node:
        def __init__(self) -> None:
            self.me = self

    threshold = gc.get_threshold()
    try:
        kept = Node()
        Node()  # a cycle nobody holds: garbage
        gc.unfreeze()
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_THRESHOLD_AFTER_START, *threshold[1:])
        assert not gc.garbage
        assert kept.me is kept
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
