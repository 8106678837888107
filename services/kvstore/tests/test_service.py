"""The kvstore service on a real bus with real UCX: puts, fetches, tiers, restarts, resync.

The client side is the transport itself (what prefill uses): a `KVSender` puts blocks
under put request ids and a `KVReceiver` reservation receives fetches. The block
events are read back from the log and folded exactly as the conductor folds them
(`yb_conductor.state.ClusterState`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.bus import Bus, EventReader
from yb_core.config import KVStoreConfig, NatsConfig, TelemetryConfig, YbConfig
from yb_dataplane.transport import KVReceiver, KVSender, PeerAddress, Reason, ReservationRefused
from yb_dataplane.transport.blocks import PutId, fetch_request_id, key_text
from yb_kvstore.service import KVStoreService
from yb_kvstore.ssd import State

LAYERS = 3
CHUNK = 4096
BLOCK = LAYERS * CHUNK
INSTANCE = "kvstore-t"


def block_bytes(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BLOCK, dtype=np.uint8)


def config(nats: NatsConfig, ssd_dir: Path, **kvstore: object) -> YbConfig:
    settings: dict[str, object] = {
        "dram_blocks": 2,
        "ssd_blocks": 2,
        "ssd_dir": str(ssd_dir),
        "dram_headroom_blocks": 0,
        "load_report_interval_s": 0.2,
    }
    settings.update(kvstore)
    return YbConfig(
        instance_id=INSTANCE,
        nats=nats,
        kvstore=KVStoreConfig(**settings),  # type: ignore[arg-type]
        telemetry=TelemetryConfig(log_json=False),
    )


class Client:
    """Puts and fetches blocks like a prefill instance does."""

    def __init__(self, sender: KVSender, receiver: KVReceiver) -> None:
        self.sender = sender
        self.receiver = receiver

    async def put(self, store: PeerAddress, key: int) -> None:
        data = block_bytes(key)
        rid = PutId(key, LAYERS, CHUNK).request_id()
        items = [(i, data[i * CHUNK : (i + 1) * CHUNK]) for i in range(LAYERS)]
        await self.sender.send(store, rid, items, deadline_s=DEADLINE_S)
        await self.sender.commit(store, rid, deadline_s=DEADLINE_S)

    async def fetch(
        self, store: PeerAddress, keys: list[int], layers: range = range(LAYERS)
    ) -> np.ndarray:
        """The blocks' bytes; of the chunks outside `layers` (not asked for), zeros."""
        dest = np.zeros((len(keys), BLOCK), dtype=np.uint8)
        bufs = [
            dest[i, layer * CHUNK : (layer + 1) * CHUNK]
            for i in range(len(keys))
            for layer in layers
        ]
        rid = fetch_request_id(f"fetch.{uuid.uuid4().hex[:8]}", LAYERS, layers)
        res = self.receiver.reserve(rid, bufs, deadline_s=DEADLINE_S)
        try:
            await self.sender.request_fetch(
                store,
                rid,
                [key_text(k) for k in keys],
                reply_to=self.receiver.address,
                deadline_s=DEADLINE_S,
                breaks=res.breaks(),
            )
            await res.wait_committed()
        finally:
            self.receiver.cancel(rid)
        return dest


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    receiver = KVReceiver()
    await receiver.start()
    sender = KVSender()
    try:
        yield Client(sender, receiver)
    finally:
        await sender.close()
        await receiver.close()


async def start_store(cfg: YbConfig) -> tuple[KVStoreService, PeerAddress]:
    service = KVStoreService(cfg)
    await service.start()
    return service, PeerAddress.parse(service.ucx_address)


#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
DEADLINE_S = 60.0


async def block_events(
    reader: EventReader, until: int, timeout_s: float = DEADLINE_S
) -> list[ev.AnyEvent]:
    """Block events from `reader` until one with event id `until` (inclusive)."""
    out: list[ev.AnyEvent] = []
    async with asyncio.timeout(timeout_s):
        while True:
            item = await reader.next(timeout_s)
            if item is None:
                continue
            out.append(item.event)
            if isinstance(item.event, ev.BlockEvent) and item.event.event_id >= until:
                return out


