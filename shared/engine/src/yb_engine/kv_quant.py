"""8-bit KV rows: FP8 e4m3 numbers with a float32 scale per (token, head, part).

`model.kv_dtype = "fp8_e4m3"` keeps the KV cache, its transfers and the pool's blocks
in 8 bits (`yb_core.kv_spec.SCALED_DTYPES`). Each row (one token's key, value or
latent of one head) is quantized on its own: its scale is its largest magnitude over
e4m3's largest number (448), kept as float32 right after the row's bytes. A per-row
scale needs no calibration, follows outliers token by token, and never re-quantizes
a page as tokens join it, so a block's bytes are a function of its tokens alone (what
the pool's keys promise). The scale costs 4 bytes a row: a 64-number head keeps 68
bytes a row against 128 in bfloat16 and 256 in float32.

The cache tensor holds such rows as bytes (uint8); attention dequantizes what it
gathers and computes in the model's dtype. On a GPU, an FP8 attention kernel would
read the 8-bit pages and their scales in place instead (flash-attn 3's and
FlashInfer's FP8 paths take per-head descales): the flash backends here read pages
of the model's dtype only, so an 8-bit cache runs on the SDPA backend everywhere.
"""

from __future__ import annotations

import torch

from yb_core.kv_spec import SCALE_NBYTES

#: The element type of an 8-bit row and its largest finite number.
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)

#: The dtypes `model.kv_dtype` names, beside "auto" (the model's own dtype).
KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": FP8}

# The smallest scale: an all-zero row quantizes to zeros, not NaNs.
_TINY = float(torch.finfo(torch.float32).tiny)


def kv_dtype_for(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for `model.kv_dtype` `setting`."""
    if setting == "auto":
        return model_dtype
    try:
        return KV_DTYPES[setting]
    except KeyError:
        raise ValueError(
            f"model.kv_dtype {setting!r} is not one of {['auto', *KV_DTYPES]}"
        ) from None


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` keeps scaled 8-bit rows."""
    return bool(dtype == FP8)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The element type of the tensor that holds a cache of `dtype`: bytes for scaled
    rows (numbers and scale side by side), else `dtype` itself."""
    return torch.uint8 if is_scaled(dtype) else dtype


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., dim]` as scaled 8-bit rows, uint8 `[..., dim + 4]`."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    # Clamped: a division that rounds past 448 must saturate, not overflow to NaN.
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return torch.cat([q, scale.view(torch.uint8)], dim=-1)


def dequantize_rows(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scaled rows uint8 `[..., dim + 4]` back to numbers, `[..., dim]` of `dtype`."""
    dim = raw.shape[-1] - SCALE_NBYTES
    numbers = raw[..., :dim].view(FP8).to(torch.float32)
    scale = raw[..., dim:].contiguous().view(torch.float32)
    return (numbers * scale).to(dtype)
