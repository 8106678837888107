"""Attention over the paged KV cache, behind one interface with swappable backends.

A backend does two things per layer: it writes the new tokens' K/V into their pages and
it attends the queries to every visible key of their sequence. Everything that is the
same for all layers of one forward (page and slot indices, masks, padded block tables)
is computed once, in a *plan*, so the per-layer work is a few tensor ops.

- `TorchSDPABackend` (any device, the CPU default): gathers a sequence's pages into a
  reused workspace and calls `scaled_dot_product_attention`.
- `FlashAttnBackend` (CUDA with flash-attn installed): `flash_attn_with_kvcache` reads
  the pages in place through the block table. It cannot run here (no GPU), so it is
  selected only on CUDA and is not exercised by the CPU test suite.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One chunk `[start, end)` of one sequence.

    `block_table` covers the pages of tokens `[0, end)`; `rows_k`/`rows_v` are the rows
    of the flattened layer view `[pages * 2 * block_size, kv_heads, head_dim]` that the
    chunk's keys and values go to; `mask` is the causal mask with the prefix offset
    (None when the chunk starts at 0 and plain causal attention applies).
    """

    start: int
    end: int
    block_table: torch.Tensor
    rows_k: torch.Tensor
    rows_v: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One new token for each of B sequences.

    `block_tables` is `[B, max_pages]`, padded with a valid page index whose keys the
    mask hides; `seq_lens` counts each sequence's tokens including the new one.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    rows_k: torch.Tensor
    rows_v: torch.Tensor
    mask: torch.Tensor


class AttentionBackend(Protocol):
    """What the runner needs from an attention implementation.

    `kv_layer` is `cache.kv[layer]`, `[num_pages, 2, block_size, kv_heads, head_dim]`.
    Queries are `[T, heads, head_dim]` and keys/values `[T, kv_heads, head_dim]`, with
    RoPE applied; the result has the queries' shape. Plans are made once per forward
    and shared by all layers.
    """

    name: str

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
    ) -> torch.Tensor: ...


