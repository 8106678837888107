"""The served model's tokenizer, without its weights (the gateway must not load them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from yb_core.model_files import TINY_RANDOM, model_dir

if TYPE_CHECKING:
    from yb_core.config import ModelConfig


def load_tokenizer(model: ModelConfig, cache_dir: Path) -> Any:
    """A transformers tokenizer for `model`, which must already be prepared."""
    if model.source == TINY_RANDOM:
        from yb_text.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(model, cache_dir)))