async def test_puts_fetches_and_the_tier_chain_over_ucx(
    bus: Bus, nats_config: NatsConfig, client: Client, tmp_path: Path
) -> None:
    reader = await bus.read_ordered(f"yb.ev.block.*.{INSTANCE}")
    service, store = await start_store(config(nats_config, tmp_path / "ssd"))
    pool = service.worker.store  # read again once the service has stopped
    try:
        for key in (11, 12, 13):  # 13 pushes 11 down to SSD
            await client.put(store, key)
        with pytest.raises(ReservationRefused, match="held already") as refused:
            await client.put(store, 12)  # a duplicate put is refused as such
        assert refused.value.reason == Reason.DUPLICATE
        # 11 comes back up from SSD, 12 from DRAM: the bytes are the ones put.
        got = await client.fetch(store, [11, 12])
        assert np.array_equal(got[0], block_bytes(11))
        assert np.array_equal(got[1], block_bytes(12))
        with pytest.raises(ReservationRefused, match="not held"):
            await client.fetch(store, [99])
        # A pipeline stage asks for its layers only: those come, nothing else.
        part = await client.fetch(store, [11, 12], layers=range(1, 3))
        for i, key in enumerate((11, 12)):
            assert not part[i, :CHUNK].any()
            assert np.array_equal(part[i, CHUNK:], block_bytes(key)[CHUNK:])
        await service.worker.publisher.drained()
        last = service.worker.block_log.event_id
        events = await block_events(reader, until=last)
    finally:
        await service.stop()
        await reader.close()
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "BlocksCleared"
    assert kinds.count("BlockStored") == 3
    moves = [
        (e.block_hashes, e.from_tier, e.to_tier) for e in events if isinstance(e, ev.BlockMoved)
    ]
    assert ([11], "dram", "ssd") in moves and ([11], "ssd", "dram") in moves
    assert [e.event_id for e in events if isinstance(e, ev.BlockEvent)] == list(range(1, last + 1))
    # The conductor's fold agrees with the store about every block and tier.
    state = ClusterState()
    for event in events:
        state.apply(event)
    assert sorted(state.index.keys_of(INSTANCE)) == sorted(pool.announced)
    for key, tier in pool.announced.items():
        assert state.index.tier_of(key, INSTANCE) == tier


async def test_restart_new_epoch_clears_first_then_ssd_blocks_return(
    bus: Bus, nats_config: NatsConfig, client: Client, tmp_path: Path
) -> None:
    cfg = config(nats_config, tmp_path / "ssd", dram_blocks=1, ssd_blocks=4)
    service, store = await start_store(cfg)
    first_epoch = service.worker.block_log.epoch
    try:
        for key in (1, 2, 3):
            await client.put(store, key)
        # Stopping cancels SSD writes in flight (their files are removed): wait until
        # the copy-path writes of 1 and 2 are complete on disk.
        ssd = service.worker.store.ssd
        assert ssd is not None

        def written() -> bool:
            entries = [ssd.entry(k) for k in (1, 2)]
            return all(e is not None and e.state is State.READY for e in entries)

        async with asyncio.timeout(DEADLINE_S):
            while not written():
                await asyncio.sleep(0.01)
    finally:
        await service.stop()
    reader = await bus.read_ordered(f"yb.ev.block.*.{INSTANCE}", new_only=True)
    service, store = await start_store(cfg)
    try:
        assert service.worker.block_log.epoch > first_epoch
        events = await block_events(reader, until=2)
        assert isinstance(events[0], ev.BlocksCleared) and events[0].event_id == 1
        stored = events[1]
        assert isinstance(stored, ev.BlockStored) and stored.tier == "ssd"
        assert sorted(stored.block_hashes) == [1, 2]  # 3 was in DRAM: gone with the process
        # One DRAM slot: each fetch brings its block up, pushing the other one down.
        for key in (2, 1, 2):
            (got,) = await client.fetch(store, [key])
            assert np.array_equal(got, block_bytes(key))
    finally:
        await service.stop()
        await reader.close()


