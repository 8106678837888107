"""Tensor-parallel instances on the CPU (gloo), against one process of the same model.

Each instance is the real thing: rank 0 here, ranks 1..N-1 started as processes
(`python -m yb_engine.tp_worker`) that load their share of the checkpoint and compute
with this process over gloo. A dense (Llama), a mixture-of-experts (Mixtral) and a
latent-attention (DeepSeek-V3) checkpoint, at TP=2 and TP=4 (where the tiny models'
two KV heads are held by two ranks each).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from yb_engine import DecodeSeq, ModelRunner, PagedKVCache, PrefillSeq
from yb_engine.architecture import ArchConfig
from yb_engine.loader import load_model
from yb_engine.pausing import EnginePause, EngineThread, PauseAbandoned
from yb_engine.runner import PrefillChunk
from yb_engine.tensor_parallel import Shard, check_degree, head_cuts, merge_cuts, owner_ranks
from yb_engine.tp_instance import (
    RankLost,
    ShardedKV,
    TensorParallelRunner,
    TPInstance,
)
from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.tensor_parallel import start_tp

BLOCK = 8
PAGES = 24
TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)


def start(path: Path, size: int) -> tuple[TensorParallelRunner, ShardedKV, TPInstance]:
    return start_tp(path, size, pages=PAGES, block_size=BLOCK)


def exercise(runner: ModelRunner, prompt: list[int]) -> list[torch.Tensor]:
    """A chunked prefill over a cached prefix, a batched prefill, decode steps of
    mixed lengths and a mixed step: every logits row they give."""
    out = []
    a = list(range(0, 6))
    b = list(range(6, 12))
    c = list(range(12, 18))
    out.append(runner.prefill(prompt[:16], a, chunk_size=8))
    out.append(runner.prefill(prompt, a, num_cached_tokens=16, chunk_size=8))
    out.append(
        runner.prefill_batch(
            [PrefillSeq(prompt[:9], b), PrefillSeq(prompt[3:20], c, num_cached_tokens=0)]
        )
    )
    seqs = [DecodeSeq(a, len(prompt), 5), DecodeSeq(b, 9, 7)]
    out.append(runner.decode(seqs))
    decode_logits, chunk_logits = runner.mixed(
        [DecodeSeq(a, len(prompt) + 1, 9)], PrefillChunk(prompt[:5], list(range(18, 20)), 0, True)
    )
    out.append(decode_logits)
    assert chunk_logits is not None
    out.append(chunk_logits)
    out.append(runner.prefill(prompt[:12], list(range(20, 22)), all_logits=True))
    return out


@pytest.fixture(scope="module", params=["llama", "mixtral", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    return build_checkpoint(name, tmp_path_factory.mktemp(name) / "ckpt")


@pytest.mark.parametrize("size", [2, 4])
def test_tp_logits_and_kv_match_one_process(checkpoint: Path, size: int) -> None:
    whole = load_model(checkpoint)
    arch = whole.config
    assert check_degree(arch, size) is None
    gen = torch.Generator().manual_seed(5)
    prompt: list[int] = torch.randint(3, arch.vocab, (30,), generator=gen).tolist()
    one = ModelRunner(whole, PagedKVCache(arch, PAGES, BLOCK))
    expected = exercise(one, prompt)
    runner, sharded, ranks = start(checkpoint, size)
    try:
        got = exercise(runner, prompt)
        for ours, ref in zip(got, expected, strict=True):
            assert ours.shape == ref.shape
            assert rel_err(ours, ref) <= TOL
        # Every page's bytes, put together from the ranks' pieces, are the one
        # process's page (the pool's block layout does not depend on the degree).
        cuts = sharded.head_cuts
        for layer in range(arch.num_layers):
            for page in range(22):
                joined = torch.cat(sharded.pieces(layer, page, cuts))
                assert rel_err(joined, one.cache.page_view(layer, page)) <= TOL
        # Replicas hold what their owner holds (each computed it: the same function,
        # in a matmul of another shape, so not always to the last bit).
        for ranks_of_run in owner_ranks(arch, size):
            owner = ranks_of_run[0]
            for replica in ranks_of_run[1:]:
                assert rel_err(sharded._ranks[replica], sharded._ranks[owner]) <= TOL
    finally:
        ranks.close()


def test_pieces_land_in_the_owners_and_reach_the_replicas(tmp_path: Path) -> None:
    path = build_checkpoint("llama", tmp_path / "ckpt")
    _, sharded, ranks = start(path, 4)  # 2 KV heads: each held by two ranks
    try:
        assert sharded.head_cuts == [0, 1, 2]
        arch: ArchConfig = sharded.arch
        page = torch.arange(
            arch.num_kv_heads * 2 * BLOCK * arch.head_dim, dtype=torch.float32
        ).view(arch.num_kv_heads, 2, BLOCK, arch.head_dim)
        for layer in range(arch.num_layers):
            for piece, source in zip(
                sharded.pieces(layer, 3, [0, 1, 2]), page.split(1), strict=True
            ):
                piece.copy_(source + layer)
        sharded.replicate([3])
        for rank in range(4):
            head = Shard(rank, 4).kv_heads(arch).start
            for layer in range(arch.num_layers):
                assert torch.equal(sharded._ranks[rank][layer, 3, 0], page[head] + layer)
        with pytest.raises(ValueError, match="cut across"):
            sharded.page_view(0, 3)
        with pytest.raises(ValueError, match="do not refine"):
            sharded.pieces(0, 3, [0, 2])
    finally:
        ranks.close()


def test_a_lost_rank_is_noticed_and_no_call_waits(tmp_path: Path) -> None:
    path = build_checkpoint("llama", tmp_path / "ckpt")
    runner, _, ranks = start(path, 2)
    try:
        runner.prefill(list(range(3, 12)), [0, 1])
        os.kill(ranks._procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while ranks._lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ranks._lost is not None and "exited with code -9" in ranks._lost
        with pytest.raises(RankLost, match="rank 1 of 2"):
            runner.decode([DecodeSeq([0, 1], 9, 4)])
    finally:
        ranks.close()


def test_a_rank_that_stops_answering_fails_the_instance_at_the_collective_deadline(
    tmp_path: Path,
) -> None:
    path = build_checkpoint("llama", tmp_path / "ckpt")
    # The short deadline bounds every collective, so none runs before the stop: a
    # healthy call could miss it on a busy machine. A decode of unwritten pages fails
    # on the stopped rank all the same.
    runner, _, ranks = start_tp(path, 2, pages=PAGES, block_size=BLOCK, timeout_s=2.0)
    stopped = ranks._procs[0].pid
    try:
        os.kill(stopped, signal.SIGSTOP)  # alive, but it never reaches the all-reduce
        with pytest.raises(RankLost, match="failed"):
            runner.decode([DecodeSeq([0, 1], 9, 4)])
        assert ranks._lost is not None
        # Out of step for good: every later call is refused at once.
        with pytest.raises(RankLost):
            runner.decode([DecodeSeq([0, 1], 9, 4)])
    finally:
        os.kill(stopped, signal.SIGCONT)
        ranks.close()


async def test_a_held_call_holds_every_rank_at_the_same_layer(tmp_path: Path) -> None:
    """A holdable prefill held after its first layer: a second prefill computes inside
    it on every rank, then it goes on; both give the one process's logits. Then one
    abandoned where it is held: every rank ends it, and the instance computes on."""
    path = build_checkpoint("llama", tmp_path / "ckpt")
    arch = load_model(path).config
    gen = torch.Generator().manual_seed(7)
    long: list[int] = torch.randint(3, arch.vocab, (24,), generator=gen).tolist()
    short: list[int] = torch.randint(3, arch.vocab, (9,), generator=gen).tolist()
    one = ModelRunner(load_model(path), PagedKVCache(arch, PAGES, BLOCK))
    want_long = one.prefill(long, list(range(0, 3)), chunk_size=8)
    want_short = one.prefill(short, list(range(3, 5)))
    runner, _, ranks = start(path, 2)
    engine = EngineThread(ThreadPoolExecutor(max_workers=1))  # rank 0's engine thread
    submit = engine.submit

    def pause() -> EnginePause:
        made = engine.pause_point()
        made.wanted = True
        return made

    try:
        async with asyncio.timeout(120):
            held = pause()
            line = submit(lambda: runner.prefill(long, list(range(0, 3)), chunk_size=8, hold=held))
            assert await asyncio.shield(held.held) == (0, 0, 8)
            got_short = await submit(runner.prefill, short, list(range(3, 5)))
            held.resume()
            got_long = await line
            assert rel_err(got_long, want_long) <= TOL
            assert rel_err(got_short, want_short) <= TOL

            held = pause()
            line = submit(lambda: runner.prefill(long, list(range(5, 8)), hold=held))
            await asyncio.shield(held.held)
            held.abandon()
            with pytest.raises(PauseAbandoned):
                await line
            got_short = await submit(runner.prefill, short, list(range(3, 5)))
            assert rel_err(got_short, want_short) <= TOL
        assert ranks._lost is None
    finally:
        engine.close()
        engine.executor.shutdown(wait=True)
        ranks.close()


def test_degrees_a_model_cannot_take_are_refused_with_the_reason(tmp_path: Path) -> None:
    arch = load_model(build_checkpoint("llama", tmp_path / "ckpt")).config  # 4 heads, 2 KV
    assert check_degree(arch, 3) == "4 attention heads cannot be cut 3 ways"
    assert check_degree(arch, 8) is not None
    assert check_degree(arch, 1) is None
    assert head_cuts(arch, 2) == [0, 1, 2] and head_cuts(arch, 1) == [0, 2]


def test_merged_cuts_refine_both_sides() -> None:
    assert merge_cuts([0, 2, 4], [0, 4]) == [0, 2, 4]
    assert merge_cuts([0, 2, 4, 6], [0, 3, 6]) == [0, 2, 3, 4, 6]
    with pytest.raises(ValueError):
        merge_cuts([0, 2], [0, 4])


@pytest.fixture(autouse=True)
def _no_stray_ranks() -> Iterator[None]:
    yield
    import torch.distributed as dist

    assert not dist.is_initialized()
