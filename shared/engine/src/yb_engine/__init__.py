"""The model runner: a registry of model families, a paged KV cache, our own forward pass,
sampling and continuous batching. See docs/engine.md.

Typical use::

    model = load_model(ensure_default_model(default_model_cache_dir()))  # yb_core.model_files
    cache = PagedKVCache(model.config, num_pages=1024, block_size=64)
    runner = ModelRunner(model, cache)
    logits = runner.prefill(token_ids, block_table)

The names below are imported on first use, so that importing a torch-free module of
the package (`yb_engine.models`, `yb_engine.kv_sizing`) does not import torch: the
`yb` launcher uses those and stays a light process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yb_engine.architecture import ArchConfig, RopeParams, UnsupportedModelError
    from yb_engine.attention import (
        AttentionBackend,
        FlashAttnBackend,
        TorchSDPABackend,
        select_backend,
    )
    from yb_engine.batcher import DecodeBatcher, FinishReason, TokenOutput
    from yb_engine.choice_sampling import (
        ChoiceState,
        GrammarViolation,
        Sampled,
        sample_choices,
        sample_first_tokens,
    )
    from yb_engine.kv_cache import OutOfPages, PageAllocator, PagedKVCache
    from yb_engine.loader import (
        LoadedModel,
        ensure_default_model,
        find_smollm2_gguf,
        load_model,
        tiny_random_model,
    )
    from yb_engine.runner import DecodeSeq, ModelRunner, PrefillSeq
    from yb_engine.sampling import (
        Sampler,
        choice_generator,
        is_greedy,
        new_generator,
        skip_draws,
    )
    from yb_engine.weights import LayerWeights, ModelWeights

#: Each module of the package -> the public names it defines, imported on first use.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "yb_engine.architecture": (
        "ArchConfig",
        "RopeParams",
        "UnsupportedModelError",
    ),
    "yb_engine.attention": (
        "AttentionBackend",
        "FlashAttnBackend",
        "TorchSDPABackend",
        "select_backend",
    ),
    "yb_engine.batcher": (
        "DecodeBatcher",
        "FinishReason",
        "TokenOutput",
    ),
    "yb_engine.choice_sampling": (
        "ChoiceState",
        "GrammarViolation",
        "Sampled",
        "sample_choices",
        "sample_first_tokens",
    ),
    "yb_engine.kv_cache": (
        "OutOfPages",
        "PageAllocator",
        "PagedKVCache",
    ),
    "yb_engine.loader": (
        "LoadedModel",
        "ensure_default_model",
        "find_smollm2_gguf",
        "load_model",
        "tiny_random_model",
    ),
    "yb_engine.runner": (
        "DecodeSeq",
        "ModelRunner",
        "PrefillSeq",
    ),
    "yb_engine.sampling": (
        "Sampler",
        "choice_generator",
        "is_greedy",
        "new_generator",
        "skip_draws",
    ),
    "yb_engine.weights": (
        "LayerWeights",
        "ModelWeights",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'yb_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ArchConfig",
    "AttentionBackend",
    "ChoiceState",
    "DecodeBatcher",
    "DecodeSeq",
    "FinishReason",
    "FlashAttnBackend",
    "GrammarViolation",
    "LayerWeights",
    "LoadedModel",
    "ModelRunner",
    "ModelWeights",
    "OutOfPages",
    "PageAllocator",
    "PagedKVCache",
    "PrefillSeq",
    "RopeParams",
    "Sampled",
    "Sampler",
    "TokenOutput",
    "TorchSDPABackend",
    "UnsupportedModelError",
    "choice_generator",
    "ensure_default_model",
    "find_smollm2_gguf",
    "is_greedy",
    "load_model",
    "new_generator",
    "sample_choices",
    "sample_first_tokens",
    "select_backend",
    "skip_draws",
    "tiny_random_model",
]
