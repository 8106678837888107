"""One host's block pool: the DRAM slab, the SSD tier, the chain between them, events.

Blocks enter DRAM (puts), go down to SSD when DRAM needs room, and are dropped when
SSD needs room: DRAM -> SSD -> dropped, each step chosen by the tiers' eviction
policies, never taking a block that an in-flight transfer has pinned. A fetch of a
block on SSD brings it back up to DRAM first (its file is read straight into a slot)
and sends it from there.

Moving a block down costs a file write, which must not stall a put waiting for a
slot, so DRAM keeps `headroom` slots free: when it fills past that, the least
recently used blocks are written to SSD in the background (from their slots, no
copy; the slot is freed once the file is complete). If puts outrun that, a put takes
the slot of the least recently used block at once: its bytes are copied aside and
written from the copy, and reads of it are served from the copy until the file is
complete.

The conductor's retention advice (`RetentionPlanned`, `advise`) orders both tiers
where their policies take it (`eviction.RetentionPolicy`): blocks advised `drop` leave
first and are dropped, never written to SSD; blocks advised `demote` leave DRAM next;
the rest by recency, a block predicted to be reused every `g` seconds counting as `g`
seconds older. Nothing is evicted on the advice alone.

Every change of what the pool holds is announced as it happens, in order:
`BlockStored` (a committed put), `BlockMoved` (DRAM <-> SSD), `BlockEvicted`
(dropped), `BlocksCleared` (a new life). `announced` is exactly what those events
say, so a resync's inventory never disagrees with the event stream it continues.
Everything here runs on the event loop; file I/O runs on the SSD tier's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from yb_core import events as ev
from yb_core.block_events import AnyBlockEvent, BlockLog
from yb_core.telemetry import get_logger
from yb_kvstore.eviction import RetentionPolicy
from yb_kvstore.slab import DramSlab, SlabFull
from yb_kvstore.ssd import BlockCorrupt, SsdFull, SsdTier

log = get_logger(__name__)

#: Most keys per `BlockStored` when a restarted store announces what its SSD kept.
_ANNOUNCE_BATCH = 2048


class MissingBlocks(KeyError):
    """Blocks the pool does not hold (any more)."""

    def __init__(self, keys: Sequence[int]) -> None:
        super().__init__(", ".join(f"{k:x}" for k in keys[:4]))
        self.keys = list(keys)


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What the pool knows of a block besides its bytes: its layer chunks' checksums.

    The put's verified xxh3 per layer chunk; a fetch that asks for the same layout
    sends them along instead of hashing the block again.
    """

    checksums: tuple[int, ...]


@dataclass(slots=True)
class PoolStats:
    """Counters of the chain, for metrics and tests."""

    demoted: int = 0
    demoted_by_copy: int = 0
    promoted: int = 0
    dropped: int = 0


