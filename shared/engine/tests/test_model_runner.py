"""Our forward pass against transformers' on tiny random models (fast, no files).

Tolerance: max |ours - reference| / max |reference| <= 1e-4 in float32.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from yb_engine import (
    DecodeSeq,
    LoadedModel,
    ModelRunner,
    PagedKVCache,
    PrefillSeq,
    tiny_random_model,
)
from yb_engine.architecture import arch_from_hf_config
from yb_engine.rope import inverse_frequencies

TOL = 1e-4
BLOCK = 16


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def prompt(model: LoadedModel, n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, model.config.vocab, (n,), generator=gen).tolist()
    return ids


def reference_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `ids` (one full forward)."""
    with torch.inference_mode():
        logits: torch.Tensor = model.hf_model(torch.tensor([ids])).logits[0].float()
    return logits


def scattered_table(n_pages: int, num_pages: int, seed: int = 0) -> list[int]:
    """Pages in no particular order, so nothing relies on a contiguous block table."""
    gen = torch.Generator().manual_seed(seed)
    table: list[int] = torch.randperm(num_pages, generator=gen)[:n_pages].tolist()
    return table


def check_model(model: LoadedModel, n_prompt: int = 70, n_decode: int = 4) -> None:
    ids = prompt(model, n_prompt + n_decode)
    ref = reference_logits(model, ids)
    cache = PagedKVCache(model.config, 64, BLOCK)
    runner = ModelRunner(model, cache)
    table = scattered_table(cache.pages_for(len(ids)), 64)
    last = n_prompt - 1

    assert rel_err(runner.prefill(ids[:n_prompt], table), ref[last]) < TOL
    # a chunk smaller than the prompt that does not divide it
    assert rel_err(runner.prefill(ids[:n_prompt], table, chunk_size=17), ref[last]) < TOL
    # prefix KV from a separate call, then only the suffix
    runner.prefill(ids[:40], table)
    assert rel_err(runner.prefill(ids[:n_prompt], table, num_cached_tokens=40), ref[last]) < TOL
    for pos in range(n_prompt, n_prompt + n_decode):
        out = runner.decode([DecodeSeq(table, pos, ids[pos])])
        assert out.shape == (1, model.config.vocab) and out.dtype == torch.float32
        assert rel_err(out[0], ref[pos]) < TOL


def test_tiny_llama_matches_transformers() -> None:
    check_model(tiny_random_model(0))


def test_qwen2_style_qkv_bias_matches_transformers() -> None:
    model = tiny_random_model(1, qkv_bias=True)
    assert model.config.qkv_bias and not model.config.o_bias
    assert model.config.model_type == "qwen2"
    check_model(model)


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=["llama3", "linear", "yarn"],
)
def test_scaled_rope_matches_transformers(scaling: dict[str, Any]) -> None:
    # prompt longer than original_max_position so the scaled frequencies matter
    check_model(tiny_random_model(2, rope_scaling=scaling), n_prompt=150)


def test_inverse_frequencies_equal_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in (
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ):
        cfg = LlamaConfig(
            hidden_size=2048,
            num_attention_heads=32,
            max_position_embeddings=131072,
            rope_parameters={"rope_theta": 500000.0, **params},
        )
        ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[str(params["rope_type"])](cfg, "cpu")
        arch = arch_from_hf_config(cfg, model_id="x")
        freq, scale = inverse_frequencies(arch.rope, arch.head_dim)
        assert torch.equal(freq, ref_freq.float())
        assert math.isclose(scale, ref_scale)


def test_bfloat16_is_as_accurate_as_transformers_bfloat16() -> None:
    ids = prompt(tiny_random_model(0), 90)
    truth = reference_logits(tiny_random_model(0), ids)[-1]
    model = tiny_random_model(0, dtype=torch.bfloat16)
    cache = PagedKVCache(model.config, 8, BLOCK, dtype=torch.bfloat16)
    ours = ModelRunner(model, cache).prefill(ids, list(range(6)), chunk_size=33)
    assert ours.dtype == torch.float32
    theirs = reference_logits(model, ids)[-1]
    assert rel_err(ours, truth) <= 1.5 * rel_err(theirs, truth)


