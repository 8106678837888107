"""One pool for every tensor-parallel degree: a prefix put by an instance of one degree
is fetched and reused by instances of others, through a real kvstore over real UCX.

The engines are real tensor-parallel instances (`yb_engine.tp_instance`: rank 0 here,
the other ranks processes of their own) and the transfers are the production ones:
`BlockUploader` puts each block from the ranks' pages, cut into one piece per rank
that owns heads, and `BlockFetcher` pulls it into another instance's ranks' pages,
cut as that instance cuts them. The store keeps the block whole either way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_dataplane.block_upload import BlockUploader
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.prefix_fetch import BlockFetcher, FetchRun
from yb_dataplane.transport import KVReceiver, KVSender
from yb_engine import ModelRunner, PagedKVCache
from yb_engine.loader import load_model
from yb_engine.tp_instance import TPInstance
from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.pool import HeldPages, running_kvstore
from yb_testkit.tensor_parallel import start_tp

BLOCK = 8
PAGES = 16
PREFIX_BLOCKS = 3
STORE = "kvstore-tp"
TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


@pytest.fixture
async def store(bus: Bus, nats_config: NatsConfig) -> AsyncIterator[PeerDirectory]:
    async with running_kvstore(bus, nats_config, STORE, dram_blocks=16) as peers:
        yield peers


def instance(path: Path, size: int) -> tuple[ModelRunner, TPInstance | None]:
    if size == 1:
        model = load_model(path)
        return ModelRunner(model, PagedKVCache(model.config, PAGES, BLOCK)), None
    runner, _, ranks = start_tp(path, size, pages=PAGES, block_size=BLOCK)
    return runner, ranks


@pytest.mark.parametrize(("put_by", "reused_by"), [(4, 2), (4, 1), (1, 4), (2, 4)])
async def test_a_prefix_put_at_one_degree_is_reused_at_another(
    checkpoint: Path, store: PeerDirectory, put_by: int, reused_by: int
) -> None:
    arch = load_model(checkpoint).config
    gen = torch.Generator().manual_seed(9)
    prompt: list[int] = torch.randint(
        3, arch.vocab, (PREFIX_BLOCKS * BLOCK + 5,), generator=gen
    ).tolist()
    keys = [0x7000 + 16 * put_by + 4 * reused_by + i for i in range(PREFIX_BLOCKS)]
    table = list(range(5))
    address = store.address(STORE)
    assert address is not None
    writer, writer_ranks = instance(checkpoint, put_by)
    reader, reader_ranks = instance(checkpoint, reused_by)
    sender, receiver = KVSender(), KVReceiver()
    await receiver.start()
    try:
        expected = writer.prefill(prompt, table)
        uploader = BlockUploader(writer.cache, sender, deadline_s=10.0)
        put = await uploader.upload(
            address, keys, HeldPages({key: table[i] for i, key in enumerate(keys)})
        )
        assert put.stored == PREFIX_BLOCKS, put
        fetcher = BlockFetcher(f"engine-tp{reused_by}", reader.cache, store, receiver, sender)
        pages = list(range(7, 12))
        fetched = await fetcher.fetch(
            "req-1", [FetchRun(STORE, 0, PREFIX_BLOCKS, ("dram",))], keys, pages, 10.0
        )
        assert not fetched.failures, fetched.failures
        assert sorted(fetched.loaded_from) == list(range(PREFIX_BLOCKS))
        # The reused prefix gives the logits of the whole prompt computed at once.
        logits = reader.prefill(prompt, pages, num_cached_tokens=PREFIX_BLOCKS * BLOCK)
        assert rel_err(logits, expected) <= TOL
        assert int(logits.argmax()) == int(expected.argmax())
        # Every piece the reader holds is the writer's bytes.
        for layer in range(arch.num_layers):
            for i in range(PREFIX_BLOCKS):
                ours = torch.cat(reader.cache.pieces(layer, pages[i], reader.cache.head_cuts))
                theirs = torch.cat(writer.cache.pieces(layer, table[i], writer.cache.head_cuts))
                assert torch.equal(ours, theirs)
    finally:
        await sender.close()
        await receiver.close()
        for ranks in (writer_ranks, reader_ranks):
            if ranks is not None:
                ranks.close()
