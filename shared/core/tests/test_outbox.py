"""The outbox against a real nats-server: order kept, nothing awaited by the caller,
what is left published by `flush`, a failure dropped rather than raised."""

from __future__ import annotations

import asyncio

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.outbox import Outbox


async def _logged_ids(bus: Bus, count: int) -> list[str]:
    reader = await bus.read_ordered()
    ids: list[str] = []
    while len(ids) < count:
        item = await reader.next(timeout_s=60)
        assert item is not None, ids
        assert isinstance(item.event, ev.RequestCancelled)
        ids.append(item.event.request_id)
    await reader.close()
    return ids


async def test_events_reach_the_log_in_the_order_put(bus: Bus) -> None:
    outbox = Outbox(bus, max_batch=8)
    runner = asyncio.create_task(outbox.run())
    # Put from several places at once, as requests do: 50 events in 7 bursts, so
    # batches of one and full batches both occur.
    ids = [f"r{i}" for i in range(50)]
    for start in range(0, 50, 8):
        for rid in ids[start : start + 8]:
            outbox.put(ev.RequestCancelled(request_id=rid, reason="test"))
        await asyncio.sleep(0)
    assert await _logged_ids(bus, 50) == ids
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)


async def test_put_returns_before_the_log_has_the_event(bus: Bus) -> None:
    outbox = Outbox(bus)
    outbox.put(ev.RequestCancelled(request_id="r0", reason="test"))
    # No task runs the outbox: the event waits in it, stamped with when it arose.
    assert outbox.pending == 1
    assert await bus.last_sequence() == 0


async def test_flush_publishes_what_is_left_without_the_task(bus: Bus) -> None:
    outbox = Outbox(bus)
    for i in range(3):
        outbox.put(ev.RequestCancelled(request_id=f"r{i}", reason="test"))
    await outbox.flush(timeout_s=30)
    assert outbox.pending == 0
    assert await _logged_ids(bus, 3) == ["r0", "r1", "r2"]


async def test_a_publish_that_fails_is_dropped_not_raised(bus: Bus) -> None:
    outbox = Outbox(bus)
    await bus.close()
    outbox.put(ev.RequestCancelled(request_id="r0", reason="test"))
    # A closed bus fails the publish at once; the outbox logs it and goes on.
    await outbox.flush(timeout_s=30)
    assert outbox.pending == 0
