"""Seeded workload generators, in the trace format `yb sim` reads (`TraceRecord`).

Prompts are streams of tokens named by 512-token blocks (`hash_ids`); a block's id
stands for the whole prefix up to its end, so two prompts share ids exactly as far
as they share full blocks of content, and a prompt's last, partial block gets an id
of its own. Five shapes, each with sensible defaults:

- `shared-prefix` (llm-d's prefix-cache benchmark): `groups` groups, each with a
  long shared system prompt (`system` tokens) and `users` users asking `questions`
  long questions each (`question` tokens, `output` out), at a rate rising from
  `qps_start` to `qps_end` requests/s over the run: linearly, or with `steps` > 1 in
  that many steps, each an equal share of the requests at one rate (llm-d's
  stages); with `repeats` > 1 each question is asked that many times, the same
  prompt each time (llm-d sends each user's prompt again and again);
- `multi-turn`: `sessions` conversations starting at `session_rate`/s, each of
  `turns` turns `think_s` apart whose prompt is the previous prompt, its answer
  (`output` tokens) and a new question (`question` tokens), after a `system` prompt;
- `tool-agent`: `tools` long tool prompts (`system` tokens) shared by agent tasks
  arriving at `task_rate`/s; a task (`task` tokens) runs `steps` calls `step_s`
  apart, each extending the last by its short answer (`output`) and a tool result
  (`result` tokens);
- `phase-change` (for sizing the pools): `phase_s` seconds of long prompts
  (`long_prompt` tokens, `short_output` out: prefill-bound), then `phase_s` of short
  prompts with long answers (`short_prompt`, `long_output`: decode-bound), at `rate`
  requests/s throughout, each prompt opening with one of `systems` shared system
  prompts (`system` tokens, counted in the prompt lengths);
- `daily`: a day compressed into `period_s` seconds, the arrival rate following a
  cosine from `rate` at night to `peak` times that at midday (a Poisson process of
  that rate, by thinning), each prompt one of `systems` shared system prompts and a
  question (`question` tokens, `output` out).

Lengths are drawn uniformly within +-`spread` of their mean; arrivals are Poisson.
`generate("name:k=v,...")` reads a spec (a generator's name, or a preset of one:
`PRESETS`); `write_trace` writes JSON lines.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from yb_tools.traces import TRACE_BLOCK_TOKENS, TraceRecord


class BlockIds:
    """Fresh block ids, one counter per workload."""

    def __init__(self) -> None:
        self.next_id = 0

    def take(self, n: int) -> list[int]:
        """`n` ids never handed out before."""
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids


class TokenStream:
    """A prompt that only grows (a conversation, an agent's context): its full blocks
    keep their ids as it grows."""

    def __init__(self, ids: BlockIds, shared: list[int] | None = None, tokens: int = 0) -> None:
        self.ids = ids
        self.blocks = list(shared or [])
        self.tokens = tokens

    def extend(self, tokens: int) -> None:
        """Append `tokens` tokens."""
        self.tokens += tokens
        full = self.tokens // TRACE_BLOCK_TOKENS
        if full > len(self.blocks):
            self.blocks.extend(self.ids.take(full - len(self.blocks)))

    def prompt(self, timestamp_s: float, output: int) -> TraceRecord:
        """The stream as it stands, as a request: its full blocks, then a partial one
        of its own."""
        tail = self.ids.take(1) if self.tokens % TRACE_BLOCK_TOKENS else []
        full = self.blocks[: self.tokens // TRACE_BLOCK_TOKENS]
        return TraceRecord(
            timestamp=round(timestamp_s * 1000.0, 3),
            input_length=self.tokens,
            output_length=output,
            hash_ids=full + tail,
        )


def _length(rng: random.Random, mean: int, spread: float) -> int:
    return max(1, round(mean * (1.0 + spread * (2.0 * rng.random() - 1.0))))


def _poisson(rng: random.Random, rate: Callable[[float], float]) -> Iterator[float]:
    """Arrival times of a Poisson process whose rate may change with time."""
    t = 0.0
    while True:
        t += rng.expovariate(max(rate(t), 1e-9))
        yield t


def shared_prefix(
    *,
    seed: int = 0,
    groups: int = 64,
    users: int = 8,
    questions: int = 4,
    system: int = 6000,
    question: int = 1200,
    output: int = 300,
    qps_start: float = 1.0,
    qps_end: float = 16.0,
    spread: float = 0.25,
    steps: int = 0,
    repeats: int = 1,
) -> list[TraceRecord]:
    """Groups sharing long system prompts, long questions, rising QPS (see the module)."""
    rng = random.Random(f"shared-prefix:{seed}")
    ids = BlockIds()
    prefixes = [ids.take(system // TRACE_BLOCK_TOKENS) for _ in range(groups)]
    per_group = users * questions
    # (group, its question) per request, each question `repeats` times.
    asks = [(g, q) for g in range(groups) for q in range(per_group) for _ in range(repeats)]
    rng.shuffle(asks)
    # A question asked again is the same prompt (lengths and blocks): drawn once.
    asked: dict[tuple[int, int], TraceRecord] = {}
    n = len(asks)
    # The rate rises with the share of requests sent, so it spans the whole range:
    # linearly, or in `steps` equal shares of the requests at evenly spaced rates.
    mean_rate = (qps_start + qps_end) / 2.0
    out: list[TraceRecord] = []
    t = 0.0
    for k, ask in enumerate(asks):
        if steps > 1:
            rate = qps_start + (qps_end - qps_start) * (k * steps // n) / (steps - 1)
        else:
            rate = qps_start + (qps_end - qps_start) * k / max(1, n - 1)
        t += rng.expovariate(rate if rate > 0 else mean_rate)
        first = asked.get(ask)
        if first is None:
            stream = TokenStream(ids, prefixes[ask[0]], system)
            stream.extend(_length(rng, question, spread))
            record = asked[ask] = stream.prompt(t, _length(rng, output, spread))
        else:
            record = TraceRecord(
                timestamp=round(t * 1000.0, 3),
                input_length=first.input_length,
                output_length=_length(rng, output, spread),
                hash_ids=first.hash_ids,
            )
        out.append(record)
    return out


def multi_turn(
    *,
    seed: int = 0,
    sessions: int = 200,
    turns: int = 5,
    system: int = 1000,
    question: int = 400,
    output: int = 300,
    session_rate: float = 2.0,
    think_s: float = 20.0,
    spread: float = 0.5,
) -> list[TraceRecord]:
    """Conversations whose turns extend the previous prompt (see the module)."""
    rng = random.Random(f"multi-turn:{seed}")
    ids = BlockIds()
    starts = _poisson(rng, lambda _t: session_rate)
    out: list[TraceRecord] = []
    for _ in range(sessions):
        t = next(starts)
        stream = TokenStream(ids)
        stream.extend(_length(rng, system, spread))
        for _turn in range(max(1, round(turns * (0.5 + rng.random())))):
            stream.extend(_length(rng, question, spread))
            answer = _length(rng, output, spread)
            out.append(stream.prompt(t, answer))
            stream.extend(answer)
            t += rng.expovariate(1.0 / think_s)
    out.sort(key=lambda r: r.timestamp)
    return out


def tool_agent(
    *,
    seed: int = 0,
    tools: int = 8,
    tasks: int = 300,
    steps: int = 4,
    system: int = 8000,
    task: int = 500,
    result: int = 200,
    output: int = 30,
    task_rate: float = 3.0,
    step_s: float = 2.0,
    spread: float = 0.5,
) -> list[TraceRecord]:
    """Agent tasks over long shared tool prompts with short outputs (see the module)."""
    rng = random.Random(f"tool-agent:{seed}")
    ids = BlockIds()
    prompts = [ids.take(system // TRACE_BLOCK_TOKENS) for _ in range(tools)]
    starts = _poisson(rng, lambda _t: task_rate)
    out: list[TraceRecord] = []
    for _ in range(tasks):
        t = next(starts)
        stream = TokenStream(ids, prompts[rng.randrange(tools)], system)
        stream.extend(_length(rng, task, spread))
        for _step in range(steps):
            answer = _length(rng, output, spread)
            out.append(stream.prompt(t, answer))
            stream.extend(answer + _length(rng, result, spread))
            t += step_s * (0.5 + rng.random())
    out.sort(key=lambda r: r.timestamp)
    return out


def phase_change(
    *,
    seed: int = 0,
    phase_s: float = 600.0,
    rate: float = 8.0,
    systems: int = 16,
    system: int = 1000,
    long_prompt: int = 8000,
    short_output: int = 50,
    short_prompt: int = 1500,
    long_output: int = 1000,
    spread: float = 0.5,
) -> list[TraceRecord]:
    """A prompt-heavy phase, then an output-heavy one (see the module)."""
    rng = random.Random(f"phase-change:{seed}")
    ids = BlockIds()
    prompts = [ids.take(system // TRACE_BLOCK_TOKENS) for _ in range(systems)]
    out: list[TraceRecord] = []
    for t in _poisson(rng, lambda _t: rate):
        if t >= 2.0 * phase_s:
            break
        prompt, output = (long_prompt, short_output) if t < phase_s else (short_prompt, long_output)
        stream = TokenStream(ids, prompts[rng.randrange(systems)], system)
        stream.extend(_length(rng, max(1, prompt - system), spread))
        out.append(stream.prompt(t, _length(rng, output, spread)))
    return out


def daily(
    *,
    seed: int = 0,
    period_s: float = 3600.0,
    rate: float = 6.0,
    peak: float = 4.0,
    systems: int = 16,
    system: int = 1000,
    question: int = 1500,
    output: int = 300,
    spread: float = 0.5,
) -> list[TraceRecord]:
    """A day compressed into `period_s`: the rate from `rate` at night to `peak` times
    that at midday (see the module)."""
    rng = random.Random(f"daily:{seed}")
    ids = BlockIds()
    prompts = [ids.take(system // TRACE_BLOCK_TOKENS) for _ in range(systems)]
    out: list[TraceRecord] = []
    for t in _thinned(rng, lambda t: daily_rate(t, period_s, rate, peak), rate * max(1.0, peak)):
        if t >= period_s:
            break
        stream = TokenStream(ids, prompts[rng.randrange(systems)], system)
        stream.extend(_length(rng, question, spread))
        out.append(stream.prompt(t, _length(rng, output, spread)))
    return out


def daily_rate(t: float, period_s: float, rate: float, peak: float) -> float:
    """The `daily` workload's arrival rate at `t`: a cosine from `rate` at 0 (night)
    to `peak` x `rate` at half the period (midday) and back."""
    return rate * (1.0 + (peak - 1.0) * (1.0 - math.cos(2.0 * math.pi * t / period_s)) / 2.0)


def _thinned(rng: random.Random, rate: Callable[[float], float], most: float) -> Iterator[float]:
    """Arrival times of a Poisson process of rate `rate(t)` <= `most`, by thinning:
    exact however fast the rate changes."""
    t = 0.0
    while True:
        t += rng.expovariate(most)
        if rng.random() * most <= rate(t):
            yield t


GENERATORS: dict[str, Callable[..., list[TraceRecord]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "tool-agent": tool_agent,
    "phase-change": phase_change,
    "daily": daily,
}

# Named settings of a generator. `shared-prefix-ladder`: the shape of llm-d's
# prefix-cache benchmark (150 groups of 5 users on 6,000-token system prompts,
# 1,200-token questions) with its load stepping up to 60 requests/s, 8 questions a
# user and 500-token answers: at the top steps the prefill pool queues and the
# decode pool's KV binds on `llama2-70b-a800` with 8 + 8 instances.
PRESETS: dict[str, str] = {
    "shared-prefix-ladder": (
        "shared-prefix:groups=150,users=5,questions=8,system=6000,question=1200,"
        "output=500,qps_start=3,qps_end=60,steps=8"
    ),
}


def generate(spec: str, *, seed: int = 0) -> list[TraceRecord]:
    """The workload `spec` names: `NAME` or `NAME:key=value,...` (the generator's
    parameters; `seed` unless the spec sets one), or a preset (`PRESETS`), whose
    parameters the spec's own override. ValueError on an unknown name or parameter,
    or a value that does not parse."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name in PRESETS:
        name, _, preset = PRESETS[name].partition(":")
        rest = f"{preset},{rest}"
    if name not in GENERATORS:
        known = ", ".join([*GENERATORS, *PRESETS])
        raise ValueError(f"unknown workload {name!r}; known: {known}")
    generator = GENERATORS[name]
    defaults = generator.__kwdefaults__ or {}
    kwargs: dict[str, int | float] = {"seed": seed}
    for part in (p.strip() for p in rest.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in defaults:
            known = ", ".join(k for k in defaults)
            raise ValueError(f"workload {name}: {part!r} is not key=value with a key of {known}")
        kind = type(defaults[key])
        try:
            kwargs[key] = kind(value) if kind is not int else int(value)
        except ValueError:
            raise ValueError(
                f"workload {name}: {key} wants {kind.__name__}, got {value!r}"
            ) from None
    return generator(**kwargs)


def write_trace(path: str | Path, records: list[TraceRecord]) -> None:
    """Write records as a Mooncake trace (JSON lines)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    with out.open("wb") as f:
        for record in records:
            f.write(encoder.encode(record) + b"\n")


def span_s(records: list[TraceRecord]) -> float:
    """Seconds from the first arrival to the last."""
    if not records:
        return 0.0
    return (max(r.timestamp for r in records) - min(r.timestamp for r in records)) / 1000.0
