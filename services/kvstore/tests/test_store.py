"""The block pool without the network: the DRAM -> SSD -> dropped chain, pins, events.

Real files in a temporary directory, real I/O threads; what is checked is what the
rest of the cluster sees: the bytes a fetch gets back, and the block events.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from yb_core import events as ev
from yb_core.block_events import AnyBlockEvent, BlockLog
from yb_kvstore.eviction import FifoPolicy, eviction_policy
from yb_kvstore.slab import DramSlab, SlabFull
from yb_kvstore.ssd import SsdTier, State, chunk_checksums
from yb_kvstore.store import BlockStore, MissingBlocks

LAYERS = 4
CHUNK = 1024
BLOCK = LAYERS * CHUNK


def block_bytes(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BLOCK, dtype=np.uint8)


class Pool:
    """A BlockStore with its events recorded."""

    def __init__(self, store: BlockStore, events: list[AnyBlockEvent]) -> None:
        self.store = store
        self.events = events

    def put(self, key: int) -> None:
        slot = self.store.reserve_put(key, BLOCK)
        assert slot is not None
        data = block_bytes(key)
        slot[:] = data
        self.store.commit_put(key, chunk_checksums(data, LAYERS))

    async def fetch(self, key: int) -> np.ndarray:
        (slot,) = await self.store.acquire([key])
        try:
            return slot.copy()
        finally:
            self.store.release([key])

    async def settle(self) -> None:
        """Let background moves finish (they run on I/O threads)."""
        await wait_until(lambda: not self.store._tasks, "background moves finished")

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


@pytest.fixture
async def io() -> AsyncIterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(2, thread_name_prefix="test-ssd")
    yield executor
    executor.shutdown(wait=True)


async def make_pool(
    io: ThreadPoolExecutor,
    ssd_dir: Path | None,
    *,
    dram: int,
    ssd: int = 0,
    headroom: int = 0,
    epoch: int = 1,
    policy: str = "lru",
) -> Pool:
    events: list[AnyBlockEvent] = []
    tier = SsdTier(ssd_dir, ssd, io, eviction_policy(policy)) if ssd_dir is not None else None
    store = BlockStore(
        DramSlab(dram, eviction_policy(policy)),
        tier,
        BlockLog("kv-test", epoch=epoch),
        events.append,
        headroom=headroom,
    )
    await store.open()
    return Pool(store, events)


def corrupt_tail(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-10, 2)
        f.write(b"garbage!!!")


def fold(events: list[AnyBlockEvent]) -> dict[int, ev.Tier]:
    """What a consumer of the events believes the store holds."""
    held: dict[int, ev.Tier] = {}
    for event in events:
        match event:
            case ev.BlocksCleared():
                held.clear()
            case ev.BlockStored():
                held.update(dict.fromkeys(event.block_hashes, event.tier))
            case ev.BlockMoved():
                held.update(dict.fromkeys(event.block_hashes, event.to_tier))
            case ev.BlockEvicted():
                for key in event.block_hashes:
                    held.pop(key, None)
    return held


def assert_events_consistent(pool: Pool) -> None:
    ids = [e.event_id for e in pool.events]
    assert ids == list(range(1, len(ids) + 1)), "event ids must be gap-free"
    assert isinstance(pool.events[0], ev.BlocksCleared)
    assert fold(pool.events) == pool.store.announced
    actual = {k: pool.store.tier_of(k) for k in pool.store.announced}
    assert actual == pool.store.announced


async def wait_until(check: Callable[[], bool], what: str = "the condition") -> None:
    """Poll `check` until true; what it waits for runs on I/O threads. The deadline
    is generous (a loaded machine), since the wait ends as soon as `check` holds."""
    try:
        async with asyncio.timeout(60):
            while not check():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"never happened: {what}") from None


async def test_without_ssd_lru_blocks_are_dropped(io: ThreadPoolExecutor) -> None:
    pool = await make_pool(io, None, dram=2)
    pool.put(1)
    pool.put(2)
    await pool.fetch(1)  # 2 is now the least recently used
    pool.put(3)
    assert sorted(pool.store.dram.keys()) == [1, 3]
    kinds = ["BlocksCleared", "BlockStored", "BlockStored", "BlockEvicted", "BlockStored"]
    assert pool.kinds() == kinds
    assert pool.events[3].block_hashes == [2]  # type: ignore[union-attr]
    with pytest.raises(MissingBlocks):
        await pool.store.acquire([2])
    assert_events_consistent(pool)


async def test_chain_dram_to_ssd_to_dropped_and_back_up(
    io: ThreadPoolExecutor, tmp_path: Path
) -> None:
    pool = await make_pool(io, tmp_path, dram=2, ssd=2)
    for key in (1, 2, 3):  # 3 pushes 1 down to SSD
        pool.put(key)
    await pool.settle()
    assert pool.store.tier_of(1) == "ssd"
    assert pool.store.ssd is not None and pool.store.ssd.path(1).exists()
    pool.put(4)  # pushes 2 down; SSD holds 1, 2
    pool.put(5)  # pushes 3 down; SSD full: 1 (least recent) is dropped
    await pool.settle()
    assert pool.store.tier_of(1) is None
    assert (pool.store.tier_of(2), pool.store.tier_of(3)) == ("ssd", "ssd")
    assert sorted(pool.store.dram.keys()) == [4, 5]
    # A fetch of an SSD block brings it up (pushing the LRU DRAM block down) intact.
    assert np.array_equal(await pool.fetch(2), block_bytes(2))
    await pool.settle()
    assert pool.store.tier_of(2) == "dram"
    # The promoted block's file is removed off the event loop: it goes soon after.
    await wait_until(lambda: not pool.store.ssd.path(2).exists())  # type: ignore[union-attr]
    moved = [e for e in pool.events if isinstance(e, ev.BlockMoved)]
    assert (moved[-1].block_hashes, moved[-1].to_tier) in (([2], "dram"), ([4], "ssd"))
    assert ([2], "ssd", "dram") in [(m.block_hashes, m.from_tier, m.to_tier) for m in moved]
    assert pool.store.stats.promoted == 1
    assert_events_consistent(pool)
    await pool.store.close()


async def test_pinned_blocks_are_never_evicted(io: ThreadPoolExecutor, tmp_path: Path) -> None:
    pool = await make_pool(io, tmp_path, dram=2, ssd=1)
    pool.put(1)
    pool.put(2)
    slots = await pool.store.acquire([1, 2])  # two fetches in flight
    with pytest.raises(SlabFull):
        pool.store.reserve_put(3, BLOCK)
    pool.store.release([2])
    pool.put(3)  # 2 goes down, 1 stays pinned in DRAM
    assert np.array_equal(slots[0], block_bytes(1))
    await pool.settle()
    assert pool.store.tier_of(1) == "dram" and pool.store.tier_of(2) == "ssd"
    # An SSD block being read up is pinned there too: SSD's only block cannot be dropped.
    pool.store.release([1])
    assert_events_consistent(pool)
    await pool.store.close()


async def test_headroom_moves_blocks_down_in_the_background(
    io: ThreadPoolExecutor, tmp_path: Path
) -> None:
    pool = await make_pool(io, tmp_path, dram=4, ssd=8, headroom=2)
    for key in range(1, 5):
        pool.put(key)
        await pool.settle()
    # Two slots are kept free: the two oldest blocks went to SSD without a put waiting.
    assert pool.store.dram.num_free == 2
    assert sorted(pool.store.dram.keys()) == [3, 4]
    assert pool.store.stats.demoted == 2 and pool.store.stats.demoted_by_copy == 0
    for key in (1, 2):
        assert np.array_equal(await pool.fetch(key), block_bytes(key))
    await pool.settle()
    assert_events_consistent(pool)
    await pool.store.close()


async def test_fetch_during_the_copy_path_reads_the_staged_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every SSD file write is held at a gate the test opens, so the fetches below
    # happen while the files are still being written, by construction.
    gate = threading.Event()
    real_write = SsdTier._write_file

    def gated_write(path: Path, header: bytes, data: np.ndarray) -> None:
        assert gate.wait(timeout=60), "the test never opened the gate"
        real_write(path, header, data)

    monkeypatch.setattr(SsdTier, "_write_file", staticmethod(gated_write))
    # Threads for two held writes and the staged copies beside them.
    io = ThreadPoolExecutor(4, thread_name_prefix="test-ssd")
    try:
        pool = await make_pool(io, tmp_path, dram=1, ssd=4)
        pool.put(1)
        pool.put(2)  # 1 leaves DRAM through a copy; its file is still being written
        assert pool.store.stats.demoted_by_copy == 1
        assert pool.store.tier_of(1) == "ssd"
        assert pool.store.ssd is not None
        entry = pool.store.ssd.entry(1)
        assert entry is not None and entry.state is State.WRITING
        # Bringing 1 up needs 2's slot: 2 goes down by copy too. Both stay intact.
        assert np.array_equal(await pool.fetch(1), block_bytes(1))
        entry = pool.store.ssd.entry(2)
        assert entry is not None and entry.state is State.WRITING
        assert np.array_equal(await pool.fetch(2), block_bytes(2))
        gate.set()
        await pool.settle()
        assert_events_consistent(pool)
        await pool.store.close()
    finally:
        gate.set()
        io.shutdown(wait=True)


async def test_corrupt_ssd_file_is_dropped_not_served(
    io: ThreadPoolExecutor, tmp_path: Path
) -> None:
    pool = await make_pool(io, tmp_path, dram=1, ssd=2)
    pool.put(1)
    pool.put(2)
    await pool.settle()
    assert pool.store.ssd is not None
    path = pool.store.ssd.path(1)
    await asyncio.to_thread(corrupt_tail, path)
    with pytest.raises(MissingBlocks):
        await pool.store.acquire([1])
    assert pool.store.tier_of(1) is None
    assert isinstance(pool.events[-1], ev.BlockEvicted)
    assert pool.events[-1].block_hashes == [1]
    assert_events_consistent(pool)
    await pool.store.close()


async def test_restart_starts_a_new_epoch_and_keeps_the_ssd_tier(
    io: ThreadPoolExecutor, tmp_path: Path
) -> None:
    pool = await make_pool(io, tmp_path, dram=2, ssd=4, epoch=1)
    for key in (1, 2, 3, 4):
        pool.put(key)
    await pool.settle()
    on_ssd = sorted(k for k, t in pool.store.announced.items() if t == "ssd")
    assert on_ssd == [1, 2]
    await pool.store.close()

    again = await make_pool(io, tmp_path, dram=2, ssd=4, epoch=2)
    # The new life: BlocksCleared first, then what survived on SSD (DRAM did not).
    assert again.kinds() == ["BlocksCleared", "BlockStored"]
    assert all(e.epoch == 2 for e in again.events)
    stored = again.events[1]
    assert isinstance(stored, ev.BlockStored) and stored.tier == "ssd"
    assert sorted(stored.block_hashes) == [1, 2]
    for key in (1, 2):
        assert np.array_equal(await again.fetch(key), block_bytes(key))
    inventory = again.store.inventory()
    assert sorted(inventory.dram) == [1, 2] and inventory.event_id == again.events[-1].event_id
    assert_events_consistent(again)
    await again.store.close()


async def test_fifo_policy_ignores_reads(io: ThreadPoolExecutor) -> None:
    pool = await make_pool(io, None, dram=2, policy="fifo")
    assert isinstance(pool.store.dram.policy, FifoPolicy)
    pool.put(1)
    pool.put(2)
    await pool.fetch(1)
    pool.put(3)  # FIFO: 1 goes although it was just read
    assert sorted(pool.store.dram.keys()) == [2, 3]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        eviction_policy("mru")
