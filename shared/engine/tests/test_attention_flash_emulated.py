"""The engine's flash-attn path, run on CPU against `yb_testkit.flash_standin`.

The backends' own code (plans, calls, cache layout) runs unchanged; only the kernels are
the stand-in, which enforces flash-attn's argument contract (tested below) and computes
in float32 like the kernels.

Tolerances (bfloat16 model, 256-token pages):
- attention outputs of one call, flash vs SDPA on identical inputs: max |diff| <= 1e-2
  x max |SDPA| (bf16 rounding of the output and a different summation order);
- logits through the whole model, flash vs SDPA: <= 5e-2 x max |SDPA logits|, and the
  flash path's distance to the float32 model no more than 1.5x SDPA's (each layer
  rounds to bf16; the two paths round at different points);
- KV cache bytes: equal to the byte where both paths wrote from the same K/V (every
  backend-level test, and layer 0 through the model); later layers within 5e-2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import structlog
import torch

from yb_engine import DecodeSeq, LoadedModel, ModelRunner, PagedKVCache, tiny_random_model
from yb_engine import attention as attn
from yb_engine.attention import (
    AttentionBackend,
    FlashAttnBackend,
    FlashAttnCuteBackend,
    TorchSDPABackend,
    probe_backend,
    select_backend,
)
from yb_testkit.flash_standin import CUTE, FA2, cute_flash_attn_varlen_func, flash_attn_with_kvcache

BF16 = torch.bfloat16
BLOCK = 256
OUT_TOL = 1e-2
LOGIT_TOL = 5e-2


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def fa2() -> AttentionBackend:
    return FlashAttnBackend("cpu", BF16, kernels=FA2)


def cute() -> AttentionBackend:
    return FlashAttnCuteBackend("cpu", BF16, kernels=CUTE)


FLASH = [pytest.param(fa2, id="flash-attn"), pytest.param(cute, id="flash-attn-cute")]


def prompt(model: LoadedModel, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, model.config.vocab, (n,), generator=gen).tolist()
    return ids


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    m = tiny_random_model(7, dtype=BF16)
    # GQA with head_dim a multiple of 8: what flash-attn accepts.
    assert m.config.num_heads % m.config.num_kv_heads == 0 < m.config.num_heads // 2
    assert m.config.head_dim % 8 == 0
    return m


@pytest.fixture(scope="module")
def model_f32() -> LoadedModel:
    return tiny_random_model(7)


# -- through the model runner ------------------------------------------------------------


@pytest.mark.parametrize("make", FLASH)
def test_chunked_prefill_over_cached_prefix_pages_matches_sdpa(
    make: Callable[[], AttentionBackend], model: LoadedModel, model_f32: LoadedModel
) -> None:
    """Prefix pages computed elsewhere (copied in page by page, as UCX would), then the
    rest in chunks that start mid-page and cross page boundaries; the last chunk's last
    layer attends only its last row."""
    ids = prompt(model, 700, seed=1)
    table = [5, 1, 3]
    source = PagedKVCache(model.config, 6, BLOCK, dtype=BF16)
    ModelRunner(model, source, TorchSDPABackend("cpu", BF16)).prefill(ids[:300], [0, 1])
    caches = {}
    logits = {}
    for name, backend in (("sdpa", TorchSDPABackend("cpu", BF16)), ("flash", make())):
        cache = PagedKVCache(model.config, 6, BLOCK, dtype=BF16)
        for layer in range(model.config.num_layers):
            for src, dst in zip([0, 1], table, strict=False):
                cache.page_view(layer, dst).copy_(source.page_view(layer, src))
        runner = ModelRunner(model, cache, backend)
        assert runner.attention_backend == backend.name
        logits[name] = runner.prefill(ids, table, num_cached_tokens=300, chunk_size=150)
        caches[name] = cache.kv
    truth_cache = PagedKVCache(model_f32.config, 6, BLOCK)
    truth = ModelRunner(model_f32, truth_cache).prefill(ids, table)

    assert rel_err(logits["flash"], logits["sdpa"]) <= LOGIT_TOL
    assert rel_err(logits["flash"], truth) <= 1.5 * rel_err(logits["sdpa"], truth)
    assert torch.equal(caches["flash"][0], caches["sdpa"][0])  # same K/V in, same bytes
    assert rel_err(caches["flash"], caches["sdpa"]) <= LOGIT_TOL
    # the prefix pages were read, not rewritten
    for layer in range(model.config.num_layers):
        head = slice(0, 300 - BLOCK)
        assert torch.equal(caches["flash"][layer, 1, :, :, head], source.kv[layer, 1, :, :, head])


@pytest.mark.parametrize("make", FLASH)
def test_batched_decode_with_mixed_lengths_matches_sdpa(
    make: Callable[[], AttentionBackend], model: LoadedModel
) -> None:
    lengths = [3, 255, 256, 257, 600]  # around and across page boundaries
    runs: dict[str, tuple[torch.Tensor, ModelRunner, list[DecodeSeq]]] = {}
    for name, backend in (("sdpa", TorchSDPABackend("cpu", BF16)), ("flash", make())):
        cache = PagedKVCache(model.config, 16, BLOCK, dtype=BF16)
        runner = ModelRunner(model, cache, backend)
        seqs, next_page = [], 15  # pages handed out downwards: tables are not 0, 1, 2
        for i, n in enumerate(lengths):
            ids = prompt(model, n + 1, seed=20 + i)
            pages = list(range(next_page, next_page - cache.pages_for(n + 1), -1))
            next_page -= len(pages)
            runner.prefill(ids[:n], pages)
            seqs.append(DecodeSeq(pages, n, ids[n]))
        runs[name] = (runner.decode(seqs), runner, seqs)

    flash, runner, seqs = runs["flash"]
    sdpa = runs["sdpa"][0]
    assert flash.shape == (len(lengths), model.config.vocab) and flash.dtype == torch.float32
    assert rel_err(flash, sdpa) <= LOGIT_TOL
    assert torch.equal(runner.cache.kv[0], runs["sdpa"][1].cache.kv[0])
    for i, seq in enumerate(seqs):
        solo = runner.decode([seq])  # rewrites the same KV, reads the same prefix
        assert rel_err(flash[i], solo[0]) < 1e-5


def test_flash_backend_refuses_a_cache_in_another_dtype(model: LoadedModel) -> None:
    """The kernels read the pages in place in the queries' dtype: no silent cast."""
    cache = PagedKVCache(model.config, 2, BLOCK, dtype=torch.float32)
    with pytest.raises(ValueError, match="reads the KV cache in place"):
        ModelRunner(model, cache, fa2())
    # SDPA casts, so it still serves that combination
    runner = ModelRunner(model, cache, TorchSDPABackend("cpu", BF16))
    assert runner.prefill([1, 2, 3], [0]).isfinite().all()


