"""The DRAM tier: one preallocated slab of fixed-size slots, one KV block per slot.

A block is every layer's keys and values for `block_size` tokens, so all blocks of a
model have one size. The slab is allocated on the first put (the store learns the
block size from its first writer, so it needs no model), and every later put must
match it. Eviction is pluggable (`EvictionPolicy`, LRU by default) and never takes a
slot pinned by an in-flight transfer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

import numpy as np


class SlabFull(RuntimeError):
    """Every slot is pinned: nothing can be evicted to make room."""


class EvictionPolicy(Protocol):
    """Chooses which unpinned block leaves the slab first."""

    def touch(self, key: int) -> None:
        """`key` was used (stored or read)."""

    def forget(self, key: int) -> None:
        """`key` left the slab."""

    def victims(self) -> Iterator[int]:
        """Candidate keys, best victim first."""


class LruPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def touch(self, key: int) -> None:
        """Move `key` to the most-recent end."""
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: int) -> None:
        """Drop `key` from the order."""
        self._order.pop(key, None)

    def victims(self) -> Iterator[int]:
        """Oldest first."""
        return iter(list(self._order))


class DramSlab:
    """Fixed slots in one contiguous array; blocks are written and read in place."""

    def __init__(self, num_slots: int, policy: EvictionPolicy | None = None) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self.policy = policy or LruPolicy()
        self.block_nbytes = 0
        self._data: np.ndarray | None = None
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def keys(self) -> list[int]:
        """Every block key in the slab."""
        return list(self._slot_of)

    def ensure_layout(self, block_nbytes: int) -> None:
        """Allocate the slab for blocks of `block_nbytes`, or check they match."""
        if block_nbytes <= 0:
            raise ValueError("block size must be positive")
        if self._data is None:
            self._data = np.zeros((self.num_slots, block_nbytes), dtype=np.uint8)
            self.block_nbytes = block_nbytes
        elif block_nbytes != self.block_nbytes:
            raise ValueError(
                f"block of {block_nbytes} bytes does not fit slots of {self.block_nbytes} bytes"
            )

    def view(self, key: int) -> np.ndarray:
        """The slot holding `key`, as a writable view (no copy)."""
        assert self._data is not None
        view: np.ndarray = self._data[self._slot_of[key]]
        return view

    def reserve(self, key: int) -> tuple[np.ndarray, list[int]]:
        """A slot for `key` (pinned), evicting if needed; returns (view, evicted keys).

        The slot is pinned so that nothing evicts it while its bytes arrive; the caller
        `unpin`s it once the write is committed (or `discard`s it if the write failed).
        """
        assert self._data is not None, "ensure_layout first"
        if key in self._slot_of:
            self.pin(key)
            return self.view(key), []
        evicted: list[int] = []
        if not self._free:
            evicted.append(self._evict_one())
        slot = self._free.pop()
        self._slot_of[key] = slot
        self.policy.touch(key)
        self.pin(key)
        return self.view(key), evicted

    def pin(self, key: int) -> None:
        """Protect `key` from eviction (counted: pins nest)."""
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: int) -> None:
        """Release one pin."""
        count = self._pins.get(key, 0) - 1
        if count <= 0:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count

    def pinned(self, key: int) -> bool:
        """Whether an in-flight transfer holds `key`."""
        return key in self._pins

    def touch(self, key: int) -> None:
        """Record a use of `key` for the eviction policy."""
        if key in self._slot_of:
            self.policy.touch(key)

    def discard(self, key: int) -> None:
        """Remove `key` regardless of pins (its write failed: its bytes are garbage)."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self._pins.pop(key, None)
            self.policy.forget(key)

    def pop_victim(self) -> tuple[int, np.ndarray] | None:
        """Remove the best unpinned victim and return (key, a copy of its bytes)."""
        for key in self.policy.victims():
            if key in self._slot_of and key not in self._pins:
                data = self.view(key).copy()
                self.discard(key)
                return key, data
        return None

    def _evict_one(self) -> int:
        for key in self.policy.victims():
            if key in self._slot_of and key not in self._pins:
                self.discard(key)
                return key
        raise SlabFull(f"all {self.num_slots} DRAM slots are pinned by transfers")