class BlockStore:
    """DRAM slab + optional SSD tier + the eviction chain + block events."""

    def __init__(
        self,
        dram: DramSlab,
        ssd: SsdTier | None,
        block_log: BlockLog,
        emit: Callable[[AnyBlockEvent], None],
        *,
        headroom: int = 0,
    ) -> None:
        self.dram = dram
        self.ssd = ssd
        self.block_log = block_log
        self._emit = emit
        self.headroom = max(0, min(headroom, dram.num_slots - 1)) if ssd is not None else 0
        self.stats = PoolStats()
        #: Each block's tier as the events announced it.
        self.announced: dict[int, ev.Tier] = {}
        self._meta: dict[int, BlockMeta] = {}
        self._demoting: set[int] = set()
        self._promoting: dict[int, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # --- life -------------------------------------------------------------------------

    async def open(self) -> None:
        """Start a new epoch: `BlocksCleared`, then the blocks the SSD tier kept."""
        self._emit(self.block_log.cleared())
        self.announced.clear()
        if self.ssd is None:
            return
        keys = await self.ssd.recover()
        for key in keys:
            entry = self.ssd.entry(key)
            assert entry is not None
            self._meta[key] = BlockMeta(entry.checksums)
        for i in range(0, len(keys), _ANNOUNCE_BATCH):
            self._announce_stored(keys[i : i + _ANNOUNCE_BATCH], "ssd")
        if keys:
            log.info("ssd_recovered", blocks=len(keys))

    async def close(self) -> None:
        """Stop background moves and wait for them (files half written are removed)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pool_task_failed", task=task.get_name(), error=repr(task.exception()))

    # --- what is held -----------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self.dram or (self.ssd is not None and key in self.ssd)

    def tier_of(self, key: int) -> ev.Tier | None:
        """Where the block is now ('dram' while it is still being moved down)."""
        if key in self.dram:
            return "dram"
        if self.ssd is not None and key in self.ssd:
            return "ssd"
        return None

    def advise(self, plan: ev.RetentionPlanned) -> None:
        """Take the conductor's retention advice into the tiers whose policy takes it."""
        for tier in (self.dram, self.ssd):
            policy = tier.policy if tier is not None else None
            if isinstance(policy, RetentionPolicy):
                policy.advise(
                    reuse=plan.reuse,
                    reuse_s=plan.reuse_s,
                    demote=plan.demote,
                    drop=plan.drop,
                    needed=plan.needed,
                    needed_s=plan.needed_s,
                )

    def _drop_advised(self, key: int) -> bool:
        policy = self.dram.policy
        return isinstance(policy, RetentionPolicy) and policy.marked(key) == "drop"

    def meta(self, key: int) -> BlockMeta | None:
        """The block's layer checksums, if held."""
        return self._meta.get(key)

    def inventory(self) -> ev.BlockInventory:
        """Everything announced so far, as of the latest event id."""
        dram = [k for k, t in self.announced.items() if t == "dram"]
        ssd = [k for k, t in self.announced.items() if t == "ssd"]
        return self.block_log.inventory(dram=dram, ssd=ssd)

    # --- events (state and announcement change together) ------------------------------

    def _announce_stored(self, keys: list[int], tier: ev.Tier) -> None:
        for key in keys:
            self.announced[key] = tier
        self._emit(self.block_log.stored(keys, tier))

    def _announce_moved(self, keys: list[int], from_tier: ev.Tier, to_tier: ev.Tier) -> None:
        for key in keys:
            self.announced[key] = to_tier
        self._emit(self.block_log.moved(keys, from_tier, to_tier))

    def _announce_dropped(self, keys: list[int]) -> None:
        if not keys:
            return
        for key in keys:
            self.announced.pop(key, None)
            self._meta.pop(key, None)
        self.stats.dropped += len(keys)
        self._emit(self.block_log.evicted(keys))

    # --- puts -------------------------------------------------------------------------

    def reserve_put(self, key: int, block_nbytes: int) -> np.ndarray | None:
        """A pinned DRAM slot for a block arriving now, or None if it is held already.

        Makes room down the chain if DRAM is full. Raises ValueError for a block
        that does not fit the slab's layout, SlabFull if every slot is pinned.
        """
        if key in self or key in self._promoting:
            return None
        self.dram.ensure_layout(block_nbytes)
        return self._take_slot(key)

    def commit_put(self, key: int, checksums: Sequence[int]) -> None:
        """The put's bytes are in the slot and verified: announce the block."""
        self.dram.unpin(key)
        self._meta[key] = BlockMeta(tuple(checksums))
        self._announce_stored([key], "dram")
        self._keep_headroom()

    def abort_put(self, key: int) -> None:
        """The put failed: its slot holds garbage and goes back, nothing is announced."""
        self.dram.discard(key)

    def _take_slot(self, key: int) -> np.ndarray:
        """A pinned slot for `key`, freeing the least recently used one if needed."""
        if self.dram.num_free == 0:
            victim = self.dram.victim()
            if victim is None:
                raise SlabFull(f"all {self.dram.num_slots} DRAM slots are pinned by transfers")
            self._move_down_now(victim)
        view, evicted = self.dram.reserve(key)
        assert not evicted
        return view

    def _move_down_now(self, key: int) -> None:
        """Free `key`'s slot at once: to SSD through a copy, or dropped without SSD."""
        meta = self._meta.get(key)
        if self.ssd is not None and meta is not None and not self._drop_advised(key):
            data = self.dram.view(key).copy()
            try:
                dropped = self.ssd.admit(key, data.nbytes, meta.checksums, staging=data)
            except SsdFull:
                pass
            else:
                self._announce_dropped(dropped)
                self.dram.discard(key)
                self.stats.demoted_by_copy += 1
                self._announce_moved([key], "dram", "ssd")
                self._spawn(self._write_copy(key, data), f"ssd-write:{key:x}")
                return
        self.dram.discard(key)
        self._announce_dropped([key])

    async def _write_copy(self, key: int, data: np.ndarray) -> None:
        assert self.ssd is not None
        try:
            await self.ssd.write(key, data)
        except OSError:
            self._announce_dropped([key])  # the entry is gone: so is the block

    # --- moving down in the background ------------------------------------------------

    def _keep_headroom(self) -> None:
        """Start writing LRU blocks to SSD until `headroom` slots are (being) freed."""
        if self.ssd is None or self._closed:
            return
        while self.dram.num_free + len(self._demoting) < self.headroom:
            victim = self.dram.victim()  # demoting blocks are pinned: never chosen twice
            meta = self._meta.get(victim) if victim is not None else None
            if victim is None or meta is None:
                return
            if self._drop_advised(victim):
                # No reuse is predicted: its slot is freed at once, no file written.
                self.dram.discard(victim)
                self._announce_dropped([victim])
                continue
            try:
                dropped = self.ssd.admit(victim, self.dram.block_nbytes, meta.checksums)
            except SsdFull:
                return
            self._announce_dropped(dropped)
            self.dram.pin(victim)
            self._demoting.add(victim)
            self._spawn(self._move_down(victim), f"ssd-demote:{victim:x}")

    async def _move_down(self, key: int) -> None:
        assert self.ssd is not None
        written = False
        try:
            await self.ssd.write(key, self.dram.view(key))
            written = True
        except OSError:
            pass  # the SSD entry is gone; the block stays in DRAM
        finally:
            self.dram.unpin(key)
            self._demoting.discard(key)
        if not written:
            return
        if self.dram.pinned(key) or key not in self.dram:
            # Read while it was being written: it is hot, keep it up here.
            self.ssd.drop(key)
            return
        self.dram.discard(key)
        self.stats.demoted += 1
        self._announce_moved([key], "dram", "ssd")
        self._keep_headroom()

    # --- fetches ----------------------------------------------------------------------

    async def acquire(self, keys: Sequence[int]) -> list[np.ndarray]:
        """Pin every block in DRAM (bringing SSD blocks up) and return their slots.

        Raises MissingBlocks if any is not held (then nothing stays pinned). Pair
        with `release(keys)` once the bytes are sent.
        """
        missing = [k for k in keys if k not in self and k not in self._promoting]
        if missing:
            raise MissingBlocks(missing)
        pinned: list[int] = []
        try:
            for key in keys:
                await self._pin_in_dram(key)
                pinned.append(key)
        except BaseException:
            self.release(pinned)
            raise
        return [self.dram.view(k) for k in keys]

    def release(self, keys: Sequence[int]) -> None:
        """Unpin blocks pinned by `acquire`."""
        for key in keys:
            self.dram.unpin(key)

    async def _pin_in_dram(self, key: int) -> None:
        for _attempt in range(4):
            if key in self.dram and key not in self._promoting:
                self.dram.pin(key)
                self.dram.touch(key)
                return
            task = self._promoting.get(key)
            if task is None:
                if self.ssd is None or key not in self.ssd:
                    raise MissingBlocks([key])
                task = asyncio.get_running_loop().create_task(
                    self._move_up(key), name=f"ssd-promote:{key:x}"
                )
                self._promoting[key] = task
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            # Shielded: a fetch that gives up must not stop a read that writes a slot.
            with contextlib.suppress(MissingBlocks):
                await asyncio.shield(task)
        raise MissingBlocks([key])

    async def _move_up(self, key: int) -> None:
        """Read an SSD block into a DRAM slot and announce the move."""
        assert self.ssd is not None
        ssd = self.ssd
        entry = ssd.entry(key)
        try:
            if entry is None:
                raise MissingBlocks([key])
            ssd.pin(key)
            try:
                self.dram.ensure_layout(entry.nbytes)
                slot = self._take_slot(key)
            except (ValueError, SlabFull) as exc:
                ssd.unpin(key)
                log.warning("ssd_promote_refused", key=f"{key:x}", reason=str(exc))
                raise MissingBlocks([key]) from None
            try:
                checksums = await ssd.read_into(key, slot)
            except BaseException as exc:
                self.dram.discard(key)
                ssd.unpin(key)
                if isinstance(exc, BlockCorrupt):
                    self._announce_dropped([key])  # the tier dropped its entry
                    raise MissingBlocks([key]) from None
                raise
            ssd.unpin(key)
            was_on_ssd = key in ssd
            ssd.drop(key)
            self._meta[key] = BlockMeta(checksums)
            self.dram.unpin(key)
            self.stats.promoted += 1
            if was_on_ssd:
                self._announce_moved([key], "ssd", "dram")
            else:  # its SSD write failed meanwhile and announced it dropped
                self._announce_stored([key], "dram")
            self._keep_headroom()
        finally:
            self._promoting.pop(key, None)