@pytest.mark.parametrize("make", FLASH)
def test_layers_only_launch_kernels(
    make: Callable[[], AttentionBackend], model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing per layer builds a tensor from host data: plans hold every index."""
    backend = make()
    real_tensor = torch.tensor
    in_layer = False

    def guarded(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert not in_layer, "torch.tensor called inside a layer's attention"
        return real_tensor(*args, **kwargs)

    def per_layer(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal in_layer
            in_layer = True
            try:
                return fn(*args, **kwargs)
            finally:
                in_layer = False

        return run

    monkeypatch.setattr(torch, "tensor", guarded)
    monkeypatch.setattr(backend, "prefill", per_layer(backend.prefill))
    monkeypatch.setattr(backend, "decode", per_layer(backend.decode))
    cache = PagedKVCache(model.config, 4, BLOCK, dtype=BF16)
    runner = ModelRunner(model, cache, backend)
    ids = prompt(model, 300, seed=3)
    runner.prefill(ids, [2, 0], chunk_size=100)
    runner.decode([DecodeSeq([2, 0], 300, ids[-1]), DecodeSeq([1], 4, ids[0])])


# -- one backend call against SDPA's, same inputs ---------------------------------------


def _inputs(
    rows: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(5, kv_heads, 2, BLOCK, dim, generator=gen).to(BF16)
    q = torch.randn(rows, heads, dim, generator=gen).to(BF16)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(BF16)
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(BF16)
    return kv, q, k, v


def _both_prefill(
    make: Callable[[], AttentionBackend],
    table: list[int],
    start: int,
    end: int,
    last_only: bool = False,
    kv_only: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    kv, q, k, v = _inputs(end - start)
    ref_kv = kv.clone()
    flash, sdpa = make(), TorchSDPABackend("cpu", BF16)
    query = None if kv_only else (q[-1:] if last_only else q)
    out = flash.prefill(kv, query, k, v, flash.plan_prefill(table, start, end, BLOCK))
    ref = sdpa.prefill(ref_kv, query, k, v, sdpa.plan_prefill(table, start, end, BLOCK))
    return out, ref, kv, ref_kv


@pytest.mark.parametrize("make", FLASH)
def test_prefill_chunk_over_a_cached_prefix(make: Callable[[], AttentionBackend]) -> None:
    out, ref, kv, ref_kv = _both_prefill(make, [3, 0, 4], start=200, end=530)
    assert out is not None and ref is not None and out.shape == ref.shape == (330, 4, 16)
    assert out.dtype == BF16
    assert torch.equal(kv, ref_kv)
    assert rel_err(out, ref) <= OUT_TOL


@pytest.mark.parametrize("make", FLASH)
def test_prefill_last_row_only(make: Callable[[], AttentionBackend]) -> None:
    out, ref, kv, ref_kv = _both_prefill(make, [3, 0, 4], start=200, end=530, last_only=True)
    full, _, _, _ = _both_prefill(make, [3, 0, 4], start=200, end=530)
    assert out is not None and ref is not None and full is not None
    assert out.shape == (1, 4, 16)
    assert torch.equal(kv, ref_kv)  # every token of the chunk is written
    assert rel_err(out, ref) <= OUT_TOL
    assert torch.equal(out[0], full[-1])


@pytest.mark.parametrize("make", FLASH)
def test_prefill_keys_and_values_only(make: Callable[[], AttentionBackend]) -> None:
    out, ref, kv, ref_kv = _both_prefill(make, [3, 0, 4], start=100, end=600, kv_only=True)
    assert out is None and ref is None
    assert torch.equal(kv, ref_kv)


@pytest.mark.parametrize("make", FLASH)
def test_decode_of_sequences_with_different_lengths(make: Callable[[], AttentionBackend]) -> None:
    kv, q, k, v = _inputs(4, seed=1)
    ref_kv = kv.clone()
    tables, positions = [[4], [1, 3], [2, 0, 3], [0, 1]], [0, 255, 600, 256]
    flash, sdpa = make(), TorchSDPABackend("cpu", BF16)
    out = flash.decode(kv, q, k, v, flash.plan_decode(tables, positions, BLOCK))
    ref = sdpa.decode(ref_kv, q, k, v, sdpa.plan_decode(tables, positions, BLOCK))
    assert out.shape == ref.shape == (4, 4, 16) and out.dtype == BF16
    assert torch.equal(kv, ref_kv)
    assert rel_err(out, ref) <= OUT_TOL


@pytest.mark.parametrize("make", FLASH)
def test_plans_hold_int32_tables_and_lengths(make: Callable[[], AttentionBackend]) -> None:
    backend = make()
    plan = backend.plan_prefill([3, 0, 4, 1], 200, 530, BLOCK)
    assert plan.block_table.dtype == torch.int32 and plan.block_table.tolist() == [[3, 0, 4]]
    assert plan.cache_seqlens is not None and plan.cache_seqlens.tolist() == [200]
    assert plan.seqused_k is not None and plan.seqused_k.tolist() == [530]
    assert plan.cu_seqlens_q is not None and plan.cu_seqlens_q.tolist() == [0, 330]
    assert plan.cu_seqlens_q_last is not None and plan.cu_seqlens_q_last.tolist() == [0, 1]
    d = backend.plan_decode([[4], [1, 3]], [0, 300], BLOCK)
    assert d.block_tables.dtype == torch.int32 and d.block_tables.tolist() == [[4, 4], [1, 3]]
    assert d.cache_seqlens is not None and d.cache_seqlens.tolist() == [0, 300]
    assert d.seq_lens.tolist() == [1, 301] and d.positions.tolist() == [0, 300]
    assert d.cu_seqlens_q is not None and d.cu_seqlens_q.tolist() == [0, 1, 2]
    for t in (plan.cache_seqlens, plan.cu_seqlens_q, d.cache_seqlens, d.seq_lens):
        assert t is not None and t.is_contiguous()
    with pytest.raises(ValueError, match="block table has 1 pages"):
        backend.plan_decode([[4]], [256], BLOCK)


# -- the stand-in computes what the kernels compute ---------------------------------------


def _naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool) -> torch.Tensor:
    """Dense float32 attention, bottom-right causal: q [sq, h, d], keys [sk, hk, d]."""
    sq, sk = q.shape[0], keys.shape[0]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        keys.float().transpose(0, 1),
        values.float().transpose(0, 1),
        attn_mask=visible,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _paged(
    dense: torch.Tensor, pages: list[int], num_pages: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter `dense` `[n, hk, d]` into a `[num_pages, BLOCK, hk, d]` cache at `pages`."""
    cache = torch.zeros(num_pages, BLOCK, *dense.shape[1:], dtype=dense.dtype)
    for i, page in enumerate(pages):
        chunk = dense[i * BLOCK : (i + 1) * BLOCK]
        cache[page, : chunk.shape[0]] = chunk
    return cache, torch.tensor([pages], dtype=torch.int32)


def test_standin_attends_like_dense_attention_and_appends() -> None:
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(400, 2, 16, generator=gen).to(BF16)
    values = torch.randn(400, 2, 16, generator=gen).to(BF16)
    q = torch.randn(70, 6, 16, generator=gen).to(BF16)
    kc, table = _paged(keys[:330], [2, 0])
    vc, _ = _paged(values[:330], [2, 0])
    out = flash_attn_with_kvcache(
        q[None],
        kc,
        vc,
        k=keys[None, 330:],
        v=values[None, 330:],
        cache_seqlens=torch.tensor([330], dtype=torch.int32),
        block_table=table,
        causal=True,
    )
    assert isinstance(out, torch.Tensor) and out.dtype == BF16
    assert rel_err(out[0], _naive(q, keys, values, causal=True)) <= OUT_TOL
    assert torch.equal(kc[0, 330 - BLOCK : 400 - BLOCK], keys[330:])  # appended in place
    assert torch.equal(vc[0, 330 - BLOCK : 400 - BLOCK], values[330:])

    cu = torch.tensor([0, 70], dtype=torch.int32)
    used = torch.tensor([400], dtype=torch.int32)
    out_c, lse = cute_flash_attn_varlen_func(
        q, kc, vc, cu_seqlens_q=cu, seqused_k=used, page_table=table, causal=True
    )
    assert lse is None and torch.equal(out_c, out[0])


def test_standin_causal_mask_is_aligned_bottom_right() -> None:
    """flash-attn's documented example: 2 queries over 5 keys see 4 and 5 keys; 5
    queries over 2 keys: the first three see nothing and output zeros."""
    values = torch.eye(16)[:5, None, :].to(BF16)  # key j carries the unit vector e_j
    keys = torch.zeros(5, 1, 16, dtype=BF16)  # equal scores: uniform over what is visible
    kc, table = _paged(keys, [1])
    vc, _ = _paged(values, [1])
    two = flash_attn_with_kvcache(
        torch.zeros(1, 2, 1, 16, dtype=BF16),
        kc,
        vc,
        cache_seqlens=torch.tensor([5], dtype=torch.int32),
        block_table=table,
        causal=True,
    )
    assert isinstance(two, torch.Tensor)
    expect = torch.tensor([[0.25] * 4 + [0.0], [0.2] * 5]).to(BF16)
    assert torch.equal(two[0, :, 0, :5], expect)
    five = flash_attn_with_kvcache(
        torch.zeros(1, 5, 1, 16, dtype=BF16),
        kc,
        vc,
        cache_seqlens=torch.tensor([2], dtype=torch.int32),
        block_table=table,
        causal=True,
    )
    assert isinstance(five, torch.Tensor)
    expect = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0], [0.5, 0.5]]).to(BF16)
    assert torch.equal(five[0, :, 0, :2], expect)


