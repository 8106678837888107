"""Model families: speed and KV size per family, MoE against dense, and MLA's latent.

    python benchmarks/families.py --json PATH [--threads N] [--repeats N]

Three parts, all on random checkpoints that transformers builds offline
(`yb_testkit.checkpoints`), loaded by the engine's loader as a user's directory is:

- Per family (every one the suite covers), a small model of the same size class
  (hidden 256, 4 layers; MoE: 8 experts of 256, 2 per token): `ModelRunner.prefill`
  tokens/s on a 512-token prompt, `ModelRunner.decode` tokens/s with 8 sequences of
  256 tokens, and the KV bytes one token keeps (its `KVCacheSpec`, float32).
- MoE against dense with the same active parameters, in the same run: Qwen3-MoE (16
  experts of 512, 2 per token) and Qwen3 with one MLP of 1,024, otherwise identical;
  decode tokens/s at batch 1 and 32 (contexts of 128 tokens). The experts are computed
  grouped: each expert that got tokens runs one matmul over all of them per step.
- MLA's latent at real sizes, from the configs alone (no weights): Kimi K2's and
  DeepSeek-V3's KV bytes per token in bfloat16 as the engine keeps it (one latent of
  `kv_lora_rank + qk_rope_head_dim` per layer) against per-head keys and values, and
  the tokens a GB of pool holds either way.

Every timing is the median of `--repeats` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from figures import emit

from yb_engine import DecodeSeq, ModelRunner, PagedKVCache
from yb_engine.architecture import arch_from_hf_config
from yb_engine.loader import load_model
from yb_testkit.checkpoints import FAMILY_CONFIGS, build_checkpoint

BLOCK = 64
GB = 10**9

#: The per-family size class: every family at the same width and depth.
SIZE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
FAMILY_SIZE: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8},
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 256},
    "deepseek_v3": {
        "num_key_value_heads": 8,
        "head_dim": 16,
        "n_routed_experts": 8,
        "moe_intermediate_size": 256,
        "kv_lora_rank": 128,
        "q_lora_rank": 192,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    },
}

#: Kimi K2 (DeepSeek-V3's architecture, 64 heads) and DeepSeek-V3 (128 heads): the
#: attention fields of their published configs.
REAL_MLA: dict[str, dict[str, Any]] = {
    "kimi_k2": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 2048,
        "intermediate_size": 18432,
        "vocab_size": 163840,
    },
    "deepseek_v3": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "moe_intermediate_size": 2048,
        "intermediate_size": 18432,
        "vocab_size": 129280,
    },
}


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(3, vocab, (n,), generator=gen).tolist()
    return ids


def decode_rate(runner: ModelRunner, batch: int, context: int, repeats: int) -> float:
    """Decode tokens/s with `batch` sequences of `context` tokens (their KV in pages)."""
    cache = runner.cache
    per_seq = cache.pages_for(context + 1)
    vocab = runner.arch.vocab
    seqs = []
    for i in range(batch):
        pages = list(range(i * per_seq, (i + 1) * per_seq))
        ids = tokens(context, vocab, seed=i)
        if i == 0:
            runner.prefill(ids, pages)
        else:  # the same context for every sequence: copy the first one's pages
            cache.kv[:, pages] = cache.kv[:, list(range(per_seq))]
        seqs.append(DecodeSeq(pages, context, ids[-1]))
    seconds = median_time(lambda: runner.decode(seqs), repeats)
    return batch / seconds


def family_figures(root: Path, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family in sorted(FAMILY_CONFIGS):
        overrides = {**SIZE, **FAMILY_SIZE.get(family, {})}
        path = build_checkpoint(family, root / family, **overrides)
        model = load_model(path)
        cache = PagedKVCache(model.config, 8 * 5 + 16, BLOCK)
        runner = ModelRunner(model, cache)
        prompt = tokens(512, model.config.vocab, seed=1)
        pages = list(range(cache.pages_for(512)))
        out[f"{family}_prefill_tokens_per_s"] = 512 / median_time(
            partial(runner.prefill, prompt, pages), repeats
        )
        out[f"{family}_decode_tokens_per_s_batch_8"] = decode_rate(runner, 8, 256, repeats)
        out[f"{family}_kv_bytes_per_token"] = cache.spec.bytes_per_token
        print(f"  {family}: done", flush=True)
    return out


def moe_figures(root: Path, repeats: int) -> dict[str, Any]:
    shape = {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    }
    moe = build_checkpoint(
        "qwen3_moe",
        root / "moe",
        **shape,
        intermediate_size=1024,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        mlp_only_layers=[],
    )
    dense = build_checkpoint("qwen3", root / "dense", **shape, intermediate_size=1024)
    runners = {}
    for name, path in (("moe", moe), ("dense", dense)):
        model = load_model(path)
        runners[name] = ModelRunner(model, PagedKVCache(model.config, 32 * 3 + 8, BLOCK))
    out: dict[str, Any] = {}
    for batch in (1, 32):
        for name in ("moe", "dense"):
            out[f"{name}_decode_tokens_per_s_batch_{batch}"] = decode_rate(
                runners[name], batch, 128, repeats
            )
        out[f"moe_vs_dense_batch_{batch}"] = (
            out[f"moe_decode_tokens_per_s_batch_{batch}"]
            / out[f"dense_decode_tokens_per_s_batch_{batch}"]
        )
    params = {
        name: sum(t.numel() for layer in r.weights.layers for t in layer.tensors())
        for name, r in runners.items()
    }
    out["moe_layer_parameters"] = params["moe"]
    out["dense_layer_parameters"] = params["dense"]
    return out


def mla_figures() -> dict[str, Any]:
    from transformers import AutoConfig

    out: dict[str, Any] = {}
    for name, fields in REAL_MLA.items():
        arch = arch_from_hf_config(AutoConfig.for_model("deepseek_v3", **fields), model_id=name)
        assert arch.mla is not None
        latent = arch.kv_spec("bfloat16").bytes_per_token
        # Per-head K/V: every head's key (nope + rope) and value, in every layer.
        per_head = arch.num_layers * arch.num_heads * (arch.mla.qk_dim + arch.mla.v_dim) * 2
        out[f"{name}_latent_kv_bytes_per_token"] = latent
        out[f"{name}_per_head_kv_bytes_per_token"] = per_head
        out[f"{name}_per_head_over_latent"] = per_head / latent
        out[f"{name}_pool_tokens_per_gb_latent"] = GB // latent
        out[f"{name}_pool_tokens_per_gb_per_head"] = GB // per_head
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    figures: dict[str, Any] = {"threads": args.threads, "dtype": "float32"}
    with torch.inference_mode(), tempfile.TemporaryDirectory(prefix="yb-families-") as tmp:
        root = Path(tmp)
        print("families:", flush=True)
        figures.update(family_figures(root, args.repeats))
        print("MoE against dense:", flush=True)
        figures.update(moe_figures(root, args.repeats))
    figures.update(mla_figures())
    emit(figures, args.json)


if __name__ == "__main__":
    main()
