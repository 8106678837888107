"""What `yb bench` sends and when: a Mooncake trace replayed, or groups of shared prefixes.

Both workloads become the same thing, a list of `RequestSpec` (token-id prompt,
output length, arrival offset), built up front and deterministically: the load is
known before the first byte goes out, and two runs with the same flags send the same
prompts at the same offsets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from yb_tools.bench.tokens import TokenBlocks
from yb_tools.traces import TRACE_BLOCK_TOKENS, TraceRecord


class RequestSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One request to send: its prompt as token ids, its output length, its arrival.

    `arrival_s` is the offset from the start of the run; `group` labels a request's
    prefix family (the trace's first hash id, or the shared-prefix group).
    """

    index: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    group: int = 0
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server accepts: vocabulary and context length (from /v1/models or flags)."""

    vocab_size: int
    max_model_len: int = 0  # 0: unknown, do not cut


@dataclass(frozen=True, slots=True)
class TraceScaling:
    """How a trace recorded on a large deployment is shrunk to fit this one.

    `block_tokens` replaces the trace's 512 tokens per hash id (input lengths scale by
    the same factor); outputs are multiplied by `output_scale`, then capped at
    `output_cap` (0: no cap); arrival times are divided by `speedup`. `max_requests`
    and `duration_s` keep the first requests / the first seconds (after the speed-up);
    0 keeps all. `max_input_tokens` caps a prompt (0: only the model's context does).
    """

    block_tokens: int = 64
    output_scale: float = 1.0
    output_cap: int = 64
    speedup: float = 1.0
    max_requests: int = 0
    duration_s: float = 0.0
    max_input_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.speedup <= 0:
            raise ValueError(f"speedup must be positive, got {self.speedup}")
        if self.output_scale <= 0:
            raise ValueError(f"output_scale must be positive, got {self.output_scale}")


def scaled_input_length(record: TraceRecord, block_tokens: int) -> int:
    """The prompt length of `record` with `block_tokens` per hash id.

    Scaled in proportion, then kept inside the blocks the record names: its last hash
    id holds at least one token and none past the last block, so the prefix structure
    (which blocks are full and shared) survives the scaling.
    """
    # Half up, not Python's half-to-even: the same length for the same ratio.
    n = max(1, math.floor(record.input_length * block_tokens / TRACE_BLOCK_TOKENS + 0.5))
    if record.hash_ids:
        blocks = len(record.hash_ids)
        n = min(max(n, (blocks - 1) * block_tokens + 1), blocks * block_tokens)
    return n


def _fit(prompt_len: int, max_tokens: int, limits: Limits, cap: int) -> tuple[int, int]:
    """Cut a prompt (never the output) so that prompt + output fits the context."""
    room = prompt_len
    if cap > 0:
        room = min(room, cap)
    if limits.max_model_len > 0:
        max_tokens = min(max_tokens, limits.max_model_len - 1)
        room = min(room, limits.max_model_len - max_tokens)
    return max(1, room), max(1, max_tokens)


def trace_requests(
    records: Iterable[TraceRecord], scaling: TraceScaling, limits: Limits, seed: int = 0
) -> list[RequestSpec]:
    """The requests of a trace, scaled: each hash id its own token block.

    A record without hash ids (some traces have them empty) gets a block of its own,
    so it shares nothing.
    """
    blocks = TokenBlocks("trace", limits.vocab_size, seed)
    singles = TokenBlocks("trace-unshared", limits.vocab_size, seed)
    specs: list[RequestSpec] = []
    first_ms: float | None = None
    for number, record in enumerate(records):
        if scaling.max_requests and len(specs) >= scaling.max_requests:
            break
        if first_ms is None:
            first_ms = record.timestamp
        arrival_s = (record.timestamp - first_ms) / 1000.0 / scaling.speedup
        if scaling.duration_s and arrival_s > scaling.duration_s:
            break
        wanted = scaled_input_length(record, scaling.block_tokens)
        out = max(1, math.ceil(record.output_length * scaling.output_scale))
        if scaling.output_cap > 0:
            out = min(out, scaling.output_cap)
        length, out = _fit(wanted, out, limits, scaling.max_input_tokens)
        if record.hash_ids:
            prompt = blocks.chain(record.hash_ids, scaling.block_tokens, length)
            group = record.hash_ids[0]
        else:
            prompt = singles.block(number, length)
            group = -1
        specs.append(
            RequestSpec(
                index=len(specs),
                arrival_s=arrival_s,
                prompt=prompt,
                max_tokens=out,
                group=group,
                truncated=length < wanted,
            )
        )
    return specs


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """`groups` system prompts of `prefix_tokens` each, asked by `users` users each.

    Every user sends one request: the group's prefix, then a question of its own of
    `question_tokens`, for `output_tokens` tokens. Requests go out round by round (user
    0 of every group, then user 1 ...), so the first round fills the cache and the
    later ones can reuse it. `rate` is the mean request rate of Poisson arrivals
    (seeded); 0 sends everything at once and leaves the pace to the concurrency cap.
    """

    groups: int = 4
    prefix_tokens: int = 512
    users: int = 4
    question_tokens: int = 32
    output_tokens: int = 32
    rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("groups", "users", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefix_tokens < 0 or self.question_tokens < 0:
            raise ValueError("prefix_tokens and question_tokens must not be negative")
        if self.prefix_tokens + self.question_tokens < 1:
            raise ValueError("a prompt needs at least one token")
        if self.rate < 0:
            raise ValueError(f"rate must not be negative, got {self.rate}")


def shared_prefix_requests(
    workload: SharedPrefix, limits: Limits, seed: int = 0
) -> list[RequestSpec]:
    """The requests of a shared-prefix workload, in arrival order."""
    prefixes = TokenBlocks("prefix", limits.vocab_size, seed)
    questions = TokenBlocks("question", limits.vocab_size, seed)
    # A seeded generator of its own: arrivals never depend on other users of `random`.
    arrivals = random.Random(f"yb-bench/{seed}/arrivals")
    specs: list[RequestSpec] = []
    clock = 0.0
    wanted = workload.prefix_tokens + workload.question_tokens
    length, out = _fit(wanted, workload.output_tokens, limits, 0)
    for user in range(workload.users):
        for group in range(workload.groups):
            if workload.rate > 0 and specs:
                clock += arrivals.expovariate(workload.rate)
            prompt = [
                *prefixes.block(group, workload.prefix_tokens),
                *questions.block(group * workload.users + user, workload.question_tokens),
            ][:length]
            specs.append(
                RequestSpec(
                    index=len(specs),
                    arrival_s=clock,
                    prompt=prompt,
                    max_tokens=out,
                    group=group,
                    truncated=length < wanted,
                )
            )
    return specs
