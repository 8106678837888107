"""The mixed step (decode tokens and a prefill chunk in one forward pass) on the flash
backends' code path, run on CPU against `yb_testkit.flash_standin`.

Each part of a mixed step must compute what `decode` and `prefill` compute for it apart
on the same backend: the same K/V bytes in every page of layer 0 (whose K/V come
straight from the embeddings) and logits within 1e-2 of the largest (bf16 rounds the
shared matmuls' sums differently with the number of rows).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from yb_engine import DecodeSeq, LoadedModel, ModelRunner, PagedKVCache, tiny_random_model
from yb_engine.attention import AttentionBackend, FlashAttnBackend, FlashAttnCuteBackend
from yb_engine.runner import PrefillChunk
from yb_testkit.flash_standin import CUTE, FA2

BF16 = torch.bfloat16
BLOCK = 256
TOL = 1e-2

FLASH = [
    pytest.param(lambda: FlashAttnBackend("cpu", BF16, kernels=FA2), id="flash-attn"),
    pytest.param(lambda: FlashAttnCuteBackend("cpu", BF16, kernels=CUTE), id="flash-attn-cute"),
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_random_model(7, dtype=BF16)


def ids_of(model: LoadedModel, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, model.config.vocab, (n,), generator=gen).tolist()
    return ids


@pytest.mark.parametrize("make", FLASH)
def test_mixed_step_equals_decode_and_prefill_apart(
    make: Callable[[], AttentionBackend], model: LoadedModel
) -> None:
    cache = PagedKVCache(model.config, 12, BLOCK, dtype=BF16)
    runner = ModelRunner(model, cache, make())
    seqs, next_page = [], 11
    for i, n in enumerate([3, 255, 256, 300]):  # around and across page boundaries
        ids = ids_of(model, n + 1, seed=30 + i)
        pages = list(range(next_page, next_page - cache.pages_for(n + 1), -1))
        next_page -= len(pages)
        runner.prefill(ids[:n], pages)
        seqs.append(DecodeSeq(pages, n, ids[n]))
    prompt = ids_of(model, 400, seed=5)
    table = [0, 2]
    runner.prefill(prompt[:200], table)  # a cached prefix; the chunk starts mid-page
    saved = cache.kv.clone()
    decode_apart = runner.decode(seqs)
    prefill_apart = runner.prefill(prompt, table, num_cached_tokens=200)
    kv_apart = cache.kv.clone()
    cache.kv.copy_(saved)
    decode_mixed, prompt_logits = runner.mixed(seqs, PrefillChunk(prompt[200:], table, 200, True))
    assert prompt_logits is not None
    assert rel_err(decode_mixed, decode_apart) <= TOL
    assert rel_err(prompt_logits, prefill_apart) <= TOL
    assert torch.equal(cache.kv[0], kv_apart[0])
    assert rel_err(cache.kv, kv_apart) <= TOL
