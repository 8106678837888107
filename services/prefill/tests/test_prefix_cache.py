"""The engine tier and the reading of reuse plans, without a model or a network."""

from __future__ import annotations

import pytest

from yb_core import events as ev
from yb_core.block_events import AnyBlockEvent, BlockLog
from yb_engine.kv_cache import OutOfPages, PageAllocator
from yb_prefill.prefix_cache import PrefixCache
from yb_prefill.reuse import FetchRun, plan_runs, reusable_blocks


def make_cache(pages: int, capacity: int) -> tuple[PrefixCache, list[AnyBlockEvent]]:
    events: list[AnyBlockEvent] = []
    cache = PrefixCache(PageAllocator(pages), capacity, BlockLog("p0", epoch=5), events.append)
    cache.open()
    return cache, events


def test_adopted_blocks_are_announced_kept_and_reused_in_place() -> None:
    cache, events = make_cache(pages=8, capacity=4)
    pages = cache.allocate(3)
    spare = cache.adopt([10, 11], pages[:2])
    assert spare == []
    cache.free(pages[2:])  # the partial last page is not kept
    cache.release([10, 11])
    assert [type(e).__name__ for e in events] == ["BlocksCleared", "BlockStored"]
    stored = events[1]
    assert isinstance(stored, ev.BlockStored)
    assert (stored.tier, stored.block_hashes, stored.epoch) == ("engine", [10, 11], 5)
    # A later request gets the very same pages (no copy).
    assert cache.prefix_length([10, 11, 12]) == 2
    assert cache.acquire([10, 11]) == pages[:2]
    assert cache.allocator.num_used == 2
    cache.release([10, 11])
    assert cache.inventory().engine == [10, 11]


def test_capacity_and_page_pressure_evict_idle_blocks_only() -> None:
    cache, events = make_cache(pages=4, capacity=2)
    cache.adopt([1, 2, 3], cache.allocate(3))
    assert len(cache) == 3  # all referenced (uploads running): over capacity for now
    cache.release([2])
    assert sorted(cache.keys()) == [1, 3]  # trimmed at once: 2 was the idle one
    cache.release([1, 3])
    cache.release(cache.acquire([3]) and [3])  # a hit: 1 is now the least recently used
    cache.adopt([4], cache.allocate(1))
    cache.release([4])
    assert sorted(cache.keys()) == [3, 4]
    evicted = [e for e in events if isinstance(e, ev.BlockEvicted)]
    assert [e.block_hashes for e in evicted] == [[2], [1]]
    held = cache.acquire([4])
    # Four pages, two cached: a request for three evicts the idle one (3), not 4.
    fresh = cache.allocate(3)
    assert held[0] not in fresh and 3 not in cache and 4 in cache
    with pytest.raises(OutOfPages):
        cache.allocate(1)
    cache.free(fresh)
    cache.release([4])
    ids = [e.event_id for e in events]
    assert ids == list(range(1, len(ids) + 1))


def test_a_disabled_cache_announces_nothing_but_holds_pages_for_uploads() -> None:
    cache, events = make_cache(pages=4, capacity=0)
    pages = cache.allocate(2)
    assert cache.adopt([7, 8], pages) == []
    assert cache.page_of(7) == pages[0]
    cache.release([7, 8])
    assert len(cache) == 0 and cache.allocator.num_used == 0
    assert [type(e).__name__ for e in events] == ["BlocksCleared"]


def test_reusable_blocks_keep_the_last_token_computed() -> None:
    assert reusable_blocks(num_tokens=64, num_keys=4, block_size=16) == 3
    assert reusable_blocks(num_tokens=65, num_keys=4, block_size=16) == 4
    assert reusable_blocks(num_tokens=10, num_keys=0, block_size=16) == 0


def plan(source: str, tier: ev.Tier, first: int, count: int) -> ev.ReusePlan:
    return ev.ReusePlan(source_instance=source, tier=tier, first_block=first, num_blocks=count)


def test_plan_runs_merge_per_source_and_stop_at_gaps() -> None:
    plans = [
        plan("kv-1", "ssd", 5, 2),
        plan("p0", "engine", 0, 2),
        plan("kv-0", "dram", 2, 1),
        plan("kv-1", "dram", 3, 2),
    ]
    engine, runs = plan_runs(plans, "p0", limit=100)
    assert engine == 2
    assert runs == [
        FetchRun("kv-0", 2, 1, ("dram",)),
        FetchRun("kv-1", 3, 4, ("dram", "ssd")),
    ]
    # Capped by what the prompt may reuse.
    assert plan_runs(plans, "p0", limit=4)[1][-1] == FetchRun("kv-1", 3, 1, ("dram",))
    # A gap ends the prefix; another engine's cache is not ours to read.
    assert plan_runs([plan("kv-0", "dram", 1, 3)], "p0", 100) == (0, [])
    assert plan_runs([plan("p9", "engine", 0, 3)], "p0", 100) == (0, [])
