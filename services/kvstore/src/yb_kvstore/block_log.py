"""This store's block events, numbered so that consumers can trust the index.

Each event carries the store's `epoch` (new at every start: the wall-clock
millisecond, so it increases across restarts) and an `event_id` that grows by one per
event. A consumer that sees a gap or a new epoch knows it missed something and asks
for a resync, which this store answers with a `BlockInventory` at its current
`event_id`. Events are built here and published by the service in order.
"""

from __future__ import annotations

import time

from yb_shared import events as ev


class BlockLog:
    """Numbers and builds the block events of one store instance."""

    def __init__(self, instance_id: str, epoch: int | None = None) -> None:
        self.instance_id = instance_id
        self.epoch = epoch if epoch is not None else int(time.time() * 1000)
        self.event_id = 0

    def _next(self) -> int:
        self.event_id += 1
        return self.event_id

    def cleared(self) -> ev.BlocksCleared:
        """The first event of an epoch: nothing from an earlier life survives."""
        return ev.BlocksCleared(
            instance_id=self.instance_id, epoch=self.epoch, event_id=self._next()
        )

    def stored(self, keys: list[int], tier: ev.Tier) -> ev.BlockStored:
        """Blocks became available in `tier`."""
        return ev.BlockStored(
            instance_id=self.instance_id,
            epoch=self.epoch,
            event_id=self._next(),
            block_hashes=keys,
            tier=tier,
        )

    def evicted(self, keys: list[int]) -> ev.BlockEvicted:
        """Blocks left this store."""
        return ev.BlockEvicted(
            instance_id=self.instance_id, epoch=self.epoch, event_id=self._next(), block_hashes=keys
        )

    def moved(self, keys: list[int], from_tier: ev.Tier, to_tier: ev.Tier) -> ev.BlockMoved:
        """Blocks changed tier."""
        return ev.BlockMoved(
            instance_id=self.instance_id,
            epoch=self.epoch,
            event_id=self._next(),
            block_hashes=keys,
            from_tier=from_tier,
            to_tier=to_tier,
        )

    def inventory(self, dram: list[int], ssd: list[int]) -> ev.BlockInventory:
        """The full list, valid as of the last event issued (it takes no new id)."""
        return ev.BlockInventory(
            instance_id=self.instance_id,
            epoch=self.epoch,
            event_id=self.event_id,
            dram=dram,
            ssd=ssd,
        )
