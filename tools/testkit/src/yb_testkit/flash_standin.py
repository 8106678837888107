"""flash-attn's paged-KV entry points in plain torch, holding callers to the kernels' contract.

The engine's flash path cannot run here (no GPU), so tests inject this module in place of
the real kernels (`FlashAttnBackend(..., kernels=FA2)`, `FlashAttnCuteBackend(...,
kernels=CUTE)`). It is only useful if it refuses what the real kernels refuse, so every
argument check of the real entry points is made here, raising the same kind of error:

- flash-attn 2 (`flash_attn.flash_attn_with_kvcache`): the Python wrapper asserts
  (`AssertionError`) and the C++ `mha_fwd_kvcache` checks (`RuntimeError`, as
  `TORCH_CHECK` raises).
- flash-attn 4 (`flash_attn.cute.flash_attn_varlen_func`): Python asserts only
  (`AssertionError`).

Where the real kernel does not check but would read out of bounds (a block-table entry
outside the cache, a sequence longer than its block-table row), the stand-in raises
`IndexError`: on a GPU that is an illegal memory access or silent garbage.

Features the engine does not use (rotary, ALiBi, sliding windows, softcap, cache_batch_idx,
left padding, a non-paged cache, score/mask mods) raise `NotImplementedError` rather
than being ignored, so a caller cannot start using one against an untested stand-in.

Results are computed in float32 and returned in the queries' dtype, as the kernels
accumulate in float32 and write the output in the input dtype. New keys/values are
written into the cache in the cache's dtype (which must equal the queries') and read
back from it, as the kernels do.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import torch

_HALF = (torch.float16, torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    # TORCH_CHECK raises c10::Error, which Python sees as RuntimeError.
    if not cond:
        raise RuntimeError(msg)


def _check_shape(t: torch.Tensor, name: str, *shape: int) -> None:
    _check(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _same_device(q: torch.Tensor, *tensors: torch.Tensor | None) -> None:
    # The real kernels require CUDA for every tensor; off the GPU the equivalent is that
    # nothing lives on a different device from the queries.
    for t in tensors:
        if t is not None:
            _check(t.device == q.device, f"all tensors must be on {q.device}, one is on {t.device}")


def _maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _unsupported(**features: Any) -> None:
    used = [name for name, on in features.items() if on]
    if used:
        raise NotImplementedError(f"the flash-attn stand-in does not model {', '.join(used)}")


def _check_pages(
    block_table: torch.Tensor, seqlens: list[int], page_size: int, num_blocks: int
) -> None:
    """Every page a sequence reads exists and its block-table row holds enough pages."""
    width = block_table.shape[1]
    for b, n in enumerate(seqlens):
        if n < 0:
            raise IndexError(f"sequence {b} has negative length {n}")
        need = -(-n // page_size)
        if need > width:
            raise IndexError(
                f"sequence {b} has {n} keys, {need} pages, but its block table row has {width}"
            )
        used = block_table[b, :need]
        if need and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise IndexError(
                f"sequence {b} reads page {used.tolist()} outside the cache's {num_blocks} pages"
            )


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q `[sq, h, d]`, keys/values `[sk, hk, d]`; float32 out and LSE.

    Causal masking is aligned to the bottom-right corner: query row i sees key j when
    `j <= i + sk - sq`. A row that sees no key outputs zeros.
    """
    sq, h, _ = q.shape
    sk, hk, _ = keys.shape
    group = h // hk
    kf = keys.float().repeat_interleave(group, dim=1)  # query head i uses KV head i // group
    vf = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(~(j <= i + sk - sq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [h, sq]
    probs = torch.exp(scores - lse[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with every key masked
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse


def _gather(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` token rows of the pages, `[n, heads, dim]`."""
    if n == 0:
        return cache.new_empty((0, *cache.shape[2:]))
    page_size = cache.shape[1]
    need = -(-n // page_size)
    rows = cache[pages[:need].long()]  # [need, page_size, heads, dim]
    return rows.reshape(need * page_size, *cache.shape[2:])[:n]


def _append(cache: torch.Tensor, pages: torch.Tensor, start: int, new: torch.Tensor) -> None:
    """Write `new` `[s, heads, dim]` at token positions `[start, start + s)` of the pages."""
    page_size = cache.shape[1]
    pos = torch.arange(start, start + new.shape[0], device=cache.device)
    cache[pages.long()[pos // page_size], pos % page_size] = new.to(cache.dtype)


# -- flash-attn 2 ---------------------------------------------------------------------


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash-attn 2's `flash_attn_with_kvcache` over a paged cache (see module doc).

    q `[b, sq, h, d]`; caches `[num_blocks, page_block_size, hk, d]`; optional new
    k/v `[b, s_new, hk, d]` written at `cache_seqlens` before attending; block_table
    `[b, max_blocks]` int32. Returns `[b, sq, h, d]` in q's dtype (and the LSE).
    """
    # The Python wrapper's own steps, in its order.
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    q = _maybe_contiguous(q)  # type: ignore[assignment]
    k = _maybe_contiguous(k)
    v = _maybe_contiguous(v)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full(
            (k_cache.shape[0],), cache_seqlens, dtype=torch.int32, device=k_cache.device
        )
    block_table = _maybe_contiguous(block_table)
    _unsupported(
        rotary=rotary_cos is not None or rotary_sin is not None,
        cache_batch_idx=cache_batch_idx is not None,
        cache_leftpad=cache_leftpad is not None,
        alibi_slopes=alibi_slopes is not None,
        sliding_window=tuple(window_size) != (-1, -1),
        softcap=softcap > 0.0,
        non_paged_cache=block_table is None,
    )
    assert block_table is not None

    # mha_fwd_kvcache's checks.
    dtype = q.dtype
    _check(dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k_cache.dtype == dtype, "query and key must have the same dtype")
    _check(v_cache.dtype == dtype, "query and value must have the same dtype")
    _same_device(q, k_cache, v_cache, k, v, block_table, cache_seqlens)
    _check(q.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(k_cache.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(v_cache.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(q.dim() == 4, "q must be [batch, seqlen_q, heads, head_dim]")
    _check(k_cache.dim() == 4 and v_cache.dim() == 4, "paged caches must be 4-dimensional")
    _check(block_table.dim() == 2, "block_table must be [batch, max_num_blocks_per_seq]")
    batch, seqlen_q, heads, head_dim = q.shape
    v_head_dim = v_cache.shape[3]
    max_blocks = block_table.shape[1]
    num_blocks, page_size, heads_k = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    _check(page_size % 256 == 0, "Paged KV cache block size must be divisible by 256")
    seqlen_k = max_blocks * page_size
    _check(batch > 0, "batch size must be positive")
    _check(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(
        heads % heads_k == 0,
        "Number of heads in key/value must divide number of heads in query",
    )
    _check(v_head_dim <= 256, "FlashAttention backward only supports head dimension at most 256")
    # causal=True is the same as causal=False when there is one query row.
    if seqlen_q == 1:
        causal = False
    _check_shape(k_cache, "k_cache", num_blocks, page_size, heads_k, head_dim)
    _check_shape(v_cache, "v_cache", num_blocks, page_size, heads_k, v_head_dim)
    _check_shape(block_table, "block_table", batch, max_blocks)
    new = 0
    if k is not None:
        _check(v is not None, "If key is supplied, value must also be passed in")
        _check(cache_seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
        _check(
            seqlen_q <= seqlen_k,
            "If key is supplied, it must have seqlen <= the seqlen of the KV cache",
        )
        assert v is not None
        _check(k.dtype == dtype, "Key must have the same dtype as query")
        _check(v.dtype == dtype, "Value must have the same dtype as query")
        _check(k.stride(-1) == 1, "Key tensor must have contiguous last dimension")
        _check(v.stride(-1) == 1, "Value tensor must have contiguous last dimension")
        _check(k.dim() == 4, "k must be [batch, seqlen_new, heads_k, head_dim]")
        new = k.shape[1]
        _check_shape(k, "k", batch, new, heads_k, head_dim)
        _check_shape(v, "v", batch, new, heads_k, v_head_dim)
    if cache_seqlens is not None:
        assert isinstance(cache_seqlens, torch.Tensor)
        _check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
        _check(cache_seqlens.is_contiguous(), "seqlens_k must be contiguous")
        _check_shape(cache_seqlens, "seqlens_k", batch)
        cached = [int(n) for n in cache_seqlens.tolist()]
    else:
        cached = [seqlen_k] * batch  # no lengths: every row of the table is read in full

    lengths = [n + new for n in cached]
    _check_pages(block_table, lengths, page_size, num_blocks)
    out = q.new_empty((batch, seqlen_q, heads, v_head_dim))
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    for b in range(batch):
        pages = block_table[b]
        if k is not None and v is not None and new:
            _append(k_cache, pages, cached[b], k[b])
            _append(v_cache, pages, cached[b], v[b])
        keys = _gather(k_cache, pages, lengths[b])
        values = _gather(v_cache, pages, lengths[b])
        o, lse[b] = _attend(q[b], keys, values, softmax_scale, causal)
        out[b] = o.to(dtype)
    return (out, lse) if return_softmax_lse else out


# -- flash-attn 4 (CuTe DSL) ----------------------------------------------------------


def cute_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    score_mod: Any = None,
    mask_mod: Any = None,
    block_sparse_tensors: Any = None,
    cu_total_m_blocks: torch.Tensor | None = None,
    cu_total_n_blocks: torch.Tensor | None = None,
    aux_tensors: list[torch.Tensor] | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash-attn 4's `flash_attn.cute.flash_attn_varlen_func` over a paged cache.

    q `[total_q, h, d]` with `cu_seqlens_q` `[b + 1]`; k/v `[num_pages, page_size, hk,
    d]` with `page_table` `[b, max_pages]` int32 and `seqused_k` `[b]` keys per
    sequence. Returns `(out, lse)` like the real function; lse is None unless asked for.
    It appends nothing: the caller writes new keys/values into the pages first.
    """
    _unsupported(
        sliding_window=tuple(window_size) != (None, None),
        learnable_sink=learnable_sink is not None,
        softcap=bool(softcap),
        score_mod=score_mod is not None,
        mask_mod=mask_mod is not None,
        block_sparsity=block_sparse_tensors is not None,
        aux_tensors=aux_tensors is not None,
        seqused_q=seqused_q is not None,
        non_paged_cache=page_table is None,
        batched_q=cu_seqlens_q is None,
    )
    assert page_table is not None and cu_seqlens_q is not None
    q = _maybe_contiguous(q)  # type: ignore[assignment]
    k = _maybe_contiguous(k)  # type: ignore[assignment]
    v = _maybe_contiguous(v)  # type: ignore[assignment]
    heads, head_dim = q.shape[-2:]
    batch = cu_seqlens_q.shape[0] - 1
    total_q = q.shape[0]
    assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
    assert page_table.dtype == torch.int32, "page_table must be int32"
    assert page_table.stride(-1) == 1, "page_table must be contiguous in the last dimension"
    max_pages = page_table.shape[1]
    assert page_table.shape == (batch, max_pages)
    num_pages, page_size = k.shape[:2]
    heads_k = k.shape[-2]
    head_dim_v = v.shape[-1]
    assert k.shape == (num_pages, page_size, heads_k, head_dim)
    assert v.shape == (num_pages, page_size, heads_k, head_dim_v)
    assert cu_seqlens_q.shape == (batch + 1,), "cu_seqlens_q must have shape (batch_size + 1,)"
    assert seqused_k is None or seqused_k.shape == (batch,), (
        "seqused_k must have shape (batch_size,)"
    )
    assert q.dtype in _HALF, "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype, "inputs must have the same dtype"
    for t in (cu_seqlens_q, seqused_k):
        if t is not None:
            assert t.dtype == torch.int32, "cu_seqlens_q, seqused_k must be int32"
            assert t.stride(0) == 1, "cu_seqlens_q, seqused_k must be contiguous"
    assert all(t is None or t.device == q.device for t in (k, v, cu_seqlens_q, seqused_k)), (
        "inputs must be on the same (CUDA) device"
    )
    assert page_table.device == q.device, "inputs must be on the same (CUDA) device"
    assert heads % heads_k == 0, "num_head must be divisible by num_head_kv"
    assert head_dim <= 256, "head_dim must be less than or equal to 256"
    alignment = 16 // q.element_size()
    assert head_dim % alignment == 0, f"head_dim must be divisible by {alignment}"
    assert head_dim_v % alignment == 0, f"head_dim_v must be divisible by {alignment}"
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)

    bounds = [int(x) for x in cu_seqlens_q.tolist()]
    if bounds[0] != 0 or bounds[-1] != total_q or any(a > b for a, b in itertools.pairwise(bounds)):
        raise IndexError(f"cu_seqlens_q {bounds} does not partition {total_q} query rows")
    if seqused_k is None:
        # Without it each sequence spans num_pages * page_size keys: a read past the table.
        raise IndexError("page_table without seqused_k reads past the page table")
    lengths = [int(n) for n in seqused_k.tolist()]
    _check_pages(page_table, lengths, page_size, num_pages)
    out = q.new_empty((total_q, heads, head_dim_v))
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    for b in range(batch):
        lo, hi = bounds[b], bounds[b + 1]
        keys = _gather(k, page_table[b], lengths[b])
        values = _gather(v, page_table[b], lengths[b])
        o, lse[:, lo:hi] = _attend(q[lo:hi], keys, values, softmax_scale, causal)
        out[lo:hi] = o.to(q.dtype)
    return out, (lse if return_lse else None)


FA2 = SimpleNamespace(flash_attn_with_kvcache=flash_attn_with_kvcache)
"""Stands in for the `flash_attn` module (flash-attn 2)."""

CUTE = SimpleNamespace(flash_attn_varlen_func=cute_flash_attn_varlen_func)
"""Stands in for the `flash_attn.cute` module (flash-attn 4)."""
