"""The architecture of a Llama-family decoder, as the runner needs it.

Hugging Face configs spell the same facts in many ways (`rope_scaling` or
`rope_parameters`, `attention_bias` or an implied Qwen2 bias, `eos_token_id` as an int or
a list). `arch_from_hf_config` reads them once into a flat, typed, frozen `ArchConfig`, so
the forward pass, the KV cache and the block hashing never touch a transformers config.
"""

from __future__ import annotations

from typing import Any

import msgspec

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this runner computes exactly."""


class RopeParams(msgspec.Struct, frozen=True, kw_only=True):
    """Rotary embedding parameters; `type` picks how the inverse frequencies are scaled.

    `factor`, the frequency factors and `original_max_position` matter for `linear`,
    `llama3` and `yarn`; `beta_fast`, `beta_slow`, `attention_factor` and `truncate`
    only for `yarn` (None = derived from `factor`, as transformers does).
    """

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


class ArchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape and numerics of one Llama-family model.

    `model_id` is the model's identity for KV block hashing: two engines whose KV can be
    exchanged must report the same id, and different weights must not. It names the
    weights, not the compute dtype; callers that mix dtypes across engines must add it.
    """

    model_id: str
    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    rope: RopeParams
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        """Width of the query projection."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_hf(cfg: Any) -> RopeParams:
    # transformers 5 normalizes to `rope_parameters` (theta inside); older configs keep
    # `rope_theta` beside a `rope_scaling` dict. Accept both.
    params: dict[str, Any] = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {sorted(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or max_pos)
    if factor is None:
        # transformers' yarn derives the factor from the context extension when absent.
        factor = max_pos / original if rope_type == "yarn" and original else 1.0
    return RopeParams(
        theta=float(theta),
        type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=(
            None if params.get("attention_factor") is None else float(params["attention_factor"])
        ),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=(
            None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"])
        ),
        truncate=bool(params.get("truncate", True)),
    )


def arch_from_hf_config(
    cfg: Any, *, model_id: str, extra_eos_token_ids: list[int] | None = None
) -> ArchConfig:
    """Read a transformers `PretrainedConfig` of a Llama-family model into an `ArchConfig`.

    Raises `UnsupportedModelError` for anything whose forward pass would differ from ours
    (other model types, sliding windows, partial rotary, MLP activations other than SiLU),
    because silently computing a different function is worse than refusing.
    """
    model_type = str(getattr(cfg, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not Llama-family "
            f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"MLP activation {act!r} is not supported (only SiLU)")
    sliding = getattr(cfg, "sliding_window", None)
    if sliding is not None and (
        model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
    ):
        raise UnsupportedModelError("sliding-window attention is not supported")
    num_heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // num_heads)
    num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    if num_heads % num_kv:
        raise UnsupportedModelError(f"{num_heads} heads do not group over {num_kv} KV heads")
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama's `attention_bias` adds both.
    qkv_bias = True if model_type == "qwen2" else attention_bias
    o_bias = False if model_type == "qwen2" else attention_bias
    eos = _int_list(getattr(cfg, "eos_token_id", None))
    for extra in extra_eos_token_ids or []:
        if extra not in eos:
            eos.append(extra)
    bos = getattr(cfg, "bos_token_id", None)
    return ArchConfig(
        model_id=model_id,
        model_type=model_type,
        num_layers=int(cfg.num_hidden_layers),
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate=int(cfg.intermediate_size),
        vocab=int(cfg.vocab_size),
        rms_eps=float(cfg.rms_norm_eps),
        rope=_rope_from_hf(cfg),
        max_position=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
    )


class LayerRange(msgspec.Struct, frozen=True):
    """The decoder layers `[start, end)` one pipeline stage holds.

    The first stage (start 0) also holds the token embeddings; the last (end = the
    model's layer count) the final norm and the LM head.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"layer range [{self.start}, {self.end}) is empty or negative")

    def __len__(self) -> int:
        return self.end - self.start

    def check(self, arch: ArchConfig) -> None:
        """Raise unless the range lies inside `arch`'s layers."""
        if self.end > arch.num_layers:
            raise ValueError(
                f"layer range [{self.start}, {self.end}) exceeds the {arch.num_layers} "
                f"layers of {arch.model_id}"
            )

    @property
    def is_first(self) -> bool:
        """The stage that embeds token ids."""
        return self.start == 0

    def is_last(self, arch: ArchConfig) -> bool:
        """The stage that computes logits."""
        return self.end == arch.num_layers

    @classmethod
    def whole(cls, arch: ArchConfig) -> LayerRange:
        """Every layer of `arch`: one stage that is the whole model."""
        return cls(0, arch.num_layers)

    @classmethod
    def split(cls, num_layers: int, num_stages: int) -> list[LayerRange]:
        """`num_layers` cut into `num_stages` contiguous ranges whose sizes differ by at
        most one (the earlier stages take the extra layers)."""
        if not 1 <= num_stages <= num_layers:
            raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        ranges, start = [], 0
        for i in range(num_stages):
            end = start + base + (1 if i < extra else 0)
            ranges.append(cls(start, end))
            start = end
        return ranges
