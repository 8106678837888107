"""A batch backlog in `yb sim`: Batch API lines beside the interactive trace.

`SimParams.batch_lines` lines are queued at t = 0, due `batch_window_s` later (their
`batch_deadline`), and taken in order by `SimParams.batch_concurrency` worker slots
(0: one per line), as the gateways' batch workers take them: a slot tries its line
until the line ends, then takes the next. Each line's prompt and output lengths are
those of an interactive request of the trace drawn at random (seeded by
`SimParams.seed`), with a prompt of its own (fresh block keys: a line shares no prefix
with anything else). A line is of the built-in `flex` tier, as the gateway's batch
worker sends it: priority -1, TTFT SLO `FLEX_TTFT_FACTOR` times the run's, the run's
TBT SLO.

Each try of a line is a request of its own (`cmpl-<batch>-<line>-<try>`, as the
gateway names them). A refused try (`RequestRejected`: `batch_held` under the
conductor's idle-only rule, any refusal under `batch_idle_only=false`; the gateway
retries both, 429 and 503) is tried again after the worker's back-off, `RETRY_FIRST_S`
doubling up to `RETRY_MAX_S` (and no less than the refusal's `retry_after_s`, at
most `RETRY_MAX_S`), while its deadline is further away than the wait; otherwise the
line `timed_out`. As in the gateway's worker (`yb_gateway.batches.retry_wait_s`),
each wait is jittered (half of it drawn at random, here seeded): lines queued
together would otherwise all retry at the same instants, and only the first few of
each herd find room. A try the conductor
placed runs to its end; the line is `completed` (its last token by the deadline),
`late` (after it), or `failed` (a decode instance refused or cut it short, or its
prefill never started in time).

Idle capacity (`BatchResult`) is measured over the interactive window, `[0, the last
interactive arrival]` (the whole run when the trace has no interactive request): the
prefill instance-seconds of the starting pool (`SimParams.prefill`) over that window,
less the seconds prefill instances spent on interactive prompts in it. `idle_used` is
the share of that the batch lines' prefills took (seconds inside the window). Decode
capacity has no such clear measure (its steps are shared): the lines' output tokens
are reported instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec

from yb_tools.sim.job import Job
from yb_tools.sim.results import percentile
from yb_tools.sim.workload import TraceItem

#: The gateway's back-off between tries of one line (`yb_gateway.batches`).
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0
#: Block keys of batch prompts start here, far above any trace's ids.
_KEY_BASE = 1 << 48
#: The batch id in the lines' request ids.
BATCH_ID = "batch_sim"


@dataclass(slots=True, eq=False)
class BatchLine:
    """One line of the backlog: its prompt, its deadline, its tries, how it ended.

    `fate`: "" while it runs or waits, then `completed`, `late`, `timed_out` or
    `failed` (module docstring); `end` the time it ended; `delay` the next back-off.
    """

    index: int
    prompt_tokens: int
    output_tokens: int
    keys: list[int]
    deadline: float
    tries: int = 0
    held: int = 0
    delay: float = RETRY_FIRST_S
    fate: str = ""
    end: float = -1.0
    jobs: list[Job] = field(default_factory=list)

    def try_item(self, t: float, index: int) -> TraceItem:
        """The request of its next try, arriving at `t`; `index` (unique in the run,
        after the trace's) breaks ties in the engines' orders."""
        self.tries += 1
        return TraceItem(
            index=index,
            request_id=f"cmpl-{BATCH_ID}-{self.index}-{self.tries}",
            arrival=t,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            keys=self.keys,
        )

    def wait_s(self, retry_after_s: float, spread: float) -> float:
        """How long to wait after a refusal (the back-off advances): the back-off (no
        less than `retry_after_s`, at most `RETRY_MAX_S`) times `0.5 + spread / 2`,
        `spread` in [0, 1) ("equal jitter")."""
        wait = min(RETRY_MAX_S, max(self.delay, retry_after_s))
        self.delay = min(RETRY_MAX_S, self.delay * 2)
        return wait * (0.5 + 0.5 * spread)


def backlog(
    items: list[TraceItem], lines: int, window_s: float, *, block_size: int, seed: int
) -> list[BatchLine]:
    """`lines` batch lines due at `window_s`, lengths drawn from `items` (1024 in and
    256 out when there are none), each with a prompt of its own."""
    rng = random.Random(f"batch-backlog:{seed}")
    out = []
    for i in range(lines):
        if items:
            like = items[rng.randrange(len(items))]
            prompt, output = like.prompt_tokens, like.output_tokens
        else:
            prompt, output = 1024, 256
        blocks = -(-prompt // block_size)
        keys = [_KEY_BASE + i * (1 << 20) + b for b in range(blocks)]
        out.append(BatchLine(i, prompt, output, keys, deadline=window_s))
    return out


class BatchResult(msgspec.Struct, kw_only=True):
    """How the backlog fared (module docstring): lines by fate, tries and refusals,
    the completion time of the last line in its window (`makespan_s`, 0 when none
    completed), and the idle prefill capacity it used."""

    lines: int
    completed: int
    late: int
    timed_out: int
    failed: int
    tries: int
    held_back: int
    makespan_s: float
    finish_p50_s: float
    output_tokens: int
    window_s: float
    prefill_capacity_s: float
    interactive_prefill_s: float
    idle_prefill_s: float
    batch_prefill_s: float
    idle_used: float


def _overlap(job: Job, end: float) -> float:
    """The seconds of `job`'s prefill on a prefill instance within `[0, end]` (the
    spans it ran: a paused one's pauses are other work's)."""
    if job.prefill < 0 or job.prefill_start < 0 or job.piggyback:
        return 0.0
    return sum(max(0.0, min(end, stop) - start) for start, stop in job.busy_spans())


def summarize_batch(
    lines: list[BatchLine], interactive: list[Job], *, prefill_instances: int, run_end: float
) -> BatchResult:
    """Fold the lines' fates and the prefill time into the figures."""
    window = max((j.item.arrival for j in interactive), default=0.0) or run_end
    capacity = prefill_instances * window
    busy = sum(_overlap(j, window) for j in interactive)
    used = sum(_overlap(j, window) for line in lines for j in line.jobs)
    idle = max(0.0, capacity - busy)
    fates = [line.fate for line in lines]
    done = sorted(line.end for line in lines if line.fate == "completed")
    return BatchResult(
        lines=len(lines),
        completed=fates.count("completed"),
        late=fates.count("late"),
        timed_out=fates.count("timed_out"),
        failed=fates.count("failed"),
        tries=sum(line.tries for line in lines),
        held_back=sum(line.held for line in lines),
        makespan_s=done[-1] if done else 0.0,
        finish_p50_s=percentile(done, 0.5),
        output_tokens=sum(line.output_tokens for line in lines if line.fate == "completed"),
        window_s=window,
        prefill_capacity_s=capacity,
        interactive_prefill_s=busy,
        idle_prefill_s=idle,
        batch_prefill_s=used,
        idle_used=used / idle if idle > 0 else 0.0,
    )
