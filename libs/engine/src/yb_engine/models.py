"""From a `ModelConfig` to an engine's model: the directory (converting the default
model's GGUF once) and the weights in the configured dtype."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from yb_core.model_files import DEFAULT, model_dir

if TYPE_CHECKING:
    from yb_core.config import ModelConfig
    from yb_engine.loader import LoadedModel


def resolve_model_dir(
    model: ModelConfig, cache_dir: Path, progress: Callable[[str], None] | None = None
) -> Path | None:
    """The Hugging Face directory to load, converting the default model once.

    Returns None for the tiny random model, which is built in memory.
    """
    if model.source == DEFAULT:
        from yb_engine.loader import ensure_default_model

        return ensure_default_model(cache_dir, progress)
    return model_dir(model, cache_dir)


def load_engine_model(
    model: ModelConfig, cache_dir: Path, progress: Callable[[str], None] | None = None
) -> LoadedModel:
    """The model with weights, in the configured dtype, for an engine."""
    import torch

    from yb_engine.loader import load_model, tiny_random_model

    dtype = getattr(torch, model.dtype)
    path = resolve_model_dir(model, cache_dir, progress)
    if path is None:
        return tiny_random_model()
    return load_model(path, dtype=dtype)
