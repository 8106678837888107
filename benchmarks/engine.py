"""Engine benchmark: prefill and decode throughput of our runner, against transformers.

    python benchmarks/engine.py --json PATH [--model default|tiny|DIR] [--threads N]
        [--device auto|cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16]
        [--block-size N] [--decode-batches 1,8,64]

Device, dtype and page size resolve as an engine's do (`model.device`, `model.dtype`,
`model.block_size`; auto: CUDA, bfloat16 and 256-token pages when there is a GPU,
else the CPU, float32 and 64). On CUDA every timing waits for the device.

Figures (one flat JSON object; `benchmarks/record.py` keeps them with their machine):

- `prefill_tokens_per_s_{512,2048,4096}`: a prompt of N tokens through
  `ModelRunner.prefill` with the engine's default chunking (512-token chunks), KV written
  into pages; `reference_prefill_tokens_per_s_{N}`: transformers' forward of the same
  model on the same tokens in the same process (SDPA attention, `logits_to_keep=1`, its
  KV cache on: the same useful work), measured interleaved with ours.
- `decode_tokens_per_s_batch_{1,8,32}` (the `--decode-batches`): `DecodeBatcher.step`
  (greedy sampling and detokenization included) with B sequences of `--decode-context`
  tokens each; `decode_batch_{B}_vs_1` the largest batch's over batch 1's.
- `prefix_reuse_ttft_speedup`: time to first token of a 4096-token prompt whose first
  3584 tokens' KV is already in the pages, against computing all 4096.

Every figure is the median of `--repeats` runs; the machine is shared, so medians of
interleaved runs are the fairest comparison available.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
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
)
from yb_engine.models import load_engine_model

PREFILL_SIZES = (512, 2048, 4096)
DECODE_BATCHES = (1, 8, 32)
REUSE_PROMPT, REUSE_CACHED = 4096, 3584
# Set once the model is loaded: CUDA returns before its kernels finish, so every
# timing waits for the device on both ends.
DEVICE = torch.device("cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def random_prompt(model: LoadedModel, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, model.config.vocab, (n,), generator=gen).tolist()
    return ids


def bench_prefill(
    model: LoadedModel, runner: ModelRunner, chunk: int, repeats: int, reference: bool
) -> dict[str, float]:
    out: dict[str, float] = {}
    table = list(range(runner.cache.num_pages))
    hf = model.hf_model if reference else None
    for n in PREFILL_SIZES:
        ids = random_prompt(model, n, seed=n)
        ours: list[float] = []
        ref: list[float] = []
        runner.prefill(ids[:64], table)  # warm-up
        batch = torch.tensor([ids], device=DEVICE)
        for _ in range(repeats):
            ours.append(timed(partial(runner.prefill, ids, table, chunk_size=chunk)))
            if hf is not None:
                with torch.inference_mode():
                    ref.append(timed(partial(hf, batch, logits_to_keep=1)))
        out[f"prefill_tokens_per_s_{n}"] = n / statistics.median(ours)
        if ref:
            out[f"reference_prefill_tokens_per_s_{n}"] = n / statistics.median(ref)
            out[f"prefill_vs_reference_{n}"] = statistics.median(ref) / statistics.median(ours)
    return out


def bench_decode(
    model: LoadedModel,
    runner: ModelRunner,
    context: int,
    steps: int,
    repeats: int,
    batches: tuple[int, ...] = DECODE_BATCHES,
) -> dict[str, float]:
    cache = runner.cache
    ids = random_prompt(model, context, seed=7)
    pages_per_seq = cache.pages_for(context + steps * repeats + 2)
    alloc = PageAllocator(cache.num_pages)
    # One real prompt's KV, copied into every sequence's pages: the same bytes a
    # prefill would have produced, without prefilling 32 times.
    source = alloc.allocate(pages_per_seq)
    runner.prefill(ids, source)
    first = int(runner.prefill(ids, source).argmax())
    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    out: dict[str, float] = {}
    for batch in batches:
        batcher = DecodeBatcher(runner, alloc, model.tokenizer, max_batch_size=batch)
        for b in range(batch):
            pages = alloc.allocate(cache.pages_for(context))
            cache.kv[:, pages] = cache.kv[:, source[: len(pages)]]
            batcher.add(f"r{b}", ids, pages, first, params)
        batcher.step()  # reports the first tokens; warm-up
        samples = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                produced = batcher.step()
                assert len(produced) == batch
            sync()
            samples.append(batch * steps / (time.perf_counter() - start))
        out[f"decode_tokens_per_s_batch_{batch}"] = statistics.median(samples)
        for b in range(batch):
            batcher.abort(f"r{b}")
        batcher.step()
    alloc.free(source)
    top = max(batches)
    if 1 in batches and top > 1:
        out[f"decode_batch_{top}_vs_1"] = (
            out[f"decode_tokens_per_s_batch_{top}"] / out["decode_tokens_per_s_batch_1"]
        )
    return out


def bench_reuse(
    model: LoadedModel, runner: ModelRunner, chunk: int, repeats: int
) -> dict[str, float]:
    ids = random_prompt(model, REUSE_PROMPT, seed=11)
    table = list(range(runner.cache.pages_for(REUSE_PROMPT)))
    full: list[float] = []
    reuse: list[float] = []
    for _ in range(repeats):
        full.append(timed(lambda: runner.prefill(ids, table, chunk_size=chunk)))
        # the prefix KV is now in the pages, exactly as if loaded from a KV store
        reuse.append(
            timed(
                lambda: runner.prefill(ids, table, num_cached_tokens=REUSE_CACHED, chunk_size=chunk)
            )
        )
    return {
        "ttft_full_4096_s": statistics.median(full),
        "ttft_reuse_3584_of_4096_s": statistics.median(reuse),
        "prefix_reuse_ttft_speedup": statistics.median(full) / statistics.median(reuse),
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
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--block-size", type=int, default=0, help="tokens per page (0: auto)")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument(
        "--decode-batches",
        default=",".join(map(str, DECODE_BATCHES)),
        help="decode batch sizes, comma-separated",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = tuple(sorted({int(b) for b in args.decode_batches.split(",") if b.strip()}))
    source = {"default": DEFAULT, "tiny": TINY_RANDOM}.get(args.model, args.model)
    config = ModelConfig(
        source=source, device=args.device, dtype=args.dtype, block_size=args.block_size
    )
    model = load_engine_model(config, default_model_cache_dir(), print)
    DEVICE = torch.device(model.device)
    block_size = config.block_size

    tokens_needed = max(max(PREFILL_SIZES), max(batches) * (args.decode_context + 64) + 4096)
    cache = PagedKVCache(
        model.config, -(-tokens_needed // block_size), block_size, model.dtype, DEVICE
    )
    runner = ModelRunner(model, cache)

    figures: dict[str, Any] = {
        "model": model.config.model_id,
        "device": str(DEVICE),
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "block_size": block_size,
        "chunk_size": args.chunk_size,
        "decode_context_tokens": args.decode_context,
        "attention_backend": runner.attention_backend,
    }
    figures |= bench_prefill(model, runner, args.chunk_size, args.repeats, not args.no_reference)
    figures |= bench_decode(
        model, runner, args.decode_context, args.decode_steps, args.repeats, batches
    )
    figures |= bench_reuse(model, runner, args.chunk_size, args.repeats)

    emit(figures, args.json, decimals=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
