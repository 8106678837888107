"""From a `ModelConfig` to what a service needs: a tokenizer, a model, an identity.

The gateway needs only the tokenizer (and must not load weights); the engines need
the model. Both go through here so that `source = default | tiny-random | PATH` means
the same thing everywhere, and so that block keys use one model identity.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yb_shared.config import ModelConfig
from yb_shared.hashing import model_identity

if TYPE_CHECKING:
    from yb_shared.model.loader import LoadedModel

TINY_RANDOM = "tiny-random"
DEFAULT = "default"
#: The tiny random model's position limit (its `max_position_embeddings`).
TINY_MAX_POSITION = 4096


def resolve_model_dir(
    model: ModelConfig, cache_dir: Path, progress: Callable[[str], None] | None = None
) -> Path | None:
    """The Hugging Face directory to load, converting the default model once.

    Returns None for the tiny random model, which is built in memory.
    """
    if model.source == TINY_RANDOM:
        return None
    if model.source == DEFAULT:
        from yb_shared.model.loader import ensure_default_model

        return ensure_default_model(cache_dir, progress)
    path = Path(model.source).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


def load_tokenizer(model: ModelConfig, cache_dir: Path) -> Any:
    """The served model's tokenizer (a transformers tokenizer), without its weights."""
    if model.source == TINY_RANDOM:
        from yb_shared.model.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(model, cache_dir)))


def context_limit(model: ModelConfig, cache_dir: Path) -> int | None:
    """The most positions the model itself can attend to (`max_position_embeddings`),
    or None when its config does not say. Reads only the config, never weights."""
    if model.source == TINY_RANDOM:
        return TINY_MAX_POSITION
    path = resolve_model_dir(model, cache_dir)
    assert path is not None
    config = json.loads((path / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def load_engine_model(
    model: ModelConfig, cache_dir: Path, progress: Callable[[str], None] | None = None
) -> LoadedModel:
    """The model with weights, in the configured dtype, for an engine."""
    import torch

    from yb_shared.model.loader import load_model, tiny_random_model

    dtype = getattr(torch, model.dtype)
    if model.source == TINY_RANDOM:
        return tiny_random_model()
    path = resolve_model_dir(model, cache_dir, progress)
    assert path is not None
    return load_model(path, dtype=dtype)


def identity_of(model: ModelConfig) -> bytes:
    """The model identity that goes into every block key."""
    return model_identity(model.name)