@pytest.mark.parametrize("new", [0, 7])
def test_standin_single_query_row_sees_every_key(new: int) -> None:
    """With one query row causal does not apply: it attends to the whole sequence,
    appended keys included (the last-row-only prefill)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(300, 2, 16, generator=gen).to(BF16)
    values = torch.randn(300, 2, 16, generator=gen).to(BF16)
    q = torch.randn(1, 1, 4, 16, generator=gen).to(BF16)
    outs = []
    for causal in (True, False):
        kc, table = _paged(keys[: 300 - new], [3, 1])
        vc, _ = _paged(values[: 300 - new], [3, 1])
        extra: dict[str, Any] = {}
        if new:
            extra = {"k": keys[None, 300 - new :], "v": values[None, 300 - new :]}
        seqlens = torch.tensor([300 - new], dtype=torch.int32)
        outs.append(
            flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=causal, **extra
            )
        )
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0][0], _naive(q[0], keys, values, causal=False)) <= OUT_TOL


# -- the stand-in refuses what the kernels refuse ----------------------------------------


def _fa2_args(**change: Any) -> dict[str, Any]:
    """A valid paged call: 1 sequence, 300 cached + 4 new tokens, 4 heads over 2."""
    gen = torch.Generator().manual_seed(6)
    args: dict[str, Any] = {
        "q": torch.randn(1, 4, 4, 16, generator=gen).to(BF16),
        "k_cache": torch.randn(3, BLOCK, 2, 16, generator=gen).to(BF16),
        "v_cache": torch.randn(3, BLOCK, 2, 16, generator=gen).to(BF16),
        "k": torch.randn(1, 4, 2, 16, generator=gen).to(BF16),
        "v": torch.randn(1, 4, 2, 16, generator=gen).to(BF16),
        "cache_seqlens": torch.tensor([300], dtype=torch.int32),
        "block_table": torch.tensor([[2, 0]], dtype=torch.int32),
        "causal": True,
    }
    args.update(change)
    return args


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dimension no longer unit-stride."""
    wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


