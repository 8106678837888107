"""A host's KV pool as the simulator plays it: a block set of fixed capacity that
logs what it stores and evicts, as the real kvstore does.

Eviction mirrors `yb_kvstore.eviction` by name (`lru`, `fifo`) on an ordered dict of
its own: that module is a separate service's (the conductor does not depend on it),
and its `victims()` copies the whole order on every call, which a simulator doing
thousands of stores cannot afford. A prompt's blocks are recorded tail first, so the
head of a chain is the most recent and eviction takes chain tails before the
prefixes they hang from (a prefix without its head is worthless).

It follows the conductor's retention advice (`RetentionPlanned`) as the real store
does (`yb_kvstore.eviction.RetentionPolicy`): when it must make room it evicts the
blocks marked `drop` first, then those marked `demote` (it has no SSD: demoted is
dropped), then by recency where a block advised to be reused every `g` seconds
counts as `g` seconds older than it is (an unmarked block: its own age, which is
LRU; ties: the chain's tail first), and last the blocks advised `needed` until they
are read or their time runs out. A read clears a `drop` or `demote` mark (the
block was reused after all). Advice for a block not held yet waits for it
(bounded). Its clock is the latest time it was told of (an advice, a store).

An `oracle` replaces all of that with Belady's rule, for the bound: evict the block
whose next use in the trace is farthest (`yb_tools.sim.retention.FutureUses`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Protocol

from yb_core import events as ev

# Advice classes: the marked ones in eviction order, then a reuse interval.
_DROP, _DEMOTE, _REUSE = 0, 1, 2


class NextUse(Protocol):
    """When a block is next used (`math.inf`: never again)."""

    def next_use(self, key: int) -> float:
        """The time of the block's next use."""