async def test_a_fetch_larger_than_dram_comes_up_from_ssd_batch_by_batch(
    nats_config: NatsConfig, client: Client, tmp_path: Path
) -> None:
    cfg = config(nats_config, tmp_path / "ssd", dram_blocks=2, ssd_blocks=8)
    service, store = await start_store(cfg)
    try:
        keys = list(range(31, 39))  # eight blocks: six end up on SSD
        for key in keys:
            await client.put(store, key)
        got = await client.fetch(store, keys)
        for row, key in zip(got, keys, strict=True):
            assert np.array_equal(row, block_bytes(key))
        assert client.receiver.staged_bytes == 0  # every chunk landed in place
        assert len(service.worker.store.dram) <= 2
    finally:
        await service.stop()


async def test_a_gap_is_noticed_by_the_conductor_fold_and_resync_repairs_it(
    bus: Bus, nats_config: NatsConfig, client: Client, tmp_path: Path
) -> None:
    reader = await bus.read_ordered(f"yb.ev.block.*.{INSTANCE}")
    service, store = await start_store(config(nats_config, tmp_path / "ssd", dram_blocks=4))
    try:
        for key in (21, 22, 23):
            await client.put(store, key)
        await service.worker.publisher.drained()
        events = await block_events(reader, until=service.worker.block_log.event_id)
        state = ClusterState()
        lost = events[2]  # the consumer misses one event (the store's 22)
        for event in events:
            if event is not lost:
                state.apply(event)
        assert INSTANCE in state.resync_wanted
        # The conductor asks; the store answers with its inventory at its latest id.
        await bus.publish(ev.ResyncRequested(instance_id=INSTANCE, requester="test"))
        inventory = None
        async with asyncio.timeout(DEADLINE_S):
            while inventory is None:
                item = await reader.next(DEADLINE_S)
                if item is not None and isinstance(item.event, ev.BlockInventory):
                    inventory = item.event
        assert inventory.event_id == service.worker.block_log.event_id
        state.apply(inventory)
        assert INSTANCE not in state.resync_wanted
        assert sorted(state.index.keys_of(INSTANCE)) == [21, 22, 23]
        # Events after the inventory continue the stream without another gap.
        await client.put(store, 24)
        await service.worker.publisher.drained()
        (after,) = [
            e
            for e in await block_events(reader, until=service.worker.block_log.event_id)
            if isinstance(e, ev.BlockStored)
        ]
        state.apply(after)
        assert INSTANCE not in state.resync_wanted
        assert state.index.prefix_length([21, 22, 23, 24], INSTANCE) == 4
    finally:
        await service.stop()
        await reader.close()


async def test_a_replication_plan_copies_hot_blocks_to_the_target_store(
    bus: Bus, nats_config: NatsConfig, client: Client, tmp_path: Path
) -> None:
    source_cfg = config(nats_config, tmp_path / "ssd-a")
    target_cfg = config(nats_config, tmp_path / "ssd-b")
    target_cfg.instance_id = "kvstore-target"
    source, source_addr = await start_store(source_cfg)
    target, target_addr = await start_store(target_cfg)
    reader = await bus.read_ordered("yb.ev.block.block_stored.kvstore-target")
    try:
        for key in (21, 22):
            await client.put(source_addr, key)
        # The target learns the block layout from its first put (it needs no model).
        await client.put(target_addr, 23)
        await bus.publish(
            ev.ReplicationPlanned(
                source_instance=INSTANCE,
                target_instance="kvstore-target",
                block_hashes=[21, 22, 23],
                demand=9,
            )
        )
        stored: set[int] = set()
        async with asyncio.timeout(DEADLINE_S):
            while not {21, 22} <= stored:
                item = await reader.next(DEADLINE_S)
                if item is not None and isinstance(item.event, ev.BlockStored):
                    stored.update(item.event.block_hashes)
        # The copy holds the same bytes, served from the target itself.
        got = await client.fetch(target_addr, [21, 22])
        assert np.array_equal(got[0], block_bytes(21))
        assert np.array_equal(got[1], block_bytes(22))
        # A plan for another store, or for blocks held already, does nothing here.
        plan = ev.ReplicationPlanned(
            source_instance=INSTANCE, target_instance="kvstore-target", block_hashes=[21]
        )
        assert await target.worker.replicator.carry_out(plan) == 0
        other = ev.ReplicationPlanned(
            source_instance=INSTANCE, target_instance="elsewhere", block_hashes=[22]
        )
        assert await target.worker.replicator.carry_out(other) == 0
    finally:
        await reader.close()
        await target.stop()
        await source.stop()
