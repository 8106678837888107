"""Which directory a model configuration names, without converting or loading anything:
what the gateway relies on to read a tokenizer in an image that has no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yb_core.config import ModelConfig
from yb_core.model_files import (
    IDENTITY_FILE,
    TINY_MAX_POSITION,
    context_limit,
    converted_default_dir,
    model_dir,
)


def test_an_unprepared_default_model_is_refused_with_the_command_that_prepares_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(FileNotFoundError, match="yb prepare") as refused:
        model_dir(ModelConfig(source="default"), tmp_path)
    assert "python -m yb_engine.prepare" in str(refused.value)
    # A directory left half-written by a conversion (no identity file yet) is not ready.
    converted_default_dir(tmp_path).mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not prepared"):
        model_dir(ModelConfig(source="default"), tmp_path)


def test_a_prepared_default_model_is_found_in_the_cache(tmp_path: Path) -> None:
    target = converted_default_dir(tmp_path)
    target.mkdir(parents=True)
    (target / IDENTITY_FILE).write_text("{}")
    (target / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    model = ModelConfig(source="default")
    assert model_dir(model, tmp_path) == target
    assert context_limit(model, tmp_path) == 8192


def test_a_local_directory_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        model_dir(ModelConfig(source=str(tmp_path)), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": "many"}))
    model = ModelConfig(source=str(tmp_path))
    assert model_dir(model, tmp_path / "cache") == tmp_path
    assert context_limit(model, tmp_path / "cache") is None  # the config does not say


def test_the_tiny_random_model_has_no_directory(tmp_path: Path) -> None:
    tiny = ModelConfig(source="tiny-random")
    assert model_dir(tiny, tmp_path) is None
    assert context_limit(tiny, tmp_path) == TINY_MAX_POSITION