def _gapped(t: torch.Tensor) -> torch.Tensor:
    """Same values, not contiguous (every other element of a longer tensor)."""
    wide = torch.zeros(t.shape[0] * 2, dtype=t.dtype)
    wide[::2] = t
    return wide[::2]


def _fa2_bad_cases() -> list[Any]:
    a = _fa2_args()
    cases: list[tuple[str, dict[str, Any], type[Exception], str]] = [
        ("q float32", {"q": a["q"].float()}, RuntimeError, "fp16 and bf16"),
        ("k_cache fp16", {"k_cache": a["k_cache"].half()}, RuntimeError, "same dtype"),
        ("v_cache fp16", {"v_cache": a["v_cache"].half()}, RuntimeError, "same dtype"),
        ("new k fp16", {"k": a["k"].half()}, RuntimeError, "same dtype as query"),
        ("k_cache strided", {"k_cache": _strided(a["k_cache"])}, AssertionError, "contiguous"),
        ("v_cache strided", {"v_cache": _strided(a["v_cache"])}, AssertionError, "contiguous"),
        ("block_table int64", {"block_table": a["block_table"].long()}, RuntimeError, "int32"),
        (
            "cache_seqlens int64",
            {"cache_seqlens": a["cache_seqlens"].long()},
            RuntimeError,
            "int32",
        ),
        (
            "cache_seqlens not contiguous",
            {
                "q": a["q"].expand(2, -1, -1, -1),
                "k": a["k"].expand(2, -1, -1, -1),
                "v": a["v"].expand(2, -1, -1, -1),
                "block_table": torch.tensor([[2, 0], [1, 0]], dtype=torch.int32),
                "cache_seqlens": _gapped(torch.tensor([300, 20], dtype=torch.int32)),
            },
            RuntimeError,
            "seqlens_k must be contiguous",
        ),
        (
            "cache_seqlens per wrong batch",
            {"cache_seqlens": torch.tensor([300, 1], dtype=torch.int32)},
            RuntimeError,
            "shape",
        ),
        (
            "page of 128 tokens",
            {"k_cache": a["k_cache"][:, :128], "v_cache": a["v_cache"][:, :128]},
            RuntimeError,
            "divisible by 256",
        ),
        (
            "3 query heads over 2",
            {"q": a["q"][:, :, :3]},
            RuntimeError,
            "must divide number of heads",
        ),
        (
            "head_dim 264",
            {
                "q": torch.zeros(1, 4, 4, 264, dtype=BF16),
                "k_cache": torch.zeros(3, BLOCK, 2, 264, dtype=BF16),
                "v_cache": torch.zeros(3, BLOCK, 2, 264, dtype=BF16),
                "k": None,
                "v": None,
            },
            RuntimeError,
            "at most 256",
        ),
        ("new k without v", {"v": None}, RuntimeError, "value must also"),
        ("new k without lengths", {"cache_seqlens": None}, RuntimeError, "seqlens_k must"),
        (
            "more query rows than the table holds",
            {
                "q": torch.zeros(1, 600, 4, 16, dtype=BF16),
                "k": torch.zeros(1, 600, 2, 16, dtype=BF16),
                "v": torch.zeros(1, 600, 2, 16, dtype=BF16),
                "cache_seqlens": torch.tensor([0], dtype=torch.int32),
            },
            RuntimeError,
            "seqlen <= the seqlen of the KV cache",
        ),
        ("new k of 1 head", {"k": a["k"][:, :, :1]}, RuntimeError, "k must have shape"),
        (
            "table for another batch",
            {"block_table": torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)},
            RuntimeError,
            "block_table must have shape",
        ),
        (
            "empty batch",
            {"q": a["q"][:0], "k": a["k"][:0], "v": a["v"][:0]},
            RuntimeError,
            "batch size must be positive",
        ),
        (
            "page outside the cache",
            {"block_table": torch.tensor([[2, 3]], dtype=torch.int32)},
            IndexError,
            "outside the cache",
        ),
        (
            "too few pages for the length",
            {"cache_seqlens": torch.tensor([510], dtype=torch.int32)},
            IndexError,
            "block table row has 2",
        ),
        (
            "negative length",
            {"cache_seqlens": torch.tensor([-5], dtype=torch.int32)},
            IndexError,
            "",
        ),
        ("rotary", {"rotary_cos": torch.zeros(8, 8)}, NotImplementedError, "rotary"),
        ("non-paged cache", {"block_table": None}, NotImplementedError, "non_paged"),
        ("sliding window", {"window_size": (64, 0)}, NotImplementedError, "window"),
    ]
    return [pytest.param(change, exc, match, id=name) for name, change, exc, match in cases]