def _rows(
    pages: torch.Tensor, slots: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # Row of (page, 0, slot) in the layer viewed as [pages * 2 * block_size, ...]; the
    # value row is one block further, because K and V of a page are adjacent halves.
    rows_k = pages * (2 * block_size) + slots
    return rows_k, rows_k + block_size


def _write(
    kv_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows_k: torch.Tensor,
    rows_v: torch.Tensor,
) -> None:
    flat = kv_layer.view(-1, kv_layer.shape[-2], kv_layer.shape[-1])
    flat.index_copy_(0, rows_k, k.to(flat.dtype))
    flat.index_copy_(0, rows_v, v.to(flat.dtype))


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns a boolean mask into this on every call; the plan does it once for all
    # layers (measurably cheaper on CPU for long prompts).
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


class TorchSDPABackend:
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention`.

    SDPA needs each sequence's keys contiguous in the sequence dimension, so the pages
    are gathered first. The gather goes into a workspace reused across layers and calls:
    a fresh multi-megabyte tensor per layer costs page faults that are slower than the
    copy itself. Not thread-safe (one runner, one thread).
    """

    name = "torch-sdpa"

    def __init__(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype  # the queries' dtype, which the masks must match
        self._workspace: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    # -- planning ---------------------------------------------------------------------

    def plan_prefill(
        self, block_table: Sequence[int], start: int, end: int, block_size: int
    ) -> PrefillPlan:
        """Indices and mask for the chunk `[start, end)`."""
        num_pages = -(-end // block_size)
        if len(block_table) < num_pages:
            raise ValueError(
                f"block table has {len(block_table)} pages, {end} tokens need {num_pages}"
            )
        table = torch.tensor(block_table[:num_pages], dtype=torch.int64, device=self.device)
        pos = torch.arange(start, end, device=self.device)
        rows_k, rows_v = _rows(table[pos // block_size], pos % block_size, block_size)
        mask = None
        if start > 0:
            keys = torch.arange(end, device=self.device)
            mask = _additive(keys[None, :] <= pos[:, None], self.dtype)
        return PrefillPlan(start, end, table, rows_k, rows_v, mask)

    def plan_decode(
        self, block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
    ) -> DecodePlan:
        """Padded block tables, the write slots and the length mask for one decode step."""
        lens = [p + 1 for p in positions]
        need = [-(-n // block_size) for n in lens]
        width = max(need)
        padded = []
        for table, n, pos in zip(block_tables, need, positions, strict=True):
            if len(table) < n:
                raise ValueError(f"block table has {len(table)} pages, position {pos} needs {n}")
            # Pad with the sequence's own first page: any valid index works, the mask
            # hides it, and reusing a page already being read keeps the gather local.
            padded.append(list(table[:n]) + [table[0]] * (width - n))
        tables = torch.tensor(padded, dtype=torch.int64, device=self.device)
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=self.device)
        pos_t = seq_lens - 1
        page_of = tables.gather(1, (pos_t // block_size)[:, None])[:, 0]
        rows_k, rows_v = _rows(page_of, pos_t % block_size, block_size)
        keys = torch.arange(width * block_size, device=self.device)
        mask = _additive(keys[None, :] < seq_lens[:, None], self.dtype)[:, None, None, :]
        return DecodePlan(tables, seq_lens, pos_t, rows_k, rows_v, mask)

    # -- attention --------------------------------------------------------------------

    def _gather(
        self, kv_layer: torch.Tensor, pages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages`, each `[len(pages) * block_size, kv_heads, head_dim]`."""
        _, _, block, heads, dim = kv_layer.shape
        n = pages.numel()
        size = n * block * heads * dim
        key = (kv_layer.dtype, kv_layer.device.index or 0)
        ws = self._workspace.get(key)
        if ws is None or ws.numel() < 2 * size:
            ws = torch.empty(2 * size, dtype=kv_layer.dtype, device=kv_layer.device)
            self._workspace[key] = ws
        # Each page half as one flat row: index_select then copies whole rows, faster
        # than its generic path over the 4-d strided halves (2x with 16-token pages).
        halves = kv_layer.view(kv_layer.shape[0], 2, block * heads * dim)
        torch.index_select(halves[:, 0], 0, pages, out=ws[:size].view(n, -1))
        torch.index_select(halves[:, 1], 0, pages, out=ws[size : 2 * size].view(n, -1))
        return ws[:size].view(n * block, heads, dim), ws[size : 2 * size].view(
            n * block, heads, dim
        )

    def prefill(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PrefillPlan,
    ) -> torch.Tensor | None:
        """Write the chunk's K/V into its pages, then attend (see `AttentionBackend`)."""
        _write(kv_layer, k, v, plan.rows_k, plan.rows_v)
        if q is None:
            return None
        last_only = q.shape[0] == 1 and k.shape[0] > 1
        if plan.start == 0 and kv_layer.dtype == k.dtype:
            keys, values = k, v  # nothing cached before the chunk: skip the gather
        else:
            keys, values = self._gather(kv_layer, plan.block_table)
            keys, values = keys[: plan.end].to(q.dtype), values[: plan.end].to(q.dtype)
        mask = None if last_only else plan.mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None and not last_only,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
        return out[0].transpose(0, 1)

    def decode(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DecodePlan,
    ) -> torch.Tensor:
        """Write each sequence's new K/V, then attend all B queries in one SDPA call."""
        _write(kv_layer, k, v, plan.rows_k, plan.rows_v)
        b, heads, dim = q.shape
        kv_heads = k.shape[1]
        keys, values = self._gather(kv_layer, plan.block_tables.flatten())
        keys = keys.view(b, -1, kv_heads, dim).transpose(1, 2).to(q.dtype)
        values = values.view(b, -1, kv_heads, dim).transpose(1, 2).to(q.dtype)
        # Grouped-query attention without repeating K/V: the query heads that share a KV
        # head become that head's "query positions". One query token per sequence needs
        # no causal mask, only the length mask, which broadcasts over them.
        grouped = q.view(b, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask)
        return out.reshape(b, heads, dim)


class FlashAttnBackend:
    """flash-attn 2 over the paged cache, in place (CUDA only, untested on CPU CI).

    `flash_attn_with_kvcache` appends the new K/V at `cache_seqlens` through the block
    table and attends with bottom-right causal alignment, which is exactly chunked
    prefill over a cached prefix, and decode with B sequences of different lengths.
    The cache layout's K half `kv[layer][:, 0]` is `[pages, block, kv_heads, dim]`
    with a page stride of two blocks, which flash-attn accepts (it only needs a unit
    stride in the last dimension). flash-attn requires `block_size % 256 == 0`.
    """

    name = "flash-attn"

    def __init__(
        self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16
    ) -> None:
        from flash_attn import flash_attn_with_kvcache

        self._fn: Any = flash_attn_with_kvcache
        self.device = torch.device(device)
        self._sdpa = TorchSDPABackend(device, dtype)  # only its planning is used

    def plan_prefill(
        self, block_table: Sequence[int], start: int, end: int, block_size: int
    ) -> PrefillPlan:
        """Same plan as SDPA; flash-attn reads `start` and `block_table` from it."""
        return self._sdpa.plan_prefill(block_table, start, end, block_size)

    def plan_decode(
        self, block_tables: Sequence[Sequence[int]], positions: Sequence[int], block_size: int
    ) -> DecodePlan:
        """Same plan as SDPA; flash-attn uses the padded tables and positions."""
        return self._sdpa.plan_decode(block_tables, positions, block_size)

    def prefill(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: PrefillPlan,
    ) -> torch.Tensor | None:
        """Append the chunk to the pages and attend, in one kernel."""
        table = plan.block_table[None].to(torch.int32)
        if q is None or q.shape[0] != k.shape[0]:
            # K/V only, or only the last row wanted: write, then (maybe) let that row
            # see the whole sequence, which bottom-right causal alignment gives.
            _write(kv_layer, k, v, plan.rows_k, plan.rows_v)
            if q is None:
                return None
            seqlens = torch.tensor([plan.end], dtype=torch.int32, device=q.device)
            out = self._fn(
                q[None],
                kv_layer[:, 0],
                kv_layer[:, 1],
                cache_seqlens=seqlens,
                block_table=table,
                causal=True,
            )
            return out[0]  # type: ignore[no-any-return]
        seqlens = torch.tensor([plan.start], dtype=torch.int32, device=q.device)
        out = self._fn(
            q[None],
            kv_layer[:, 0],
            kv_layer[:, 1],
            k=k[None],
            v=v[None],
            cache_seqlens=seqlens,
            block_table=table,
            causal=True,
        )
        return out[0]  # type: ignore[no-any-return]

    def decode(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: DecodePlan,
    ) -> torch.Tensor:
        """Append each sequence's token and attend, in one kernel."""
        out = self._fn(
            q[:, None],
            kv_layer[:, 0],
            kv_layer[:, 1],
            k=k[:, None],
            v=v[:, None],
            cache_seqlens=plan.positions.to(torch.int32),
            block_table=plan.block_tables.to(torch.int32),
            causal=True,
        )
        return out[:, 0]  # type: ignore[no-any-return]


def _flash_attn_usable(
    device: torch.device, block_size: int | None, dtype: torch.dtype | None
) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return False  # flash-attn computes in half precision only
    if importlib.util.find_spec("flash_attn") is None:
        return False
    return block_size is None or block_size % 256 == 0


def select_backend(
    device: str | torch.device = "cpu",
    block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """flash-attn on CUDA when installed and the page size and dtype suit it, else SDPA."""
    dev = torch.device(device)
    if _flash_attn_usable(dev, block_size, dtype):
        return FlashAttnBackend(dev, dtype)
    return TorchSDPABackend(dev, dtype)


def attention_backend_name(
    device: str | torch.device = "cpu",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """The backend `select_backend` would pick for these settings: "flash-attn" or
    "torch-sdpa". Without `block_size`/`dtype` it answers for a suitable page size and
    half precision, i.e. what this machine can offer at best."""
    usable = _flash_attn_usable(torch.device(device), block_size, dtype)
    return "flash-attn" if usable else "torch-sdpa"
