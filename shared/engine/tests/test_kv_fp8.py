"""The 8-bit KV cache: FP8 e4m3 rows with a float32 scale each (`yb_engine.kv_quant`).

What an 8-bit cache must keep: a row's error is bounded by e4m3's precision relative
to the row's own largest number; a row's bytes depend on it alone; the pages are bytes
of the size the spec announces; a prefix computed elsewhere and copied in gives what
computing it here gives; and the model's output stays close to the full-precision
cache's. How close, on the real model over a fixed prompt set, is measured by
`benchmarks/kv_fp8.py`, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from yb_core.config import ModelConfig
from yb_core.model_files import identity_of
from yb_engine import LoadedModel, ModelRunner, PagedKVCache, load_model, tiny_random_model
from yb_engine.attention import PLAIN, TorchSDPABackend
from yb_engine.kv_quant import (
    FP8,
    dequantize_rows,
    kv_dtype_for,
    quantize_rows,
    storage_dtype,
)
from yb_testkit.checkpoints import build_checkpoint
from yb_testkit.tensor_parallel import start_tp

BLOCK = 16


def prompt(model: LoadedModel, n: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, model.config.vocab, (n,), generator=gen).tolist()
    return ids


def test_a_row_comes_back_within_e4m3_precision_of_its_own_largest_number() -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes side by side, an outlier and an all-zero row.
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[0, 0, 7] = 5e4
    x[1, 2] = 0.0
    raw = quantize_rows(x)
    assert raw.dtype == torch.uint8 and raw.shape == (5, 3, 64 + 4)
    back = dequantize_rows(raw, torch.float32)
    assert back.shape == x.shape and torch.isfinite(back).all()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: a number is off by at most half a step, 1/16 of its
    # binade; below the smallest normal (2^-6 of 448's scale) steps are absolute.
    bound = torch.maximum(x.abs() / 16, amax / 448 * 2.0**-9)
    assert ((back - x).abs() <= bound * 1.0001).all()
    assert torch.equal(back[1, 2], torch.zeros(64))
    # The row's largest number survives exactly (it is what sets the scale).
    assert back[0, 0, 7] == pytest.approx(5e4, rel=1e-6)


def test_a_row_is_quantized_on_its_own() -> None:
    """A block's bytes are a function of its tokens: a row's bytes never depend on
    the rows quantized with it (what lets the pool key blocks by tokens)."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(8, 2, 32, generator=gen)
    together = quantize_rows(rows)
    alone = torch.cat([quantize_rows(rows[i : i + 1]) for i in range(8)])
    assert torch.equal(together, alone)


def test_the_pages_are_the_bytes_the_spec_announces() -> None:
    model = tiny_random_model(0)
    full = PagedKVCache(model.config, 4, BLOCK)
    eight = PagedKVCache(model.config, 4, BLOCK, dtype=FP8)
    spec = eight.spec
    assert spec.dtype == "float8_e4m3fn" and spec.scaled
    assert spec.row_nbytes == spec.dim + 4
    assert eight.kv.dtype == torch.uint8
    assert eight.kv.shape[-1] == spec.row_nbytes
    view = eight.page_view(1, 2)
    assert view.numel() * view.element_size() == eight.page_nbytes == spec.page_nbytes(BLOCK)
    # float32 pages: 4 bytes a number; 8-bit: one, and a 4-byte scale per row.
    assert full.page_nbytes / eight.page_nbytes == pytest.approx(4 * spec.dim / (spec.dim + 4))
    assert spec.layout_id != full.spec.layout_id


def test_the_kv_dtype_setting() -> None:
    assert kv_dtype_for("auto", torch.bfloat16) == torch.bfloat16
    assert kv_dtype_for("fp8_e4m3", torch.float32) == FP8
    assert storage_dtype(FP8) == torch.uint8 and storage_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_dtype_for("fp8_e5m2", torch.float32)
    with pytest.raises(msgspec.ValidationError, match="kv_dtype"):
        msgspec.convert({"kv_dtype": "int4"}, ModelConfig)


def test_a_block_key_tells_8_bit_from_full_precision_kv() -> None:
    full = identity_of(ModelConfig(source="tiny-random", name="tiny"))
    eight = identity_of(ModelConfig(source="tiny-random", name="tiny", kv_dtype="fp8_e4m3"))
    assert full != eight
    # `auto` keeps the keys every pool already holds.
    assert b"kv_dtype" not in full


def test_an_8_bit_prefix_from_another_cache_gives_the_same_logits() -> None:
    """Pages written by one engine and copied into another, as a transfer or the pool
    would: the suffix's logits equal computing the whole prompt in one cache."""
    model = tiny_random_model(3)
    ids = prompt(model, 90)
    whole = PagedKVCache(model.config, 8, BLOCK, dtype=FP8)
    expected = ModelRunner(model, whole).prefill(ids, list(range(6)))
    source = PagedKVCache(model.config, 16, BLOCK, dtype=FP8)
    ModelRunner(model, source).prefill(ids[:64], [0, 1, 2, 3])
    target = PagedKVCache(model.config, 32, BLOCK, dtype=FP8)
    table = [9, 4, 30, 17, 2, 11]
    for layer in range(model.config.num_layers):
        for src_page, dst_page in zip([0, 1, 2, 3], table, strict=False):
            target.page_view(layer, dst_page).copy_(source.page_view(layer, src_page))
    logits = ModelRunner(model, target).prefill(ids, table, num_cached_tokens=64)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5)


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def _cache_layer(dtype: torch.dtype, heads: int, parts: int, dim: int) -> torch.Tensor:
    """One layer's pages, `[pages, heads, parts, block, row]`, as `PagedKVCache` holds
    them for `dtype` (bytes with a scale per row for 8 bits)."""
    row = dim + 4 if dtype == FP8 else dim
    return torch.zeros(8, heads, parts, BLOCK, row, dtype=storage_dtype(dtype))


