"""The KV cache spec: the sizes every consumer reads, and its wire form."""

from __future__ import annotations

import msgspec
import pytest

from yb_core import events as ev
from yb_core.kv_spec import KVCacheSpec

# SmolLM2-135M: 30 layers, 3 KV heads of 64, keys and values, float32.
SMOLLM2 = KVCacheSpec(parts=("k", "v"), heads=3, dim=64, dtype="float32", num_layers=30)
# Kimi K2: 61 layers, one latent of 512 + 64 numbers, bfloat16.
KIMI_K2 = KVCacheSpec(parts=("latent",), heads=1, dim=576, dtype="bfloat16", num_layers=61)


def test_sizes_follow_the_parts() -> None:
    assert SMOLLM2.bytes_per_token_layer == 2 * 3 * 64 * 4
    assert SMOLLM2.bytes_per_token == 30 * 1536
    assert SMOLLM2.page_nbytes(64) == 64 * 1536
    assert SMOLLM2.block_nbytes(64) == 30 * 64 * 1536 == 2_949_120
    assert KIMI_K2.bytes_per_token == 61 * 576 * 2 == 70_272


def test_the_layout_id_names_what_decides_the_bytes() -> None:
    assert SMOLLM2.layout_id == "k+v:3x64:float32:30L:hm"
    assert KIMI_K2.layout_id == "latent:1x576:bfloat16:61L:hm"
    half = msgspec.structs.replace(SMOLLM2, dtype="bfloat16")
    assert half.layout_id != SMOLLM2.layout_id


def test_an_impossible_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="KV dtype"):
        KVCacheSpec(parts=("k", "v"), heads=1, dim=8, dtype="int7", num_layers=1)
    with pytest.raises(ValueError, match="empty part"):
        KVCacheSpec(parts=(), heads=1, dim=8, dtype="float32", num_layers=1)
    with pytest.raises(ValueError, match="windows"):
        KVCacheSpec(parts=("k",), heads=1, dim=8, dtype="float32", num_layers=2, windows=(4,))


def test_instances_announce_it_and_old_announcements_still_decode() -> None:
    up = ev.InstanceUp(instance_id="decode-0", role="decode", host="h", kv_spec=KIMI_K2)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(up), type=ev.InstanceUp)
    assert decoded.kv_spec == KIMI_K2
    old = ev.InstanceUp(instance_id="decode-0", role="decode", host="h")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=ev.InstanceUp).kv_spec is None
