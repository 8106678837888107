"""Piggybacked prefill benchmark: short prompts computed inside a decode engine's batch,
against a separate prefill engine and a page hand-off, at light load. Engine level.

    python benchmarks/piggyback.py --json PATH [--model default|tiny|DIR] [--threads N]
        [--device auto|cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16]
        [--block-size N] [--streams 4] [--context 256] [--prompts 32,64,96,128]
        [--rounds 3] [--warmup-rounds 1] [--gap-steps 3] [--tbt-slo 2.0]
        [--tight-tbt-slo auto|off|SECONDS]

One process holds two engines over the same weights: a decode engine (runner, pages,
`DecodeBatcher` with `tbt_slo_s`) running `--streams` greedy streams of `--context`
tokens, and a prefill engine (its own runner and pages). Each short prompt arrives at a
decode step boundary after `--gap-steps` plain steps, once per path, the two paths
interleaved prompt by prompt:

- separate: the prefill engine computes the prompt and samples the first token; its KV
  pages are copied into the decode engine's pages (the hand-off, as an in-process copy:
  no UCX transfer, no messages, no queue, each of which would only lengthen it), the
  batcher takes the request (`add`), and the decode step that follows reports the first
  token. TTFT = prefill + copy + `add` + that step.
- piggyback: `DecodeBatcher.add_prompt`; the steps that follow compute the prompt in
  chunks beside the streams' decode tokens, the chunk bounded by `--tbt-slo` through the
  batcher's learnt step-time model. TTFT = those steps, up to the one reporting it.

The requests ask for one token, so the decode batch stays at `--streams`. `--warmup-rounds`
rounds are run and dropped first (the step-time model learns from them). The running
streams' time between tokens is each step's duration: `tbt_p99_without_s` over the steps
of the separate rounds (plain decode steps: the prefill engine has its own cores),
`tbt_p99_with_s` over the piggyback rounds' steps. `--tbt-slo` defaults to the gateway's
default `tbt_slo_s`. Then the piggyback rounds run once more under `--tight-tbt-slo`
(by default twice this run's median plain decode step, so it holds on a loaded machine
too; the step-time model kept): the longer prompts no longer fit one step, so they are
cut into chunks that keep each step within it.

Figures (one flat JSON object): `ttft_separate_s`, `ttft_piggyback_s` (medians over every
prompt), `piggyback_ttft_speedup` (their ratio), `ttft_separate_{N}_s`,
`ttft_piggyback_{N}_s`, `piggyback_ttft_speedup_{N}` per prompt length,
`tbt_p99_without_s`, `tbt_p99_with_s`, `tbt_slo_s`, `decode_step_median_s` (a plain
step of the streams), `piggyback_chunks_mean` (steps a prompt took), the step-time
model's `step_fixed_s` and `step_per_token_s`; under the tight SLO `tbt_slo_tight_s`,
`ttft_piggyback_tight_s`, `tbt_p99_with_tight_s` (every step of that phase),
`tbt_p99_plain_tight_s` (its plain steps only: what the machine did meanwhile),
`tight_steps_within_slo` (the share of steps carrying a chunk that kept within it) and
`piggyback_chunks_mean_tight`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from figures import emit

from yb_core.config import ModelConfig
from yb_core.model_files import DEFAULT, TINY_RANDOM, default_model_cache_dir
from yb_core.protocol import SamplingParams
from yb_engine import (
    DecodeBatcher,
    LoadedModel,
    ModelRunner,
    PageAllocator,
    PagedKVCache,
    TokenOutput,
    sample_first_tokens,
)
from yb_engine.models import load_engine_model

DEVICE = torch.device("cpu")  # set once the model is loaded
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
STREAM = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def random_prompt(model: LoadedModel, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, model.config.vocab, (n,), generator=gen).tolist()
    return ids


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Bench:
    """The two engines, the running streams, and the step times seen."""

    def __init__(self, model: LoadedModel, args: argparse.Namespace) -> None:
        self.model = model
        block = args.block_size
        longest = max(args.prompts)
        stream_pages = -(-(args.context + 4096) // block)
        num_pages = args.streams * stream_pages + 4 * (-(-longest // block)) + 8
        self.cache = PagedKVCache(model.config, num_pages, block, model.dtype, DEVICE)
        self.alloc = PageAllocator(num_pages)
        self.runner = ModelRunner(model, self.cache)
        self.batcher = DecodeBatcher(
            self.runner, self.alloc, model.tokenizer, args.streams + 2, tbt_slo_s=args.tbt_slo
        )
        prefill_pages = -(-longest // block)
        self.prefill_cache = PagedKVCache(model.config, prefill_pages, block, model.dtype, DEVICE)
        self.prefill_runner = ModelRunner(model, self.prefill_cache)
        self.eos = model.config.eos_token_ids
        self.gap_steps = args.gap_steps
        for s in range(args.streams):
            ids = random_prompt(model, args.context, seed=1000 + s)
            pages = self.alloc.allocate(self.cache.pages_for(args.context))
            first = int(self.runner.prefill(ids, pages).argmax())
            self.batcher.add(f"stream{s}", ids, pages, first, STREAM)
        self.step()  # reports the streams' first tokens

    def step(self) -> tuple[float, list[TokenOutput]]:
        seconds, outputs = timed(self.batcher.step)
        return seconds, outputs

    def plain_steps(self, steps: list[float]) -> None:
        for _ in range(self.gap_steps):
            steps.append(self.step()[0])

    def separate(self, rid: str, ids: list[int], steps: list[float]) -> float:
        """Prefill elsewhere, hand the pages over, and the decode step that reports it."""
        self.plain_steps(steps)
        table = list(range(self.prefill_cache.pages_for(len(ids))))

        def prefill() -> int:
            logits = self.prefill_runner.prefill(ids, table)
            return sample_first_tokens(logits, ONE_TOKEN, eos_token_ids=self.eos)[0].token_id

        prefill_s, first = timed(prefill)
        pages = self.alloc.allocate(len(table))

        def hand_off() -> None:
            self.cache.kv[:, pages] = self.prefill_cache.kv[:, table]

        copy_s, _ = timed(hand_off)
        add_s, _ = timed(lambda: self.batcher.add(rid, ids, pages, first, ONE_TOKEN))
        step_s, outputs = self.step()
        steps.append(step_s)
        assert any(o.request_id == rid and o.token_id == first for o in outputs)
        return float(prefill_s + copy_s + add_s + step_s)

    def piggyback(
        self, rid: str, ids: list[int], steps: list[float], prompt_steps: list[float] | None = None
    ) -> tuple[float, int]:
        """The steps from `add_prompt` to the one reporting the first token (their
        durations into `prompt_steps`, the plain steps before them into `steps`; both
        into `steps` when `prompt_steps` is None)."""
        self.plain_steps(steps)
        self.batcher.add_prompt(rid, ids, ONE_TOKEN)
        ttft, count = 0.0, 0
        while True:
            step_s, outputs = self.step()
            (steps if prompt_steps is None else prompt_steps).append(step_s)
            ttft += step_s
            count += 1
            if any(o.request_id == rid and o.token_id is not None for o in outputs):
                return ttft, count


def run(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    sep: dict[int, list[float]] = {n: [] for n in args.prompts}
    pig: dict[int, list[float]] = {n: [] for n in args.prompts}
    steps_without: list[float] = []
    steps_with: list[float] = []
    chunks: list[int] = []
    for r in range(args.warmup_rounds + args.rounds):
        keep = r >= args.warmup_rounds
        for n in args.prompts:
            ids = random_prompt(bench.model, n, seed=r * 1000 + n)
            without: list[float] = []
            with_: list[float] = []
            t_sep = bench.separate(f"sep-{r}-{n}", ids, without)
            t_pig, count = bench.piggyback(f"pig-{r}-{n}", ids, with_)
            if keep:
                sep[n].append(t_sep)
                pig[n].append(t_pig)
                steps_without += without
                steps_with += with_
                chunks.append(count)
    figures: dict[str, Any] = {}
    for n in args.prompts:
        figures[f"ttft_separate_{n}_s"] = statistics.median(sep[n])
        figures[f"ttft_piggyback_{n}_s"] = statistics.median(pig[n])
        figures[f"piggyback_ttft_speedup_{n}"] = statistics.median(sep[n]) / statistics.median(
            pig[n]
        )
    all_sep = [t for n in args.prompts for t in sep[n]]
    all_pig = [t for n in args.prompts for t in pig[n]]
    figures["ttft_separate_s"] = statistics.median(all_sep)
    figures["ttft_piggyback_s"] = statistics.median(all_pig)
    figures["piggyback_ttft_speedup"] = figures["ttft_separate_s"] / figures["ttft_piggyback_s"]
    figures["decode_step_median_s"] = statistics.median(steps_without)
    figures["tbt_p99_without_s"] = p99(steps_without)
    figures["tbt_p99_with_s"] = p99(steps_with)
    figures["tbt_slo_s"] = args.tbt_slo
    figures["piggyback_chunks_mean"] = statistics.mean(chunks)
    fit = bench.batcher.step_time.coefficients()
    if fit is not None:
        figures["step_fixed_s"], figures["step_per_token_s"] = fit
    return figures


def run_tight(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The piggyback rounds again under `--tight-tbt-slo`, which the longer prompts'
    steps would break in one chunk: the chunk bound at work."""
    bench.batcher.tbt_slo_s = args.tight_tbt_slo
    ttfts: list[float] = []
    plain: list[float] = []
    with_chunk: list[float] = []
    chunks: list[int] = []
    for r in range(args.rounds):
        for n in args.prompts:
            ids = random_prompt(bench.model, n, seed=r * 1000 + n)
            ttft, count = bench.piggyback(f"tight-{r}-{n}", ids, plain, with_chunk)
            ttfts.append(ttft)
            chunks.append(count)
    return {
        "tbt_slo_tight_s": args.tight_tbt_slo,
        "ttft_piggyback_tight_s": statistics.median(ttfts),
        "tbt_p99_with_tight_s": p99(plain + with_chunk),
        "tbt_p99_plain_tight_s": p99(plain),
        "tight_steps_within_slo": sum(t <= args.tight_tbt_slo for t in with_chunk)
        / len(with_chunk),
        "piggyback_chunks_mean_tight": statistics.mean(chunks),
    }


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a dir")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (an engine has one here)"
    )
    parser.add_argument("--block-size", type=int, default=0, help="tokens per page (0: auto)")
    parser.add_argument("--streams", type=int, default=4, help="running decode streams")
    parser.add_argument("--context", type=int, default=256, help="each stream's prompt tokens")
    parser.add_argument(
        "--prompts", default="32,64,96,128", help="short prompt lengths, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of every prompt")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run and dropped")
    parser.add_argument("--gap-steps", type=int, default=3, help="plain steps between arrivals")
    parser.add_argument(
        "--tbt-slo",
        type=float,
        default=2.0,
        help="the streams' TBT SLO in seconds (default: gateway.tbt_slo_s's default)",
    )
    parser.add_argument(
        "--tight-tbt-slo",
        default="auto",
        help="a second SLO in seconds the piggyback rounds run under again; auto: twice "
        "the median plain decode step of this run; off: skip",
    )
    args = parser.parse_args(argv)
    args.prompts = sorted({int(n) for n in args.prompts.split(",") if n.strip()})
    if args.streams < 1 or args.rounds < 1 or not args.prompts or min(args.prompts) < 1:
        parser.error("--streams, --rounds and every prompt length must be at least 1")

    torch.set_num_threads(args.threads)
    source = {"default": DEFAULT, "tiny": TINY_RANDOM}.get(args.model, args.model)
    config = ModelConfig(
        source=source, device=args.device, dtype=args.dtype, block_size=args.block_size
    )
    model = load_engine_model(config, default_model_cache_dir(), print)
    DEVICE = torch.device(model.device)
    args.block_size = config.block_size
    bench = Bench(model, args)

    figures: dict[str, Any] = {
        "model": model.config.model_id,
        "device": str(DEVICE),
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "block_size": args.block_size,
        "attention_backend": bench.runner.attention_backend,
        "streams": args.streams,
        "stream_context_tokens": args.context,
    }
    figures |= run(bench, args)
    if args.tight_tbt_slo != "off":
        tight = args.tight_tbt_slo
        args.tight_tbt_slo = (
            2 * figures["decode_step_median_s"] if tight == "auto" else float(tight)
        )
        figures |= run_tight(bench, args)
    emit(figures, args.json, decimals=4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
