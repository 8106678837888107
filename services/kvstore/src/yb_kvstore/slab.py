"""The DRAM tier: one preallocated slab of fixed-size slots, one KV block per slot.

A block is every layer's keys and values for `block_size` tokens, so all blocks of a
model have one size. The slab is allocated on the first put (the store learns the
block size from its first writer, so it needs no model), and every later put must
match it. Allocation is `np.zeros`: the kernel maps the pages lazily, so an idle
store costs little resident memory however many slots it is configured with. Where
a CUDA device is present the slab is then page-locked (`hostmem.register`), so GPUs
copy blocks in and out by DMA in one copy; that makes all of it resident at once.
What was chosen, and why, is logged.
Eviction order comes from a pluggable policy (`policy.EvictionPolicy`, LRU by
default); a slot pinned by an in-flight transfer is never chosen.
"""

from __future__ import annotations

import time

import numpy as np

from yb_core.telemetry import get_logger
from yb_kvstore import hostmem
from yb_kvstore.eviction import EvictionPolicy, LruPolicy

log = get_logger(__name__)

__all__ = ["DramSlab", "EvictionPolicy", "LruPolicy", "SlabFull"]


class SlabFull(RuntimeError):
    """Every slot is pinned: nothing can be evicted to make room."""


class DramSlab:
    """Fixed slots in one contiguous array; blocks are written and read in place."""

    def __init__(
        self,
        num_slots: int,
        policy: EvictionPolicy | None = None,
        register: hostmem.Register = hostmem.register,
    ) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self.policy = policy or LruPolicy()
        self.block_nbytes = 0
        #: Whether the slab is pinned, and how (None until it is allocated).
        self.memory: hostmem.HostMemory | None = None
        self._register = register
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

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of the slab array (0 until the first put fixes the layout)."""
        return 0 if self._data is None else int(self._data.nbytes)

    def ensure_layout(self, block_nbytes: int) -> None:
        """Allocate the slab for blocks of `block_nbytes`, or check they match."""
        if block_nbytes <= 0:
            raise ValueError("block size must be positive")
        if self._data is None:
            self._data = np.zeros((self.num_slots, block_nbytes), dtype=np.uint8)
            self.block_nbytes = block_nbytes
            started = time.monotonic()
            self.memory = self._register(self._data)
            log.info(
                "dram_slab_allocated",
                nbytes=int(self._data.nbytes),
                slots=self.num_slots,
                block_nbytes=block_nbytes,
                memory=self.memory.how,
                register_s=round(time.monotonic() - started, 3),
            )
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
        Raises SlabFull if every slot is pinned.
        """
        assert self._data is not None, "ensure_layout first"
        if key in self._slot_of:
            self.pin(key)
            return self.view(key), []
        evicted: list[int] = []
        if not self._free:
            victim = self.victim()
            if victim is None:
                raise SlabFull(f"all {self.num_slots} DRAM slots are pinned by transfers")
            self.discard(victim)
            evicted.append(victim)
        slot = self._free.pop()
        self._slot_of[key] = slot
        self.policy.touch(key)
        self.pin(key)
        return self.view(key), evicted

    def victim(self) -> int | None:
        """The best unpinned block to evict, or None if every block is pinned."""
        for key in self.policy.victims():
            if key in self._slot_of and key not in self._pins:
                return key
        return None

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

    def pins(self, key: int) -> int:
        """How many pins hold `key`."""
        return self._pins.get(key, 0)

    def touch(self, key: int) -> None:
        """Record a use of `key` for the eviction policy."""
        if key in self._slot_of:
            self.policy.touch(key)

    def discard(self, key: int) -> None:
        """Remove `key` regardless of pins (its write failed, or it moved out)."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self._pins.pop(key, None)
            self.policy.forget(key)