@pytest.mark.parametrize(("change", "exc", "match"), _fa2_bad_cases())
def test_standin_fa2_rejects(change: dict[str, Any], exc: type[Exception], match: str) -> None:
    flash_attn_with_kvcache(**_fa2_args())  # the unchanged call is valid
    with pytest.raises(exc, match=match or None):
        flash_attn_with_kvcache(**_fa2_args(**change))


def test_standin_fa2_accepts_what_its_python_wrapper_fixes() -> None:
    """The wrapper makes q/k/v and the block table unit-stride itself, and turns an int
    `cache_seqlens` into a tensor, so those are not errors."""
    a = _fa2_args()
    ref = flash_attn_with_kvcache(**_fa2_args())
    fixed = flash_attn_with_kvcache(
        **_fa2_args(q=_strided(a["q"]), k=_strided(a["k"]), block_table=_strided(a["block_table"]))
    )
    assert torch.equal(fixed, ref)  # type: ignore[arg-type]


def _cute_args(**change: Any) -> dict[str, Any]:
    """A valid varlen call: 2 sequences (3 and 1 query rows), 4 heads over 2."""
    gen = torch.Generator().manual_seed(7)
    args: dict[str, Any] = {
        "q": torch.randn(4, 4, 16, generator=gen).to(BF16),
        "k": torch.randn(3, BLOCK, 2, 16, generator=gen).to(BF16),
        "v": torch.randn(3, BLOCK, 2, 16, generator=gen).to(BF16),
        "cu_seqlens_q": torch.tensor([0, 3, 4], dtype=torch.int32),
        "seqused_k": torch.tensor([300, 20], dtype=torch.int32),
        "page_table": torch.tensor([[2, 0], [1, 1]], dtype=torch.int32),
        "max_seqlen_q": 3,
        "causal": True,
    }
    args.update(change)
    return args


