"""Eviction policies: which unpinned block leaves a tier first.

A policy only orders keys; the tier asks it for candidates and skips the ones it may
not evict (pinned by a transfer, being written). `eviction_policy` maps the configured
name (`kvstore.eviction_policy`) to a fresh instance; each tier gets its own. With
`retention=True` it is a `RetentionPolicy` in that order: the same order until the
conductor's retention advice comes, then the advice first.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol


class EvictionPolicy(Protocol):
    """Chooses which block of a tier leaves first."""

    def touch(self, key: int) -> None:
        """`key` was used (stored or read)."""

    def forget(self, key: int) -> None:
        """`key` left the tier."""

    def victims(self) -> Iterator[int]:
        """Candidate keys, best victim first (the tier may change while iterating)."""


class LruPolicy:
    """Least recently used first: what Mooncake's pool does by default."""

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


class FifoPolicy(LruPolicy):
    """First stored, first out: reads do not rejuvenate a block."""

    def touch(self, key: int) -> None:
        """Only a new key takes a place (at the back)."""
        if key not in self._order:
            self._order[key] = None


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "fifo": FifoPolicy,
}


def eviction_policy(name: str, *, retention: bool = False) -> EvictionPolicy:
    """A fresh policy by name (a `RetentionPolicy` in its order with `retention`);
    ValueError for an unknown one."""
    if name not in EVICTION_POLICIES:
        known = sorted(EVICTION_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})")
    if retention:
        return RetentionPolicy(fifo=name == "fifo")
    return EVICTION_POLICIES[name]()


class RetentionPolicy:
    """LRU that takes the conductor's retention advice (`RetentionPlanned`).

    Victims come in this order: blocks advised `drop` (least recently used first),
    then those advised `demote`, then every other block by recency, where a block
    predicted to be reused every `g` seconds counts as `g` seconds older than it is;
    last of all, blocks a placed request will read (`needed`), until read or until
    their time runs out.
    A block without advice keeps its own age, so with no advice at all this is LRU
    (`fifo`: FIFO, a read does not rejuvenate a block). A read clears a `drop` or
    `demote` mark: the block was reused after all. Advice for a key the tier does not
    hold waits for it (the request's blocks arrive after the decision), at most
    `pending_limit` keys, the oldest forgotten first.

    The clock is `clock` (seconds); tests pass one they move by hand.
    """

    def __init__(
        self,
        *,
        fifo: bool = False,
        clock: Callable[[], float] = time.monotonic,
        pending_limit: int = 65536,
    ) -> None:
        self._fifo = fifo
        self._clock = clock
        self._pending_limit = pending_limit
        self._last: dict[int, float] = {}
        self._intervals: dict[int, float] = {}
        self._marked: dict[str, OrderedDict[int, None]] = {
            "drop": OrderedDict(),
            "demote": OrderedDict(),
        }
        self._pending: OrderedDict[int, tuple[str, float]] = OrderedDict()
        # Blocks a placed request will read: the clock time each is kept until.
        self._needed: dict[int, float] = {}
        # (last use - interval, push order, key); entries that no longer match skipped.
        self._heap: list[tuple[float, int, int]] = []
        self._pushed = 0

    def advise(
        self,
        *,
        reuse: Sequence[int] = (),
        reuse_s: Sequence[float] = (),
        demote: Sequence[int] = (),
        drop: Sequence[int] = (),
        needed: Sequence[int] = (),
        needed_s: float = 0.0,
    ) -> None:
        """Take advice: `reuse[i]` is predicted to be used every `reuse_s[i]` seconds;
        `demote` and `drop` leave first (drop before demote); `needed` (held blocks a
        placed request will read) leave last, until read or for `needed_s`."""
        until = self._clock() + needed_s
        for key in needed:
            if key in self._last:
                self._needed[key] = max(until, self._needed.get(key, until))
        advice = [
            *((key, "reuse", s) for key, s in zip(reuse, reuse_s, strict=False)),
            *((key, "demote", 0.0) for key in demote),
            *((key, "drop", 0.0) for key in drop),
        ]
        for key, kind, interval in advice:
            if key in self._last:
                self._apply(key, kind, interval)
            else:
                self._pending.pop(key, None)
                self._pending[key] = (kind, interval)
        while len(self._pending) > self._pending_limit:
            self._pending.popitem(last=False)

    def marked(self, key: int) -> str | None:
        """`drop` or `demote` if the block is advised to leave first, else None."""
        for kind, keys in self._marked.items():
            if key in keys:
                return kind
        return None

    def touch(self, key: int) -> None:
        """`key` was stored or read now."""
        known = key in self._last
        if known and self._fifo:
            return
        for keys in self._marked.values():
            keys.pop(key, None)
        self._needed.pop(key, None)
        self._last[key] = self._clock()
        if not known and key in self._pending:
            kind, interval = self._pending.pop(key)
            self._apply(key, kind, interval)
        else:
            self._rank(key)

    def forget(self, key: int) -> None:
        """`key` left the tier."""
        self._last.pop(key, None)
        self._intervals.pop(key, None)
        self._needed.pop(key, None)
        for keys in self._marked.values():
            keys.pop(key, None)

    def victims(self) -> Iterator[int]:
        """Drop-advised, then demote-advised, then by recency less the interval, and
        the blocks a placed request will read last."""
        now = self._clock()
        needed = self._needed
        for key in [k for k, until in needed.items() if until <= now]:
            del needed[key]
        kept: list[int] = []
        for kind in ("drop", "demote"):
            for key in list(self._marked[kind]):
                if key in needed:
                    kept.append(key)
                else:
                    yield key
        if len(self._heap) > 2 * len(self._last) + 64:
            self._compact()
        heap = list(self._heap)
        seen: set[int] = set()  # a key re-ranked at the same rank has two entries
        while heap:
            rank, _, key = heapq.heappop(heap)
            if self._current(key) == rank and key not in seen and self.marked(key) is None:
                seen.add(key)
                if key in needed:
                    kept.append(key)
                else:
                    yield key
        yield from kept

    def _apply(self, key: int, kind: str, interval: float) -> None:
        for keys in self._marked.values():
            keys.pop(key, None)
        if kind == "reuse":
            self._intervals[key] = interval
        else:
            self._intervals.pop(key, None)
            self._marked[kind][key] = None
        self._rank(key)

    def _current(self, key: int) -> float | None:
        last = self._last.get(key)
        return None if last is None else last - self._intervals.get(key, 0.0)

    def _rank(self, key: int) -> None:
        rank = self._current(key)
        if rank is None:
            return
        self._pushed += 1
        heapq.heappush(self._heap, (rank, self._pushed, key))

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._current(e[2]) == e[0]]
        heapq.heapify(self._heap)