def test_attention_over_8_bit_pages_stays_within_e4m3_precision() -> None:
    """A chunk written, a second chunk attending over both, and a decode step, on
    float32 pages and on 8-bit ones: the outputs differ by what the keys' and values'
    rounding costs (e4m3 keeps 3 mantissa bits: a few percent), not more. The model
    amplifies this chaotically on a random checkpoint; what it costs on the real
    model is `benchmarks/kv_fp8.py`'s to measure."""
    gen = torch.Generator().manual_seed(2)
    sdpa = TorchSDPABackend()
    heads, kv_heads, dim = 4, 2, 32

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q1, k1, v1 = rand(40, heads, dim), rand(40, kv_heads, dim), rand(40, kv_heads, dim)
    q2, k2, v2 = rand(30, heads, dim), rand(30, kv_heads, dim), rand(30, kv_heads, dim)
    qd, kd, vd = rand(1, heads, dim), rand(1, kv_heads, dim), rand(1, kv_heads, dim)
    table = [5, 1, 7, 0, 3]
    outs = []
    for dtype in (torch.float32, FP8):
        layer = _cache_layer(dtype, kv_heads, 2, dim)
        first = sdpa.prefill(layer, q1, k1, v1, sdpa.plan_prefill(table, 0, 40, BLOCK))
        second = sdpa.prefill(layer, q2, k2, v2, sdpa.plan_prefill(table, 40, 70, BLOCK))
        step = sdpa.decode(layer, qd, kd, vd, sdpa.plan_decode([table], [70], BLOCK))
        assert first is not None and second is not None
        outs.append((first, second, step))
    for full, eight in zip(*outs, strict=True):
        assert 0 < _rel(eight, full) < 0.06, _rel(eight, full)


def test_latent_attention_over_8_bit_pages_stays_within_e4m3_precision() -> None:
    """MLA's latent rows (the compressed KV and the rotated key in one row, one scale)
    through the latent prefill and the absorbed decode."""
    gen = torch.Generator().manual_seed(3)
    sdpa = TorchSDPABackend()
    heads, latent_dim, qk_dim, v_dim = 4, 48, 24, 16
    up_k = torch.randn(latent_dim, heads * qk_dim, generator=gen) / latent_dim**0.5
    up_v = torch.randn(latent_dim, heads * v_dim, generator=gen) / latent_dim**0.5

    def expand(context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = context.reshape(context.shape[0], latent_dim)
        n = flat.shape[0]
        return (flat @ up_k).view(n, heads, qk_dim), (flat @ up_v).view(n, heads, v_dim)

    latents = torch.randn(60, 1, latent_dim, generator=gen)
    q = torch.randn(60, heads, qk_dim, generator=gen)
    qd = torch.randn(1, heads, latent_dim, generator=gen)
    new = torch.randn(1, 1, latent_dim, generator=gen)
    table = [2, 6, 0, 4]
    outs = []
    for dtype in (torch.float32, FP8):
        layer = _cache_layer(dtype, 1, 1, latent_dim)
        sdpa.prefill_latent(
            layer, None, latents[:20], expand, sdpa.plan_prefill(table, 0, 20, BLOCK), PLAIN
        )
        rest = sdpa.prefill_latent(
            layer, q[20:], latents[20:], expand, sdpa.plan_prefill(table, 20, 60, BLOCK), PLAIN
        )
        step = sdpa.decode_latent(
            layer, qd, new, v_dim, sdpa.plan_decode([table], [60], BLOCK), PLAIN
        )
        assert rest is not None
        outs.append((rest, step))
    for full, eight in zip(*outs, strict=True):
        assert 0 < _rel(eight, full) < 0.06, _rel(eight, full)


def test_a_tensor_parallel_instance_keeps_the_same_8_bit_pages(tmp_path: Path) -> None:
    """TP=2 ranks, each holding its heads' 8-bit rows in memory rank 0 maps: the
    logits and every page, joined from the ranks' pieces, are one process's. The first
    layer's bytes are equal; later layers' inputs went through all-reduces, summed in
    another order, so a number may round to the next e4m3 step."""
    path = build_checkpoint("llama", tmp_path / "llama")
    model = load_model(path)
    ids = prompt(model, 50)
    one = PagedKVCache(model.config, 8, BLOCK, dtype=FP8)
    expected = ModelRunner(model, one).prefill(ids, list(range(4)))
    runner, sharded, ranks = start_tp(path, 2, pages=8, block_size=BLOCK, kv_dtype="fp8_e4m3")
    try:
        assert sharded.spec == one.spec
        got = runner.prefill(ids, list(range(4)))
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
        for layer in range(model.config.num_layers):
            for page in range(4):
                joined = torch.cat(sharded.pieces(layer, page, sharded.head_cuts))
                alone = one.page_view(layer, page)
                if layer == 0:
                    assert torch.equal(joined, alone)
                ours, ref = (dequantize_rows(t, torch.float32) for t in (joined, alone))
                assert ((ours - ref).abs() <= ref.abs() / 8 + 1e-6).all()
    finally:
        ranks.close()
