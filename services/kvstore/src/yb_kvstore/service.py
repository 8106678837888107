"""The kvstore service: one host's pool of KV blocks, put and fetched over UCX.

Puts arrive as UCX transfers whose request id names the block (`blocks.PutId`): the
first segment reserves a DRAM slot (evicting the least recently used unpinned block
if the slab is full), the bytes land straight in the slot, and only a verified commit
makes the block visible (`BlockStored`). Fetches pin the blocks and send them from
their slots straight into the asker's reservation. Every change of the block set is
an event with this store's epoch and a gap-free event id, published in order; a
`ResyncRequested` for this store is answered with its whole inventory.

This step keeps blocks in DRAM only; the SSD tier is configured but not yet used.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import Counter, Gauge

from yb_kvstore.block_log import BlockLog
from yb_kvstore.blocks import parse_key, parse_put_id
from yb_kvstore.slab import DramSlab, SlabFull
from yb_shared import events as ev
from yb_shared.bus import Bus, BusError, EventReader
from yb_shared.config import YbConfig
from yb_shared.instance import Presence
from yb_shared.service import Service
from yb_shared.telemetry import get_logger
from yb_shared.transport import (
    BufferLike,
    FetchOrder,
    KVReceiver,
    KVSender,
    Reservation,
    ReservationRefused,
    SegmentHeader,
    TransferError,
)

log = get_logger(__name__)


class KVStoreService(Service):
    """Serves one host's KV blocks from a DRAM slab."""

    role = "kvstore"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg)
        self.slab = DramSlab(cfg.kvstore.dram_blocks)
        self.block_log = BlockLog(self.instance_id)
        self.receiver = KVReceiver(cfg.kvstore.ucx_host, cfg.kvstore.ucx_port)
        self.sender = KVSender()
        self.bus: Bus | None = None
        self.presence: Presence | None = None
        self.ucx_address = ""
        self._events: asyncio.Queue[ev.AnyEvent] = asyncio.Queue()
        self._m_blocks = Gauge(
            "yb_kvstore_blocks", "Blocks held, by tier", ["tier"], registry=self.metrics
        )
        self._m_puts = Counter(
            "yb_kvstore_puts_total", "Block puts by outcome", ["outcome"], registry=self.metrics
        )
        self._m_fetches = Counter(
            "yb_kvstore_fetches_total",
            "Block fetches by outcome",
            ["outcome"],
            registry=self.metrics,
        )
        self._m_evictions = Counter(
            "yb_kvstore_evictions_total", "Blocks evicted from DRAM", registry=self.metrics
        )

    async def start(self) -> None:
        """Open the UCX listener, announce, and start serving."""
        self.serve_metrics()
        self.bus = await Bus.connect(self.cfg.nats, self.instance_id)
        await self.bus.ensure_stream()
        address = await self.receiver.start()
        self.ucx_address = str(address)
        self.receiver.set_reservation_factory(
            self._reserve_put, deadline_s=30.0, on_reserved=self._watch_put
        )
        self.receiver.set_fetch_handler(self._serve_fetch)
        resyncs = await self.bus.read_ordered(
            f"yb.ev.block.resync_requested.{ev.subject_token(self.instance_id)}", new_only=True
        )
        # A new epoch starts empty: consumers drop whatever an earlier life announced.
        self._events.put_nowait(self.block_log.cleared())
        self.presence = Presence(
            self.bus,
            ev.InstanceUp(
                instance_id=self.instance_id,
                role="kvstore",
                host=self.cfg.host,
                model=self.cfg.model.name,
                ucx_address=self.ucx_address,
                block_size=self.cfg.model.block_size,
                kv_capacity_blocks=self.slab.num_slots,
                epoch=self.block_log.epoch,
                metrics_address=self.metrics_address,
            ),
            self._load_report,
            self.cfg.kvstore.load_report_interval_s,
        )
        await self.presence.announce()
        self.tasks.spawn("events", self._publish_events())
        self.tasks.spawn("resyncs", self._answer_resyncs(resyncs))
        self.tasks.spawn("presence", self.presence.run())

    async def stop(self) -> None:
        """Stop serving and retire; idempotent."""
        if self.presence is not None:
            await self.presence.retire("stopped")
            self.presence = None
        await self.tasks.shutdown()
        await self.receiver.close()
        await self.sender.close()
        if self.bus is not None:
            bus, self.bus = self.bus, None
            await bus.close()

    # --- puts -----------------------------------------------------------------------

    def _reserve_put(self, request_id: str, header: SegmentHeader) -> list[BufferLike] | None:
        """Transport callback: slots for a put's buffers, or None to refuse it."""
        del header
        put = parse_put_id(request_id)
        if put is None:
            self._m_puts.labels("refused").inc()
            return None
        if put.key in self.slab:
            self._m_puts.labels("duplicate").inc()
            return None  # already held: the sender need not send it again
        try:
            self.slab.ensure_layout(put.block_nbytes)
            slot, evicted = self.slab.reserve(put.key)
        except (ValueError, SlabFull) as exc:
            log.warning("put_refused", request_id=request_id, reason=str(exc))
            self._m_puts.labels("refused").inc()
            return None
        if evicted:
            self._m_evictions.inc(len(evicted))
            self._events.put_nowait(self.block_log.evicted(evicted))
        n = put.page_nbytes
        return [slot[i * n : (i + 1) * n] for i in range(put.num_layers)]

    def _watch_put(self, reservation: Reservation) -> None:
        put = parse_put_id(reservation.request_id)
        assert put is not None
        self.tasks.spawn(f"put:{reservation.request_id}", self._finish_put(put.key, reservation))

    async def _finish_put(self, key: int, reservation: Reservation) -> None:
        try:
            await reservation.wait_committed()
        except TransferError as exc:
            # Half-written bytes are garbage: the slot goes back, nothing was announced.
            self.slab.discard(key)
            self._m_puts.labels("failed").inc()
            log.info("put_failed", key=key, reason=str(exc))
            return
        self.slab.unpin(key)
        self._m_puts.labels("stored").inc()
        self._events.put_nowait(self.block_log.stored([key], "dram"))

    # --- fetches --------------------------------------------------------------------

    async def _serve_fetch(self, order: FetchOrder) -> None:
        """Send blocks `order.keys` into the asker's reservation, layer by layer."""
        keys = [parse_key(k) for k in order.keys]
        missing = [
            k
            for k, key in zip(order.keys, keys, strict=True)
            if key is None or key not in self.slab
        ]
        if missing:
            self._m_fetches.labels("missing").inc()
            raise ReservationRefused(f"blocks not held here: {', '.join(missing[:4])}")
        held = [k for k in keys if k is not None]
        for key in held:
            self.slab.pin(key)
            self.slab.touch(key)
        try:
            layers = max(1, order_layers(order.request_id))
            items: list[tuple[int, BufferLike]] = []
            for i, key in enumerate(held):
                block = self.slab.view(key)
                n = block.nbytes // layers
                items += [
                    (i * layers + layer, block[layer * n : (layer + 1) * n])
                    for layer in range(layers)
                ]
            await self.sender.send(
                order.reply_to, order.request_id, items, deadline_s=order.remaining_s()
            )
            await self.sender.commit(
                order.reply_to, order.request_id, deadline_s=order.remaining_s()
            )
            self._m_fetches.labels("served").inc()
        finally:
            for key in held:
                self.slab.unpin(key)

    # --- events ---------------------------------------------------------------------

    async def _publish_events(self) -> None:
        """Publish block events strictly in event-id order, retrying through outages."""
        assert self.bus is not None
        while True:
            event = await self._events.get()
            self._m_blocks.labels("dram").set(len(self.slab))
            while True:
                try:
                    await self.bus.publish(event, timeout_s=5.0)
                    break
                except BusError as exc:
                    # Skipping one would open a gap that forces every consumer to
                    # resync: keep trying (the same message id de-duplicates).
                    log.warning("block_event_publish_retry", error=str(exc))
                    await asyncio.sleep(1.0)

    async def _answer_resyncs(self, reader: EventReader) -> None:
        try:
            async for item in reader:
                if isinstance(item.event, ev.ResyncRequested):
                    log.info("resync_requested", requester=item.event.requester)
                    self._events.put_nowait(self.block_log.inventory(self.slab.keys(), []))
        finally:
            with contextlib.suppress(Exception):
                await reader.close()

    def _load_report(self) -> ev.LoadReport:
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="kvstore",
            kv_used_blocks=len(self.slab),
            kv_total_blocks=self.slab.num_slots,
            dram_blocks=len(self.slab),
        )


def order_layers(request_id: str) -> int:
    """Layers per block a fetch asks for: its request id ends in `.L<layers>`."""
    tail = request_id.rsplit(".", 1)[-1]
    if tail.startswith("L") and tail[1:].isdigit():
        return int(tail[1:])
    return 1
