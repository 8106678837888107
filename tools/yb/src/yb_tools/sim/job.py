"""One request's journey through the simulated cluster, and how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from yb_core import events as ev
from yb_tools.sim.workload import TraceItem

Fate = Literal["", "completed", "rejected", "decode_rejected", "timed_out", "kv_exhausted"]


@dataclass(slots=True, eq=False)
class Job:
    """A request in flight: where the conductor put it and what happened to it.

        Times are simulated seconds. `plan` is the decision's reuse plan and
        `estimated_work_s` its estimate of the prefill's work; `prefill_s` is what the
        prefill instance really spent (loading reused blocks included);
        `reused_local`/`reused_remote` are blocks taken from its own host's pool and
        pulled from another host's. `priority` is what its admission asked for (drawn
        from the run's priority mix). `stages`: the pipeline stages of the prefill group
        it was placed on (0: a whole-model instance); `piggyback`: its prompt was prefilled
    inside its decode instance's batch; `parked_at`: when it began to wait for room
    on its decode instance (-1: it never waited). `decode_order`: when its decode
    instance took it (the engine's order, which picks the newest to end when KV pages
    run out); `generated`: the tokens it had when it was ended for lack of KV pages
    (`kv_exhausted`; 0 otherwise). `line`: the batch line (`yb_tools.sim.batch`) this
    is a try of (-1: an interactive request).

    A batch line's prefill can be paused between two layers (`Simulation._pause`):
    `done_at` is when the run in progress ends (-1 while paused or not started),
    `left_s` the work a paused prefill has left, `step_s` one layer of one engine chunk
    of its compute (how far apart the points it may pause at are) and `compute_from`
    when the compute of the run in progress began (its steps count from there),
    `pause_at` the boundary it pauses at (-1: none); `runs` the spans it ran before its
    last run, for the prefill time it took (`busy_spans`).
    """

    item: TraceItem
    priority: int = 0
    stages: int = 0
    piggyback: bool = False
    prefill: int = -1
    decode: int = -1
    plan: list[ev.ReusePlan] = field(default_factory=list)
    estimated_work_s: float = 0.0
    prefill_start: float = -1.0
    prefill_end: float = -1.0
    prefill_s: float = 0.0
    reused_local: int = 0
    reused_remote: int = 0
    parked_at: float = -1.0
    join_time: float = -1.0
    join_step: int = 0
    finish_time: float = -1.0
    decode_order: int = 0
    generated: int = 0
    kv_held: bool = False
    fate: Fate = ""
    reason: str = ""
    line: int = -1
    done_at: float = -1.0
    left_s: float = 0.0
    step_s: float = 0.0
    compute_from: float = 0.0
    pause_at: float = -1.0
    runs: list[tuple[float, float]] = field(default_factory=list)

    def busy_spans(self) -> list[tuple[float, float]]:
        """The spans its prefill ran on its prefill instance (one unless paused)."""
        if self.prefill_start < 0:
            return []
        if not self.runs:
            return [(self.prefill_start, self.prefill_start + self.prefill_s)]
        ran = sum(end - start for start, end in self.runs)
        last = self.runs[-1][1] if self.prefill_end < 0 else self.prefill_end
        return [*self.runs, (last - max(0.0, self.prefill_s - ran), last)]

    @property
    def ttft_s(self) -> float:
        """Arrival to first token (the prefill produces it)."""
        return self.prefill_end - self.item.arrival

    @property
    def tbt_s(self) -> float:
        """Mean time between its tokens after the first (0 with one token). A request
        that waited for a batch slot (`parked_at`) had its first token reported when
        it was parked, so the wait is one of its gaps, as a client sees it."""
        steps = self.item.output_tokens - 1
        if steps <= 0 or self.join_time < 0:
            return 0.0
        start = self.parked_at if self.parked_at >= 0 else self.join_time
        return (self.finish_time - start) / steps
