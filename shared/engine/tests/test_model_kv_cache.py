"""KV page storage layout (a contract with the data plane) and the page allocator."""

from __future__ import annotations

import pytest
import torch

from yb_engine import OutOfPages, PageAllocator, PagedKVCache, tiny_random_model


def test_allocator_hands_out_distinct_pages_and_counts() -> None:
    alloc = PageAllocator(10)
    a = alloc.allocate(4)
    b = alloc.allocate(6)
    assert len(set(a) | set(b)) == 10
    assert (alloc.num_free, alloc.num_used) == (0, 10)
    alloc.free(a)
    assert (alloc.num_free, alloc.num_used) == (4, 6)
    assert sorted(alloc.allocate(4)) == sorted(a)


def test_out_of_pages_is_typed_and_allocates_nothing() -> None:
    alloc = PageAllocator(5)
    alloc.allocate(3)
    with pytest.raises(OutOfPages) as info:
        alloc.allocate(3)
    assert (info.value.needed, info.value.free) == (3, 2)
    assert "3" in str(info.value) and "2" in str(info.value)
    assert alloc.num_free == 2  # all or nothing


def test_double_free_and_foreign_free_are_errors_that_free_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)  # pages[0] again, with a valid pages[1]
    assert alloc.num_used == 1  # pages[1] was not freed by the failed call
    with pytest.raises(ValueError):
        alloc.free([3])  # never allocated
    with pytest.raises(ValueError):
        alloc.free([pages[1], pages[1]])
    alloc.free([pages[1]])
    assert alloc.num_free == 4


def test_cache_layout_and_page_views_are_contiguous_views() -> None:
    arch = tiny_random_model().config
    cache = PagedKVCache(arch, num_pages=7, block_size=16, dtype=torch.float32)
    assert cache.kv.shape == (arch.num_layers, 7, arch.num_kv_heads, 2, 16, arch.head_dim)
    assert cache.kv.is_contiguous()
    view = cache.page_view(1, 5)
    assert view.is_contiguous()
    assert view.shape == (arch.num_kv_heads, 2, 16, arch.head_dim)
    assert cache.page_nbytes == view.numel() * 4
    # a view, not a copy: its bytes are the cache's bytes at (layer, page)
    offset = (1 * 7 + 5) * cache.page_nbytes
    assert view.data_ptr() == cache.kv.data_ptr() + offset
    view.fill_(3.0)
    assert bool((cache.kv[1, 5] == 3.0).all())
    assert float(cache.kv[1, 4].abs().sum()) == 0.0
    with pytest.raises(IndexError):
        cache.page_view(0, 7)
    assert cache.pages_for(33) == 3 and cache.pages_for(32) == 2
