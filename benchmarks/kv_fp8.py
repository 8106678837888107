"""8-bit KV against full precision on the default model: what it costs and what it saves.

    python benchmarks/kv_fp8.py --json PATH [--prompts 200] [--tokens 64] [--no-cluster]

Both sides run in the same run, on the default model (SmolLM2-135M-Instruct, float32
weights on the CPU): `model.kv_dtype` `auto` (float32 KV) against `fp8_e4m3` (8-bit rows
with a float32 scale each, `yb_engine.kv_quant`).

Accuracy, in this process, greedy, on `--prompts` fixed chat prompts (subjects x asks):

- each prompt's `--tokens` tokens are generated with a float32 cache: the reference;
- the same sequences are fed through an 8-bit cache (teacher forcing, so one early
  difference does not decide every later position): `greedy_match` is the share of
  positions where its argmax is the reference token, and `dlogprob_mean` /
  `dlogprob_max` the mean and largest |difference| of the reference token's
  log-probability;
- the 8-bit cache also generates on its own: `free_run_identical` is the share of
  prompts whose whole output is the reference's;
- the perplexity of a fixed public-domain text, computed through the pages in
  64-token chunks (each chunk reads the KV of the ones before from the cache):
  `ppl_ratio` = 8-bit over float32.

Bytes: `blocks_per_gib_*` = 2^30 over the bytes of one pool block (one page of every
layer: what a kvstore slot holds, in DRAM and on SSD), from the pages of a real cache.

Transfer: `benchmarks/transfer.py` (UCX between two processes, pages of each dtype's
size, consecutive pages as an engine's cache holds them) with the KV of a 2,048-token
prefix: `transfer_2048_s_*`.

Reuse TTFT: `benchmarks/e2e_reuse.py` with a 2,048-token prefix (a `yb up` cluster, the
prefix fetched from the other host's kvstore), once per KV dtype: `ttft_reuse_s_*`
and, for scale, `ttft_recompute_s_*`. `--no-cluster` skips it.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from e2e_reuse import run_with

from yb_core.model_files import default_model_cache_dir
from yb_engine import DecodeSeq, LoadedModel, ModelRunner, PagedKVCache
from yb_engine.kv_quant import FP8
from yb_engine.loader import ensure_default_model, load_model

HERE = Path(__file__).resolve().parent
BLOCK = 64
PREFIX_TOKENS = 2048
BATCH = 50

SUBJECTS = (
    "hash tables",
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "compound interest",
    "the immune system",
    "plate tectonics",
    "TCP congestion control",
    "the water cycle",
    "sorting algorithms",
    "volcanoes",
    "the Roman Empire",
    "vaccines",
    "climate change",
    "the stock market",
    "honey bees",
    "electric cars",
    "the printing press",
    "machine learning",
    "the Moon landing",
)
ASKS = (
    "Explain {} to a ten-year-old.",
    "Write a short paragraph about {}.",
    "What are three surprising facts about {}?",
    "Give me a one-sentence summary of {}.",
    "Why does {} matter today?",
    "Write a haiku about {}.",
    "What is a common misconception about {}?",
    "List the key ideas behind {}.",
    "How would you teach {} in five minutes?",
    "Ask me a quiz question about {} and answer it.",
)

# The opening of the United States Declaration of Independence (1776; public domain).
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to "
    "dissolve the political bands which have connected them with another, and to assume "
    "among the powers of the earth, the separate and equal station to which the Laws of "
    "Nature and of Nature's God entitle them, a decent respect to the opinions of "
    "mankind requires that they should declare the causes which impel them to the "
    "separation. We hold these truths to be self-evident, that all men are created "
    "equal, that they are endowed by their Creator with certain unalienable Rights, that "
    "among these are Life, Liberty and the pursuit of Happiness. That to secure these "
    "rights, Governments are instituted among Men, deriving their just powers from the "
    "consent of the governed, That whenever any Form of Government becomes destructive "
    "of these ends, it is the Right of the People to alter or to abolish it, and to "
    "institute new Government, laying its foundation on such principles and organizing "
    "its powers in such form, as to them shall seem most likely to effect their Safety "
    "and Happiness. Prudence, indeed, will dictate that Governments long established "
    "should not be changed for light and transient causes; and accordingly all "
    "experience hath shewn, that mankind are more disposed to suffer, while evils are "
    "sufferable, than to right themselves by abolishing the forms to which they are "
    "accustomed. But when a long train of abuses and usurpations, pursuing invariably "
    "the same Object evinces a design to reduce them under absolute Despotism, it is "
    "their right, it is their duty, to throw off such Government, and to provide new "
    "Guards for their future security."
)


def prompts(model: LoadedModel, count: int) -> list[list[int]]:
    """The first `count` of the subjects x asks chat prompts, as token ids."""
    tok = model.tokenizer
    out = []
    for ask in ASKS:
        for subject in SUBJECTS:
            messages = [{"role": "user", "content": ask.format(subject)}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out.append(tok.encode(text, add_special_tokens=False))
    if count > len(out):
        raise SystemExit(f"--prompts {count}: there are {len(out)}")
    return out[:count]


class Generated:
    """What a cache made of a batch of prompts: per prompt, the token taken at each
    position, its log-probability, and the cache's own greedy choice there."""

    def __init__(self, size: int) -> None:
        self.taken: list[list[int]] = [[] for _ in range(size)]
        self.logprobs: list[list[float]] = [[] for _ in range(size)]
        self.argmax: list[list[int]] = [[] for _ in range(size)]


