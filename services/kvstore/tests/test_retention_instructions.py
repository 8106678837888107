"""The kvstore follows the conductor's retention advice (`RetentionPlanned`): blocks
advised to drop leave first and never go to SSD, advice for a block not held yet
waits for it, and without advice the store's LRU decides."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_dataplane.transport import KVReceiver, KVSender
from yb_kvstore.eviction import RetentionPolicy

# The service tests' client and helpers, from beside this file.
sys.path.insert(0, str(Path(__file__).parent))
from test_service import (
    DEADLINE_S,
    INSTANCE,
    Client,
    block_events,
    config,
    start_store,
)


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    receiver = KVReceiver()
    await receiver.start()
    sender = KVSender()
    try:
        yield Client(sender, receiver)
    finally:
        await sender.close()
        await receiver.close()


async def test_the_store_drops_what_the_conductor_advises_and_falls_back_to_lru(
    bus: Bus, nats_config: NatsConfig, client: Client, tmp_path: Path
) -> None:
    reader = await bus.read_ordered(f"yb.ev.block.*.{INSTANCE}")
    cfg = config(nats_config, tmp_path / "ssd", dram_blocks=3, ssd_blocks=4)
    service, store = await start_store(cfg)
    worker = service.worker
    try:
        for key in (1, 2, 3):
            await client.put(store, key)
        # 2 is predicted never to be used again; 9 is not held yet (a request's own
        # block, stored when its prefill ends).
        await bus.publish(
            ev.RetentionPlanned(
                instance_id=INSTANCE,
                request_id="r",
                reuse=[1, 3],
                reuse_s=[0.0, 0.0],
                drop=[2, 9],
            )
        )
        policy = worker.store.dram.policy
        assert isinstance(policy, RetentionPolicy)
        async with asyncio.timeout(DEADLINE_S):  # until the store has taken the advice
            while policy.marked(2) != "drop":
                await asyncio.sleep(0.01)
        await client.put(store, 4)  # room for 4: 2 goes, dropped, though 1 is older
        await client.put(store, 9)  # no block advised: LRU, so 1 goes down to SSD
        await client.put(store, 10)  # 9 arrived with its advice: it goes, dropped
        await worker.publisher.drained()
        events = await block_events(reader, until=worker.block_log.event_id)
    finally:
        await service.stop()
        await reader.close()
    evicted = [e.block_hashes for e in events if isinstance(e, ev.BlockEvicted)]
    moved = [
        (e.block_hashes, e.from_tier, e.to_tier) for e in events if isinstance(e, ev.BlockMoved)
    ]
    assert evicted == [[2], [9]]
    assert moved == [([1], "dram", "ssd")]
    assert worker.store.announced == {1: "ssd", 3: "dram", 4: "dram", 10: "dram"}


def test_the_policy_orders_drop_demote_then_age_plus_interval() -> None:
    now = [0.0]
    policy = RetentionPolicy(clock=lambda: now[0])
    for t, key in enumerate((1, 2, 3, 4, 5)):
        now[0] = float(t)
        policy.touch(key)
    assert list(policy.victims()) == [1, 2, 3, 4, 5]  # no advice: LRU
    # 5 is reused every 10 s: it counts as used at 4 - 10 = -6, before all the others.
    policy.advise(reuse=[5, 1], reuse_s=[10.0, 0.0], demote=[3], drop=[4])
    assert list(policy.victims()) == [4, 3, 5, 1, 2]
    assert policy.marked(4) == "drop" and policy.marked(3) == "demote"
    now[0] = 20.0
    policy.touch(4)  # read after all: no longer dropped first
    assert policy.marked(4) is None
    assert list(policy.victims()) == [3, 5, 1, 2, 4]
    policy.advise(drop=[6])  # not held yet: waits for it
    assert 6 not in list(policy.victims())
    policy.touch(6)
    assert next(iter(policy.victims())) == 6
    policy.forget(6)
    assert 6 not in list(policy.victims())


def test_blocks_a_placed_request_will_read_leave_last_until_read_or_their_time() -> None:
    now = [0.0]
    policy = RetentionPolicy(clock=lambda: now[0])
    for t, key in enumerate((1, 2, 3, 4)):
        now[0] = float(t)
        policy.touch(key)
    # A queued request will read 1 and 2 (2 also advised to drop by an earlier one); 7
    # is not held, so nothing waits for it.
    policy.advise(drop=[2], needed=[1, 2, 7], needed_s=10.0)
    assert list(policy.victims()) == [3, 4, 2, 1]  # among the kept: drop first
    now[0] = 5.0
    policy.touch(1)  # read: an ordinary block again, by its age
    assert list(policy.victims()) == [3, 4, 1, 2]
    policy.touch(7)
    assert list(policy.victims())[-1] == 2  # 7 arrived after the advice: not kept
    now[0] = 13.0  # 2's time ran out (advised at 3, kept for 10 s)
    assert next(iter(policy.victims())) == 2
