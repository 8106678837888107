"""Paged KV cache storage and the page allocator.

The whole cache of an engine is ONE tensor `kv[num_layers, num_pages, heads, parts,
block_size, row]`, its per-token shape taken from the model's `KVCacheSpec`
(`yb_core.kv_spec`): `heads` the KV heads this engine (or tensor-parallel rank) holds,
`parts` 2 and `dim` the head size for grouped-query attention (a head's keys, then its
values); `heads` 1, `parts` 1 and `dim` the latent size for MLA. Pages are head-major:
each head's share of a page is one contiguous region, so a run of heads (what one
tensor-parallel rank holds) is one region too, of the same bytes for every degree.
A row is a head's `dim` numbers of one token, or, in an 8-bit cache, their bytes and
their scale (`yb_engine.kv_quant`): the tensor then holds bytes.

That layout is a contract with the UCX data plane: the bytes of (layer, page) are one
contiguous chunk of `spec.page_nbytes(block_size)`, so a page is sent or received
straight from or into this tensor without a staging copy, and a prefill engine can ship
layer `l` while it computes layer `l + 1`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import torch

from yb_core.kv_spec import KVCacheSpec
from yb_engine.architecture import ArchConfig
from yb_engine.kv_quant import storage_dtype


class OutOfPages(RuntimeError):
    """Not enough free KV pages; `needed` and `free` say by how much."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"need {needed} KV pages, only {free} free")
        self.needed = needed
        self.free = free


class PagedKVCache:
    """The engine's KV pages for every layer, in one contiguous tensor (see module doc)."""

    def __init__(
        self,
        arch: ArchConfig,
        num_pages: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        storage: torch.Tensor | None = None,
    ) -> None:
        """`dtype`: what the KV is kept in (the pages' tensor holds bytes for an
        8-bit one: `storage_dtype`). `storage`: memory to hold the pages in (zeroed,
        of exactly the cache's elements: a tensor-parallel rank's pages live in memory
        its instance's first rank maps too); by default a fresh zeroed tensor."""
        if num_pages <= 0 or block_size <= 0:
            raise ValueError("num_pages and block_size must be positive")
        self.arch = arch
        self.num_pages = num_pages
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.spec: KVCacheSpec = arch.kv_spec(str(dtype).removeprefix("torch."))
        spec = self.spec
        shape = self.shape_of(spec, num_pages, block_size)
        held = storage_dtype(dtype)
        if storage is not None:
            if storage.numel() != self.numel(spec, num_pages, block_size) or storage.dtype != held:
                raise ValueError(
                    f"storage of {storage.numel()} {storage.dtype} for a cache {shape}"
                )
            self.kv = storage.view(shape)
        else:
            # zeros, not empty: a page that is read before it is written (a bug
            # elsewhere) then gives finite garbage instead of NaNs that poison a batch.
            self.kv = torch.zeros(shape, dtype=held, device=self.device)

    @staticmethod
    def shape_of(spec: KVCacheSpec, num_pages: int, block_size: int) -> tuple[int, ...]:
        """The cache tensor's shape: `[layers, pages, heads, parts, block_size, row]`,
        a row `dim` numbers, or the bytes of a scaled row."""
        row = spec.row_nbytes if spec.scaled else spec.dim
        return (spec.num_layers, num_pages, spec.heads, len(spec.parts), block_size, row)

    @staticmethod
    def numel(spec: KVCacheSpec, num_pages: int, block_size: int) -> int:
        """Elements of the tensor of a cache of `num_pages` pages of `spec`."""
        return math.prod(PagedKVCache.shape_of(spec, num_pages, block_size))

    @property
    def num_layers(self) -> int:
        """Layers in the cache (the model's)."""
        return self.arch.num_layers

    @property
    def page_nbytes(self) -> int:
        """Bytes of one (layer, page) chunk: what `block_size` tokens keep in one layer."""
        return self.spec.page_nbytes(self.block_size)

    def page_view(self, layer: int, page: int) -> torch.Tensor:
        """`kv[layer, page]`, `[heads, parts, block_size, dim]`: a contiguous view.

        Writing into the view writes the cache; this is what transfers send and receive.
        """
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range [0, {self.num_pages})")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        view = self.kv[layer, page]
        assert view.is_contiguous()
        return view

    @property
    def head_cuts(self) -> list[int]:
        """The runs of KV heads a page is sent and received in by this cache's holder:
        one run, every head (a tensor-parallel instance cuts it by rank:
        `yb_engine.tp_instance.ShardedKV`)."""
        return [0, self.spec.heads]

    def pieces(self, layer: int, page: int, cuts: Sequence[int]) -> list[torch.Tensor]:
        """The (layer, page) region cut at the head boundaries `cuts` (which include
        `head_cuts`): contiguous views, heads `[cuts[i], cuts[i + 1])` each, in order.
        Their bytes back to back are the page's."""
        view = self.page_view(layer, page)
        if len(cuts) == 2 and cuts[-1] == self.spec.heads and not cuts[0]:
            # The whole page, unsliced: this is on every transfer's path.
            return [view]
        return [view[a:b] for a, b in itertools.pairwise(cuts)]

    @property
    def has_replicas(self) -> bool:
        """Whether some heads are kept by more than one rank (a cache of one holder
        keeps each once)."""
        return False

    def replicate(self, pages: Iterable[int]) -> None:
        """Copy received pages to the ranks that keep a replica of their heads; a
        cache of one holder has none."""

    def layer_view(self, layer: int) -> torch.Tensor:
        """`kv[layer]`, `[num_pages, heads, parts, block_size, dim]`, a view."""
        return self.kv[layer]

    def copy_page(self, source: int, target: int) -> None:
        """Copy page `source`'s KV, in every layer, into page `target`."""
        self.kv[:, target].copy_(self.kv[:, source])

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)


class PageAllocator:
    """Hands out page indices of a `PagedKVCache`; one owner per page at a time.

    Freed pages are reused most-recently-freed first, which keeps the working set of a
    partly used cache small. A double free or a free of a page never handed out raises:
    either means two owners think they hold the same memory, which would corrupt KV.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        # Stack with the lowest indices on top, so a fresh allocator gives 0, 1, 2...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages available to `allocate`."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages handed out and not yet freed."""
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """`n` pages, all or nothing; raises `OutOfPages` when fewer are free."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > len(self._free):
            raise OutOfPages(needed=n, free=len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; all are checked before any is freed, so an error frees nothing."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise ValueError(f"page listed twice in one free: {sorted(pages)}")
        bad = [p for p in pages if p not in self._used]
        if bad:
            raise ValueError(f"double free or foreign pages: {bad}")
        for p in reversed(pages):
            self._used.remove(p)
            self._free.append(p)
