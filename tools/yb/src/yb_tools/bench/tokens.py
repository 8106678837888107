"""Deterministic pseudo-random token blocks: the same id always gives the same tokens.

A Mooncake trace names its prompts' prefix blocks by hash id; to replay it against a
real engine every id needs real tokens, equal ids equal tokens, so that prefixes the
trace shares are shared in the prompts too (and the KV cache can reuse them). The
tokens are drawn from SHAKE-256 of the seed, a namespace and the id: stable across
runs, processes, machines and Python versions, unlike `hash()` (salted per process)
or `random`/numpy generators (whose algorithms may change between releases).

SHAKE is an extendable-output function, so a shorter block is a prefix of a longer
block with the same id: truncating a prompt keeps the prefix the trace meant.
"""

from __future__ import annotations

import hashlib

import numpy as np

# Version of the derivation, part of every digest: changing how tokens are drawn must
# change this, so that figures taken with different derivations cannot be confused.
_SCHEME = "yb-bench-tokens/1"


def token_block(
    namespace: str, block_id: int, length: int, vocab_size: int, seed: int = 0
) -> list[int]:
    """`length` token ids in `[0, vocab_size)` determined by (seed, namespace, block_id)."""
    if length < 0:
        raise ValueError(f"length must not be negative, got {length}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if length == 0:
        return []
    digest = hashlib.shake_256(f"{_SCHEME}/{seed}/{namespace}/{block_id}".encode()).digest(
        4 * length
    )
    words = np.frombuffer(digest, dtype="<u4")
    # The modulo bias is below vocab_size / 2**32 (1e-5 for a 50k vocabulary): harmless
    # for load generation.
    ids: list[int] = (words % np.uint32(vocab_size)).tolist()
    return ids


class TokenBlocks:
    """`token_block` for one namespace and vocabulary, memoised per id.

    A trace repeats the same ids in many prompts; drawing each once keeps building a
    long replay cheap.
    """

    def __init__(self, namespace: str, vocab_size: int, seed: int = 0) -> None:
        self.namespace = namespace
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def block(self, block_id: int, length: int) -> list[int]:
        """The block of `block_id`, `length` tokens long."""
        key = (block_id, length)
        found = self._blocks.get(key)
        if found is None:
            found = token_block(self.namespace, block_id, length, self.vocab_size, self.seed)
            self._blocks[key] = found
        return found

    def chain(self, block_ids: list[int], block_tokens: int, total: int) -> list[int]:
        """The prompt of a chain of blocks: each id's block in order, cut to `total`."""
        out: list[int] = []
        for block_id in block_ids:
            if len(out) >= total:
                break
            out.extend(self.block(block_id, min(block_tokens, total - len(out))))
        return out