def _cute_bad_cases() -> list[Any]:
    a = _cute_args()
    cases: list[tuple[str, dict[str, Any], type[Exception], str]] = [
        ("q float32", {"q": a["q"].float()}, AssertionError, "float16 or bfloat16"),
        ("k fp16", {"k": a["k"].half()}, AssertionError, "same dtype"),
        ("page_table int64", {"page_table": a["page_table"].long()}, AssertionError, "int32"),
        (
            "page_table strided",
            {"page_table": _strided(a["page_table"])},
            AssertionError,
            "contiguous",
        ),
        (
            "page_table for another batch",
            {"page_table": a["page_table"][:1]},
            AssertionError,
            "",
        ),
        ("cu_seqlens_q int64", {"cu_seqlens_q": a["cu_seqlens_q"].long()}, AssertionError, "int32"),
        (
            "cu_seqlens_q not contiguous",
            {"cu_seqlens_q": _gapped(a["cu_seqlens_q"])},
            AssertionError,
            "contiguous",
        ),
        ("seqused_k int64", {"seqused_k": a["seqused_k"].long()}, AssertionError, "int32"),
        (
            "seqused_k not contiguous",
            {"seqused_k": _gapped(a["seqused_k"])},
            AssertionError,
            "contiguous",
        ),
        ("seqused_k per wrong batch", {"seqused_k": a["seqused_k"][:1]}, AssertionError, "shape"),
        (
            "cu_seqlens_k with a page table",
            {"cu_seqlens_k": torch.tensor([0, 300, 320], dtype=torch.int32)},
            AssertionError,
            "not supported with cu_seqlens_k",
        ),
        ("3 query heads over 2", {"q": a["q"][:, :3]}, AssertionError, "divisible by num_head_kv"),
        (
            "head_dim 12",
            {
                "q": torch.zeros(4, 4, 12, dtype=BF16),
                "k": torch.zeros(3, BLOCK, 2, 12, dtype=BF16),
                "v": torch.zeros(3, BLOCK, 2, 12, dtype=BF16),
            },
            AssertionError,
            "divisible by 8",
        ),
        (
            "head_dim 264",
            {
                "q": torch.zeros(4, 4, 264, dtype=BF16),
                "k": torch.zeros(3, BLOCK, 2, 264, dtype=BF16),
                "v": torch.zeros(3, BLOCK, 2, 264, dtype=BF16),
            },
            AssertionError,
            "less than or equal to 256",
        ),
        (
            "page outside the cache",
            {"page_table": torch.tensor([[2, 0], [7, 1]], dtype=torch.int32)},
            IndexError,
            "outside the cache",
        ),
        (
            "too few pages for the length",
            {"seqused_k": torch.tensor([600, 20], dtype=torch.int32)},
            IndexError,
            "block table row has 2",
        ),
        ("no seqused_k", {"seqused_k": None}, IndexError, "past the page table"),
        (
            "cu_seqlens_q past the rows",
            {"cu_seqlens_q": torch.tensor([0, 3, 9], dtype=torch.int32)},
            IndexError,
            "partition",
        ),
        ("softcap", {"softcap": 30.0}, NotImplementedError, "softcap"),
        ("non-paged cache", {"page_table": None}, NotImplementedError, "non_paged"),
    ]
    return [pytest.param(change, exc, match, id=name) for name, change, exc, match in cases]


