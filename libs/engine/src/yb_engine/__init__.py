"""The model runner: Llama-family weights, a paged KV cache, our own forward pass,
sampling and continuous batching. See docs/engine.md.

Typical use::

    model = load_model(ensure_default_model(default_model_cache_dir()))  # yb_core.model_files
    cache = PagedKVCache(model.config, num_pages=1024, block_size=64)
    runner = ModelRunner(model, cache)
    logits = runner.prefill(token_ids, block_table)
"""

from yb_engine.architecture import ArchConfig, RopeParams, UnsupportedModelError
from yb_engine.attention import (
    AttentionBackend,
    FlashAttnBackend,
    TorchSDPABackend,
    select_backend,
)
from yb_engine.batcher import DecodeBatcher, FinishReason, TokenOutput
from yb_engine.kv_cache import OutOfPages, PageAllocator, PagedKVCache
from yb_engine.loader import (
    LoadedModel,
    ensure_default_model,
    find_smollm2_gguf,
    load_model,
    tiny_random_model,
)
from yb_engine.runner import DecodeSeq, ModelRunner
from yb_engine.sampling import Sampler, is_greedy, new_generator, skip_draws
from yb_engine.weights import LayerWeights, ModelWeights

__all__ = [
    "ArchConfig",
    "AttentionBackend",
    "DecodeBatcher",
    "DecodeSeq",
    "FinishReason",
    "FlashAttnBackend",
    "LayerWeights",
    "LoadedModel",
    "ModelRunner",
    "ModelWeights",
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "RopeParams",
    "Sampler",
    "TokenOutput",
    "TorchSDPABackend",
    "UnsupportedModelError",
    "ensure_default_model",
    "find_smollm2_gguf",
    "is_greedy",
    "load_model",
    "new_generator",
    "select_backend",
    "skip_draws",
    "tiny_random_model",
]
