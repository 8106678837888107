"""The engine tier: full blocks kept in the prefill engine's own KV pages.

After a prefill, the pages holding the prompt's full blocks are not freed: they stay
here under their block keys, so a later request with the same prefix uses them in
place (its block table points at the very same pages; nothing is copied). The cache
is bounded (`capacity` pages), evicts the least recently used block nobody holds,
and gives pages back to the engine whenever a request needs more than are free.

A block in use by a request (its prefix) or by an upload to the kvstore is
referenced and never evicted. Every change is announced as a block event of tier
"engine" under the prefill instance's id, like a kvstore's.

Everything here runs on the event loop: the engine thread only computes into pages
it was given, so page ownership never changes under it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from yb_core import events as ev
from yb_core.block_events import AnyBlockEvent, BlockLog
from yb_engine.kv_cache import OutOfPages, PageAllocator


class PrefixCache:
    """Block key -> engine page, reference counted, LRU-bounded."""

    def __init__(
        self,
        allocator: PageAllocator,
        capacity: int,
        block_log: BlockLog,
        emit: Callable[[AnyBlockEvent], None],
    ) -> None:
        self.allocator = allocator
        self.capacity = max(0, capacity)
        self.block_log = block_log
        self._emit = emit
        self._page_of: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        # Unreferenced blocks, least recently used first: the eviction candidates.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._announced: set[int] = set()
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._page_of)

    def __contains__(self, key: object) -> bool:
        return key in self._page_of

    def keys(self) -> list[int]:
        """Every cached block key."""
        return list(self._page_of)

    def inventory(self) -> ev.BlockInventory:
        """The announced blocks, as of the latest event id."""
        return self.block_log.inventory(engine=sorted(self._announced))

    def open(self) -> None:
        """Start the epoch (`BlocksCleared`): an engine's pages do not survive it."""
        self._emit(self.block_log.cleared())

    # --- lookups --------------------------------------------------------------------

    def prefix_length(self, keys: Sequence[int]) -> int:
        """How many leading `keys` are cached."""
        n = 0
        for key in keys:
            if key not in self._page_of:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[int]) -> list[int]:
        """The pages of cached `keys`, referenced until `release(keys)`."""
        pages = [self._page_of[k] for k in keys]  # KeyError before any reference
        for key in keys:
            self._ref(key)
        self.hits += len(keys)
        return pages

    def release(self, keys: Sequence[int]) -> None:
        """Drop one reference per key; then trim to capacity."""
        for key in keys:
            count = self._refs.get(key, 0) - 1
            if count > 0:
                self._refs[key] = count
                continue
            self._refs.pop(key, None)
            if key in self._page_of:
                self._idle[key] = None  # most recently used end
        self._trim(self.capacity)

    def _ref(self, key: int) -> None:
        self._refs[key] = self._refs.get(key, 0) + 1
        self._idle.pop(key, None)

    # --- pages ----------------------------------------------------------------------

    @property
    def room(self) -> int:
        """How many fresh pages `allocate` can give now (free, or idle cached blocks
        it would evict)."""
        return self.allocator.num_free + len(self._idle)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages, evicting idle cached blocks if too few are free.

        Raises OutOfPages if even evicting every idle block would not free enough.
        """
        short = n - self.allocator.num_free
        if short > 0:
            if short > len(self._idle):
                raise OutOfPages(needed=n, free=self.room)
            self._evict(short)
        return self.allocator.allocate(n)

    def free(self, pages: Sequence[int]) -> None:
        """Give pages that hold nothing worth keeping back to the engine."""
        if pages:
            self.allocator.free(pages)

    def page_of(self, key: int) -> int:
        """The page holding a cached block (reference it first)."""
        return self._page_of[key]

    def adopt(self, keys: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Take over request pages holding full blocks `keys`; each key is referenced.

        Returns the pages it did not take (their block is cached already: that copy
        is referenced instead), which the caller frees. Release every key when done
        with it (after storing it elsewhere); the cache then trims itself to capacity.
        """
        spare: list[int] = []
        fresh: list[int] = []
        for key, page in zip(keys, pages, strict=True):
            if key in self._page_of:
                self._ref(key)
                spare.append(page)
                continue
            self._page_of[key] = page
            self._ref(key)
            fresh.append(key)
        if fresh and self.capacity > 0:
            self._announced.update(fresh)
            self._emit(self.block_log.stored(fresh, "engine"))
        return spare

    def _trim(self, limit: int) -> None:
        excess = len(self._page_of) - limit
        if excess > 0:
            self._evict(min(excess, len(self._idle)))

    def _evict(self, count: int) -> None:
        victims: list[int] = []
        for _ in range(count):
            key, _none = self._idle.popitem(last=False)
            victims.append(key)
        pages = [self._page_of.pop(k) for k in victims]
        self.allocator.free(pages)
        self.evictions += len(victims)
        announced = [k for k in victims if k in self._announced]
        if announced:
            self._announced.difference_update(announced)
            self._emit(self.block_log.evicted(announced))