@pytest.mark.parametrize(("change", "exc", "match"), _cute_bad_cases())
def test_standin_cute_rejects(change: dict[str, Any], exc: type[Exception], match: str) -> None:
    cute_flash_attn_varlen_func(**_cute_args())
    with pytest.raises(exc, match=match or None):
        cute_flash_attn_varlen_func(**_cute_args(**change))


# -- probing a backend ------------------------------------------------------------------


@pytest.mark.parametrize("make", FLASH)
def test_probe_passes_a_correct_backend(
    make: Callable[[], AttentionBackend], model: LoadedModel
) -> None:
    assert probe_backend(make(), model.config, BLOCK, BF16) is None


def test_probe_catches_a_kernel_that_fails_or_computes_wrong(model: LoadedModel) -> None:
    def non_causal(*args: Any, **kwargs: Any) -> Any:
        # a kernel that drops the causal mask: earlier rows see later keys
        return flash_attn_with_kvcache(*args, **{**kwargs, "causal": False})

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    wrong = FlashAttnBackend(
        "cpu", BF16, kernels=SimpleNamespace(flash_attn_with_kvcache=non_causal)
    )
    reason = probe_backend(wrong, model.config, BLOCK, BF16)
    assert reason is not None and "differs from SDPA" in reason
    broken = FlashAttnBackend("cpu", BF16, kernels=SimpleNamespace(flash_attn_with_kvcache=refuse))
    reason = probe_backend(broken, model.config, BLOCK, BF16)
    assert reason is not None and "Ampere" in reason


