"""The model runner: Llama-family weights, a paged KV cache, our own forward pass,
sampling and continuous batching. See DESIGN.md, "Model runner".

Typical use::

    model = load_model(ensure_default_model(default_model_cache_dir()))
    cache = PagedKVCache(model.config, num_pages=1024, block_size=64)
    runner = ModelRunner(model, cache)
    logits = runner.prefill(token_ids, block_table)
"""

from yb_shared.model.attention import (
    AttentionBackend,
    FlashAttnBackend,
    TorchSDPABackend,
    attention_backend_name,
    select_backend,
)
from yb_shared.model.batcher import DecodeBatcher, FinishReason, TokenOutput
from yb_shared.model.config import ArchConfig, RopeParams, UnsupportedModelError
from yb_shared.model.detokenize import IncrementalDetokenizer, StopStringFilter
from yb_shared.model.kv_cache import OutOfPages, PageAllocator, PagedKVCache
from yb_shared.model.loader import (
    LoadedModel,
    default_model_cache_dir,
    ensure_default_model,
    find_smollm2_gguf,
    load_model,
    tiny_random_model,
)
from yb_shared.model.runner import DecodeSeq, ModelRunner
from yb_shared.model.sampling import Sampler, is_greedy, new_generator, skip_draws
from yb_shared.model.weights import LayerWeights, ModelWeights

__all__ = [
    "ArchConfig",
    "AttentionBackend",
    "DecodeBatcher",
    "DecodeSeq",
    "FinishReason",
    "FlashAttnBackend",
    "IncrementalDetokenizer",
    "LayerWeights",
    "LoadedModel",
    "ModelRunner",
    "ModelWeights",
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "RopeParams",
    "Sampler",
    "StopStringFilter",
    "TokenOutput",
    "TorchSDPABackend",
    "UnsupportedModelError",
    "attention_backend_name",
    "default_model_cache_dir",
    "ensure_default_model",
    "find_smollm2_gguf",
    "is_greedy",
    "load_model",
    "new_generator",
    "select_backend",
    "skip_draws",
    "tiny_random_model",
]
