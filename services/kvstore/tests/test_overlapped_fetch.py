"""A prefix computed on while it lands: a real kvstore, real UCX, a real runner.

The kvstore sends a fetch layer by layer (every block's first layer, then the next),
so the engine learns of whole layers one at a time and computes each layer of the
prompt's first chunk as soon as that layer's pages are in (`LayerArrivals`). What
must hold: the logits are those of loading the whole prefix first, the layers become
whole one by one, and a fetch that fails ends the engine's wait with an error instead
of leaving it blocked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_dataplane.block_upload import BlockUploader
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.prefix_fetch import BlockFetcher, FetchRun, LayerArrivals, PrefixLoadFailed
from yb_dataplane.transport import KVReceiver, KVSender
from yb_engine import ModelRunner, PagedKVCache
from yb_engine.loader import load_model
from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.pool import HeldPages, running_kvstore

BLOCK = 8
PAGES = 24
PREFIX_BLOCKS = 4
STORE = "kvstore-overlap"


class Recorded(LayerArrivals):
    """Arrivals that remember each count of whole layers they were told of."""

    def __init__(self, layers: range, runs: int, deadline: float) -> None:
        super().__init__(layers, runs, deadline)
        self.seen: list[int] = []

    def advance(self, run: int, layers: int) -> None:
        self.seen.append(layers)
        super().advance(run, layers)


@pytest.fixture
async def store(bus: Bus, nats_config: NatsConfig) -> AsyncIterator[PeerDirectory]:
    async with running_kvstore(bus, nats_config, STORE, dram_blocks=16) as peers:
        yield peers


async def test_a_prefix_is_computed_on_layer_by_layer_as_it_lands(
    store: PeerDirectory, tmp_path: Path
) -> None:
    model = load_model(build_checkpoint("llama", tmp_path / "llama"))
    layers = model.config.num_layers
    gen = torch.Generator().manual_seed(4)
    prompt: list[int] = torch.randint(
        3, model.config.vocab, (PREFIX_BLOCKS * BLOCK + 6,), generator=gen
    ).tolist()
    keys = [0x9100 + i for i in range(PREFIX_BLOCKS)]
    writer = ModelRunner(model, PagedKVCache(model.config, PAGES, BLOCK))
    table = list(range(5))
    expected = writer.prefill(prompt, table)
    address = store.address(STORE)
    assert address is not None
    sender, receiver = KVSender(), KVReceiver()
    await receiver.start()
    try:
        put = await BlockUploader(writer.cache, sender, deadline_s=10.0).upload(
            address, keys, HeldPages({key: table[i] for i, key in enumerate(keys)})
        )
        assert put.stored == PREFIX_BLOCKS, put
        reader = ModelRunner(model, PagedKVCache(model.config, PAGES, BLOCK))
        fetcher = BlockFetcher("engine-overlap", reader.cache, store, receiver, sender)
        pages = list(range(10, 15))
        arrivals = Recorded(range(layers), 1, time.monotonic() + 30)
        run = FetchRun(STORE, 0, PREFIX_BLOCKS, ("dram",))
        fetching = asyncio.ensure_future(
            fetcher.fetch("req-overlap", [run], keys, pages, 30.0, arrivals)
        )
        logits = await asyncio.to_thread(
            reader.prefill,
            prompt,
            pages,
            num_cached_tokens=PREFIX_BLOCKS * BLOCK,
            layer_ready=arrivals.wait_layer,
        )
        fetched = await fetching
        assert not fetched.failures, fetched.failures
        assert float((logits - expected).abs().max()) <= 1e-5  # as loading it first
        # Layer-major: whole layers one at a time, the first long before the last
        # (sent block by block, no layer would be whole before the last block).
        assert arrivals.seen[:layers] == list(range(1, layers + 1)), arrivals.seen
    finally:
        await sender.close()
        await receiver.close()


async def test_a_fetch_that_fails_ends_the_engines_wait(
    store: PeerDirectory, tmp_path: Path
) -> None:
    model = load_model(build_checkpoint("llama", tmp_path / "llama"))
    gen = torch.Generator().manual_seed(5)
    prompt: list[int] = torch.randint(
        3, model.config.vocab, (PREFIX_BLOCKS * BLOCK + 6,), generator=gen
    ).tolist()
    sender, receiver = KVSender(), KVReceiver()
    await receiver.start()
    try:
        reader = ModelRunner(model, PagedKVCache(model.config, PAGES, BLOCK))
        fetcher = BlockFetcher("engine-overlap", reader.cache, store, receiver, sender)
        arrivals = LayerArrivals(range(model.config.num_layers), 1, time.monotonic() + 30)
        # Blocks the store never held: the fetch is refused.
        keys = [0x9900 + i for i in range(PREFIX_BLOCKS)]
        run = FetchRun(STORE, 0, PREFIX_BLOCKS, ("dram",))
        fetching = asyncio.ensure_future(
            fetcher.fetch("req-missing", [run], keys, list(range(5)), 30.0, arrivals)
        )
        with pytest.raises(PrefixLoadFailed, match="not held"):
            await asyncio.to_thread(
                reader.prefill,
                prompt,
                list(range(5)),
                num_cached_tokens=PREFIX_BLOCKS * BLOCK,
                layer_ready=arrivals.wait_layer,
            )
        fetched = await fetching
        assert [f.source for f in fetched.failures] == [STORE]
    finally:
        await sender.close()
        await receiver.close()
