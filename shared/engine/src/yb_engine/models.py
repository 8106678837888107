"""From a `ModelConfig` to an engine's model: the directory (converting the default
model's GGUF once), the device and dtype it runs in, and the weights loaded there.

Importing this module does not import torch (`yb up` and `yb prepare` use
`resolve_model_dir` without it); the functions that need torch import it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from yb_core.config import nvidia_gpu_visible
from yb_core.model_files import DEFAULT, model_dir
from yb_core.telemetry import get_logger

if TYPE_CHECKING:
    import torch

    from yb_core.config import ModelConfig
    from yb_engine.architecture import ArchConfig, LayerRange
    from yb_engine.loader import LoadedModel, LoadedStage
    from yb_engine.tensor_parallel import Shard

log = get_logger(__name__)


class DeviceUnavailable(RuntimeError):
    """`model.device` names a device that torch cannot use on this machine.

    Raised when an engine starts, before any weight is read: a service asked for a GPU
    must not quietly serve from the CPU.
    """


def resolve_device(spec: str) -> torch.device:
    """The torch device `model.device` means here: `cpu`; `cuda` (device 0) or
    `cuda:N`, which must exist; `auto`, CUDA device 0 when torch sees one, else the
    CPU. Raises `DeviceUnavailable` naming what is missing."""
    import torch

    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if nvidia_gpu_visible():
            log.warning(
                "cuda_not_usable",
                reason=_no_cuda_reason(torch),
                consequence="model.device=auto runs on the CPU",
            )
        return torch.device("cpu")
    if not spec.startswith("cuda"):
        raise DeviceUnavailable(f"model.device {spec!r} is not auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"model.device is {spec!r} but torch {torch.__version__} cannot use CUDA here: "
            f"{_no_cuda_reason(torch)}. Set model.device (YB_MODEL__DEVICE, "
            "`yb up --device`) to cpu or auto."
        )
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(
            f"model.device is {spec!r} but torch sees {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)"
        )
    return torch.device("cuda", index)


def _no_cuda_reason(torch: object) -> str:
    version = getattr(getattr(torch, "version", None), "cuda", None)
    if version is None:
        return "this torch is a CPU-only build (install a CUDA wheel: ./setup.sh on a GPU machine)"
    return f"this torch (CUDA {version}) sees no GPU (driver, CUDA_VISIBLE_DEVICES)"


def resolve_dtype(model: ModelConfig, device: torch.device) -> torch.dtype:
    """The weights' and KV cache's dtype on `device` (`ModelConfig.dtype_for`)."""
    import torch

    dtype: torch.dtype = getattr(torch, model.dtype_for(device.type))
    return dtype


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
    model: ModelConfig,
    cache_dir: Path,
    progress: Callable[[str], None] | None = None,
    shard: Shard | None = None,
) -> LoadedModel:
    """The model with weights on the configured device in the configured dtype (a
    tensor-parallel rank's share of them with `shard`).

    The device is resolved first, so `DeviceUnavailable` comes before any loading.
    """
    from yb_engine.loader import load_model, tiny_random_model

    device = resolve_device(model.device)
    dtype = resolve_dtype(model, device)
    path = resolve_model_dir(model, cache_dir, progress)
    if path is None:
        return tiny_random_model(dtype=dtype, device=str(device), shard=shard)
    return load_model(path, dtype=dtype, device=str(device), shard=shard)


def engine_arch(model: ModelConfig, cache_dir: Path) -> ArchConfig:
    """The architecture of the configured model, read from its config alone (the tiny
    random model is built: it is tiny); `UnsupportedModelError` for a family the
    engine cannot compute."""
    from yb_engine.loader import check_supported, tiny_random_model

    path = resolve_model_dir(model, cache_dir, None)
    if path is None:
        return tiny_random_model().config
    return check_supported(path)


def load_engine_stage(
    model: ModelConfig,
    cache_dir: Path,
    layer_range: LayerRange | Callable[[ArchConfig], LayerRange],
    progress: Callable[[str], None] | None = None,
) -> LoadedStage:
    """One pipeline stage of the model, layers `layer_range` (or the range it gives for
    the model's architecture: a stage `i` of `n`, say), on the configured device and
    dtype: a stage loads only its own layers' weights (the tiny random model, built in
    memory, is built whole and keeps the stage's share)."""
    from yb_engine.architecture import LayerRange
    from yb_engine.loader import LoadedStage, load_stage, tiny_random_model

    device = resolve_device(model.device)
    dtype = resolve_dtype(model, device)
    path = resolve_model_dir(model, cache_dir, progress)
    if path is None:
        whole = tiny_random_model(dtype=dtype, device=str(device))
        if not isinstance(layer_range, LayerRange):
            layer_range = layer_range(whole.config)
        return LoadedStage.of_model(whole, layer_range)
    return load_stage(path, layer_range, dtype=dtype, device=str(device))
