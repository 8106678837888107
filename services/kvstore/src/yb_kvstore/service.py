"""The kvstore service: one host's pool of KV blocks, put and fetched over UCX.

Puts arrive as UCX transfers whose request id names the block
(`yb_dataplane.transport.blocks`): the first segment reserves a DRAM slot (the pool
makes room down its DRAM -> SSD -> dropped chain), the bytes land straight in the
slot, and only a verified commit makes the block visible (`BlockStored`). Fetches pin
the blocks in DRAM (bringing SSD blocks up first) and send them from their slots
straight into the asker's reservation, with the checksums verified when they were
put. The pool (`store.BlockStore`) announces every change as a block event with this
store's epoch and a gap-free event id; `BlockEventPublisher` publishes them in order
and answers resync requests with the inventory.

The bus, presence, peers, the UCX transport and the shutdown order are the data-plane
shell's (`yb_dataplane.worker.WorkerShell`); `KVStoreWorker` is what is the store's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from yb_core import events as ev
from yb_core.block_events import AnyBlockEvent, BlockEventPublisher, BlockLog
from yb_core.bus import EventReader
from yb_core.config import KVStoreConfig, YbConfig
from yb_core.telemetry import get_logger
from yb_dataplane.transport import (
    BufferLike,
    FetchOrder,
    Reason,
    Reservation,
    ReservationRefused,
    SegmentHeader,
    TransferError,
)
from yb_dataplane.transport.blocks import fetch_layers, fetch_pieces, parse_key, parse_put_id
from yb_dataplane.worker import Capacity, Worker, WorkerContext, WorkerShell
from yb_kvstore.eviction import eviction_policy
from yb_kvstore.replication import Replicator
from yb_kvstore.slab import DramSlab, SlabFull
from yb_kvstore.ssd import SsdTier
from yb_kvstore.store import BlockStore, MissingBlocks

log = get_logger(__name__)


class KVStoreService(WorkerShell["KVStoreWorker"]):
    """Serves one host's KV blocks from a DRAM slab and an SSD tier."""

    role = "kvstore"

    def __init__(self, cfg: YbConfig) -> None:
        super().__init__(cfg, cfg.kvstore)
        # Registered now, so /metrics shows them from the first scrape.
        self.metrics = StoreMetrics(self.registry)

    async def build(self, context: WorkerContext) -> KVStoreWorker:
        """The pool's tiers (`KVStoreWorker.open` opens the pool: a new epoch starts
        with `BlocksCleared`, then what the SSD tier kept)."""
        kcfg = self.cfg.kvstore
        io = ThreadPoolExecutor(max(1, kcfg.ssd_io_threads), thread_name_prefix="yb-ssd")
        dram, ssd = _tiers(kcfg, io)
        headroom = kcfg.dram_headroom_blocks
        if headroom < 0:
            headroom = max(1, kcfg.dram_blocks // 16)
        return KVStoreWorker(context, self.metrics, dram, ssd, io, headroom)


def _tiers(kcfg: KVStoreConfig, io: ThreadPoolExecutor) -> tuple[DramSlab, SsdTier | None]:
    """The DRAM slab, and the SSD tier where one is configured (its files on `io`)."""
    ssd: SsdTier | None = None
    if kcfg.ssd_dir and kcfg.ssd_blocks > 0:
        ssd = SsdTier(
            Path(kcfg.ssd_dir).expanduser(),
            kcfg.ssd_blocks,
            io,
            eviction_policy(kcfg.eviction_policy, retention=kcfg.retention_advice),
        )
    dram_policy = eviction_policy(kcfg.eviction_policy, retention=kcfg.retention_advice)
    return DramSlab(kcfg.dram_blocks, dram_policy), ssd


class StoreMetrics:
    """What a kvstore exports besides the transport's own.

    Every known label value is exported from the start (an empty store holds 0
    blocks; no byte has moved yet), so a dashboard has its series before any traffic.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Gauge(
            "yb_kvstore_blocks", "Blocks held, by tier", ["tier"], registry=registry
        )
        self.capacity = Gauge(
            "yb_kvstore_capacity_blocks",
            "Blocks the tier can hold, by tier (0: no SSD tier)",
            ["tier"],
            registry=registry,
        )
        self.puts = Counter(
            "yb_kvstore_puts_total", "Block puts by outcome", ["outcome"], registry=registry
        )
        self.fetches = Counter(
            "yb_kvstore_fetches_total", "Block fetches by outcome", ["outcome"], registry=registry
        )
        self.bytes = Counter(
            "yb_kvstore_bytes_total", "Block bytes by direction", ["direction"], registry=registry
        )
        self.replicated = Counter(
            "yb_kvstore_replicated_blocks_total",
            "Blocks of hot prefixes copied here on the conductor's plan, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.advised = Counter(
            "yb_kvstore_retention_advice_total",
            "Retention advice (RetentionPlanned) from the conductor taken by this store",
            registry=registry,
        )
        for tier in ("dram", "ssd"):
            self.blocks.labels(tier)
            self.capacity.labels(tier)
        for outcome in ("stored", "duplicate", "refused", "failed"):
            self.puts.labels(outcome)
        for outcome in ("served", "missing", "refused"):
            self.fetches.labels(outcome)
        for direction in ("in", "out"):
            self.bytes.labels(direction)


class KVStoreWorker(Worker):
    """The pool, its block events, and the puts, fetches and replications it serves.

    Its work arrives over the transport itself, so the shell stops it by closing the
    transport; it follows no cancellations (a transfer ends with its own deadline).
    """

    follows_cancellations = False
    transport_is_intake = True
    # It sends fetched blocks to engines (prefill, and decode instances that prefill
    # inside their batch) and fetches replicas from stores.
    preconnect_roles = frozenset({"prefill", "kvstore"})

    def preconnects_to(self, up: ev.InstanceUp) -> bool:
        return up.role in self.preconnect_roles or (up.role == "decode" and up.piggyback)

    def __init__(
        self,
        context: WorkerContext,
        metrics: StoreMetrics,
        dram: DramSlab,
        ssd: SsdTier | None,
        io: ThreadPoolExecutor,
        headroom: int,
    ) -> None:
        self.instance_id = context.instance_id
        self._bus = context.bus
        self._receiver = context.receiver
        self._sender = context.sender
        self._tasks = context.tasks
        self._io = io
        self.metrics = metrics
        self.block_log = BlockLog(context.instance_id)
        self.store = BlockStore(dram, ssd, self.block_log, self._emit, headroom=headroom)
        self.publisher = BlockEventPublisher(context.bus, self.block_log, self.store.inventory)
        self.replicator = Replicator(
            self.instance_id,
            self.store,
            context.receiver,
            context.sender,
            context.peers,
            on_outcome=lambda outcome, n: self.metrics.replicated.labels(outcome).inc(n),
        )
        metrics.capacity.labels("dram").set(dram.num_slots)
        metrics.capacity.labels("ssd").set(ssd.capacity if ssd is not None else 0)

    async def open(self) -> None:
        """Open the block-event log, then the pool (a new epoch)."""
        await self.publisher.open()
        await self.store.open()

    def _emit(self, event: AnyBlockEvent) -> None:
        self.publisher.emit(event)
        dram = len(self.store.dram)
        ssd = len(self.store.ssd) if self.store.ssd is not None else 0
        self.metrics.blocks.labels("dram").set(dram)
        self.metrics.blocks.labels("ssd").set(ssd)

    def capacity(self) -> Capacity:
        ssd = self.store.ssd
        return Capacity(
            kv_capacity_blocks=self.store.dram.num_slots + (ssd.capacity if ssd else 0),
            epoch=self.block_log.epoch,
        )

    async def serve(self) -> None:
        """Take puts and fetches on the receiver, follow replication plans."""
        self._receiver.set_reservation_factory(
            self._reserve_put, deadline_s=30.0, on_reserved=self._watch_put
        )
        self._receiver.set_fetch_handler(self._serve_fetch)
        plans = await self._bus.read_ordered(
            f"yb.ev.decision.replication.{ev.subject_token(self.instance_id)}", new_only=True
        )
        self._tasks.spawn("replication", self._follow_plans(plans))
        advice = await self._bus.read_ordered(
            f"yb.ev.decision.retention.{ev.subject_token(self.instance_id)}", new_only=True
        )
        self._tasks.spawn("retention", self._follow_advice(advice))
        self._tasks.spawn("block-events", self.publisher.run_publisher())
        self._tasks.spawn("resyncs", self.publisher.run_resyncs())
        ssd = self.store.ssd
        log.info(
            "kvstore_ready",
            ucx=self._receiver.address.to_wire(),
            dram_blocks=self.store.dram.num_slots,
            ssd_blocks=ssd.capacity if ssd else 0,
            ssd_dir=str(ssd.directory) if ssd else "",
            recovered=len(ssd) if ssd else 0,
        )

    async def settle(self) -> None:
        """Best effort: what is announced should reach the log before we go."""
        try:
            await asyncio.wait_for(self.publisher.drained(), 2.0)
        except TimeoutError:
            log.warning("block_events_unpublished", pending=self.publisher.pending)

    async def close(self) -> None:
        """Close the pool; file writes already running finish (a file is complete or
        absent, never torn)."""
        await self.store.close()
        await asyncio.get_running_loop().run_in_executor(None, self._io.shutdown, True)

    # --- replication ----------------------------------------------------------------

    async def _follow_plans(self, reader: EventReader) -> None:
        """Carry out the conductor's replication plans for this store, one at a time."""
        try:
            async for item in reader:
                if isinstance(item.event, ev.ReplicationPlanned):
                    try:
                        await self.replicator.carry_out(item.event)
                    except Exception as exc:  # an optimisation must not stop the store
                        log.exception("replication_error", error=repr(exc))
        finally:
            with contextlib.suppress(Exception):
                await reader.close()

    async def _follow_advice(self, reader: EventReader) -> None:
        """Take the conductor's retention advice for this store as it comes: it orders
        what the tiers evict when they must make room (`BlockStore.advise`)."""
        try:
            async for item in reader:
                if isinstance(item.event, ev.RetentionPlanned):
                    self.store.advise(item.event)
                    self.metrics.advised.inc()
        finally:
            with contextlib.suppress(Exception):
                await reader.close()

    # --- puts -----------------------------------------------------------------------

    def _reserve_put(self, request_id: str, header: SegmentHeader) -> list[BufferLike] | None:
        """Transport callback: slots for a put's buffers, or None to refuse it."""
        del header
        put = parse_put_id(request_id)
        if put is None:
            self.metrics.puts.labels("refused").inc()
            return None
        try:
            slot = self.store.reserve_put(put.key, put.block_nbytes)
        except (ValueError, SlabFull) as exc:
            log.warning("put_refused", request_id=request_id, reason=str(exc))
            self.metrics.puts.labels("refused").inc()
            return None
        if slot is None:
            self.metrics.puts.labels("duplicate").inc()
            # Already held: the sender learns it is there (and its bytes are drained).
            raise ReservationRefused(f"block {put.key:x} is held already", reason=Reason.DUPLICATE)
        # Each layer's chunk in `put.pieces` pieces (a tensor-parallel sender's runs of
        # heads), side by side: the slot holds the block whole either way.
        n = put.page_nbytes // put.pieces
        return [slot[i * n : (i + 1) * n] for i in range(put.num_layers * put.pieces)]

    def _watch_put(self, reservation: Reservation) -> None:
        put = parse_put_id(reservation.request_id)
        assert put is not None
        self._tasks.spawn(f"put:{reservation.request_id}", self._finish_put(put.key, reservation))

    async def _finish_put(self, key: int, reservation: Reservation) -> None:
        try:
            await reservation.wait_committed()
        except TransferError as exc:
            # Half-written bytes are garbage: the slot goes back, nothing was announced.
            self.store.abort_put(key)
            self.metrics.puts.labels("failed").inc()
            log.info("put_failed", key=f"{key:x}", reason=str(exc))
            return
        self.store.commit_put(key, reservation.checksums)
        self.metrics.puts.labels("stored").inc()
        self.metrics.bytes.labels("in").inc(reservation.nbytes)

    # --- fetches --------------------------------------------------------------------

    async def _serve_fetch(self, order: FetchOrder) -> None:
        """Send blocks `order.keys` into the asker's reservation, layer chunk by chunk.

        Index `i * layers + layer` of the reservation is chunk `layer` of block `i`.
        Blocks go in batches of at most half the DRAM slab, each pinned only while
        its batch moves, so a fetch may be larger than DRAM (SSD blocks come up batch
        by batch) and never pins the whole slab against other fetches.
        """
        keys: list[int] = []
        for text in order.keys:
            key = parse_key(text)
            if key is None:
                self.metrics.fetches.labels("refused").inc()
                raise ReservationRefused(f"malformed block key {text!r}")
            keys.append(key)
        missing = [key for key in keys if key not in self.store]
        if missing:
            self.metrics.fetches.labels("missing").inc()
            raise ReservationRefused(f"blocks not held here: {MissingBlocks(missing)}")
        layout = fetch_layers(order.request_id)
        pieces = fetch_pieces(order.request_id)
        if layout is None or pieces is None:
            self.metrics.fetches.labels("refused").inc()
            raise ReservationRefused(f"malformed layer range in {order.request_id!r}")
        layers, wanted = layout
        batch = max(1, self.store.dram.num_slots // 2)
        sent = 0
        for first in range(0, len(keys), batch):
            part = keys[first : first + batch]
            try:
                slots = await self.store.acquire(part)
            except MissingBlocks as exc:  # evicted from SSD since the check above
                self.metrics.fetches.labels("missing").inc()
                raise ReservationRefused(f"blocks not held here: {exc}") from None
            try:
                items, checksums = self._fetch_items(part, slots, first, layers, wanted, pieces)
                # The last batch carries the commit: a small fetch is one round trip.
                # Each block's layers lie side by side in its slot; they share a
                # message only where the asker's destinations are adjacent too
                # (`order.breaks`; an engine's pages of one block are a layer apart),
                # so nothing is staged there.
                await self._sender.send(
                    order.reply_to,
                    order.request_id,
                    items,
                    deadline_s=order.remaining_s(),
                    checksums=checksums,
                    commit=first + batch >= len(keys),
                    receiver_breaks=order.breaks,
                )
                sent += sum(int(b.nbytes) for b in slots)
            finally:
                self.store.release(part)
        self.metrics.fetches.labels("served").inc()
        self.metrics.bytes.labels("out").inc(sent)

    def _fetch_items(
        self,
        keys: list[int],
        slots: list[np.ndarray],
        first: int,
        layers: int,
        wanted: range,
        pieces: int = 1,
    ) -> tuple[list[tuple[int, BufferLike]], list[int] | None]:
        """The (reservation index, piece) pairs of chunks `wanted` of blocks `keys`
        (the fetch's blocks `first`, `first + 1`, ...; each cut into `layers`, each
        chunk into `pieces`), with their stored checksums when every block has them in
        this layout (put in as many pieces; else None: the sender hashes).

        Layer-major: every block's first wanted layer, then the next layer's. They land
        in that order, so an engine that computes on a prefix as it arrives
        (`yb_dataplane.prefix_fetch.LayerArrivals`) starts its first layer after one
        layer's share of the bytes, not after the whole prefix."""
        width = len(wanted)
        cuts = layers * pieces
        chunks: list[tuple[int, int, np.ndarray, int]] = []  # (i, key, block, chunk bytes)
        for i, (key, block) in enumerate(zip(keys, slots, strict=True), start=first):
            if block.nbytes % cuts:
                raise ReservationRefused(
                    f"block {key:x} does not split into {layers} layers of {pieces} pieces"
                )
            chunks.append((i, key, block, block.nbytes // cuts))
        items: list[tuple[int, BufferLike]] = []
        stored: list[Sequence[int]] | None = []
        for _, key, _, _ in chunks:
            meta = self.store.meta(key)
            if stored is not None and meta is not None and len(meta.checksums) == cuts:
                stored.append(meta.checksums)
            else:
                stored = None
        checksums: list[int] | None = None if stored is None else []
        for layer in wanted:
            for b, (i, _, block, n) in enumerate(chunks):
                for j in range(pieces):
                    at = layer * pieces + j
                    items.append(
                        (
                            (i * width + layer - wanted.start) * pieces + j,
                            block[at * n : (at + 1) * n],
                        )
                    )
                    if checksums is not None and stored is not None:
                        checksums.append(stored[b][at])
        return items, checksums

    # --- load -----------------------------------------------------------------------

    def load_report(self) -> ev.LoadReport:
        dram = self.store.dram
        ssd = self.store.ssd
        return ev.LoadReport(
            instance_id=self.instance_id,
            role="kvstore",
            kv_used_blocks=len(dram) + (len(ssd) if ssd else 0),
            kv_total_blocks=dram.num_slots + (ssd.capacity if ssd else 0),
            dram_blocks=len(dram),
            ssd_blocks=len(ssd) if ssd else 0,
        )
