"""The model families the engine computes, each as its difference from a Llama decoder.

One registry, keyed by the checkpoint's `architectures` (`Qwen3ForCausalLM`), with the
config's `model_type` as the fallback for configs that do not name one. An entry reads
the family's config into the `ArchConfig` fields where it differs from Llama's and says
where its weights lie when the names differ (`ExpertNames`). The forward pass
(`layers.py`) reads only `ArchConfig`: a family is data, not a fork of the code.

A family the engine cannot compute exactly is refused with what is missing: a known
encoder-decoder, a vision tower, recurrent or linear-attention layers, or simply a name
that is not in the registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from yb_engine.architecture import (
    ArchConfig,
    MLAConfig,
    MoEConfig,
    UnsupportedModelError,
    int_list,
    rope_from_hf,
)


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """Where a MoE layer's tensors lie, relative to `model.layers.N.`: the router's
    weight (and selection bias), each expert's gate, up and down projections (with `{e}`
    for the expert), and the shared expert's prefix."""

    router: str
    gate: str
    up: str
    down: str
    selection_bias: str = ""
    shared: str = ""


QWEN_EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
)
MIXTRAL_EXPERTS = ExpertNames(
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{e}.w1.weight",
    up="block_sparse_moe.experts.{e}.w3.weight",
    down="block_sparse_moe.experts.{e}.w2.weight",
)
DEEPSEEK_EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
    selection_bias="mlp.gate.e_score_correction_bias",
    shared="mlp.shared_experts.",
)

