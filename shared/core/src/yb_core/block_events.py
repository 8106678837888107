"""Block events of one block holder (a kvstore, or an engine's own page cache).

Every instance that holds KV blocks tells the log what it holds: `BlockStored`,
`BlockEvicted`, `BlockMoved` (a tier change) and `BlocksCleared`, each with the
instance's `epoch` (new at every start: the wall-clock millisecond, so it grows
across restarts) and an `event_id` that grows by one per event, gap-free. A consumer
(the conductor's block index) that sees a gap or a new epoch asks for a resync with
`ResyncRequested`; the holder answers with a `BlockInventory` valid as of its latest
`event_id`, and the consumer carries on from there.

Every answer reaches the log: an inventory's own fields repeat when no block event
came between two requests (same epoch, same `event_id`), so its `Nats-Msg-Id` also
names the stream sequence of the request it answers. JetStream then drops only a
retried publish of the same answer, never a second answer to a second request (which
it used to, leaving the index stale when it had been voided in between).

`BlockLog` numbers and builds the events; `BlockEventPublisher` publishes them
strictly in `event_id` order (retrying through NATS outages, since a skipped event is
a gap every consumer would have to resync over) and answers resync requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from yb_core import events as ev
from yb_core.bus import Bus, BusError, EventReader
from yb_core.telemetry import get_logger

log = get_logger(__name__)

#: Every event a block holder publishes about its blocks.
AnyBlockEvent = (
    ev.BlockStored | ev.BlockEvicted | ev.BlockMoved | ev.BlocksCleared | ev.BlockInventory
)


class BlockLog:
    """Numbers and builds the block events of one instance."""

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
        """Blocks left this instance."""
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

    def inventory(
        self,
        *,
        dram: list[int] | None = None,
        ssd: list[int] | None = None,
        engine: list[int] | None = None,
    ) -> ev.BlockInventory:
        """The full list, valid as of the last event issued (it takes no new id)."""
        return ev.BlockInventory(
            instance_id=self.instance_id,
            epoch=self.epoch,
            event_id=self.event_id,
            dram=list(dram or []),
            ssd=list(ssd or []),
            engine=list(engine or []),
        )


def inventory_message_id(inventory: ev.BlockInventory, request_seq: int) -> str:
    """The `Nats-Msg-Id` of the inventory answering the request at `request_seq`."""
    return f"{ev.message_id_for(inventory)}:answers:{request_seq}"


#: Builds the holder's current inventory (called on the event loop, between events).
InventorySource = Callable[[], ev.BlockInventory]


class BlockEventPublisher:
    """Publishes one instance's block events in order and answers its resyncs.

    `emit()` is synchronous and cheap, so state changes and their events are recorded
    in the same step (no await in between, hence no reordering). Two owned tasks do
    the rest: `run_publisher()` drains the queue in order, `run_resyncs()` answers
    `ResyncRequested` for this instance with `inventory()`, queued behind every event
    issued so far so the inventory is valid at its `event_id`. The owner spawns both
    (after `open()`) and cancels them on shutdown.
    """

    def __init__(self, bus: Bus, block_log: BlockLog, inventory: InventorySource) -> None:
        self._bus = bus
        self.block_log = block_log
        self._inventory = inventory
        # Each event with the `Nats-Msg-Id` it keeps across retries ('' for the
        # event's own, see `message_id_for`).
        self._queue: asyncio.Queue[tuple[AnyBlockEvent, str]] = asyncio.Queue()
        self._resyncs: EventReader | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.published = 0

    async def open(self) -> None:
        """Subscribe to resync requests (before the first event, so none is missed)."""
        subject = f"yb.ev.block.resync_requested.{ev.subject_token(self.block_log.instance_id)}"
        self._resyncs = await self._bus.read_ordered(subject, new_only=True)

    def emit(self, event: AnyBlockEvent, *, msg_id: str = "") -> None:
        """Queue an event built by `block_log` (call in `event_id` order); `msg_id`
        overrides its de-duplication id (see the module docstring)."""
        self._idle.clear()
        self._queue.put_nowait((event, msg_id))

    @property
    def pending(self) -> int:
        """Events queued and not yet acknowledged by the log."""
        return self._queue.qsize() + (0 if self._idle.is_set() else 1)

    async def drained(self) -> None:
        """Wait until every event emitted so far is in the log (tests, shutdown)."""
        while not (self._idle.is_set() and self._queue.empty()):
            await asyncio.sleep(0.01)

    async def run_publisher(self) -> None:
        """Publish queued events strictly in order, retrying through outages."""
        while True:
            if self._queue.empty():
                self._idle.set()
            event, msg_id = await self._queue.get()
            self._idle.clear()
            while True:
                try:
                    await self._bus.publish(event, timeout_s=5.0, msg_id=msg_id)
                    self.published += 1
                    break
                except BusError as exc:
                    # Skipping one would open a gap that forces every consumer to
                    # resync: keep trying (the same message id de-duplicates).
                    log.warning("block_event_publish_retry", error=str(exc))
                    await asyncio.sleep(1.0)

    def emit_inventory(self, *, request_seq: int) -> ev.BlockInventory:
        """Queue the inventory that answers the resync request at `request_seq`.

        Its message id is unique per request (see the module docstring), and the
        same for every retry of this answer.
        """
        inventory = self._inventory()
        self.emit(inventory, msg_id=inventory_message_id(inventory, request_seq))
        return inventory

    async def run_resyncs(self) -> None:
        """Answer every resync request for this instance with its inventory."""
        assert self._resyncs is not None, "open() first"
        reader = self._resyncs
        try:
            async for item in reader:
                if isinstance(item.event, ev.ResyncRequested):
                    log.info("resync_requested", requester=item.event.requester, seq=item.seq)
                    self.emit_inventory(request_seq=item.seq)
        finally:
            with contextlib.suppress(Exception):
                await reader.close()
