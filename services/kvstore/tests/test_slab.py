"""The DRAM slab: fixed slots, LRU eviction, pins respected, layout enforced."""

from __future__ import annotations

import numpy as np
import pytest

from yb_core.block_events import BlockLog
from yb_kvstore.slab import DramSlab, SlabFull


def _store(slab: DramSlab, key: int) -> list[int]:
    view, evicted = slab.reserve(key)
    view[:] = key % 251
    slab.unpin(key)
    return evicted


def test_lru_evicts_the_least_recently_used_unpinned_block() -> None:
    slab = DramSlab(3)
    slab.ensure_layout(8)
    for key in (1, 2, 3):
        assert _store(slab, key) == []
    slab.touch(1)  # 2 is now the oldest
    assert _store(slab, 4) == [2]
    assert sorted(slab.keys()) == [1, 3, 4]
    assert np.all(slab.view(4) == 4)


def test_pinned_blocks_are_never_evicted() -> None:
    slab = DramSlab(2)
    slab.ensure_layout(8)
    _store(slab, 1)
    _store(slab, 2)
    slab.pin(1)  # an in-flight transfer reads block 1
    assert _store(slab, 3) == [2]
    slab.pin(3)
    with pytest.raises(SlabFull):
        slab.reserve(4)
    slab.unpin(1)
    assert _store(slab, 4) == [1]


def test_layout_is_fixed_by_the_first_block() -> None:
    slab = DramSlab(2)
    slab.ensure_layout(16)
    slab.ensure_layout(16)
    with pytest.raises(ValueError, match="16 bytes"):
        slab.ensure_layout(32)


def test_block_log_numbers_events_and_inventories() -> None:
    log = BlockLog("kv0", epoch=7)
    first = log.cleared()
    stored = log.stored([1, 2], "dram")
    evicted = log.evicted([1])
    assert [e.event_id for e in (first, stored, evicted)] == [1, 2, 3]
    assert {e.epoch for e in (first, stored, evicted)} == {7}
    inv = log.inventory(dram=[2], ssd=[])
    assert (inv.event_id, inv.dram) == (3, [2])
