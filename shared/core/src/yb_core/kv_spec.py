"""What one token's KV is, as a property of the model: the contract every consumer reads.

An engine's KV pages, the UCX transfers between engines, the kvstore's blocks, the
conductor's transfer cost and `yb sim`'s profiles all depend on how many bytes a token
leaves in the cache and how they are laid out. That is a property of the model family,
not a constant: Llama-style attention keeps a key and a value per KV head; DeepSeek's
multi-head latent attention (MLA) keeps one compressed latent shared by every head.
The engine derives a `KVCacheSpec` from its model and announces it (`InstanceUp.kv_spec`);
everything downstream reads the sizes from it instead of guessing from a head count.

The page layout it implies: layer `l`'s page `p` is one contiguous region of
`page_nbytes(block_size)` bytes, `[heads, parts, block_size, row]` row-major: head by
head, each head's keys of the block then its values, a row per token of `dim` numbers
(`row_nbytes`). An 8-bit dtype (`SCALED_DTYPES`) keeps each row's float32 scale after
its `dim` bytes: a token's row, quantized on its own, never changes when later tokens
join its page, so a block's bytes depend on its tokens alone. Head-major, so the heads one
tensor-parallel rank holds (a contiguous run) are one region of the page, at every
degree. A block in the pool is that region for every layer the model has: the same
bytes whatever degree wrote it.

Torch-free: the conductor, the gateway and `yb sim` use it.
"""

from __future__ import annotations

import msgspec

#: Bytes per element of the dtypes a KV cache may hold.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
}

#: Dtypes whose rows carry a scale: a row holds `dim` numbers `q` and then the float32
#: `s` with `q * s` the value (`s` = the row's largest magnitude over the dtype's).
SCALED_DTYPES: frozenset[str] = frozenset({"float8_e4m3fn"})

#: Bytes of one row's scale, in a scaled dtype.
SCALE_NBYTES = 4


class KVCacheSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One model's KV per token and per layer, and how a page holds it.

    - `parts`: what is kept per token, each `heads` x `dim` numbers: `("k", "v")` for
      grouped-query attention, `("latent",)` for MLA (one head of `kv_lora_rank +
      qk_rope_head_dim` numbers: the normalized compressed KV, then the rotated shared key).
    - `dtype`: the element type in pages, transfers and blocks (a torch dtype's name);
      an 8-bit one keeps a scale per row (`SCALED_DTYPES`).
    - `num_layers`: the layers that keep KV (every decoder layer).
    - `windows`: per layer, the sliding window in tokens (0: global attention). A
      windowed layer still keeps every token's KV, so blocks are whole-prefix and
      reusable by any later prompt; the window only limits what a query reads.
    """

    parts: tuple[str, ...]
    heads: int
    dim: int
    dtype: str
    num_layers: int
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.parts or self.heads <= 0 or self.dim <= 0 or self.num_layers <= 0:
            raise ValueError(f"KV cache spec with an empty part: {self}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} windows for {self.num_layers} layers")

    @property
    def element_size(self) -> int:
        """Bytes of one number."""
        return DTYPE_BYTES[self.dtype]

    @property
    def scaled(self) -> bool:
        """Whether each row carries its scale (an 8-bit dtype)."""
        return self.dtype in SCALED_DTYPES

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token's row of one head and part: its numbers, then its scale
        in a scaled dtype."""
        return self.dim * self.element_size + (SCALE_NBYTES if self.scaled else 0)

    @property
    def bytes_per_token_layer(self) -> int:
        """Bytes one token keeps in one layer."""
        return len(self.parts) * self.heads * self.row_nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token keeps in the whole cache (every layer)."""
        return self.num_layers * self.bytes_per_token_layer

    def page_nbytes(self, block_size: int) -> int:
        """Bytes of one (layer, page) region: `block_size` tokens of one layer."""
        return block_size * self.bytes_per_token_layer

    def block_nbytes(self, block_size: int) -> int:
        """Bytes of one pool block: one page of every layer."""
        return self.num_layers * self.page_nbytes(block_size)

    @property
    def layout_id(self) -> str:
        """Everything that decides a block's bytes, as a short string: two engines
        whose blocks can be exchanged have the same one (part of a block's key)."""
        # "hm": head-major pages (the module doc).
        parts = "+".join(self.parts)
        return f"{parts}:{self.heads}x{self.dim}:{self.dtype}:{self.num_layers}L:hm"
