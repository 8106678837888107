"""Eviction policies: which unpinned block leaves a tier first.

A policy only orders keys; the tier asks it for candidates and skips the ones it may
not evict (pinned by a transfer, being written). `eviction_policy` maps the configured
name (`kvstore.eviction_policy`) to a fresh instance; each tier gets its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
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


def eviction_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name; ValueError for an unknown one."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        known = sorted(EVICTION_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})") from None
