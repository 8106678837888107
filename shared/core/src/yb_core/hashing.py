"""Chained KV block keys, stable across processes and machines.

A block's key is xxh3-64 of (parent key, model identity, the block's token ids).
Chaining makes a key stand for the whole prefix up to and including its block, so
"the longest cached prefix" is "the longest run of leading keys present". The model
identity is part of every key, so two models never share KV. Python's `hash` is
salted per process and would not do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# Keys are unsigned 63-bit ints: they fit msgpack's signed int64 and stay positive.
_KEY_MASK = (1 << 63) - 1
ROOT_KEY = 0


def model_identity(model_name: str, adapter: str = "", kv: str = "") -> bytes:
    """Bytes that distinguish one model (and adapter) from every other, and, with `kv`,
    one layout of its KV bytes (dtype, shapes) from another."""
    base = f"{model_name}\x00{adapter}"
    return (f"{base}\x00{kv}" if kv else base).encode()


def block_key(parent: int, token_ids: Sequence[int], identity: bytes) -> int:
    """Key of one block given its parent's key (`ROOT_KEY` for the first block)."""
    h = xxhash.xxh3_64()
    h.update(parent.to_bytes(8, "little"))
    h.update(identity)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.intdigest() & _KEY_MASK


def block_hashes(token_ids: Sequence[int], block_size: int, identity: bytes) -> list[int]:
    """Keys of every *full* block of a prompt, in order.

    A trailing partial block has no key: it is never shared, because the next request
    with the same prefix may continue it differently.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype="<i4")
    keys: list[int] = []
    parent = ROOT_KEY
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxhash.xxh3_64()
        h.update(parent.to_bytes(8, "little"))
        h.update(identity)
        h.update(tokens[start : start + block_size].tobytes())
        parent = h.intdigest() & _KEY_MASK
        keys.append(parent)
    return keys
