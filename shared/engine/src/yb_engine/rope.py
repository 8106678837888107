"""Rotary position embeddings with the scalings checkpoints use (linear, llama3, yarn).

The inverse frequencies follow transformers' formulas exactly (same float32 arithmetic),
because RoPE errors grow with the position: a frequency that is off in the last bit is
a visible logit difference at position 4096.
"""

from __future__ import annotations

import math

import torch

from yb_engine.architecture import RopeParams


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeParams, dim: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = correction_dim(rope.beta_fast)
    high = correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _llama3(rope: RopeParams, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_len = rope.original_max_position
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inverse_frequencies(rope: RopeParams, head_dim: int) -> tuple[torch.Tensor, float]:
    """Float32 inverse frequencies `[head_dim // 2]` and the factor applied to cos/sin."""
    if rope.type == "default":
        return _base_inv_freq(rope.theta, head_dim), 1.0
    if rope.type == "linear":
        return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(rope, head_dim), 1.0
    if rope.type == "yarn":
        return _yarn(rope, head_dim)
    raise ValueError(f"unknown rope type {rope.type!r}")


class Rotary:
    """Computes cos/sin for given positions and rotates query/key heads.

    Uses the half-split convention of Hugging Face Llama checkpoints (the GGUF loader
    un-permutes q/k weights into that convention).
    """

    def __init__(self, rope: RopeParams, head_dim: int, device: torch.device | str) -> None:
        inv_freq, self.attention_factor = inverse_frequencies(rope, head_dim)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Half-width `(cos, sin)`, each `[T, 1, head_dim // 2]`, ready to broadcast over heads."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        if self.attention_factor != 1.0:
            cos = cos * self.attention_factor
            sin = sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` `[T, heads, head_dim]`; same rounding as `x*cos + rotate_half(x)*sin`."""
        half = x.shape[-1] // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
