"""Our forward pass against transformers' own modules over our paged attention, same run.

    python benchmarks/hf_backend.py --json PATH [--model default|tiny|DIR] [--threads N]
        [--repeats N] [--decode-context N] [--decode-steps N]

Two ways to compute a model family, over the same weights, the same `PagedKVCache`
layout and the same `TorchSDPABackend`:

- `runner` (today): `ModelRunner`, Yuebing's own layer loop (`decoder.py`): fused QKV
  and gate/up projections, last layer computing only the rows whose output is used.
- `hf_modules` (a "transformers backend", as vLLM's): transformers' own decoder
  modules (`model.model.layers`, its norms, MLP and rotary embedding) driven by a
  layer loop here, with attention registered as `"yb_paged"` in transformers'
  `AttentionInterface`: the function writes each layer's new K/V into the pages and
  attends over the sequence's pages with the backend's plans, the plan travelling
  through the modules' `**kwargs` and the layer from `module.layer_idx`. A decode
  step of B sequences of different lengths is one forward of `[B, 1]` tokens with
  per-token `position_ids` and one paged decode plan.

Both must be the same model: the run fails unless their float32 logits agree within
1e-4 after a 512- and a 2048-token prefill (chunks of 512) and a decode step of 8
sequences of different lengths (`logits_max_abs_diff_*`).

Figures (one flat JSON object; `benchmarks/record.py` keeps them with their machine):
`{runner,hf_modules}_prefill_tokens_per_s_{512,2048}` (a prompt computed in 512-token
chunks, KV written into pages, next-token logits), `{...}_decode_tokens_per_s_batch_{1,8}`
(`--decode-steps` greedy steps, argmax of the logits and nothing else, B sequences of
about `--decode-context` tokens), and `hf_modules_over_runner_*`, the speed ratio. The
two ways alternate (ABBA) for `--repeats` rounds; a speed is the median of its runs, a
ratio the median of the rounds' ratios (each of two neighbouring runs), which the
machine's spells of a slower speed disturb far less than a ratio of medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from figures import emit
from transformers import AttentionInterface

from yb_core.config import ModelConfig
from yb_core.model_files import DEFAULT, TINY_RANDOM, default_model_cache_dir
from yb_engine import DecodeSeq, LoadedModel, ModelRunner, PagedKVCache
from yb_engine.attention import (
    PLAIN,
    AttnOptions,
    DecodePlan,
    PrefillPlan,
    TorchSDPABackend,
    host_ints,
)
from yb_engine.models import load_engine_model

PREFILL_SIZES = (512, 2048)
DECODE_BATCHES = (1, 8)
ATTN_NAME = "yb_paged"
TOLERANCE = 1e-4  # float32 logits, absolute
DEVICE = torch.device("cpu")
DecodeFn = Callable[[Sequence[DecodeSeq]], torch.Tensor]


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# -- option B: transformers' modules, our paged attention ---------------------------------


@dataclass(frozen=True, slots=True)
class PagedStep:
    """What every layer's attention needs in one forward: the cache, the backend and
    the plan (made once per forward). Passed to the modules as the `yb_paged` kwarg,
    which transformers hands on, untouched, down to the attention function."""

    kv: torch.Tensor  # PagedKVCache.kv, [layers, pages, 2, block, kv_heads, dim]
    backend: TorchSDPABackend
    plan: PrefillPlan | DecodePlan


_OPTS: dict[tuple[float, int], AttnOptions] = {}


def _opts(module: torch.nn.Module, scaling: float | None) -> AttnOptions:
    """The backend's options for this module: its scale and sliding window, if any."""
    window = int(getattr(module, "sliding_window", None) or 0)
    scale = float(scaling) if scaling is not None else float(module.head_dim) ** -0.5
    key = (scale, window)
    opts = _OPTS.get(key)
    if opts is None:
        default = scale == float(module.head_dim) ** -0.5
        opts = _OPTS[key] = (
            PLAIN if default and not window else AttnOptions(None if default else scale, window)
        )
    return opts


