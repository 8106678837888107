"""Tiny random checkpoints of real model families, built offline with transformers.

Each is what a user would hand `yb up --model PATH`: a directory written by
`save_pretrained` (config, safetensors weights in the checkpoint's own names, generation
config) plus a tokenizer with a chat template. transformers builds the model from a
config (`AutoConfig.for_model`, `from_config`), nothing is downloaded, and the weights
are re-drawn from a seeded generator with a trained model's spread replaced by a wider
one, so logits are spread out and greedy choices are not near-ties that a change of
summation order could flip.

`FAMILY_CONFIGS` names each family the suite covers with the config fields that make it
small; `build_checkpoint(family, directory)` writes one (and returns early when the
directory already holds it: a built checkpoint is cached by its directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Shared by every family: a model small enough to run in milliseconds.
_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

#: Family name -> (transformers model_type, config fields beyond `_SMALL`).
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # Qwen's own windows: from `max_window_layers` up, with `use_sliding_window`.
    "qwen2_windowed": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2},
    ),
    "mistral": ("mistral", {"sliding_window": 24}),
    "gemma2": (
        "gemma2",
        {
            "query_pre_attn_scalar": 24,
            "sliding_window": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_text": (
        "gemma3_text",
        {
            "query_pre_attn_scalar": 24,
            "sliding_window": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
            # Gemma 3's pattern is five windowed layers to one global; two to one here.
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
            "tie_word_embeddings": True,
        },
    ),
    "olmo2": ("olmo2", {}),
    "phi3": ("phi3", {"sliding_window": 24}),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.125,
            "logits_scaling": 4.0,
        },
    ),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "num_key_value_heads": 4,
            # DeepSeek's config names the rotary width `head_dim` too.
            "head_dim": 8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 48,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "routed_scaling_factor": 2.5,
        },
    ),
}

#: Families the registry must refuse, with a config that shows why.
REFUSED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "falcon_h1 (hybrid recurrent)": ("falcon_h1", {}),
    "t5 (encoder)": ("t5", {}),
    "llava (vision tower)": ("llava", {}),
}


def family_config(family: str, *, vocab_size: int, **overrides: Any) -> Any:
    """The transformers config of `family`'s tiny checkpoint."""
    from transformers import AutoConfig

    model_type, extra = FAMILY_CONFIGS[family]
    fields = {**_SMALL, **extra, "vocab_size": vocab_size, **overrides}
    return AutoConfig.for_model(model_type, **fields)


def _redraw(model: Any, seed: int, family: str) -> None:
    """Re-draw every parameter and buffer that the checkpoint keeps, seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    offset_norms = family.startswith("gemma")
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                # Norm weights around 1 (Gemma stores them around 0: it adds the 1).
                value = 0.1 * noise + (0.0 if offset_norms else 1.0)
            elif "embed_tokens" in name:
                value = noise
            elif name.endswith("bias") or "down_proj" in name or name.endswith("w2.weight"):
                value = 0.1 * noise
            else:
                value = 0.25 * noise
            p.copy_(value.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build_checkpoint(family: str, directory: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write `family`'s tiny checkpoint into `directory` (made if needed); returns it.

    The tokenizer is `yb_text.tiny_tokenizer` (byte-level BPE, ChatML template), with
    `<|im_end|>` as the end of a turn. A directory that already has `config.json` is
    taken as built.
    """
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from yb_text.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = family_config(
        family,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_of_turn,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    _redraw(model, seed, family)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=end_of_turn, bos_token_id=tokenizer.bos_token_id).save_pretrained(
        tmp
    )
    for entry in tmp.iterdir():
        entry.rename(directory / entry.name)
    tmp.rmdir()
    return directory


def refused_config_dir(name: str, directory: Path) -> Path:
    """A directory whose `config.json` is a family the engine must refuse (no weights:
    the refusal comes before any weight is read)."""
    from transformers import AutoConfig

    model_type, extra = REFUSED_CONFIGS[name]
    config = AutoConfig.for_model(model_type, **extra)
    directory.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    (directory / "config.json").write_text(json.dumps(data, indent=2, default=str))
    return directory
