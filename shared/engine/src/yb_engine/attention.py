"""Attention over the paged KV cache, behind one interface with swappable backends.

A backend does two things per layer: it writes the new tokens' K/V into their pages and
it attends the queries to every visible key of their sequence. Everything that is the
same for all layers of one forward (block tables, sequence lengths, page and slot
indices, masks) is computed once per step, in a *plan*, with one host-to-device copy
that does not wait for the device; the per-layer work only launches kernels.

- `TorchSDPABackend` (any device, the CPU default): gathers a sequence's pages into a
  reused workspace and calls `scaled_dot_product_attention`.
- `FlashAttnBackend` (flash-attn 2, CUDA sm80-sm90): `flash_attn_with_kvcache` appends
  the new K/V through the block table and attends, in one kernel per layer.
- `FlashAttnCuteBackend` (flash-attn 4, `flash_attn.cute`, sm80-sm120): the K/V
  are written with one indexed store, then `flash_attn_varlen_func` attends through
  `page_table` and `seqused_k`.

`select_backend` picks the first flash backend whose every requirement holds (see its
docstring), else SDPA, and logs why (`attention_fallback`). The flash backends take an
injected `kernels` module, so the CPU suite runs their real code path against
`yb_testkit.flash_standin`, which enforces the kernels' argument contract; production
selection only ever imports the real modules.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from yb_core.telemetry import get_logger
from yb_engine.architecture import ArchConfig
from yb_engine.kv_quant import dequantize_rows, quantize_rows

log = get_logger(__name__)

FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The only dtypes flash-attn computes in (queries, keys, values and the cache alike)."""

FA2_PAGE_MULTIPLE = 256
"""flash-attn 2's paged KV requires `page_block_size % 256 == 0`."""


@dataclass(frozen=True, slots=True)
class AttnOptions:
    """How one layer attends, where a family differs from plain causal softmax
    attention: the score `scale` (None: `head_dim ** -0.5`), a sliding `window` (a
    query at position i sees keys in `(i - window, i]`; 0: every earlier key), and a
    `softcap` (scores become `softcap * tanh(scores / softcap)` before the mask)."""

    scale: float | None = None
    window: int = 0
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """Causal attention over every earlier key, no soft-capping."""
        return not self.window and self.softcap is None


