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


def test_the_slab_is_registered_once_allocated_and_says_how() -> None:
    from yb_kvstore.hostmem import HostMemory

    seen: list[np.ndarray] = []

    def pinning(array: np.ndarray) -> HostMemory:
        seen.append(array)
        return HostMemory(True, "pinned (test)")

    slab = DramSlab(4, register=pinning)
    assert slab.memory is None and seen == []
    slab.ensure_layout(16)
    # The whole slab, once: the array every slot is a view of.
    assert len(seen) == 1 and seen[0].nbytes == 4 * 16
    view, _ = slab.reserve(1)
    assert np.shares_memory(view, seen[0])
    assert slab.memory == HostMemory(True, "pinned (test)")
    slab.ensure_layout(16)
    assert len(seen) == 1


def test_without_a_cuda_device_the_slab_stays_pageable_and_says_why() -> None:
    # The real registration on this machine: a CPU-only one stays pageable, with the
    # reason (no libcudart, or libcudart finding no device).
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present (see the cuda test)")
    slab = DramSlab(2)
    slab.ensure_layout(4096)
    assert slab.memory is not None and not slab.memory.pinned
    assert slab.memory.how.startswith("pageable (")


@pytest.mark.cuda
def test_with_cuda_the_slab_is_pinned() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    slab = DramSlab(2)
    slab.ensure_layout(1 << 20)
    assert slab.memory is not None and slab.memory.pinned, slab.memory
    # Pinned memory copies to the device asynchronously (pageable would not be
    # allowed to): a round trip through the GPU gives the same bytes.
    view, _ = slab.reserve(7)
    view[:] = np.arange(view.size, dtype=np.uint64).astype(np.uint8)
    host = torch.from_numpy(view)
    assert host.is_pinned()
    back = host.to("cuda", non_blocking=True).cpu()
    assert torch.equal(back, host)