def generate(
    model: LoadedModel,
    batch: Sequence[list[int]],
    tokens: int,
    kv_dtype: torch.dtype,
    forced: Sequence[list[int]] | None = None,
) -> Generated:
    """`tokens` positions after each prompt, all prompts decoded as one batch: taking
    the cache's greedy choices, or `forced`'s tokens (teacher forcing)."""
    per_seq = -(-(max(map(len, batch)) + tokens) // BLOCK)
    cache = PagedKVCache(model.config, per_seq * len(batch), BLOCK, dtype=kv_dtype)
    runner = ModelRunner(model, cache)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(batch))]
    out = Generated(len(batch))

    def take(i: int, row: torch.Tensor) -> None:
        lp = torch.log_softmax(row.float(), dim=-1)
        best = int(row.argmax())
        t = forced[i][len(out.taken[i])] if forced is not None else best
        out.taken[i].append(t)
        out.logprobs[i].append(float(lp[t]))
        out.argmax[i].append(best)

    for i, ids in enumerate(batch):
        take(i, runner.prefill(ids, tables[i]))
    for step in range(1, tokens):
        seqs = [
            DecodeSeq(tables[i], len(ids) + step - 1, out.taken[i][-1])
            for i, ids in enumerate(batch)
        ]
        for i, row in enumerate(runner.decode(seqs)):
            take(i, row)
    return out