class SimKvstore:
    """One kvstore instance: `capacity` blocks, LRU or FIFO."""

    __slots__ = (
        "advised",
        "blocks",
        "capacity",
        "clock",
        "event_id",
        "heap",
        "host",
        "instance_id",
        "intervals",
        "last",
        "lru",
        "marked",
        "needed",
        "oracle",
        "pending",
        "pushed",
    )

    def __init__(self, instance_id: str, host: str, capacity: int, eviction: str = "lru") -> None:
        self.instance_id = instance_id
        self.host = host
        self.capacity = capacity
        self.lru = eviction == "lru"
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.event_id = 0
        # Blocks marked drop and demote, each in the blocks' order (oldest first).
        self.marked: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(),
            OrderedDict(),
        )
        # Advised reuse intervals; when each block was last stored or read (kept
        # once advice came); a min-heap of (last use - interval, push order, key),
        # entries that no longer match `_rank` skipped.
        self.intervals: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.pushed = 0
        # Advice for blocks not held yet: class and reuse interval.
        self.pending: OrderedDict[int, tuple[int, float]] = OrderedDict()
        # Blocks a placed request will read: the time each stays kept until.
        self.needed: dict[int, float] = {}
        self.advised = False
        self.clock = 0.0
        self.oracle: NextUse | None = None

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
        if self.advised:
            now = self.clock
            needed = self.needed
            for key in reversed(keys):
                for marked in self.marked:
                    marked.pop(key, None)
                if needed:
                    needed.pop(key, None)
                self._used(key, now)
        if not self.lru:
            return
        move = self.blocks.move_to_end
        for key in reversed(keys):
            move(key)

    def advise(self, plan: ev.RetentionPlanned, t: float) -> None:
        """Take the conductor's advice on which blocks to keep and which to let go."""
        if not self.advised:
            self.advised = True
            for key in self.blocks:
                self._used(key, t)
        self.clock = max(self.clock, t)
        blocks = self.blocks
        pending = self.pending
        advice = [
            *((key, _DROP, 0.0) for key in plan.drop),
            *((key, _DEMOTE, 0.0) for key in plan.demote),
            *((key, _REUSE, s) for key, s in zip(plan.reuse, plan.reuse_s, strict=False)),
        ]
        for key, cls, interval in reversed(advice):
            if key in blocks:
                self._mark(key, cls, interval)
            else:
                pending.pop(key, None)
                pending[key] = (cls, interval)
        until = t + plan.needed_s
        for key in plan.needed:
            if key in blocks:
                self.needed[key] = max(until, self.needed.get(key, 0.0))
        while len(pending) > 4 * self.capacity:
            pending.popitem(last=False)

    def _used(self, key: int, t: float) -> None:
        """`key` was stored or read at `t` (FIFO: only its first store counts)."""
        if not self.lru and key in self.last:
            return
        self.last[key] = t
        self._rank(key)

    def _rank(self, key: int) -> None:
        self.pushed += 1
        rank = self.last[key] - self.intervals.get(key, 0.0)
        heapq.heappush(self.heap, (rank, self.pushed, key))
        if len(self.heap) > 4 * len(self.blocks) + 64:
            last, intervals = self.last, self.intervals
            self.heap = [
                e
                for e in self.heap
                if e[2] in last and e[0] == last[e[2]] - intervals.get(e[2], 0.0)
            ]
            heapq.heapify(self.heap)

    def _mark_new(self, key: int, cls: int, interval: float) -> None:
        """Advice waiting for a block that just arrived (ranked as it is used)."""
        if cls == _REUSE:
            self.intervals[key] = interval
        else:
            self.marked[cls][key] = None

    def _mark(self, key: int, cls: int, interval: float) -> None:
        for marked in self.marked:
            marked.pop(key, None)
        if cls == _REUSE:
            self.intervals[key] = interval
        else:
            self.intervals.pop(key, None)
            self.marked[cls][key] = None
        self._rank(key)

    def _victims(self, excess: int, t: float) -> list[int]:
        """`excess` blocks to evict at `t`: by the oracle, else advice then order."""
        blocks = self.blocks
        if self.oracle is not None:
            # Belady: farthest next use first; ties go in the blocks' order.
            next_use = self.oracle.next_use
            order = {key: i for i, key in enumerate(blocks)}
            farthest = sorted(blocks, key=lambda k: (-next_use(k), order[k]))[:excess]
            for key in farthest:
                del blocks[key]
            return farthest
        out: list[int] = []
        needed = self.needed
        for key in [k for k, until in needed.items() if until <= t]:
            del needed[key]
        # Kept for a placed request: the last to go, in their ranks' order.
        kept: list[tuple[float, int, int]] = []
        for marked in self.marked:
            for key in list(marked):
                if len(out) == excess:
                    break
                if key in needed:
                    continue
                del marked[key]
                del blocks[key]
                out.append(key)
        heap = self.heap
        last = self.last
        intervals = self.intervals
        while len(out) < excess and heap:
            entry = heapq.heappop(heap)
            rank, _, key = entry
            if key in blocks and rank == last[key] - intervals.get(key, 0.0):
                if key in needed:
                    kept.append(entry)
                    continue
                del blocks[key]
                out.append(key)
        for entry in kept:
            key = entry[2]
            if len(out) < excess:
                del blocks[key]
                del needed[key]
                for marked in self.marked:
                    marked.pop(key, None)
                out.append(key)
            else:
                heapq.heappush(heap, entry)
        for key in out:
            last.pop(key, None)
            intervals.pop(key, None)
        return out

    def store(self, keys: list[int], t: float) -> list[ev.AnyEvent]:
        """Store `keys` (a prompt's full blocks); the events that announce the change."""
        blocks = self.blocks
        lru = self.lru
        new: list[int] = []
        pending = self.pending
        advised = self.advised
        if advised:
            self.clock = max(self.clock, t)
        for key in reversed(keys):
            if key in blocks:
                if lru:
                    blocks.move_to_end(key)
            else:
                blocks[key] = None
                new.append(key)
                if pending and key in pending:
                    cls, interval = pending.pop(key)
                    self._mark_new(key, cls, interval)
            if advised:
                self._used(key, t)
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
            if self.advised or self.oracle is not None:
                evicted = self._victims(excess, t)
            else:
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