def test_prefix_kv_from_another_cache() -> None:
    """Prefix pages computed elsewhere and copied in page by page, as UCX would."""
    model = tiny_random_model(3)
    ids = prompt(model, 90)
    ref = reference_logits(model, ids)
    source = PagedKVCache(model.config, 16, BLOCK)
    ModelRunner(model, source).prefill(ids[:64], [0, 1, 2, 3])
    target = PagedKVCache(model.config, 32, BLOCK)
    table = [9, 4, 30, 17, 2, 11]
    for layer in range(model.config.num_layers):
        for src_page, dst_page in zip([0, 1, 2, 3], table, strict=False):
            target.page_view(layer, dst_page).copy_(source.page_view(layer, src_page))
    logits = ModelRunner(model, target).prefill(ids, table, num_cached_tokens=64)
    assert rel_err(logits, ref[-1]) < TOL


def test_layer_hook_runs_after_each_layer_wrote_its_chunk() -> None:
    model = tiny_random_model(4)
    ids = prompt(model, 50)
    cache = PagedKVCache(model.config, 8, BLOCK)
    runner = ModelRunner(model, cache)
    table = [5, 1, 6, 2]
    calls: list[tuple[int, int, int]] = []
    seen: dict[tuple[int, int], torch.Tensor] = {}

    def k_of(layer: int, start: int, end: int) -> torch.Tensor:
        rows = [cache.kv[layer, table[p // BLOCK], :, 0, p % BLOCK] for p in range(start, end)]
        return torch.stack(rows).clone()

    def hook(layer: int, start: int, end: int) -> None:
        calls.append((layer, start, end))
        seen[(layer, start)] = k_of(layer, start, end)
        if layer + 1 < model.config.num_layers:
            # the next layer has not computed this chunk yet
            assert float(k_of(layer + 1, start, end).abs().sum()) == 0.0

    runner.prefill(ids, table, num_cached_tokens=0, chunk_size=20, layer_hook=hook)
    chunks = [(0, 20), (20, 40), (40, 50)]
    assert calls == [(layer, s, e) for s, e in chunks for layer in range(2)]
    for (layer, start), snapshot in seen.items():
        end = min(start + 20, 50)
        assert torch.equal(snapshot, k_of(layer, start, end))
        assert float(snapshot.abs().sum()) > 0.0


def test_batched_decode_equals_single_sequence_decode() -> None:
    """Sequences of different lengths in one step give each one's solo logits."""
    model = tiny_random_model(5)
    lengths = [3, 40, 17, 65]
    cache = PagedKVCache(model.config, 64, BLOCK)
    runner = ModelRunner(model, cache)
    seqs = []
    next_page = 0
    for i, n in enumerate(lengths):
        ids = prompt(model, n + 1, seed=10 + i)
        pages = list(range(next_page, next_page + cache.pages_for(n + 1)))
        next_page += len(pages)
        runner.prefill(ids[:n], pages)
        seqs.append(DecodeSeq(pages, n, ids[n]))
    batched = runner.decode(seqs)
    for i, seq in enumerate(seqs):
        solo = runner.decode([seq])  # rewrites the same KV, reads the same prefix
        assert rel_err(batched[i], solo[0]) < 1e-5
        ids = prompt(model, lengths[i] + 1, seed=10 + i)
        assert rel_err(solo[0], reference_logits(model, ids)[-1]) < TOL


def test_batched_prefill_equals_one_prompt_at_a_time() -> None:
    """Prompts of different lengths, some with a cached prefix, in one forward pass:
    each gets its solo logits (and greedy token) and the same KV in its pages, and
    its layer hook runs after each layer with its own range."""
    model = tiny_random_model(6)
    lengths = [5, 40, 1, 33, 17]
    cached = [0, 16, 0, 32, 0]
    batched_cache = PagedKVCache(model.config, 64, BLOCK)
    solo_cache = PagedKVCache(model.config, 64, BLOCK)
    batched_runner = ModelRunner(model, batched_cache)
    solo_runner = ModelRunner(model, solo_cache)
    calls: list[tuple[int, int, int, int]] = []
    seqs: list[PrefillSeq] = []
    tables: list[list[int]] = []
    solo: list[torch.Tensor] = []
    next_page = 0
    for i, (n, c) in enumerate(zip(lengths, cached, strict=True)):
        ids = prompt(model, n, seed=20 + i)
        table = list(range(next_page, next_page + batched_cache.pages_for(n)))
        next_page += len(table)
        tables.append(table)
        if c:  # the prefix's KV in both caches already
            batched_runner.prefill(ids[:c], table)
            solo_runner.prefill(ids[:c], table)
        solo.append(solo_runner.prefill(ids, table, num_cached_tokens=c))

        def hook(layer: int, start: int, end: int, i: int = i) -> None:
            calls.append((i, layer, start, end))

        seqs.append(PrefillSeq(ids, table, c, hook))
    logits = batched_runner.prefill_batch(seqs)
    assert logits.shape == (len(seqs), model.config.vocab) and logits.dtype == torch.float32
    for i, seq in enumerate(seqs):
        assert rel_err(logits[i], solo[i]) < 1e-5
        assert int(logits[i].argmax()) == int(solo[i].argmax())
        assert rel_err(logits[i], reference_logits(model, list(seq.token_ids))[-1]) < TOL
        for layer in range(model.config.num_layers):
            for page in tables[i]:
                solo_kv = solo_cache.page_view(layer, page)
                assert rel_err(batched_cache.page_view(layer, page), solo_kv) < 1e-5
    assert calls == [
        (i, layer, c, n)
        for layer in range(model.config.num_layers)
        for i, (n, c) in enumerate(zip(lengths, cached, strict=True))
    ]
    assert batched_runner.prefill_batch([]).shape == (0, model.config.vocab)
    with pytest.raises(ValueError, match="last prompt token"):
        batched_runner.prefill_batch([PrefillSeq(prompt(model, 4), [0], 4)])


def test_prefill_rejects_what_it_cannot_compute() -> None:
    model = tiny_random_model(0)
    runner = ModelRunner(model, PagedKVCache(model.config, 4, BLOCK))
    with pytest.raises(ValueError, match="last prompt token"):
        runner.prefill([1, 2, 3], [0], num_cached_tokens=3)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.prefill(list(range(40)), [0, 1])
    with pytest.raises(ValueError, match="block table"):
        runner.decode([DecodeSeq([0], 16, 1)])


def test_backend_is_sdpa_on_cpu() -> None:
    model = tiny_random_model(0)
    runner = ModelRunner(model, PagedKVCache(model.config, 4, BLOCK))
    assert runner.attention_backend == "torch-sdpa"


@pytest.mark.cuda
def test_cuda_backend_matches_transformers() -> None:
    model = tiny_random_model(0, dtype=torch.bfloat16, device="cuda")
    ids = prompt(model, 80)
    cache = PagedKVCache(model.config, 4, 256, dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(model, cache)
    ref = reference_logits(model, ids)
    assert rel_err(runner.prefill(ids, [2, 0], chunk_size=33), ref[-1]) < 2e-2


def test_a_prefix_landing_layer_by_layer_is_read_only_once_each_layer_is_there() -> None:
    """`layer_ready(layer)` runs before each layer of the first chunk reads the cache:
    here it is what copies that layer's prefix pages in (as a fetch landing while the
    compute runs would), so a layer read before its call would read zeros. The logits
    are those of a prefix copied in whole beforehand, and later chunks wait on nothing."""
    model = tiny_random_model(3)
    ids = prompt(model, 90)
    ref = reference_logits(model, ids)
    source = PagedKVCache(model.config, 16, BLOCK)
    ModelRunner(model, source).prefill(ids[:64], [0, 1, 2, 3])
    target = PagedKVCache(model.config, 32, BLOCK)
    table = [9, 4, 30, 17, 2, 11]
    called: list[int] = []

    def ready(layer: int) -> None:
        called.append(layer)
        for src_page, dst_page in zip([0, 1, 2, 3], table, strict=False):
            target.page_view(layer, dst_page).copy_(source.page_view(layer, src_page))

    logits = ModelRunner(model, target).prefill(
        ids, table, num_cached_tokens=64, chunk_size=16, layer_ready=ready
    )
    assert called == list(range(model.config.num_layers))  # the first chunk's layers only
    assert rel_err(logits, ref[-1]) < TOL