Fields = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Family:
    """One registry entry: the family's name, the `architectures` and `model_type`s
    that select it, how its config differs from Llama's (`read`: the config and the
    Llama fields read so far, to the fields that change), and where its weights lie
    when the names differ (its expert names, fused projections)."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read: Callable[[Any, Fields], Fields]
    experts: ExpertNames | None = None
    #: The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`.
    fused_checkpoint: bool = False


# -- the base decoder -----------------------------------------------------------------


def _llama_fields(cfg: Any) -> Fields:
    """The fields every family starts from, read as a Llama config spells them."""
    act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", "silu")
    num_heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // num_heads)
    num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    if num_heads % num_kv:
        raise UnsupportedModelError(f"{num_heads} heads do not group over {num_kv} KV heads")
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "num_layers": int(cfg.num_hidden_layers),
        "hidden": hidden,
        "num_heads": num_heads,
        "num_kv_heads": num_kv,
        "head_dim": head_dim,
        "intermediate": int(cfg.intermediate_size),
        "vocab": int(cfg.vocab_size),
        "rms_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope": rope_from_hf(cfg),
        "max_position": int(getattr(cfg, "max_position_embeddings", 0) or 0),
        "tie_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "hidden_act": _activation(str(act)),
    }


def _activation(name: str) -> str:
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise UnsupportedModelError(f"MLP activation {name!r} is not supported (silu, gelu_tanh)")


def _uniform_window(cfg: Any, fields: Fields) -> Fields:
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return {}
    return {"layer_windows": (int(window),) * fields["num_layers"]}


def _layer_type_windows(cfg: Any, fields: Fields) -> Fields:
    """Per-layer windows from `layer_types` (`sliding_attention` / `full_attention`)."""
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        return {}
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"layer types {unknown} are not attention layers we compute")
    window = int(getattr(cfg, "sliding_window", 0) or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return {"layer_windows": windows} if any(windows) else {}


# -- families, as differences -----------------------------------------------------------


def _llama(cfg: Any, fields: Fields) -> Fields:
    return {}


def _mistral(cfg: Any, fields: Fields) -> Fields:
    return _uniform_window(cfg, fields)


def _qwen2(cfg: Any, fields: Fields) -> Fields:
    # Qwen2 always has q/k/v biases and no o_proj bias. Its `sliding_window` applies
    # only with `use_sliding_window`, from `max_window_layers` up: the config says which
    # layers in `layer_types`.
    return {"qkv_bias": True, "o_bias": False, **_layer_type_windows(cfg, fields)}


def _qwen3(cfg: Any, fields: Fields) -> Fields:
    return {"qk_norm": "head", **_layer_type_windows(cfg, fields)}


def _gemma3(cfg: Any, fields: Fields) -> Fields:
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError("gemma3: bidirectional attention is not a decoder we compute")
    windows = _layer_type_windows(cfg, fields)
    # Gemma 3 keys its RoPE by layer type: the global layers' (long theta, maybe
    # scaled) and the windowed layers' (short theta).
    by_type = isinstance((getattr(cfg, "rope_parameters", None) or {}).get("full_attention"), dict)
    rope = rope_from_hf(cfg, "full_attention") if by_type else fields["rope"]
    rope_local = rope_from_hf(cfg, "sliding_attention") if by_type else None
    final_cap = getattr(cfg, "final_logit_softcapping", None)
    # Gemma 2 soft-caps attention scores; Gemma 3 replaced that with its q/k norms, and
    # transformers' Gemma 3 never applies the `attn_logit_softcapping` its config
    # still carries. The reference is what the checkpoint was trained with.
    attn_cap = getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None
    return {
        "norm_offset": 1.0,
        "norm_layout": "sandwich",
        "qk_norm": "head" if cfg.model_type != "gemma2" else "",
        "embed_scale": float(fields["hidden"]) ** 0.5,
        "attn_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
        "attn_softcap": None if attn_cap is None else float(attn_cap),
        "final_softcap": None if final_cap is None else float(final_cap),
        "rope": rope,
        "rope_local": rope_local,
        "qkv_bias": bool(getattr(cfg, "attention_bias", False)),
        "o_bias": bool(getattr(cfg, "attention_bias", False)),
        **windows,
    }


def _phi3(cfg: Any, fields: Fields) -> Fields:
    return _uniform_window(cfg, fields)


def _olmo2(cfg: Any, fields: Fields) -> Fields:
    return {"norm_layout": "post", "qk_norm": "full"}


def _granite(cfg: Any, fields: Fields) -> Fields:
    return {
        "embed_scale": float(cfg.embedding_multiplier),
        "residual_scale": float(cfg.residual_multiplier),
        "attn_scale": float(cfg.attention_multiplier),
        "logit_scale": 1.0 / float(cfg.logits_scaling),
    }


def _mixtral(cfg: Any, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    return {
        "moe": MoEConfig(
            num_experts=int(cfg.num_local_experts),
            top_k=int(cfg.num_experts_per_tok),
            intermediate=fields["intermediate"],
            normalize=True,
            sparse_layers=tuple(range(layers)),
        ),
        **_uniform_window(cfg, fields),
    }


def _qwen3_moe(cfg: Any, fields: Fields) -> Fields:
    layers = fields["num_layers"]
    dense = set(int_list(getattr(cfg, "mlp_only_layers", None)))
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    num_experts = int(cfg.num_experts)
    sparse = tuple(
        i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    return {
        "qk_norm": "head",
        **_layer_type_windows(cfg, fields),
        "moe": MoEConfig(
            num_experts=num_experts,
            top_k=int(cfg.num_experts_per_tok),
            intermediate=int(cfg.moe_intermediate_size),
            normalize=bool(cfg.norm_topk_prob),
            sparse_layers=sparse,
        ),
    }


def _deepseek_v3(cfg: Any, fields: Fields) -> Fields:
    rope = fields["rope"]
    nope, rope_dim = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
    scale = float(nope + rope_dim) ** -0.5
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.type != "default" and params.get("mscale_all_dim"):
        # transformers' yarn_apply_mscale: the softmax scale grows with the context
        # extension, squared (queries and keys each carry one factor).
        factor, all_dim = float(params["factor"]), float(params["mscale_all_dim"])
        mscale = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    layers = fields["num_layers"]
    first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
    moe_inter = int(cfg.moe_intermediate_size)
    topk_method = getattr(cfg, "topk_method", "noaux_tc")
    if topk_method not in (None, "noaux_tc"):
        raise UnsupportedModelError(f"deepseek_v3: router topk_method {topk_method!r}")
    return {
        # The latent is rotated at `rope_dim`, and every head shares it.
        "head_dim": nope + rope_dim,
        "num_kv_heads": fields["num_heads"],
        "attn_scale": scale,
        "mla": MLAConfig(
            q_lora_rank=None if cfg.q_lora_rank is None else int(cfg.q_lora_rank),
            kv_lora_rank=int(cfg.kv_lora_rank),
            nope_dim=nope,
            rope_dim=rope_dim,
            v_dim=int(cfg.v_head_dim),
            interleaved_rope=bool(getattr(cfg, "rope_interleave", True)),
        ),
        "moe": MoEConfig(
            num_experts=int(cfg.n_routed_experts),
            top_k=int(cfg.num_experts_per_tok),
            intermediate=moe_inter,
            scoring="sigmoid",
            normalize=bool(cfg.norm_topk_prob),
            scale=float(cfg.routed_scaling_factor),
            num_groups=int(cfg.n_group or 1),
            topk_group=int(cfg.topk_group or 1),
            shared_intermediate=moe_inter * shared,
            sparse_layers=tuple(range(first_dense, layers)),
            router_fp32=True,
            selection_bias=True,
        ),
    }


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), _llama),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), _mistral),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _qwen2),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _qwen3),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), _gemma3),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), _gemma3),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), _phi3, fused_checkpoint=True),
    Family("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), _olmo2),
    Family("granite", ("GraniteForCausalLM",), ("granite",), _granite),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), _mixtral, MIXTRAL_EXPERTS),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), _qwen3_moe, QWEN_EXPERTS),
    Family(
        "deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), _deepseek_v3, DEEPSEEK_EXPERTS
    ),
)
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_NAME = {f.name: f for f in FAMILIES}


def family_named(name: str) -> Family:
    """The registry entry called `name` (an `ArchConfig.family`)."""
    return _BY_NAME[name]


def supported_architectures() -> list[str]:
    """Every `architectures` name the registry computes."""
    return sorted(_BY_ARCHITECTURE)


def _missing(cfg: Any) -> str | None:
    """What a config has that no decoder here computes, in words; None if nothing."""
    model_type = str(getattr(cfg, "model_type", ""))
    if getattr(cfg, "is_encoder_decoder", False):
        return "an encoder (encoder-decoder models are not decoders we serve)"
    for key in ("vision_config", "audio_config", "vision_tower", "mm_vision_tower"):
        if getattr(cfg, key, None) is not None:
            return f"a {key.split('_')[0]} tower ({key}); serve its text-only checkpoint"
    types = set(getattr(cfg, "layer_types", None) or [])
    recurrent = types - {"sliding_attention", "full_attention", "attention", "chunked_attention"}
    if recurrent or any(
        getattr(cfg, key, None)
        for key in ("mamba_d_state", "mamba_n_heads", "linear_num_value_heads")
    ):
        return f"hybrid recurrent or linear-attention layers ({sorted(recurrent) or 'mamba'})"
    if "chunked_attention" in types:
        return "chunked attention layers"
    if model_type.endswith("_vl") or "vision" in model_type:
        return "a vision tower"
    return None


def family_of(cfg: Any) -> Family:
    """The registry entry for a transformers config, or `UnsupportedModelError`."""
    model_type = str(getattr(cfg, "model_type", ""))
    names = [str(a) for a in (getattr(cfg, "architectures", None) or [])]
    missing = _missing(cfg)
    label = names[0] if names else model_type or "unknown"
    if missing is not None:
        raise UnsupportedModelError(f"{label} ({model_type}) has {missing}")
    for name in names:
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    if not names and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise UnsupportedModelError(
        f"{label} ({model_type}) is not a family this engine computes "
        f"(supported: {', '.join(supported_architectures())})"
    )


def read_architecture(
    cfg: Any, *, model_id: str, extra_eos_token_ids: list[int] | None = None
) -> ArchConfig:
    """`cfg` read through its family's entry (see `arch_from_hf_config`)."""
    family = family_of(cfg)
    fields = _llama_fields(cfg)
    fields.update(family.read(cfg, fields))
    eos = int_list(getattr(cfg, "eos_token_id", None))
    for extra in extra_eos_token_ids or []:
        if extra not in eos:
            eos.append(extra)
    bos = getattr(cfg, "bos_token_id", None)
    return ArchConfig(
        model_id=model_id,
        model_type=str(getattr(cfg, "model_type", family.name)),
        family=family.name,
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
        **fields,
    )
