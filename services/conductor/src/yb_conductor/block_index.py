"""The global block index: which instances hold which KV blocks, in which tier.

The question the scheduler asks on every admission is "for each instance, how many
leading blocks of this chain does it hold?" — with 64+ prefill instances, as many
kvstores, and millions of blocks. Asking it instance by instance costs
O(instances x chain); here it costs one dict lookup and one integer AND per block of
the chain, plus a little per instance that drops out.

Each instance gets a *slot*, a bit position. For every key the index keeps one
Python int whose set bits are the slots holding it (`holders`). Walking the chain
with `alive &= holders[key]` leaves exactly the instances whose prefix is still
running; an instance's prefix length is the position where its bit falls out. Bits
are arbitrary-precision, so there is no limit on instances, and the walk stops as
soon as nobody is left.

Most chains, though, have one holder or two (the kvstore of the host that computed
the prefix, a copy or so). The walk pays the interpreter for every block, so with
few holders (`FEW_HOLDERS`) each one's run is counted in its own keys instead: a
loop in C (`itertools.takewhile`) over the slot's key dict, smaller than the whole
index and so kinder to the cache. Both give the same lengths and tier counts.

Tiers: most blocks sit in one tier per instance (a kvstore's DRAM, an engine's own
cache). Two sparse maps keep the slots holding a key in "ssd" and in "engine"; a
slot in `holders` that is in neither holds the block in DRAM. When no SSD or engine
block exists anywhere (the common case), the walk does not even look.

Per slot the index also keeps its keys, so that dropping an instance (restart,
inventory, death) costs its own blocks, not the whole index. They are dicts, not
sets: CPython's garbage collector never looks inside a dict that holds only ints,
but walks every entry of a set — with a million blocks, that is a pause of
milliseconds in the middle of a decision every time a full collection runs.

Everything here is deterministic: slots are handed out lowest-free-first in the
order instances appear in the log, so a replay rebuilds the same slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat, takewhile

from yb_core import events as ev

TIERS: tuple[ev.Tier, ...] = ("engine", "dram", "ssd")

# Up to this many holders of a chain's first block, `match` scans each holder's own
# keys (a loop in C over a smaller dict) instead of walking the chain once in Python
# with an AND per block: the walk pays the interpreter once per block, each scan a
# lookup per block of that holder's run (and per tier, one more where any block is
# out of DRAM). Replaying the conductor benchmark's logs in one process, a round of
# each in turn, decisions per second with up to 2 holders scanned over the walk
# alone: 1.075 at 64 + 16, 1.054 at 1,024 + 256; with up to 3 or up to 1 scanned,
# the same within the rounds' noise. In a warm loop a scan of 2 holders costs what
# the walk does, of 3 half as much again: so 2. With blocks out of DRAM the walk
# counts tiers block by block and the scan gains more (a 37-block chain with its
# tail on SSD, warm: 4.7 us against 12.2 for one holder, 9.4 against 13.9 for two).
FEW_HOLDERS = 2


@dataclass(frozen=True, slots=True)
class TierRun:
    """A contiguous run of blocks `[first, first + count)` held in one tier."""

    tier: ev.Tier
    first: int
    count: int


@dataclass(slots=True)
class ChainMatch:
    """What the pool holds of one chain: per slot, its prefix length and SSD share.

    `lengths[slot]` is the number of leading blocks the slot holds (only slots with
    at least one); `ssd[slot]` and `engine[slot]` count how many of those blocks it
    holds in that tier (absent: none).
    """

    lengths: dict[int, int]
    ssd: dict[int, int]
    engine: dict[int, int]


def _leading(owned: dict[int, None], keys: Sequence[int]) -> int:
    """How many leading `keys` are in `owned` (the position of the first that is not)."""
    return len(list(takewhile(owned.__contains__, keys)))


def _count_held(tier_map: dict[int, int], keys: Sequence[int], bit: int) -> int:
    """How many of `keys` have `bit` (one slot's) set in a tier's map."""
    return sum(map(bit.__and__, map(tier_map.get, keys, repeat(0)))) // bit


def _set_lengths(lengths: dict[int, int], slots: int, length: int) -> None:
    """Each slot whose bit is set in `slots` holds a prefix of `length` blocks."""
    while slots:
        low = slots & -slots
        lengths[low.bit_length() - 1] = length
        slots ^= low


class BlockIndex:
    """Key -> holder bitmask, per-tier exceptions, and per-slot key sets."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._ssd: dict[int, int] = {}
        self._engine: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._ids: list[str] = []
        self._keys_of: list[dict[int, None]] = []
        self._free_slots: list[int] = []

    # --- slots -------------------------------------------------------------------------

    def slot(self, instance_id: str) -> int:
        """The instance's slot, assigned (lowest free first) on first use."""
        slot = self._slot_of.get(instance_id)
        if slot is not None:
            return slot
        if self._free_slots:
            self._free_slots.sort()
            slot = self._free_slots.pop(0)
            self._ids[slot] = instance_id
        else:
            slot = len(self._ids)
            self._ids.append(instance_id)
            self._keys_of.append({})
        self._slot_of[instance_id] = slot
        return slot

    def slot_of(self, instance_id: str) -> int | None:
        """The instance's slot, or None if it never held a block."""
        return self._slot_of.get(instance_id)

    def instance(self, slot: int) -> str:
        """The instance id behind a slot."""
        return self._ids[slot]

    # --- updates -----------------------------------------------------------------------

    def store(self, instance_id: str, keys: Iterable[int], tier: ev.Tier) -> None:
        """The instance now holds `keys` in `tier` (moving them if held elsewhere)."""
        slot = self.slot(instance_id)
        bit = 1 << slot
        holders = self._holders
        owned = self._keys_of[slot]
        ssd, engine = self._ssd, self._engine
        for key in keys:
            holders[key] = holders.get(key, 0) | bit
            owned[key] = None
            if tier != "dram" or ssd or engine:
                self._set_tier(key, bit, tier)

    def move(self, instance_id: str, keys: Iterable[int], tier: ev.Tier) -> None:
        """Blocks the instance holds changed tier; keys it does not hold are ignored."""
        slot = self._slot_of.get(instance_id)
        if slot is None:
            return
        bit = 1 << slot
        for key in keys:
            if self._holders.get(key, 0) & bit:
                self._set_tier(key, bit, tier)

    def evict(self, instance_id: str, keys: Iterable[int]) -> None:
        """The instance no longer holds `keys`."""
        slot = self._slot_of.get(instance_id)
        if slot is None:
            return
        owned = self._keys_of[slot]
        for key in keys:
            if key in owned:
                del owned[key]
                self._unset(key, 1 << slot)
        self._release_if_empty(instance_id, slot)

    def clear(self, instance_id: str) -> None:
        """Forget everything the instance held."""
        slot = self._slot_of.get(instance_id)
        if slot is None:
            return
        bit = 1 << slot
        for key in self._keys_of[slot]:
            self._unset(key, bit)
        self._keys_of[slot] = {}
        self._release_if_empty(instance_id, slot)

    def _set_tier(self, key: int, bit: int, tier: ev.Tier) -> None:
        for name, tier_map in (("ssd", self._ssd), ("engine", self._engine)):
            if tier == name:
                tier_map[key] = tier_map.get(key, 0) | bit
            else:
                mask = tier_map.get(key, 0)
                if mask & bit:
                    mask &= ~bit
                    if mask:
                        tier_map[key] = mask
                    else:
                        del tier_map[key]

    def _unset(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)
        for tier_map in (self._ssd, self._engine):
            tmask = tier_map.get(key, 0)
            if tmask & bit:
                tmask &= ~bit
                if tmask:
                    tier_map[key] = tmask
                else:
                    del tier_map[key]

    def _release_if_empty(self, instance_id: str, slot: int) -> None:
        # A slot with no blocks goes back to the pool, so instance churn (new ids at
        # every restart) does not grow the masks without bound.
        if not self._keys_of[slot]:
            del self._slot_of[instance_id]
            self._ids[slot] = ""
            self._free_slots.append(slot)

    # --- queries -----------------------------------------------------------------------

    def match(self, keys: Sequence[int]) -> ChainMatch:
        """Every slot's prefix length over `keys`: one walk of the chain, or with
        `FEW_HOLDERS` holders at most, a scan of each one's own keys."""
        lengths: dict[int, int] = {}
        ssd_counts: dict[int, int] = {}
        engine_counts: dict[int, int] = {}
        if not keys:
            return ChainMatch(lengths, ssd_counts, engine_counts)
        holders = self._holders
        alive = holders.get(keys[0], 0)
        if not alive:
            return ChainMatch(lengths, ssd_counts, engine_counts)
        ssd, engine = self._ssd, self._engine
        # Tiers are counted only where some block anywhere is not in DRAM.
        count_tiers = bool(ssd or engine)
        n = len(keys)
        if alive.bit_count() <= FEW_HOLDERS:
            keys_of = self._keys_of
            while alive:
                low = alive & -alive
                slot = low.bit_length() - 1
                run = _leading(keys_of[slot], keys)
                lengths[slot] = run
                if count_tiers:
                    for tier_map, counts in ((ssd, ssd_counts), (engine, engine_counts)):
                        if tier_map and (held := _count_held(tier_map, keys[:run], low)):
                            counts[slot] = held
                alive ^= low
            return ChainMatch(lengths, ssd_counts, engine_counts)
        get = holders.get
        if not count_tiers:
            # The usual case, walked without the tiers' test per block.
            for i, key in enumerate(keys[1:], 1):
                nxt = alive & get(key, 0)
                if nxt != alive:
                    _set_lengths(lengths, alive ^ nxt, i)
                    alive = nxt
                    if not alive:
                        break
            _set_lengths(lengths, alive, n)
            return ChainMatch(lengths, ssd_counts, engine_counts)
        for i in range(1, n):
            self._count_tiers(keys[i - 1], alive, ssd_counts, engine_counts)
            nxt = alive & get(keys[i], 0)
            if nxt != alive:
                _set_lengths(lengths, alive ^ nxt, i)
                alive = nxt
                if not alive:
                    break
        else:
            self._count_tiers(keys[n - 1], alive, ssd_counts, engine_counts)
        _set_lengths(lengths, alive, n)
        return ChainMatch(lengths, ssd_counts, engine_counts)

    def _count_tiers(
        self, key: int, alive: int, ssd_counts: dict[int, int], engine_counts: dict[int, int]
    ) -> None:
        """Count the block in the SSD and engine tiers of the `alive` slots holding it."""
        for tier_map, counts in ((self._ssd, ssd_counts), (self._engine, engine_counts)):
            if tier_map:
                m = tier_map.get(key, 0) & alive
                while m:
                    low = m & -m
                    s = low.bit_length() - 1
                    counts[s] = counts.get(s, 0) + 1
                    m ^= low

    def held(self, key: int) -> bool:
        """Whether any instance holds the block."""
        return key in self._holders

    def prefix_length(self, keys: Sequence[int], instance_id: str) -> int:
        """How many leading blocks of `keys` one instance holds (any tier)."""
        slot = self._slot_of.get(instance_id)
        return _leading(self._keys_of[slot], keys) if slot is not None else 0

    def tier_runs(self, keys: Sequence[int], first: int, end: int, slot: int) -> list[TierRun]:
        """Blocks `[first, end)` of `keys` on one slot, cut into runs of one tier."""
        if not self._ssd and not self._engine:
            # No block anywhere is in another tier: one run in DRAM.
            return [TierRun("dram", first, end - first)] if end > first else []
        bit = 1 << slot
        runs: list[TierRun] = []
        run_tier: ev.Tier | None = None
        run_start = first
        for i in range(first, end):
            key = keys[i]
            if self._ssd.get(key, 0) & bit:
                tier: ev.Tier = "ssd"
            elif self._engine.get(key, 0) & bit:
                tier = "engine"
            else:
                tier = "dram"
            if tier != run_tier:
                if run_tier is not None:
                    runs.append(TierRun(run_tier, run_start, i - run_start))
                run_tier, run_start = tier, i
        if run_tier is not None:
            runs.append(TierRun(run_tier, run_start, end - run_start))
        return runs

    def tier_of(self, key: int, instance_id: str) -> ev.Tier | None:
        """The tier one instance holds a key in, or None."""
        slot = self._slot_of.get(instance_id)
        if slot is None:
            return None
        bit = 1 << slot
        if not self._holders.get(key, 0) & bit:
            return None
        if self._ssd.get(key, 0) & bit:
            return "ssd"
        if self._engine.get(key, 0) & bit:
            return "engine"
        return "dram"

    def holders(self, key: int) -> list[str]:
        """Instances holding a key, by slot."""
        mask = self._holders.get(key, 0)
        out = []
        while mask:
            low = mask & -mask
            out.append(self._ids[low.bit_length() - 1])
            mask ^= low
        return out

    def keys_of(self, instance_id: str) -> set[int]:
        """The keys one instance holds (a copy)."""
        slot = self._slot_of.get(instance_id)
        return set(self._keys_of[slot]) if slot is not None else set()

    def blocks_held(self, instance_id: str) -> int:
        """How many blocks one instance holds."""
        slot = self._slot_of.get(instance_id)
        return len(self._keys_of[slot]) if slot is not None else 0

    def __len__(self) -> int:
        """Distinct keys held anywhere."""
        return len(self._holders)

    def __contains__(self, key: object) -> bool:
        return key in self._holders

    # --- snapshots ---------------------------------------------------------------------

    def export(self) -> list[tuple[str, list[int], list[int], list[int]]]:
        """Per slot (in slot order): instance id, every key it holds in the order it
        holds them, and which of those it holds in SSD and in the engine (the rest:
        DRAM).

        Masks can exceed 64 bits, which msgpack cannot carry; key lists can, and
        slot order lets `restore` hand out the very same slots again. The held order
        is the slot's own, across tiers: a list per tier would lose it (a key
        re-stored in another tier keeps its place), and a restored index would then
        export the same keys in another order once later events moved them into one
        tier.
        """
        out: list[tuple[str, list[int], list[int], list[int]]] = []
        for slot, instance_id in enumerate(self._ids):
            bit = 1 << slot
            held = list(self._keys_of[slot])
            ssd = [k for k in held if self._ssd.get(k, 0) & bit] if self._ssd else []
            engine = [k for k in held if self._engine.get(k, 0) & bit] if self._engine else []
            out.append((instance_id, held, ssd, engine))
        return out

    @classmethod
    def restore(cls, slots: Sequence[tuple[str, list[int], list[int], list[int]]]) -> BlockIndex:
        """The index `export` described, with the same slot numbers and key order.

        Also reads snapshots whose first list held only the DRAM keys: their SSD and
        engine keys come after them.
        """
        index = cls()
        holders = index._holders
        for slot, (instance_id, held, ssd, engine) in enumerate(slots):
            index._ids.append(instance_id)
            owned: dict[int, None] = {}
            index._keys_of.append(owned)
            if not instance_id:
                index._free_slots.append(slot)
                continue
            index._slot_of[instance_id] = slot
            bit = 1 << slot
            for key in held:
                holders[key] = holders.get(key, 0) | bit
                owned[key] = None
            for keys, tier_map in ((ssd, index._ssd), (engine, index._engine)):
                for key in keys:
                    holders[key] = holders.get(key, 0) | bit
                    owned[key] = None  # already there (in place) unless an old snapshot
                    tier_map[key] = tier_map.get(key, 0) | bit
        return index
