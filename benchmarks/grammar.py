"""Grammar benchmark: what a JSON-schema grammar costs per decoded token.

    python benchmarks/grammar.py --json PATH [--model default|tiny|DIR] [--threads N]
        [--batches 1,8] [--steps 24] [--repeats 5]

The default model (SmolLM2-135M-Instruct) on the CPU, float32, decoding B sequences of
one chat prompt that asks for JSON, through `DecodeBatcher.step` (sampling and
detokenization included), with and without an llguidance grammar from a JSON schema
(an array of at least 20 objects, so no sequence finishes during a run), in the same
process, runs interleaved.

Figures (one flat JSON object; `benchmarks/record.py` keeps them with their machine):

- `step_ms_batch_{B}_unconstrained`, `step_ms_batch_{B}_grammar`: median time of one
  decode step of the batch; `grammar_step_overhead_pct_batch_{B}`: how much longer a
  grammar-constrained step takes.
- `mask_us_per_token_batch_{B}`: the median time to build one sequence's token mask
  (llguidance's bitmask, unpacked and applied to the logits row), measured at every
  position of the constrained runs: the part of the overhead that is the grammar's.

Every figure is the median over `--repeats` interleaved runs of `--steps` steps; the
machine may be shared, so medians of interleaved runs are the fairest comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from figures import emit

from yb_core.config import ModelConfig
from yb_core.model_files import DEFAULT, TINY_RANDOM, default_model_cache_dir
from yb_core.protocol import SamplingParams
from yb_engine import (
    ChoiceState,
    DecodeBatcher,
    LoadedModel,
    ModelRunner,
    PageAllocator,
    PagedKVCache,
    sample_first_tokens,
)
from yb_engine.models import load_engine_model
from yb_text.grammar import json_schema_grammar

BATCHES = (1, 8)
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                },
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
QUESTION = "List twenty people as JSON: each with a name, an age and a city."


def chat_prompt(model: LoadedModel) -> list[int]:
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = QUESTION
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def run_once(
    model: LoadedModel,
    runner: ModelRunner,
    ids: list[int],
    params: SamplingParams,
    batch: int,
    steps: int,
    mask_us: list[float],
) -> float:
    """One run: `batch` sequences admitted, then `steps` timed steps; the median step
    time in seconds. With a grammar, every sequence's mask is timed too (apart)."""
    cache = runner.cache
    alloc = PageAllocator(cache.num_pages)
    source = alloc.allocate(cache.pages_for(len(ids)))
    logits = runner.prefill(ids, source)
    batcher = DecodeBatcher(runner, alloc, model.tokenizer, max_batch_size=batch)
    # Each sequence's grammar state, followed beside the batcher's to time its mask.
    states: dict[str, ChoiceState] = {}
    for b in range(batch):
        pages = source if b == 0 else alloc.allocate(len(source))
        if b:
            cache.kv[:, pages] = cache.kv[:, source]
        (first,) = sample_first_tokens(
            logits,
            params,
            tokenizer=model.tokenizer,
            eos_token_ids=model.config.eos_token_ids,
        )
        batcher.add(f"r{b}", ids, pages, first.token_id, params)
        if params.grammar:
            states[f"r{b}"] = ChoiceState.rebuild(
                params,
                [first.token_id],
                tokenizer=model.tokenizer,
                eos_token_ids=model.config.eos_token_ids,
            )
    batcher.step()  # reports the first tokens; warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        produced = batcher.step()
        times.append(time.perf_counter() - start)
        assert len(produced) == batch and not any(o.finished for o in produced), produced
        for out in produced if params.grammar else []:
            assert out.token_id is not None
            state = states[out.request_id]
            state.accept(out.token_id)
            row = torch.zeros(model.config.vocab)
            start = time.perf_counter()
            state.process(row)  # the mask the next step builds for this sequence
            mask_us.append((time.perf_counter() - start) * 1e6)
    for b in range(batch):
        batcher.abort(f"r{b}")
    batcher.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a dir")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = tuple(sorted({int(b) for b in args.batches.split(",") if b.strip()}))
    source = {"default": DEFAULT, "tiny": TINY_RANDOM}.get(args.model, args.model)
    config = ModelConfig(source=source, device="cpu", dtype="float32", block_size=16)
    model = load_engine_model(config, default_model_cache_dir(), print)
    ids = chat_prompt(model)
    tokens = max(batches) * (len(ids) + (args.steps + 4) + 32)
    cache = PagedKVCache(model.config, -(-tokens // 16) + 8, 16, model.dtype)
    runner = ModelRunner(model, cache)
    # Greedy: the same tokens every run, so runs are the same work.
    plain = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=10**6, grammar=json_schema_grammar(SCHEMA)
    )

    figures: dict[str, Any] = {
        "model": model.config.model_id,
        "device": "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
        "steps": args.steps,
        "grammar": "JSON schema: an array of >= 20 {name, age, city} objects",
    }
    for batch in batches:
        samples: dict[str, list[float]] = {"unconstrained": [], "grammar": []}
        mask_us: list[float] = []
        for _ in range(args.repeats):
            for name, params in (("unconstrained", plain), ("grammar", constrained)):
                samples[name].append(
                    run_once(model, runner, ids, params, batch, args.steps, mask_us)
                )
        plain_ms = statistics.median(samples["unconstrained"]) * 1e3
        grammar_ms = statistics.median(samples["grammar"]) * 1e3
        figures[f"step_ms_batch_{batch}_unconstrained"] = plain_ms
        figures[f"step_ms_batch_{batch}_grammar"] = grammar_ms
        figures[f"grammar_step_overhead_pct_batch_{batch}"] = (grammar_ms / plain_ms - 1) * 100
        figures[f"mask_us_per_token_batch_{batch}"] = statistics.median(mask_us)

    emit(figures, args.json, decimals=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
