"""A tensor-parallel instance of a checkpoint directory, for tests: rank 0 in this
process, ranks 1..N-1 as processes of their own (`yb_engine.tp_instance`), on the CPU,
float32 (its KV in `kv_dtype`). The caller closes the ranks (`TPInstance.close`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from yb_core.config import ModelConfig
from yb_engine.kv_quant import kv_dtype_for
from yb_engine.loader import load_model
from yb_engine.models import load_engine_model
from yb_engine.tp_instance import ShardedKV, TensorParallelRunner, TPInstance, start_instance


def start_tp(
    path: Path,
    size: int,
    *,
    pages: int,
    block_size: int,
    timeout_s: float = 30.0,
    kv_dtype: Literal["auto", "fp8_e4m3"] = "auto",
) -> tuple[TensorParallelRunner, ShardedKV, TPInstance]:
    """A TP=`size` instance of the model in `path` with `pages` pages of `block_size`
    in `kv_dtype` (`model.kv_dtype`), each collective bounded by `timeout_s`."""
    cfg = ModelConfig(
        source=str(path), device="cpu", dtype="float32", block_size=block_size, kv_dtype=kv_dtype
    )
    runner, sharded, ranks, _ = start_instance(
        cfg,
        path.parent,
        size=size,
        arch=load_model(path).config,
        num_pages=pages,
        block_size=block_size,
        kv_dtype=kv_dtype_for(kv_dtype, torch.float32),
        threads=1,
        timeout_s=timeout_s,
        load_timeout_s=120.0,
        load_own=lambda shard: load_engine_model(cfg, path.parent, shard=shard),
    )
    return runner, sharded, ranks
