"""Short prompts prefilled inside a decode instance's batch (piggybacking).

A decode instance that announces `piggyback` can take a prompt straight into its
continuous batch: each decode step then also computes a chunk of the prompt beside
the running streams' tokens (SARATHI's chunked prefill), and the step that computes
the last chunk yields the first token. That saves the prefill queue, the hand-off
and the KV transfer. The price is the running streams' step time, so a chunk is as
large as fits the TBT limit beside the batch's own decode step, and no step runs
over it: the streams keep their TBT, and so do the requests that join meanwhile. A
prompt that would take more than `MAX_STEPS` such steps is not planned at all.

The conductor weighs this against the prefill pool with the cost model: a prompt
goes to the decode instance only when its TTFT there is the lower one. So the
threshold is no constant: it falls as the decode batch grows (less room per step)
and rises as the prefill pool queues.

`plan_steps` is shared with `yb sim`, which plays the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from yb_conductor.cost_model import CostModel

# A prompt that needs more steps than this is left to the prefill pool.
MAX_STEPS = 64


def chunk_within(cost: CostModel, budget_s: float, done: int, left: int) -> int:
    """The largest chunk (tokens, at most `left`) whose prefill on top of `done`
    tokens takes at most `budget_s` (0: not even one token fits)."""
    prefill_s = cost.prefill_s
    if budget_s <= 0.0:
        return 0
    if prefill_s(left, done) <= budget_s:
        return left
    lo, hi = 0, left  # prefill_s(lo) fits (or lo is 0), prefill_s(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefill_s(mid, done) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo


def plan_steps(
    cost: CostModel,
    *,
    batch: int,
    context: int,
    new_tokens: int,
    cached_tokens: int,
    limit_s: float,
    block_size: int,
) -> list[tuple[int, float]] | None:
    """The mixed steps that prefill `new_tokens` on top of `cached_tokens` beside a
    decode batch of `batch` sequences holding `context` tokens, each step within
    `limit_s`: (chunk tokens, step seconds) per step. None when a step cannot take
    even one block (or the last tokens, when fewer), or it would take more than
    `MAX_STEPS` steps."""
    decode_s = cost.tbt_s(batch, context) if batch > 0 else 0.0
    budget = limit_s - decode_s
    steps: list[tuple[int, float]] = []
    done, left = cached_tokens, new_tokens
    while left > 0:
        chunk = chunk_within(cost, budget, done, left)
        if chunk < min(left, max(1, block_size)) or len(steps) >= MAX_STEPS:
            return None
        steps.append((chunk, decode_s + cost.prefill_s(chunk, done)))
        done += chunk
        left -= chunk
    return steps


@dataclass(slots=True)
class PiggybackEstimate:
    """A prompt planned inside a decode instance's batch: the wait for the steps
    (the instance's earlier piggybacked prompts and, on average, half its current
    step), the load of its reused prefix from the pool, and the mixed steps."""

    wait_s: float
    load_s: float
    steps: list[tuple[int, float]]
    reuse_blocks: int

    @property
    def prefill_s(self) -> float:
        """The mixed steps' seconds, their decode parts included."""
        return sum(seconds for _, seconds in self.steps)

    @property
    def ttft_s(self) -> float:
        """Wait, load and steps."""
        return self.wait_s + self.load_s + self.prefill_s
