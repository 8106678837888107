"""Which model a `ModelConfig` names, where its files are, and its identity.

`source = default | tiny-random | PATH` means the same thing in every service, and block
keys use one model identity. Nothing here loads weights or imports torch: the gateway and
the conductor use it too. Converting the default model's GGUF is the engine's job
(`yb_engine.models.resolve_model_dir`, run once by `yb prepare` or `yb up`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from yb_core.config import ModelConfig

TINY_RANDOM = "tiny-random"
DEFAULT = "default"
#: The tiny random model's position limit (its `max_position_embeddings`).
TINY_MAX_POSITION = 4096
#: The default model, and the directory its converted weights live in under the cache.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Written last into a converted directory: a directory that has it is complete.
IDENTITY_FILE = "yuebing_model.json"


def default_model_cache_dir() -> Path:
    """Where converted models live: `$YB_MODEL_CACHE`, else `~/.cache/yuebing/models`."""
    env = os.environ.get("YB_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "yuebing" / "models"


def converted_default_dir(cache_dir: Path) -> Path:
    """Where the default model's converted directory is (or will be) under `cache_dir`."""
    return Path(cache_dir).expanduser() / DEFAULT_MODEL_NAME


def model_dir(model: ModelConfig, cache_dir: Path) -> Path | None:
    """The Hugging Face directory of an already prepared model; None for the tiny random
    model, which is built in memory.

    Raises FileNotFoundError, saying what to run, when the default model has not been
    converted yet or a configured directory has no `config.json`.
    """
    if model.source == TINY_RANDOM:
        return None
    if model.source == DEFAULT:
        path = converted_default_dir(cache_dir)
        if not (path / IDENTITY_FILE).is_file():
            raise FileNotFoundError(
                f"the default model is not prepared in {cache_dir}: run `yb prepare` "
                "(`python -m yb_engine.prepare` where the yb tool is not installed) first"
            )
        return path
    path = Path(model.source).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


def context_limit(model: ModelConfig, cache_dir: Path) -> int | None:
    """The most positions the model itself can attend to (`max_position_embeddings`),
    or None when its config does not say. Reads only the config, never weights."""
    if model.source == TINY_RANDOM:
        return TINY_MAX_POSITION
    path = model_dir(model, cache_dir)
    assert path is not None
    config = json.loads((path / "config.json").read_text())
    limit = config.get("max_position_embeddings")
    return int(limit) if isinstance(limit, int) and limit > 0 else None


_KV_IDENTITIES: dict[tuple[str, str, str, str, str], str] = {}


def kv_identity(model: ModelConfig, cache_dir: Path | None) -> str:
    """What, beside the model's name, decides the bytes of its KV blocks: the dtype
    settings (the KV's element type: `dtype`, and `kv_dtype` unless `auto`) and a
    digest of the checkpoint's `config.json` (its family and shapes decide what a
    token keeps: per-head K/V or a latent, how many heads and layers). Read once per
    process and model."""
    key = (model.name, model.source, model.dtype, model.kv_dtype, str(cache_dir))
    found = _KV_IDENTITIES.get(key)
    if found is None:
        found = f"dtype={model.dtype}"
        if model.kv_dtype != "auto":
            found += f";kv_dtype={model.kv_dtype}"
        try:
            path = model_dir(model, cache_dir) if cache_dir is not None else None
        except FileNotFoundError:  # not prepared here: whoever serves it has it
            return found
        if path is not None and (path / "config.json").is_file():
            import xxhash

            found += f";config={xxhash.xxh3_64_hexdigest((path / 'config.json').read_bytes())}"
        _KV_IDENTITIES[key] = found
    return found


def identity_of(model: ModelConfig, cache_dir: Path | None = None) -> bytes:
    """The model identity that goes into every block key: its name and, where the
    model's directory is known (`cache_dir`), what decides its KV bytes
    (`kv_identity`), so two checkpoints or KV dtypes served under one name never
    share blocks."""
    # Imported here: the hashing module loads numpy and xxhash, which the configuration
    # (and so every process, the conductor included) must not pay for at start-up.
    from yb_core.hashing import model_identity

    return model_identity(model.name, kv=kv_identity(model, cache_dir))