PLAIN = AttnOptions()


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One chunk `[start, end)` of one sequence.

    `block_table` covers the pages of tokens `[0, end)` (int64 `[pages]` for SDPA, int32
    `[1, pages]` for flash-attn); `write_pages`/`write_slots` (int64 `[end - start]`)
    are the page and the slot in it that each of the chunk's tokens is written to;
    `mask` is SDPA's causal mask with the prefix offset (None when the chunk
    starts at 0, and for flash-attn, whose causal mask is aligned bottom-right).

    The flash fields are int32 device tensors: `cache_seqlens` `[1]` = start (tokens
    already in the pages), `seqused_k` `[1]` = end, `cu_seqlens_q` `[2]` = `[0, end -
    start]` and `cu_seqlens_q_last` `[2]` = `[0, 1]` (last row only).
    """

    start: int
    end: int
    block_table: torch.Tensor
    write_pages: torch.Tensor
    write_slots: torch.Tensor
    mask: torch.Tensor | None
    cache_seqlens: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_q_last: torch.Tensor | None = None
    #: Boolean visibility masks of windowed layers, made on first use per window.
    window_masks: dict[tuple[int, bool], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One new token for each of B sequences.

    `block_tables` is `[B, max_pages]`, padded with a valid page index that is never
    read (SDPA's mask hides it; flash-attn stops at the length); `seq_lens` counts each
    sequence's tokens including the new one; `positions` (int64) is where the new token
    goes. Flash fields (int32): `cache_seqlens` `[B]` = positions, `cu_seqlens_q`
    `[B + 1]` = `0..B`.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    write_pages: torch.Tensor
    write_slots: torch.Tensor
    mask: torch.Tensor | None
    cache_seqlens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class AttentionBackend(Protocol):
    """What the runner needs from an attention implementation.

    `kv_layer` is `cache.kv[layer]`, `[num_pages, kv_heads, 2, block_size, head_dim]`
    (head-major pages: `yb_engine.kv_cache`).
    Queries are `[T, heads, head_dim]` and keys/values `[T, kv_heads, head_dim]`, with
    RoPE applied; the result has the queries' shape. Plans are made once per forward
    and shared by all layers; `opts` says how the layer attends (scale, window,
    soft-cap). `cache_dtype_must_match` says the backend reads the pages in place and so
    needs the cache in the model's dtype (SDPA casts instead).
    """

    name: str
    cache_dtype_must_match: bool

    def plan_prefill(
        self, block_table: Sequence[int], start: int, end: int, block_size: int
    ) -> PrefillPlan: ...

    def plan_decode(
        self, block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
    ) -> DecodePlan: ...

    def prefill(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PrefillPlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor | None:
        """Write the chunk's K/V; attend `q` unless it is None (K/V only).

        When `q` has one row and the chunk more, that row is the chunk's last token,
        which sees every key: the final layer needs no other output.
        """
        ...

    def decode(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DecodePlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor: ...


def host_ints(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-d tensor on `device`, copied without waiting for the device.

    `torch.tensor(values, device=cuda)` copies from pageable memory and synchronises the
    stream, stalling the host until every queued kernel has run. Staging in pinned memory
    makes the copy asynchronous; torch's caching host allocator keeps the staging block
    from being reused until the copy has executed.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _write(
    kv_layer: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, *parts: torch.Tensor
) -> None:
    """Write each token's parts (`[T, heads, dim]` each: K and V, or the latent) at
    (its page, every head, the part, its slot) of `kv_layer` `[pages, heads, parts,
    block, row]`, quantized in an 8-bit cache (`yb_engine.kv_quant`)."""
    heads = torch.arange(kv_layer.shape[1], device=kv_layer.device)[None, :]
    at_page, at_slot = pages[:, None], slots[:, None]
    scaled = kv_layer.dtype == torch.uint8
    for i, values in enumerate(parts):
        rows = quantize_rows(values) if scaled else values.to(kv_layer.dtype)
        kv_layer[at_page, heads, i, at_slot] = rows


def key_cache(kv_layer: torch.Tensor, part: int) -> torch.Tensor:
    """One part of every page as `[pages, block, heads, dim]` (a strided view, unit
    stride in the last dimension): the paged layout flash-attn's kernels read."""
    return kv_layer[:, :, part].transpose(1, 2)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into this on every call; the plan does it once for all
    # layers (measurably cheaper on CPU for long prompts).
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _pages_needed(table: Sequence[int], tokens: int, block_size: int, what: str) -> int:
    need = -(-tokens // block_size)
    if len(table) < need:
        raise ValueError(f"block table has {len(table)} pages, {what} needs {need}")
    return need


def _padded_tables(
    block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
) -> tuple[list[int], int]:
    """Row-major `[B, width]` tables, each padded with its own first page."""
    need = [
        _pages_needed(t, p + 1, block_size, f"position {p}")
        for t, p in zip(block_tables, positions, strict=True)
    ]
    width = max(need)
    flat: list[int] = []
    for table, n in zip(block_tables, need, strict=True):
        # Any valid index pads: nothing reads it. The sequence's own first page keeps
        # SDPA's gather local.
        flat.extend(table[:n])
        flat.extend([table[0]] * (width - n))
    return flat, width


def _window_visible(
    queries: torch.Tensor, keys: torch.Tensor, window: int, causal: bool
) -> torch.Tensor:
    """Which keys each query position sees: `[Q, K]` booleans, causal (key <= query)
    and, with a window, within `(query - window, query]`."""
    visible = keys[None, :] > queries[:, None] - window if window else None
    if causal:
        before = keys[None, :] <= queries[:, None]
        visible = before if visible is None else visible & before
    assert visible is not None
    return visible


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention spelled out, as transformers' eager path computes it: scores scaled,
    soft-capped, masked, softmax in float32. `q` `[..., Q, D]`, `k`/`v` `[..., K, D]`
    with the same heads; `visible` broadcasts to `[..., Q, K]`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


class TorchSDPABackend:
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention`.

    SDPA needs each sequence's keys contiguous in the sequence dimension, so the pages
    are gathered first. The gather goes into a workspace reused across layers and calls:
    a fresh multi-megabyte tensor per layer costs page faults that are slower than the
    copy itself. Any cache dtype works (keys are cast to the queries'). Not thread-safe
    (one runner, one thread). `fallback_reason` says why `select_backend` did not pick
    flash-attn (None when constructed directly).

    It computes every family's attention: sliding windows (a mask), soft-capped scores
    (the eager formula, which SDPA cannot express), and MLA's latent pages
    (`prefill_latent`, `decode_latent`): a page then holds one part per token (the
    writes and gathers read the parts from the pages' shape).
    """

    name = "torch-sdpa"
    cache_dtype_must_match = False

    def __init__(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype  # the queries' dtype, which the masks must match
        self.fallback_reason: str | None = None
        self._workspace: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    # -- planning ---------------------------------------------------------------------

    def plan_prefill(
        self, block_table: Sequence[int], start: int, end: int, block_size: int
    ) -> PrefillPlan:
        """Indices and mask for the chunk `[start, end)`."""
        num_pages = _pages_needed(block_table, end, block_size, f"{end} tokens")
        table = host_ints(list(block_table[:num_pages]), torch.int64, self.device)
        pos = torch.arange(start, end, device=self.device)
        write_pages, write_slots = table[pos // block_size], pos % block_size
        mask = None
        if start > 0:
            keys = torch.arange(end, device=self.device)
            mask = _additive(keys[None, :] <= pos[:, None], self.dtype)
        return PrefillPlan(start, end, table, write_pages, write_slots, mask)

    def plan_decode(
        self, block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
    ) -> DecodePlan:
        """Padded block tables, the write slots and the length mask for one decode step."""
        flat, width = _padded_tables(block_tables, positions, block_size)
        b = len(positions)
        ints = host_ints(flat + [p + 1 for p in positions], torch.int64, self.device)
        tables = ints[: b * width].view(b, width)
        seq_lens = ints[b * width :]
        pos_t = seq_lens - 1
        page_of = tables.gather(1, (pos_t // block_size)[:, None])[:, 0]
        keys = torch.arange(width * block_size, device=self.device)
        mask = _additive(keys[None, :] < seq_lens[:, None], self.dtype)[:, None, None, :]
        return DecodePlan(tables, seq_lens, pos_t, page_of, pos_t % block_size, mask)

    def _prefill_visible(
        self, plan: PrefillPlan, window: int, last_only: bool
    ) -> torch.Tensor | None:
        """The chunk's `[Q, end]` visibility under a window (None: plain causal)."""
        if not window:
            return None
        key = (window, last_only)
        mask = plan.window_masks.get(key)
        if mask is None:
            first = plan.end - 1 if last_only else plan.start
            queries = torch.arange(first, plan.end, device=self.device)
            keys = torch.arange(plan.end, device=self.device)
            mask = plan.window_masks[key] = _window_visible(queries, keys, window, causal=True)
        return mask

    def _decode_visible(self, plan: DecodePlan, window: int) -> torch.Tensor:
        """Each sequence's `[B, 1, 1, width * block]` visibility (length and window)."""
        mask = plan.window_masks.get(window)
        if mask is None:
            keys = torch.arange(
                plan.mask.shape[-1] if plan.mask is not None else 0, device=self.device
            )
            visible = keys[None, :] < plan.seq_lens[:, None]
            if window:
                visible &= keys[None, :] > plan.positions[:, None] - window
            mask = plan.window_masks[window] = visible[:, None, None, :]
        return mask

    # -- attention --------------------------------------------------------------------

    def _gather_parts(self, kv_layer: torch.Tensor, pages: torch.Tensor) -> list[torch.Tensor]:
        """Each part (K, V; or the latent) of `pages`, head-major: `[heads,
        len(pages) * block_size, dim]` each, in a reused workspace (dequantized into
        the queries' dtype from an 8-bit cache)."""
        _, heads, parts, block, dim = kv_layer.shape
        n = pages.numel()
        size = n * block * heads * dim
        key = (kv_layer.dtype, kv_layer.device.index or 0)
        ws = self._workspace.get(key)
        if ws is None or ws.numel() < parts * size:
            ws = torch.empty(parts * size, dtype=kv_layer.dtype, device=kv_layer.device)
            self._workspace[key] = ws
        # Straight into the `[heads, tokens, dim]` order attention reads, one
        # index_select per (part, head): each (head, page) row of `block * dim` numbers
        # is contiguous, which its fast row-copy path takes (selecting along the pages
        # of a transposed view in one call falls to its generic path, 30x slower).
        rows = kv_layer.view(kv_layer.shape[0], heads, parts, block * dim)
        out = []
        for i in range(parts):
            target = ws[i * size : (i + 1) * size].view(heads, n, block * dim)
            for h in range(heads):
                torch.index_select(rows[:, h, i], 0, pages, out=target[h])
            out.append(target.view(heads, n * block, dim))
        if kv_layer.dtype == torch.uint8:
            return [dequantize_rows(part, self.dtype) for part in out]
        return out

    def _gather(
        self, kv_layer: torch.Tensor, pages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages`, each `[kv_heads, len(pages) * block_size, head_dim]`."""
        k, v = self._gather_parts(kv_layer, pages)
        return k, v

    def prefill(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PrefillPlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor | None:
        """Write the chunk's K/V into its pages, then attend (see `AttentionBackend`)."""
        _write(kv_layer, plan.write_pages, plan.write_slots, k, v)
        if q is None:
            return None
        if plan.start == 0 and kv_layer.dtype == k.dtype:
            # nothing cached before the chunk: skip the gather
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys, values = self._gather(kv_layer, plan.block_table)
            keys, values = keys[:, : plan.end].to(q.dtype), values[:, : plan.end].to(q.dtype)
        return self._attend_prefill(q, keys, values, plan, opts)

    def _attend_prefill(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan: PrefillPlan,
        opts: AttnOptions,
    ) -> torch.Tensor:
        """`q` `[Q, heads, d]` (the chunk's rows, or its last only) against the
        sequence's `[kv_heads, end, d]` keys and values."""
        last_only = q.shape[0] == 1 and plan.end - plan.start > 1
        qh, kh, vh = q.transpose(0, 1)[None], keys[None], values[None]
        gqa = q.shape[1] != keys.shape[0]
        if opts.plain:
            mask = None if last_only else plan.mask
            out = F.scaled_dot_product_attention(
                qh,
                kh,
                vh,
                attn_mask=mask,
                is_causal=mask is None and not last_only,
                enable_gqa=gqa,
                scale=opts.scale,
            )
            return out[0].transpose(0, 1)
        visible = self._prefill_visible(plan, opts.window, last_only)
        if visible is None:
            queries = torch.arange(plan.end - q.shape[0], plan.end, device=self.device)
            visible = _window_visible(queries, torch.arange(plan.end, device=self.device), 0, True)
        if gqa:
            group = q.shape[1] // keys.shape[0]
            kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        scale = q.shape[-1] ** -0.5 if opts.scale is None else opts.scale
        out = _softcapped_attention(qh, kh, vh, visible, scale, opts.softcap)
        return out[0].transpose(0, 1)

    def decode(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DecodePlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor:
        """Write each sequence's new K/V, then attend all B queries in one SDPA call."""
        _write(kv_layer, plan.write_pages, plan.write_slots, k, v)
        b, heads, dim = q.shape
        kv_heads = k.shape[1]
        keys, values = self._gather(kv_layer, plan.block_tables.flatten())
        keys = keys.view(kv_heads, b, -1, dim).transpose(0, 1).to(q.dtype)
        values = values.view(kv_heads, b, -1, v.shape[-1]).transpose(0, 1).to(q.dtype)
        # Grouped-query attention without repeating K/V: the query heads that share a KV
        # head become that head's "query positions". One query token per sequence needs
        # no causal mask, only the length mask, which broadcasts over them.
        grouped = q.view(b, kv_heads, heads // kv_heads, dim)
        if opts.plain:
            out = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=plan.mask, scale=opts.scale
            )
        else:
            scale = dim**-0.5 if opts.scale is None else opts.scale
            visible = self._decode_visible(plan, opts.window)
            out = _softcapped_attention(grouped, keys, values, visible, scale, opts.softcap)
        return out.reshape(b, heads, -1)

    # -- latent attention (MLA) ---------------------------------------------------------

    def prefill_latent(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        latent: torch.Tensor,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        plan: PrefillPlan,
        opts: AttnOptions,
    ) -> torch.Tensor | None:
        """Write the chunk's latents `[T, 1, latent_dim]` into its pages, then attend
        `q` `[Q, heads, qk_dim]` to the keys and values `expand` makes of the
        sequence's latents (`[N, 1, latent_dim]` to `[N, heads, qk_dim]`, `[N, heads,
        v_dim]`)."""
        _write(kv_layer, plan.write_pages, plan.write_slots, latent)
        if q is None:
            return None
        if plan.start == 0 and kv_layer.dtype == latent.dtype:
            context = latent
        else:
            (context,) = self._gather_parts(kv_layer, plan.block_table)
            context = context[:, : plan.end].transpose(0, 1).to(q.dtype)
        keys, values = expand(context)
        return self._attend_prefill(q, keys.transpose(0, 1), values.transpose(0, 1), plan, opts)

    def decode_latent(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        latent: torch.Tensor,
        value_dim: int,
        plan: DecodePlan,
        opts: AttnOptions,
    ) -> torch.Tensor:
        """Write each sequence's new latent `[B, 1, latent_dim]`, then attend all B
        queries in latent space: `q` `[B, heads, latent_dim]` is already absorbed (each
        head's key up-projection folded into its query), so every head reads the
        sequence's latents themselves as keys and their first `value_dim` numbers as
        values, one shared KV head; `[B, heads, value_dim]`, still to be projected up."""
        _write(kv_layer, plan.write_pages, plan.write_slots, latent)
        b, heads, dim = q.shape
        (context,) = self._gather_parts(kv_layer, plan.block_tables.flatten())
        keys = context.view(1, b, -1, dim).transpose(0, 1).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.view(b, 1, heads, dim),
            keys,
            keys[..., :value_dim],
            attn_mask=plan.mask,
            scale=opts.scale,
        )
        return out.view(b, heads, value_dim)


class _PagedFlashBackend:
    """What the flash backends share: their kernel, read from `kernels` (the real
    module, `_MODULE`, by default; tests pass a `yb_testkit.flash_standin` one), and
    their plans: int32 tables and lengths, copied to the device once per step."""

    name: str
    cache_dtype_must_match = True
    _MODULE: str
    _FUNCTION: str

    def __init__(
        self,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        kernels: Any = None,
    ) -> None:
        if kernels is None:
            kernels = importlib.import_module(self._MODULE)
        self._fn: Any = getattr(kernels, self._FUNCTION)
        self.device = torch.device(device)
        self.dtype = dtype

    def plan_prefill(
        self, block_table: Sequence[int], start: int, end: int, block_size: int
    ) -> PrefillPlan:
        """int32 table `[1, pages]`; `cache_seqlens = [start]` (flash-attn 2),
        `seqused_k = [end]` and `cu_seqlens_q` (flash-attn 4); the write rows."""
        n = _pages_needed(block_table, end, block_size, f"{end} tokens")
        ints = host_ints(
            [*block_table[:n], start, end, 0, end - start, 0, 1], torch.int32, self.device
        )
        table = ints[:n].view(1, n)
        pos = torch.arange(start, end, device=self.device)
        return PrefillPlan(
            start,
            end,
            table,
            table[0].long()[pos // block_size],
            pos % block_size,
            None,
            cache_seqlens=ints[n : n + 1],
            seqused_k=ints[n + 1 : n + 2],
            cu_seqlens_q=ints[n + 2 : n + 4],
            cu_seqlens_q_last=ints[n + 4 : n + 6],
        )

    def plan_decode(
        self, block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
    ) -> DecodePlan:
        """int32 tables `[B, width]`; `cache_seqlens = positions` (flash-attn 2),
        `seq_lens` and `cu_seqlens_q = 0..B` (flash-attn 4); the write rows."""
        flat, width = _padded_tables(block_tables, positions, block_size)
        b = len(positions)
        lens = [p + 1 for p in positions]
        ints = host_ints(
            flat + list(positions) + lens + list(range(b + 1)), torch.int32, self.device
        )
        at = b * width
        tables = ints[:at].view(b, width)
        cache_seqlens = ints[at : at + b]
        seq_lens = ints[at + b : at + 2 * b]
        pos = cache_seqlens.long()
        page_of = tables.gather(1, (pos // block_size)[:, None])[:, 0].long()
        return DecodePlan(
            tables,
            seq_lens,
            pos,
            page_of,
            pos % block_size,
            None,
            cache_seqlens=cache_seqlens,
            cu_seqlens_q=ints[at + 2 * b :],
        )


def _plain_only(name: str, opts: AttnOptions) -> None:
    # `select_backend` never gives a flash backend to a model that needs more; a
    # caller that builds one by hand gets an error, not a different function.
    if not opts.plain or opts.scale is not None:
        raise ValueError(f"{name} here computes plain causal attention only, not {opts}")


def _output(result: Any) -> torch.Tensor:
    # flash_attn.cute returns (out, lse); flash-attn 2 returns out unless asked for lse.
    out = result[0] if isinstance(result, tuple) else result
    assert isinstance(out, torch.Tensor)
    return out


class FlashAttnBackend(_PagedFlashBackend):
    """flash-attn 2 over the paged cache, in place.

    `flash_attn_with_kvcache` appends the new K/V at `cache_seqlens` through the block
    table and attends with bottom-right causal alignment, which is exactly chunked
    prefill over a cached prefix (and, with one query row, last-row-only: causal is
    moot for a single row, which sees every key), and decode with B sequences of
    different lengths. The cache's keys, `key_cache(kv[layer], 0)`, are a `[pages, block,
    kv_heads, dim]` view strided over the head-major pages, which flash-attn accepts
    (it needs a unit stride in the last dimension only, and reads the other strides).

    Requires (checked by `select_backend`, enforced by the kernel): CUDA sm80-sm90,
    fp16/bf16, `block_size % 256 == 0`, `heads % kv_heads == 0`, `head_dim <= 256`,
    and a cache in the model's dtype (the kernel reads and writes the pages in the
    queries' dtype, so a bf16 model over an fp32 cache is refused, not cast).

    `kernels` is the module providing `flash_attn_with_kvcache` (default: `flash_attn`);
    tests pass `yb_testkit.flash_standin.FA2` to run this code on CPU.
    """

    name = "flash-attn"
    _MODULE = "flash_attn"
    _FUNCTION = "flash_attn_with_kvcache"

    def prefill(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PrefillPlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor | None:
        """Append the chunk to its pages and attend, in one kernel."""
        _plain_only(self.name, opts)
        if q is None:
            _write(kv_layer, plan.write_pages, plan.write_slots, k, v)
            return None
        out = self._fn(
            q[None],
            key_cache(kv_layer, 0),
            key_cache(kv_layer, 1),
            k=k[None],
            v=v[None],
            cache_seqlens=plan.cache_seqlens,
            block_table=plan.block_table,
            causal=True,
        )
        return _output(out)[0]

    def decode(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DecodePlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor:
        """Append each sequence's token and attend, in one kernel."""
        _plain_only(self.name, opts)
        out = self._fn(
            q[:, None],
            key_cache(kv_layer, 0),
            key_cache(kv_layer, 1),
            k=k[:, None],
            v=v[:, None],
            cache_seqlens=plan.cache_seqlens,
            block_table=plan.block_tables,
            causal=True,
        )
        return _output(out)[:, 0]


class FlashAttnCuteBackend(_PagedFlashBackend):
    """flash-attn 4 (`flash_attn.cute`, CuTe DSL) over the paged cache.

    It cannot append to the cache, so the chunk's K/V are written with an indexed store
    first (the same writer as SDPA's); `flash_attn_varlen_func` then attends through
    `page_table` with `seqused_k` keys per sequence and `cu_seqlens_q` query rows,
    causal aligned bottom-right (a single row sees every key). Requires compute
    capability 8.x-12.x (its releases differ: early ones ran on sm90/sm100 only and had
    no paged KV on sm90, which `select_backend`'s probe finds out), fp16/bf16, `heads %
    kv_heads == 0`, `head_dim` a multiple of 8 and <= 256 (<= 128 or exactly 256 on
    sm100/sm110), and a cache in the model's dtype. It has no page-size rule: 128-token
    pages take its TMA path, other sizes its cp.async path.

    `kernels` is the module providing `flash_attn_varlen_func` (default:
    `flash_attn.cute`); tests pass `yb_testkit.flash_standin.CUTE`.
    """

    name = "flash-attn-cute"
    _MODULE = "flash_attn.cute"
    _FUNCTION = "flash_attn_varlen_func"

    def prefill(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PrefillPlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor | None:
        """Write the chunk's K/V, then attend its queries (or only the last row)."""
        _plain_only(self.name, opts)
        _write(kv_layer, plan.write_pages, plan.write_slots, k, v)
        if q is None:
            return None
        last_only = q.shape[0] != k.shape[0]
        out = self._fn(
            q,
            key_cache(kv_layer, 0),
            key_cache(kv_layer, 1),
            cu_seqlens_q=plan.cu_seqlens_q_last if last_only else plan.cu_seqlens_q,
            max_seqlen_q=q.shape[0],
            seqused_k=plan.seqused_k,
            page_table=plan.block_table,
            causal=True,
        )
        return _output(out)

    def decode(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DecodePlan,
        opts: AttnOptions = PLAIN,
    ) -> torch.Tensor:
        """Write each sequence's token, then attend all B in one varlen call."""
        _plain_only(self.name, opts)
        _write(kv_layer, plan.write_pages, plan.write_slots, k, v)
        out = self._fn(
            q,
            key_cache(kv_layer, 0),
            key_cache(kv_layer, 1),
            cu_seqlens_q=plan.cu_seqlens_q,
            max_seqlen_q=1,
            seqused_k=plan.seq_lens,
            page_table=plan.block_tables,
            causal=True,
        )
        return _output(out)


def _import(module: str) -> tuple[Any, str | None]:
    """The module, or why it cannot be used."""
    try:
        if importlib.util.find_spec(module) is None:
            return None, f"{module} is not installed"
        return importlib.import_module(module), None
    except ModuleNotFoundError as exc:
        return None, f"{module} is not installed ({exc})"
    except Exception as exc:
        # A wheel built against another torch (or CUDA) raises here, at import, with an
        # undefined symbol or a version error; that is a reason to fall back, not to crash.
        return None, f"import {module} failed: {type(exc).__name__}: {exc}"


def _common_reason(
    device: torch.device,
    dtype: torch.dtype,
    arch: ArchConfig | None,
    cache_dtype: torch.dtype | None,
) -> str | None:
    """Why no flash-attn kernel can run here, whichever is installed; None if one may."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return f"compute capability {major}.{minor} < 8.0"
    if dtype not in FLASH_DTYPES:
        return f"dtype {dtype} (flash-attn computes in float16/bfloat16 only)"
    if cache_dtype is not None and cache_dtype != dtype:
        return f"KV cache dtype {cache_dtype} differs from the model's {dtype}"
    if arch is not None:
        if arch.mla is not None:
            return "latent attention (MLA) pages hold one latent per token, not per-head K/V"
        if any(arch.layer_windows) or arch.attn_softcap is not None:
            return "sliding windows and soft-capped scores are computed by SDPA here"
        if arch.attn_scale is not None:
            return f"attention scale {arch.attn_scale:g} is not head_dim ** -0.5"
        if arch.num_heads % arch.num_kv_heads:
            return f"{arch.num_heads} query heads are not a multiple of {arch.num_kv_heads}"
        if arch.head_dim > 256:
            return f"head_dim {arch.head_dim} > 256"
        if arch.head_dim % 8:
            # flash-attn 2 would pad q and the whole cache on every call; flash-attn 4
            # refuses it.
            return f"head_dim {arch.head_dim} is not a multiple of 8"
    return None


def _fa2_reason(capability: tuple[int, int], block_size: int | None) -> str | None:
    major, minor = capability
    if not (major == 8 or capability == (9, 0)):
        return f"runs on sm80-sm90 only, not sm{major}{minor}"
    if block_size is not None and block_size % FA2_PAGE_MULTIPLE:
        return f"block_size {block_size} is not a multiple of {FA2_PAGE_MULTIPLE}"
    return None


def _cute_reason(capability: tuple[int, int], arch: ArchConfig | None) -> str | None:
    major, minor = capability
    if major not in (8, 9, 10, 11, 12):
        return f"runs on sm80-sm120 only, not sm{major}{minor}"
    if (
        major in (10, 11)
        and arch is not None
        and not (arch.head_dim <= 128 or arch.head_dim == 256)
    ):
        return f"head_dim {arch.head_dim} unsupported on sm{major}{minor} (<= 128 or 256)"
    return None


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = float(ref.float().abs().max())
    return float((ours.float() - ref.float()).abs().max()) / max(scale, 1e-6)


def probe_backend(
    backend: AttentionBackend,
    arch: ArchConfig | None,
    block_size: int,
    dtype: torch.dtype,
) -> str | None:
    """Run `backend` once against SDPA on tiny inputs; None when they agree.

    One prefill chunk over a cached prefix that crosses a page boundary, and one decode
    step of two sequences of different lengths, with the model's head shape (so
    flash_attn.cute compiles the kernels the model will use). A kernel that imports but
    cannot run here (an unsupported GPU or feature in the installed release) fails
    here, at start, instead of on the first request. The caches must come out equal to
    the byte, the outputs within 2e-2 of the largest (bf16 rounding of the inputs and
    a different summation order).
    """
    heads, kv_heads, head_dim = (
        (arch.num_heads, arch.num_kv_heads, arch.head_dim) if arch is not None else (2, 1, 64)
    )
    dev = torch.device(getattr(backend, "device", "cpu"))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    sdpa = TorchSDPABackend(dev, dtype)
    kv = rand(3, kv_heads, 2, block_size, head_dim)
    ref_kv = kv.clone()
    start, end = block_size - 2, block_size + 3

    def fused(rows: int) -> tuple[torch.Tensor, ...]:
        # Views into one projection output, strided like the runner's q/k/v.
        qkv = rand(rows, heads + 2 * kv_heads, head_dim)
        return tuple(qkv.split([heads, kv_heads, kv_heads], dim=1))

    q, k, v = fused(end - start)
    tables, positions = [[2, 0], [1]], [end, 3]
    qd, kd, vd = fused(2)
    try:
        out = backend.prefill(kv, q, k, v, backend.plan_prefill([2, 0], start, end, block_size))
        ref = sdpa.prefill(ref_kv, q, k, v, sdpa.plan_prefill([2, 0], start, end, block_size))
        out_d = backend.decode(kv, qd, kd, vd, backend.plan_decode(tables, positions, block_size))
        ref_d = sdpa.decode(ref_kv, qd, kd, vd, sdpa.plan_decode(tables, positions, block_size))
        assert out is not None and ref is not None
        if not torch.equal(kv, ref_kv):
            return "probe: the kernel wrote the KV pages differently from the writer"
        worst = max(_rel_err(out, ref), _rel_err(out_d, ref_d))
    except Exception as exc:
        return f"probe failed: {type(exc).__name__}: {exc}"
    if worst > 2e-2:
        return f"probe: output differs from SDPA by {worst:.3g} (relative)"
    return None


def _select_flash(
    device: torch.device,
    block_size: int | None,
    dtype: torch.dtype,
    arch: ArchConfig | None,
    cache_dtype: torch.dtype | None,
    probe: bool,
) -> tuple[AttentionBackend | None, str]:
    reason = _common_reason(device, dtype, arch, cache_dtype)
    if reason is not None:
        return None, reason
    capability = torch.cuda.get_device_capability(device)
    candidates: list[
        tuple[str, type[FlashAttnBackend] | type[FlashAttnCuteBackend], str, str | None]
    ] = [
        ("flash-attn", FlashAttnBackend, "flash_attn", _fa2_reason(capability, block_size)),
        (
            "flash-attn-cute",
            FlashAttnCuteBackend,
            "flash_attn.cute",
            _cute_reason(capability, arch),
        ),
    ]
    tried = []
    for name, cls, module, why in candidates:
        if why is None:
            kernels, why = _import(module)
        if why is None:
            try:
                backend = cls(device, dtype, kernels=kernels)
            except Exception as exc:  # e.g. a module of that name without the entry point
                why = f"{module} unusable: {type(exc).__name__}: {exc}"
            else:
                if probe:
                    why = probe_backend(backend, arch, block_size or FA2_PAGE_MULTIPLE, dtype)
                if why is None:
                    return backend, ""
        tried.append(f"{name}: {why}")
    return None, "; ".join(tried)


def select_backend(
    device: str | torch.device = "cpu",
    block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    arch: ArchConfig | None = None,
    *,
    cache_dtype: torch.dtype | None = None,
    probe: bool = True,
) -> AttentionBackend:
    """The fastest backend whose every requirement holds here, else SDPA.

    flash-attn needs: a CUDA device that torch sees, compute capability >= 8.0,
    fp16/bf16, a KV cache in that same dtype (`cache_dtype`; the kernels read the pages
    in place), `heads % kv_heads == 0`, `head_dim <= 256` and a multiple of 8 (`arch`).
    Then flash-attn 2 (`flash_attn`) on sm80-sm90 with `block_size % 256 == 0`, else
    flash-attn 4 (`flash_attn.cute`) on sm80-sm120, provided the module imports
    (a wheel built against another torch raises at import) and, with `probe`, runs one
    tiny prefill and decode that agree with SDPA (see `probe_backend`).

    When it falls back on CUDA it logs `attention_fallback` with the reason; the reason
    is also the returned backend's `fallback_reason`. On CPU, SDPA is the design, not a
    fallback, and nothing is logged.
    """
    dev = torch.device(device)
    backend, reason = _select_flash(dev, block_size, dtype, arch, cache_dtype, probe)
    if backend is not None:
        log.info("attention_backend", backend=backend.name, device=str(dev))
        return backend
    sdpa = TorchSDPABackend(dev, dtype)
    sdpa.fallback_reason = reason
    if dev.type == "cuda":
        log.warning("attention_fallback", backend=sdpa.name, reason=reason, device=str(dev))
    return sdpa
