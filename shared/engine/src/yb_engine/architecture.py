"""The architecture of a decoder-only model, as the runner needs it.

Hugging Face configs spell the same facts in many ways (`rope_scaling` or
`rope_parameters`, `attention_bias` or an implied Qwen2 bias, `eos_token_id` as an int or
a list), and each family adds its own (Gemma's scaled embeddings and sandwich norms,
MoE routers, DeepSeek's latent attention). `arch_from_hf_config` reads them once into a
flat, typed, frozen `ArchConfig` through the family registry (`families.py`), so the
forward pass, the KV cache and the block hashing never touch a transformers config.
"""

from __future__ import annotations

from typing import Any

import msgspec

from yb_core.kv_spec import KVCacheSpec

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedModelError(ValueError):
    """The checkpoint is a model this runner cannot compute exactly; the message names
    the family and what is missing."""


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


class MoEConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A mixture-of-experts MLP: `num_experts` gated experts of `intermediate` each,
    `top_k` per token.

    `scoring` is how router logits become weights: `softmax` (Mixtral, Qwen3-MoE) or
    `sigmoid` with a per-expert selection bias and group-limited choice (DeepSeek-V3:
    the top `topk_group` of `num_groups` groups, each scored by its two best experts).
    `normalize` renormalizes the chosen weights to sum to 1; `scale` multiplies them.
    `shared_intermediate` is the width of an always-on shared expert (0: none).
    `sparse_layers` are the layers whose MLP is the MoE (the rest are dense, of the
    model's `intermediate`). `router_fp32` computes the router in float32 whatever the
    model's dtype (DeepSeek keeps its router weights in float32).
    """

    num_experts: int
    top_k: int
    intermediate: int
    scoring: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    num_groups: int = 1
    topk_group: int = 1
    shared_intermediate: int = 0
    sparse_layers: tuple[int, ...] = ()
    router_fp32: bool = False
    selection_bias: bool = False


class MLAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

    Each token keeps one latent of `kv_lora_rank` numbers (normalized) plus one shared
    rotated key of `rope_dim`; per-head keys (`nope_dim` + `rope_dim`) and values
    (`v_dim`) are expanded from it by `kv_b_proj`. Queries go through a low-rank
    `q_lora_rank` bottleneck when it is set. `interleaved_rope`: the checkpoint's
    rotary pairs are adjacent (x0, x1), not split halves.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    interleaved_rope: bool = False

    @property
    def latent_dim(self) -> int:
        """Numbers one token keeps per layer."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def qk_dim(self) -> int:
        """Width of one head's query and key."""
        return self.nope_dim + self.rope_dim


class ArchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shape and numerics of one decoder-only model.

    `model_id` is the model's identity for KV block hashing: two engines whose KV can be
    exchanged must report the same id, and different weights must not. It names the
    weights, not the compute dtype; callers that mix dtypes across engines must add it.

    `family` is the registry entry that read it (`families.py`). The fields after
    `eos_token_ids` are the differences of families from a Llama decoder; their
    defaults are Llama's.
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
    family: str = "llama"
    #: RMSNorm scales by `norm_offset + weight` (Gemma stores weights around 0: 1.0).
    norm_offset: float = 0.0
    #: Where the norms sit: `pre` (Llama: before attention and MLP), `sandwich`
    #: (Gemma: before and after each), `post` (OLMo 2: after each only).
    norm_layout: str = "pre"
    #: RMSNorm of queries and keys before RoPE: `head` (per head, Qwen3, Gemma 3) or
    #: `full` (over the whole projection, OLMo 2); empty for none.
    qk_norm: str = ""
    #: The MLP's gate activation: `silu` or `gelu_tanh`.
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    final_softcap: float | None = None
    #: Attention's score scale; None: `head_dim ** -0.5`.
    attn_scale: float | None = None
    attn_softcap: float | None = None
    #: Per layer, the sliding window in tokens (0: global); empty: every layer global.
    layer_windows: tuple[int, ...] = ()
    #: RoPE of the windowed layers when it differs from the global layers' (Gemma 3).
    rope_local: RopeParams | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None

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

    @property
    def scale(self) -> float:
        """The attention score scale."""
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: global attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def kv_parts(self) -> tuple[tuple[str, ...], int, int]:
        """What a token keeps per layer: the parts, heads per part, numbers per head."""
        if self.mla is not None:
            return ("latent",), 1, self.mla.latent_dim
        return ("k", "v"), self.num_kv_heads, self.head_dim

    def kv_spec(self, dtype: str, start: int = 0, end: int | None = None) -> KVCacheSpec:
        """The KV cache spec of this model with elements of `dtype` (a torch dtype's
        name), for all its layers or the layers `[start, end)` a stage holds."""
        parts, heads, dim = self.kv_parts
        end = self.num_layers if end is None else end
        windows = self.layer_windows[start:end]
        windows = windows if any(windows) else ()
        return KVCacheSpec(
            parts=parts, heads=heads, dim=dim, dtype=dtype, num_layers=end - start, windows=windows
        )


def int_list(value: Any) -> list[int]:
    """An int, a list of ints or None, as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_from_hf(cfg: Any, layer_type: str | None = None) -> RopeParams:
    """The RoPE parameters of `cfg` (of its layers of `layer_type`, where the config
    keys them by layer type, as Gemma 3's does)."""
    # transformers 5 normalizes to `rope_parameters` (theta inside); older configs keep
    # `rope_theta` beside a `rope_scaling` dict. Accept both.
    params: dict[str, Any] = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
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
    """Read a transformers `PretrainedConfig` into an `ArchConfig` through the family
    registry (`families.read_architecture`).

    Raises `UnsupportedModelError` for anything whose forward pass would differ from
    ours, naming the family and what is missing, because silently computing a
    different function is worse than refusing.
    """
    from yb_engine.families import read_architecture

    return read_architecture(cfg, model_id=model_id, extra_eos_token_ids=extra_eos_token_ids)


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