def perplexity(model: LoadedModel, ids: list[int], kv_dtype: torch.dtype) -> float:
    cache = PagedKVCache(model.config, -(-len(ids) // BLOCK), BLOCK, dtype=kv_dtype)
    runner = ModelRunner(model, cache)
    logits = runner.prefill(ids, list(range(cache.num_pages)), chunk_size=BLOCK, all_logits=True)
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -lp.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return math.exp(float(nll))


def accuracy(model: LoadedModel, count: int, tokens: int) -> dict[str, float]:
    all_prompts = prompts(model, count)
    match = total = identical = 0
    deltas: list[float] = []
    started = time.monotonic()
    for start in range(0, len(all_prompts), BATCH):
        batch = all_prompts[start : start + BATCH]
        ref = generate(model, batch, tokens, torch.float32)
        forced = generate(model, batch, tokens, FP8, forced=ref.taken)
        own = generate(model, batch, tokens, FP8)
        for i in range(len(batch)):
            match += sum(a == r for a, r in zip(forced.argmax[i], ref.taken[i], strict=True))
            total += tokens
            deltas += [abs(a - b) for a, b in zip(forced.logprobs[i], ref.logprobs[i], strict=True)]
            identical += own.taken[i] == ref.taken[i]
        done = start + len(batch)
        print(
            f"  {done}/{len(all_prompts)} prompts ({time.monotonic() - started:.0f}s)", flush=True
        )
    text = model.tokenizer.encode(TEXT, add_special_tokens=False)
    ppl_full = perplexity(model, text, torch.float32)
    ppl_fp8 = perplexity(model, text, FP8)
    return {
        "prompts": float(len(all_prompts)),
        "tokens_per_prompt": float(tokens),
        "greedy_match": round(match / total, 4),
        "dlogprob_mean": round(sum(deltas) / len(deltas), 5),
        "dlogprob_max": round(max(deltas), 4),
        "free_run_identical": round(identical / len(all_prompts), 4),
        "ppl_text_tokens": float(len(text)),
        "ppl_full": round(ppl_full, 4),
        "ppl_fp8": round(ppl_fp8, 4),
        "ppl_ratio": round(ppl_fp8 / ppl_full, 4),
    }


def block_bytes(model: LoadedModel, kv_dtype: torch.dtype) -> tuple[int, int]:
    """One pool block's bytes and one page's (one layer), from a real cache's pages."""
    cache = PagedKVCache(model.config, 1, BLOCK, dtype=kv_dtype)
    page = cache.page_view(0, 0)
    page_bytes = page.numel() * page.element_size()
    assert page_bytes * cache.num_layers == cache.spec.block_nbytes(BLOCK)
    return page_bytes * cache.num_layers, page_bytes


def transfer_seconds(page_bytes: int, layers: int) -> float:
    """`benchmarks/transfer.py`'s median time for the KV of a 2,048-token prefix."""
    pages = PREFIX_TOKENS // BLOCK * layers
    mib = pages * page_bytes / (1 << 20)
    size = f"{mib:.0f}" if mib.is_integer() else repr(mib)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        subprocess.run(
            [
                sys.executable,
                str(HERE / "transfer.py"),
                *("--sizes", size, "--page-bytes", str(page_bytes)),
                *("--layouts", "contiguous", "--repeat", "5", "--no-perftest"),
                *("--json", str(out)),
            ],
            check=True,
        )
        figures = json.loads(out.read_text())
    gbps = float(figures[f"ucx_gbps_{size}mb_contiguous"])
    return pages * page_bytes / (gbps * 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-cluster", action="store_true", help="skip the reuse TTFT runs")
    args = parser.parse_args()

    model = load_model(ensure_default_model(default_model_cache_dir()))
    results: dict[str, Any] = {}
    print(f"accuracy: {args.prompts} prompts x {args.tokens} tokens", flush=True)
    results.update(accuracy(model, args.prompts, args.tokens))
    for name, dtype in (("full", torch.float32), ("fp8", FP8)):
        block, page = block_bytes(model, dtype)
        results[f"block_bytes_{name}"] = float(block)
        results[f"blocks_per_gib_{name}"] = float((1 << 30) // block)
        print(f"transfer: 2,048 tokens in {page}-byte pages ({name})", flush=True)
        results[f"transfer_2048_s_{name}"] = round(
            transfer_seconds(page, model.config.num_layers), 4
        )
    results["blocks_per_gib_ratio"] = round(
        results["blocks_per_gib_fp8"] / results["blocks_per_gib_full"], 3
    )
    results["transfer_2048_speedup"] = round(
        results["transfer_2048_s_full"] / results["transfer_2048_s_fp8"], 2
    )
    if not args.no_cluster:
        for name, setting in (("full", "auto"), ("fp8", "fp8_e4m3")):
            print(f"reuse TTFT through a cluster, model.kv_dtype={setting}", flush=True)
            figures = run_with(
                {"YB_MODEL__KV_DTYPE": setting},
                prefix_tokens=PREFIX_TOKENS,
                question_tokens=40,
            )
            results[f"ttft_reuse_s_{name}"] = figures["ttft_reuse_s"]
            results[f"ttft_recompute_s_{name}"] = figures["ttft_recompute_s"]
            results[f"reused_tokens_{name}"] = figures["reused_tokens"]

    print()
    print(f"{'':<34} {'float32 KV':>12} {'8-bit KV':>12}")
    rows = [
        ("block bytes", "block_bytes"),
        ("blocks per GiB", "blocks_per_gib"),
        ("transfer of 2,048 tokens (s)", "transfer_2048_s"),
        ("TTFT, 2,048-token prefix reused (s)", "ttft_reuse_s"),
        ("TTFT, computed (s)", "ttft_recompute_s"),
    ]
    for label, key in rows:
        if f"{key}_full" in results:
            print(f"{label:<34} {results[f'{key}_full']:>12g} {results[f'{key}_fp8']:>12g}")
    print(
        f"\naccuracy over {int(results['prompts'])} prompts x {args.tokens} tokens: "
        f"greedy match {results['greedy_match']:.2%}, |dlogprob| mean "
        f"{results['dlogprob_mean']:.4f} max {results['dlogprob_max']:.3f}, whole output "
        f"identical {results['free_run_identical']:.1%}; perplexity {results['ppl_full']:.3f}"
        f" -> {results['ppl_fp8']:.3f} (x{results['ppl_ratio']:.4f})"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