def yb_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    yb_paged: PagedStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over Yuebing's pages.

    `query` `[B, heads, T, dim]`, `key`/`value` `[B, kv_heads, T, dim]`, RoPE applied.
    A prefill chunk is `B = 1` (T tokens of one sequence); a decode step is `T = 1`
    (one token of each of B sequences). Writes the new K/V into the pages of layer
    `module.layer_idx`, attends, and returns `[B, T, heads, dim]` as transformers'
    own functions do. `attention_mask` is ignored: the plan holds the causal and
    length masks (transformers builds none for an implementation it has no mask
    function for).
    """
    if yb_paged is None:
        raise RuntimeError(f"{ATTN_NAME} attention needs the yb_paged kwarg (a PagedStep)")
    kv_layer = yb_paged.kv[module.layer_idx]
    plan = yb_paged.plan
    opts = _opts(module, scaling)
    if isinstance(plan, DecodePlan):
        # [B, H, 1, D] -> [B, H, D]
        q, k, v = query[:, :, 0].contiguous(), key[:, :, 0], value[:, :, 0]
        out = yb_paged.backend.decode(kv_layer, q, k, v, plan, opts)
        return out[:, None], None
    # [1, H, T, D] -> [T, H, D]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    out = yb_paged.backend.prefill(kv_layer, q, k, v, plan, opts)
    assert out is not None
    return out[None], None


class HFModulesRunner:
    """Prefill and decode (ModelRunner's signatures) through transformers' modules of
    a `*ForCausalLM`, over a `PagedKVCache`, with `yb_paged_attention`."""

    def __init__(self, hf: Any, cache: PagedKVCache, backend: TorchSDPABackend) -> None:
        AttentionInterface.register(ATTN_NAME, yb_paged_attention)
        hf.set_attn_implementation(ATTN_NAME)
        if hf.config._attn_implementation != ATTN_NAME:
            raise RuntimeError(f"{type(hf).__name__} did not take attention {ATTN_NAME!r}")
        self.hf = hf
        self.base = hf.model
        self.cache = cache
        self.backend = backend
        self.device = cache.device

    def forward(
        self, ids: torch.Tensor, position_ids: torch.Tensor, plan: PrefillPlan | DecodePlan
    ) -> torch.Tensor:
        """Hidden states after the final norm, `[B, T, hidden]`; `ids` and
        `position_ids` are `[B, T]`."""
        base = self.base
        hidden = base.embed_tokens(ids)
        rope = base.rotary_emb(hidden, position_ids=position_ids)
        step = PagedStep(self.cache.kv, self.backend, plan)
        for layer in base.layers:
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=rope,
                yb_paged=step,
            )
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states `[N, hidden]` (final norm, then the head)."""
        return self.hf.lm_head(self.base.norm(hidden)).float()

    def prefill(
        self,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_cached_tokens: int = 0,
        chunk_size: int = 512,
    ) -> torch.Tensor:
        """As `ModelRunner.prefill`: float32 logits `[vocab]` after the prompt."""
        n = len(token_ids)
        block = self.cache.block_size
        with torch.inference_mode():
            ids = host_ints(list(token_ids), torch.int64, self.device)
            for start in range(num_cached_tokens, n, chunk_size):
                end = min(start + chunk_size, n)
                plan = self.backend.plan_prefill(block_table, start, end, block)
                positions = torch.arange(start, end, device=self.device)[None]
                hidden = self.forward(ids[None, start:end], positions, plan)
            return self.logits(hidden[0, -1:])[0]

    def decode(self, batch: Sequence[DecodeSeq]) -> torch.Tensor:
        """As `ModelRunner.decode`: one token of each sequence, one forward of `[B, 1]`;
        float32 logits `[B, vocab]`."""
        with torch.inference_mode():
            plan = self.backend.plan_decode(
                [s.block_table for s in batch], [s.position for s in batch], self.cache.block_size
            )
            ids = host_ints([s.token_id for s in batch], torch.int64, self.device)
            hidden = self.forward(ids[:, None], plan.positions[:, None], plan)
            return self.logits(hidden[:, 0])


# -- the measurement --------------------------------------------------------------------


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return ids


def interleaved(
    ways: dict[str, Callable[[], float]], repeats: int
) -> tuple[dict[str, float], float]:
    """Each way's median seconds over `repeats` rounds, the order reversed every other
    round (ABBA), and the median over rounds of the first way's seconds over the
    second's within the round: a ratio of neighbours, which a machine that changes
    speed for seconds at a time disturbs much less than a ratio of medians."""
    samples: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(ways[name]())
    first, second = (samples[name] for name in names[:2])
    paired = statistics.median(a / b for a, b in zip(first, second, strict=True))
    return {name: statistics.median(s) for name, s in samples.items()}, paired


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@dataclass
class DecodeSet:
    """B sequences of about `context` tokens (different lengths), their pages in both
    caches (the same indices, the same KV bytes)."""

    tables: list[list[int]]
    lengths: list[int]
    first_tokens: list[int]


def decode_set(
    runner: ModelRunner,
    other: PagedKVCache,
    prompt: list[int],
    batch: int,
    context: int,
    room: int,
    next_page: int,
) -> tuple[DecodeSet, int]:
    """Sequence i holds the first `context + 8 * (i - batch // 2)` prompt tokens
    (copied from a prefill of the whole prompt in pages [0, p)), with `room` more
    tokens of pages after them; returns the set and the next free page."""
    cache = runner.cache
    tables, lengths, firsts = [], [], []
    for i in range(batch):
        n = context + 8 * (i - batch // 2)
        pages = list(range(next_page, next_page + cache.pages_for(n + room)))
        next_page += len(pages)
        used = cache.pages_for(n)
        cache.kv[:, pages[:used]] = cache.kv[:, :used]
        other.kv[:, pages[:used]] = cache.kv[:, :used]
        tables.append(pages)
        lengths.append(n)
        firsts.append(prompt[n])  # the prompt's next token: what a prefill would feed
    return DecodeSet(tables, lengths, firsts), next_page


def greedy(step: DecodeFn, ds: DecodeSet, start: int, steps: int) -> None:
    """`steps` greedy decode steps from `start` tokens past each sequence's length."""
    tokens = ds.first_tokens  # the same first tokens in every round: the same work
    for s in range(steps):
        batch = [
            DecodeSeq(t, n + start + s, tok)
            for t, n, tok in zip(ds.tables, ds.lengths, tokens, strict=True)
        ]
        tokens = step(batch).argmax(dim=-1).tolist()


class Way(Protocol):
    """What both ways offer: `ModelRunner`'s prefill and decode."""

    def prefill(
        self,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        num_cached_tokens: int = 0,
        chunk_size: int = 512,
    ) -> torch.Tensor: ...

    def decode(self, batch: Sequence[DecodeSeq]) -> torch.Tensor: ...


def time_prefill(way: Way, ids: list[int], pages: list[int], chunk: int) -> float:
    return timed(lambda: way.prefill(ids, pages, chunk_size=chunk))


@dataclass
class DecodeRounds:
    """Timed rounds of `steps` greedy steps of one way over one `DecodeSet`; each round
    starts `steps` positions further on (so both ways see the same contexts)."""

    step: DecodeFn
    ds: DecodeSet
    steps: int
    done: int = 0

    def warm_up(self) -> None:
        greedy(self.step, self.ds, 0, self.steps)

    def timed_round(self) -> float:
        self.done += 1
        return timed(lambda: greedy(self.step, self.ds, self.done * self.steps, self.steps))


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="default", help="default (SmolLM2), tiny, or a dir")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    source = {"default": DEFAULT, "tiny": TINY_RANDOM}.get(args.model, args.model)
    # float32 on the CPU: the 1e-4 agreement is a float32 statement.
    config = ModelConfig(source=source, device="cpu", dtype="float32")
    model: LoadedModel = load_engine_model(config, default_model_cache_dir(), print)
    DEVICE = torch.device(model.device)
    arch = model.config
    block = config.block_size
    room = args.decode_steps * args.repeats + args.decode_steps + 8
    max_context = args.decode_context + 8 * (max(DECODE_BATCHES) // 2)
    pages = (
        -(-max(PREFILL_SIZES) // block)
        + sum(DECODE_BATCHES) * -(-(max_context + room) // block)
        + 4
    )
    cache_a = PagedKVCache(arch, pages, block, model.dtype, DEVICE)
    cache_b = PagedKVCache(arch, pages, block, model.dtype, DEVICE)
    runner = ModelRunner(model, cache_a)
    hf_runner = HFModulesRunner(model.hf_model, cache_b, TorchSDPABackend(DEVICE, model.dtype))

    figures: dict[str, Any] = {
        "model": arch.model_id,
        "device": str(DEVICE),
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "block_size": block,
        "chunk_size": args.chunk_size,
        "decode_context_tokens": args.decode_context,
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "attention_backend": runner.attention_backend,
        "transformers": transformers.__version__,
    }

    # -- the same model? ------------------------------------------------------------
    prompt = random_prompt(arch.vocab, max(PREFILL_SIZES) + 1, seed=1)
    table = list(range(-(-max(PREFILL_SIZES) // block)))
    diffs: dict[str, float] = {}
    for n in PREFILL_SIZES:
        a = runner.prefill(prompt[:n], table, chunk_size=args.chunk_size)
        b = hf_runner.prefill(prompt[:n], table, chunk_size=args.chunk_size)
        diffs[f"logits_max_abs_diff_prefill_{n}"] = max_diff(a, b)
    diffs["kv_max_abs_diff_prefill"] = max_diff(
        cache_a.kv[:, table], cache_b.kv[:, table]
    )  # the last prefill's pages, every layer: what the two wrote
    next_page = len(table)
    sets: dict[int, DecodeSet] = {}
    for batch in DECODE_BATCHES:
        sets[batch], next_page = decode_set(
            runner, cache_b, prompt, batch, args.decode_context, room, next_page
        )
    check = sets[max(DECODE_BATCHES)]
    batch0 = [
        DecodeSeq(t, n, tok)
        for t, n, tok in zip(check.tables, check.lengths, check.first_tokens, strict=True)
    ]
    diffs[f"logits_max_abs_diff_decode_batch_{max(DECODE_BATCHES)}"] = max_diff(
        runner.decode(batch0), hf_runner.decode(batch0)
    )
    figures |= diffs
    for name, diff in diffs.items():
        print(f"{name}: {diff:.3g}")
    bad = {k: v for k, v in diffs.items() if k.startswith("logits") and not v <= TOLERANCE}
    if bad:
        raise SystemExit(f"option B is not the same model: {bad} over {TOLERANCE}")

    # -- prefill ----------------------------------------------------------------------
    ways: dict[str, Way] = {"runner": runner, "hf_modules": hf_runner}
    for n in PREFILL_SIZES:
        ids = random_prompt(arch.vocab, n, seed=n)
        pages = table[: -(-n // block)]
        for way in ways.values():
            way.prefill(ids[:64], pages)  # warm-up
        medians, ratio = interleaved(
            {
                name: partial(time_prefill, way, ids, pages, args.chunk_size)
                for name, way in ways.items()
            },
            args.repeats,
        )
        for name, seconds in medians.items():
            figures[f"{name}_prefill_tokens_per_s_{n}"] = n / seconds
        figures[f"hf_modules_over_runner_prefill_{n}"] = ratio

    # -- decode -----------------------------------------------------------------------
    steps = args.decode_steps
    for batch in DECODE_BATCHES:
        rounds = {name: DecodeRounds(way.decode, sets[batch], steps) for name, way in ways.items()}
        for r in rounds.values():
            r.warm_up()
        medians, ratio = interleaved(
            {name: r.timed_round for name, r in rounds.items()}, args.repeats
        )
        for name, seconds in medians.items():
            figures[f"{name}_decode_tokens_per_s_batch_{batch}"] = batch * steps / seconds
        figures[f"hf_modules_over_runner_decode_batch_{batch}"] = ratio

    emit(figures, args.json, decimals=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
