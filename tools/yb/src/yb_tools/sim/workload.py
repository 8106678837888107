"""The trace as the simulator replays it: arrival times, lengths and block keys.

Mooncake's traces name one block per 512 tokens (`hash_ids`, chained like prefix
blocks). At another block size the keys are derived so that equal prefixes still
mean equal keys: a smaller block splits each id into `512 / block_size` keys, a
larger one is named by the last id it covers (ids chain, so the last stands for the
whole prefix). The keys are computed once and shared by every policy's run.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from yb_tools.traces import TRACE_BLOCK_TOKENS, TraceRecord, read_trace


@dataclass(slots=True)
class TraceItem:
    """One request of the workload, immutable across runs."""

    index: int
    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    keys: list[int]


def block_keys(hash_ids: list[int], prompt_tokens: int, block_size: int) -> list[int]:
    """The prompt's block keys at `block_size` (one per block, the last maybe partial)."""
    n = -(-prompt_tokens // block_size)
    if block_size == TRACE_BLOCK_TOKENS:
        return list(hash_ids[:n])
    if TRACE_BLOCK_TOKENS % block_size == 0:
        split = TRACE_BLOCK_TOKENS // block_size
        return [h * split + j for h in hash_ids for j in range(split)][:n]
    if block_size % TRACE_BLOCK_TOKENS == 0:
        group = block_size // TRACE_BLOCK_TOKENS
        last = len(hash_ids) - 1
        return [hash_ids[min(k * group + group - 1, last)] for k in range(n)]
    raise ValueError(
        f"block size {block_size} must divide or be a multiple of the trace's "
        f"{TRACE_BLOCK_TOKENS}-token blocks"
    )


def load_workload(
    path: str | Path, *, block_size: int, speedup: float = 1.0, limit: int = 0
) -> list[TraceItem]:
    """The trace's requests, arrivals compressed by `speedup`, in arrival order."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    return workload_from(read_trace(path, limit=limit), block_size=block_size, speedup=speedup)


def workload_from(
    trace: list[TraceRecord], *, block_size: int, speedup: float = 1.0
) -> list[TraceItem]:
    """As `load_workload`, from requests already read."""
    items = [
        TraceItem(
            index=i,
            request_id=f"req-{i}",
            arrival=req.timestamp / 1000.0 / speedup,
            prompt_tokens=max(1, req.input_length),
            output_tokens=max(1, req.output_length),
            keys=block_keys(req.hash_ids, max(1, req.input_length), block_size),
        )
        for i, req in enumerate(trace)
    ]
    items.sort(key=lambda r: (r.arrival, r.index))
    return items


def draw_priorities(n: int, mix: Mapping[int, float], seed: int) -> list[int]:
    """`n` priorities drawn from `mix` (priority -> share; empty: all 0), the same
    for the same seed. ValueError on a negative share or none positive."""
    if not mix:
        return [0] * n
    priorities = sorted(mix)
    shares = [mix[p] for p in priorities]
    if any(w < 0 for w in shares) or not sum(shares) > 0:
        raise ValueError(f"priority mix {dict(mix)} needs shares >= 0, at least one > 0")
    cumulative = list(itertools.accumulate(shares))
    total = cumulative[-1]
    # A generator of its own: the mix must not shift the run's other draws.
    rng = random.Random(f"priority-mix:{seed}")
    return [
        priorities[min(bisect.bisect_right(cumulative, rng.random() * total), len(priorities) - 1)]
        for _ in range(n)
    ]
