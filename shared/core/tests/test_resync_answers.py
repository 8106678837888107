"""Every resync request gets its own answer in the log, even when nothing changed.

Two `ResyncRequested` back to back, with no block event in between, are answered by
two inventories whose fields are identical (same epoch, same `event_id`): each must
still reach the log, while a retried publish of one answer must not land twice.
"""

from __future__ import annotations

import asyncio

from yb_core import events as ev
from yb_core.block_events import BlockEventPublisher, BlockLog, inventory_message_id
from yb_core.bus import Bus


async def _inventories(bus: Bus, want: int, timeout_s: float = 60.0) -> list[int]:
    """Stream sequences of the inventories in the log, once `want` are there (or the
    deadline passed), read up to a marker published after them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    found: list[int] = []
    while loop.time() < deadline:
        marker = await bus.publish(ev.LoadReport(instance_id="marker", role="gateway"))
        reader = await bus.read_ordered()
        found = []
        try:
            while True:
                item = await reader.next(timeout_s=5.0)
                assert item is not None, "the log ended before the marker"
                if isinstance(item.event, ev.BlockInventory):
                    found.append(item.seq)
                if item.seq >= marker:
                    break
        finally:
            await reader.close()
        if len(found) >= want:
            return found
        await asyncio.sleep(0.05)
    return found


async def test_two_resyncs_back_to_back_both_reach_the_log(bus: Bus) -> None:
    block_log = BlockLog("kv0", epoch=7)
    held = [11, 12]
    publisher = BlockEventPublisher(bus, block_log, lambda: block_log.inventory(dram=held))
    await publisher.open()
    tasks = [
        asyncio.create_task(publisher.run_publisher()),
        asyncio.create_task(publisher.run_resyncs()),
    ]
    try:
        publisher.emit(block_log.stored(held, "dram"))
        for n in (1, 2):
            # Two occurrences at the same event time, told apart as the conductor
            # does (by the sequence it had folded up to).
            request = ev.ResyncRequested(instance_id="kv0", requester="c", time=1.0)
            await bus.publish(request, msg_id=f"{ev.message_id_for(request)}:at:{n}")
        seqs = await _inventories(bus, 2)
        # Identical fields, distinct answers: both are in the log.
        assert len(seqs) == 2, seqs
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_retried_answer_is_still_stored_once(bus: Bus) -> None:
    inventory = BlockLog("kv0", epoch=7).inventory(dram=[1])
    msg_id = inventory_message_id(inventory, request_seq=42)
    first = await bus.publish(inventory, msg_id=msg_id)
    again = await bus.publish(inventory, msg_id=msg_id)
    # JetStream answers a duplicate with the sequence of the stored message.
    assert again == first
    other = await bus.publish(inventory, msg_id=inventory_message_id(inventory, request_seq=43))
    assert other > first
