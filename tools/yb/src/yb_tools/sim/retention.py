"""What the pool keeps, measured: LRU, the conductor's retention, and Belady's bound.

`run_retention` plays one workload on one cluster three ways, everything else equal:

- `lru`: each kvstore evicts its least recently used blocks (the conductor's
  `retention` off), what the pool did before the conductor advised it;
- `retention`: the conductor advises each kvstore which blocks to keep and which to
  let go first (`yb_conductor.retention`, `RetentionPlanned`), the kvstore's LRU
  deciding among the rest;
- `belady`: every kvstore evicts by Belady's rule, the block whose next use in the
  trace is farthest (never used again: first), the offline optimum a pool with
  perfect foresight reaches. A block's next use is the arrival of the earliest
  request that wants it and has not read its prefix yet (queued requests count as
  wanting it now). The rule is Belady's per kvstore with the cluster's future, which
  is the limit the retention is judged against, not a proof of optimality across
  hosts.

With `hot_replicas` each may also replicate hot prefixes (`ReplicationPlanned`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

from yb_conductor.cost_model import CostModel
from yb_tools.sim.job import Job
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.simulator import Simulation, block_size_for
from yb_tools.sim.workload import TraceItem

#: The ways `run_retention` plays a workload.
MODES = ("lru", "retention", "belady")


class FutureUses:
    """When each block is next wanted: the arrivals of the requests whose reusable
    prefix holds it, less those that have read their prefix already."""

    def __init__(self, items: list[TraceItem], block_size: int) -> None:
        self._uses: dict[int, list[tuple[float, int]]] = {}
        for item in items:
            for key in item.keys[: (item.prompt_tokens - 1) // block_size]:
                self._uses.setdefault(key, []).append((item.arrival, item.index))
        for uses in self._uses.values():
            uses.sort()
        self._next: dict[int, int] = {}
        self._done: set[int] = set()

    def done(self, index: int) -> None:
        """Request `index` has read what it reuses (or never will): not a use to come."""
        self._done.add(index)

    def next_use(self, key: int) -> float:
        """The arrival of the earliest request still to read `key` (inf: none)."""
        uses = self._uses.get(key)
        if uses is None:
            return math.inf
        i = self._next.get(key, 0)
        done = self._done
        while i < len(uses) and uses[i][1] in done:
            i += 1
        self._next[key] = i
        return uses[i][0] if i < len(uses) else math.inf

    def uses_after(self, key: int, t: float) -> int:
        """How many requests arriving after `t` want `key` (for tests)."""
        uses = self._uses.get(key, [])
        return len(uses) - bisect.bisect_right(uses, (t, math.inf))


class BeladySimulation(Simulation):
    """The simulation with every kvstore evicting by Belady's rule."""

    def __init__(
        self, items: list[TraceItem], params: SimParams, cost: CostModel, **kwargs: Any
    ) -> None:
        super().__init__(items, params, cost, **kwargs)
        self.future = FutureUses(items, self.bs)
        for kv in self.kvstores:
            kv.oracle = self.future

    def _arrive(self, job: Job, t: float) -> None:
        super()._arrive(job, t)
        if job.fate == "rejected":
            self.future.done(job.item.index)

    def _start(self, p: int, job: Job, t: float) -> bool:
        started = super()._start(p, job, t)
        self.future.done(job.item.index)
        return started

    def _piggyback(self, job: Job, t: float) -> None:
        super()._piggyback(job, t)
        self.future.done(job.item.index)


def run_retention(
    items: list[TraceItem],
    params: SimParams,
    cost: CostModel,
    mode: str,
    *,
    policy: str = "mooncake",
    admission: str = "predicted",
    settings: Mapping[str, Any] | None = None,
) -> PolicyResult:
    """One run of `items` with the pool kept by `mode` (one of `MODES`); `settings`
    are laid over the conductor's (e.g. `hot_replicas`)."""
    if mode not in MODES:
        raise ValueError(f"unknown retention mode {mode!r}; known: {', '.join(MODES)}")
    block_size_for(params, cost)  # checks the block size before anything runs
    laid = {**(settings or {}), "retention": mode == "retention"}
    kind = BeladySimulation if mode == "belady" else Simulation
    sim = kind(items, params, cost, policy=policy, admission=admission, label=mode, settings=laid)
    return sim.run()