# -- selection: every reason to fall back ---------------------------------------------------


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Pretend torch sees a GPU of a given capability with given modules installed.

    Only the selection logic runs against this; nothing is computed on the 'GPU'.
    """

    def set_up(
        capability: tuple[int, int] = (8, 0),
        modules: dict[str, Any] | None = None,
        probe: str | None = None,
    ) -> None:
        installed = {"flash_attn": FA2, "flash_attn.cute": CUTE} if modules is None else modules

        def fake_import(module: str) -> tuple[Any, str | None]:
            found = installed.get(module)
            if isinstance(found, str):
                return None, found
            return (found, None) if found is not None else (None, f"{module} is not installed")

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(attn, "_import", fake_import)
        monkeypatch.setattr(attn, "probe_backend", lambda *args: probe)

    return set_up


def _select(**kwargs: Any) -> tuple[AttentionBackend, list[dict[str, Any]]]:
    args: dict[str, Any] = {"device": "cuda", "block_size": BLOCK, "dtype": BF16}
    args.update(kwargs)
    with structlog.testing.capture_logs() as logs:
        backend = select_backend(**args)
    return backend, logs


def _fallback(backend: AttentionBackend, logs: list[dict[str, Any]], reason: str) -> None:
    assert backend.name == "torch-sdpa"
    assert isinstance(backend, TorchSDPABackend) and backend.fallback_reason is not None
    assert reason in backend.fallback_reason
    events = [e for e in logs if e["event"] == "attention_fallback"]
    assert len(events) == 1 and events[0]["reason"] == backend.fallback_reason
    assert events[0]["log_level"] == "warning"


def test_selection_picks_flash_attn_2_when_everything_fits(
    gpu: Callable[..., None], model: LoadedModel
) -> None:
    gpu((9, 0))
    backend, logs = _select(arch=model.config, cache_dtype=BF16)
    assert isinstance(backend, FlashAttnBackend) and backend.name == "flash-attn"
    assert not [e for e in logs if e["event"] == "attention_fallback"]


def test_selection_picks_cute_on_blackwell_or_without_flash_attn_2(
    gpu: Callable[..., None], model: LoadedModel
) -> None:
    gpu((10, 0))
    assert isinstance(_select(arch=model.config)[0], FlashAttnCuteBackend)
    gpu((8, 0), modules={"flash_attn.cute": CUTE})
    assert isinstance(_select(arch=model.config)[0], FlashAttnCuteBackend)
    gpu((8, 6))  # FA2's pages must be 256-token multiples; cute has no such rule
    assert isinstance(_select(block_size=64)[0], FlashAttnCuteBackend)


def test_cpu_is_sdpa_by_design_and_logs_nothing() -> None:
    backend, logs = _select(device="cpu")
    assert backend.name == "torch-sdpa" and logs == []
    assert isinstance(backend, TorchSDPABackend)
    assert backend.fallback_reason == "device cpu is not CUDA"


def test_fallback_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fallback(*_select(), "CUDA is not available")


def _arch(model: LoadedModel, **change: Any) -> Any:
    return msgspec.structs.replace(model.config, **change)


@pytest.mark.parametrize(
    ("capability", "select", "modules", "reason"),
    [
        ((7, 5), {}, None, "compute capability 7.5 < 8.0"),
        ((8, 0), {"dtype": torch.float32}, None, "dtype torch.float32"),
        ((8, 0), {"dtype": torch.float16, "cache_dtype": torch.float32}, None, "KV cache dtype"),
        ((8, 0), {"arch": {"num_heads": 6, "num_kv_heads": 4}}, None, "not a multiple of 4"),
        ((8, 0), {"arch": {"head_dim": 320}}, None, "head_dim 320 > 256"),
        ((8, 0), {"arch": {"head_dim": 12}}, None, "head_dim 12 is not a multiple of 8"),
        (
            (8, 0),
            {"block_size": 64},
            {"flash_attn.cute": "flash_attn.cute is not installed"},
            "flash-attn: block_size 64 is not a multiple of 256; "
            "flash-attn-cute: flash_attn.cute is not installed",
        ),
        (
            (10, 0),
            {"arch": {"head_dim": 192}},
            None,
            "flash-attn: runs on sm80-sm90 only, not sm100; "
            "flash-attn-cute: head_dim 192 unsupported on sm100",
        ),
        (
            (9, 0),
            {},
            {
                "flash_attn": "import flash_attn failed: ImportError: undefined symbol",
                "flash_attn.cute": "flash_attn.cute is not installed",
            },
            "import flash_attn failed: ImportError: undefined symbol",
        ),
        (
            (9, 0),
            {},
            {"flash_attn": SimpleNamespace(), "flash_attn.cute": "x is not installed"},
            "flash_attn unusable: AttributeError",
        ),
    ],
    ids=[
        "capability",
        "float32",
        "cache dtype",
        "gqa ratio",
        "head_dim > 256",
        "head_dim % 8",
        "page size",
        "sm100 head_dim",
        "broken wheel",
        "no entry point",
    ],
)
def test_each_fallback_reason_is_logged(
    gpu: Callable[..., None],
    model: LoadedModel,
    capability: tuple[int, int],
    select: dict[str, Any],
    modules: dict[str, Any] | None,
    reason: str,
) -> None:
    gpu(capability, modules)
    if "arch" in select:
        select = {**select, "arch": _arch(model, **select["arch"])}
    _fallback(*_select(**select), reason)


def test_fallback_when_the_probe_fails(gpu: Callable[..., None]) -> None:
    gpu((9, 0), probe="probe failed: AssertionError: paged KV not supported on SM 9.0")
    _fallback(*_select(), "flash-attn-cute: probe failed: AssertionError: paged KV")


def test_import_failures_are_reasons_not_crashes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel built against another torch raises at import; that must not escape."""
    pkg = tmp_path / "yb_broken_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libc10.so: undefined symbol: _ZN3c105ErrorC2E')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module, why = attn._import("yb_broken_kernels")
    assert module is None and why is not None
    assert why.startswith("import yb_broken_kernels failed: ImportError: libc10.so")
    assert attn._import("yb_no_such_kernels") == (None, "yb_no_such_kernels is not installed")
    assert attn._import("yb_no_such_kernels.cute")[1] is not None
    module, why = attn._import("json")
    assert why is None and module is sys.modules["json"]
