"""A host's KV pool as the simulator plays it: a block set of fixed capacity that
logs what it stores and evicts, as the real kvstore does.

Eviction mirrors `yb_kvstore.eviction` by name (`lru`, `fifo`) on an ordered dict of
its own: that module is a separate service's (the conductor does not depend on it),
and its `victims()` copies the whole order on every call, which a simulator doing
thousands of stores cannot afford. A prompt's blocks are recorded tail first, so the
head of a chain is the most recent and eviction takes chain tails before the
prefixes they hang from (a prefix without its head is worthless).
"""

from __future__ import annotations

from collections import OrderedDict

from yb_core import events as ev


class SimKvstore:
    """One kvstore instance: `capacity` blocks, LRU or FIFO."""

    __slots__ = ("blocks", "capacity", "event_id", "host", "instance_id", "lru")

    def __init__(self, instance_id: str, host: str, capacity: int, eviction: str = "lru") -> None:
        self.instance_id = instance_id
        self.host = host
        self.capacity = capacity
        self.lru = eviction == "lru"
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.event_id = 0

    def _next(self) -> int:
        self.event_id += 1
        return self.event_id

    def cleared(self, t: float) -> ev.BlocksCleared:
        """The first event of its epoch: it starts empty."""
        return ev.BlocksCleared(
            time=t, instance_id=self.instance_id, epoch=1, event_id=self._next()
        )

    def prefix(self, keys: list[int]) -> int:
        """How many leading blocks of `keys` it holds."""
        blocks = self.blocks
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def touch(self, keys: list[int]) -> None:
        """`keys` were read (LRU: they become the most recent, head last)."""
        if not self.lru:
            return
        move = self.blocks.move_to_end
        for key in reversed(keys):
            move(key)

    def store(self, keys: list[int], t: float) -> list[ev.AnyEvent]:
        """Store `keys` (a prompt's full blocks); the events that announce the change."""
        blocks = self.blocks
        lru = self.lru
        new: list[int] = []
        for key in reversed(keys):
            if key in blocks:
                if lru:
                    blocks.move_to_end(key)
            else:
                blocks[key] = None
                new.append(key)
        out: list[ev.AnyEvent] = []
        if new:
            new.reverse()
            out.append(
                ev.BlockStored(
                    time=t,
                    instance_id=self.instance_id,
                    epoch=1,
                    event_id=self._next(),
                    block_hashes=new,
                    tier="dram",
                )
            )
        excess = len(blocks) - self.capacity
        if excess > 0:
            pop = blocks.popitem
            evicted = [pop(last=False)[0] for _ in range(excess)]
            out.append(
                ev.BlockEvicted(
                    time=t,
                    instance_id=self.instance_id,
                    epoch=1,
                    event_id=self._next(),
                    block_hashes=evicted,
                )
            )
        return out
