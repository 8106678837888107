"""A prefill instance as the simulator plays it: one job at a time, by priority.

Like the real engine it runs its queue by priority (larger first), then arrival, never
preempting the job it runs but a batch line's, which pauses between layers for work of a
higher priority (`Simulation._pause`) and then runs before the rest of its priority;
with one priority everywhere that is arrival order. It reuses the longest prefix its own
host's pool holds, pulls from another host's pool what the conductor's plan names (when
the source still holds it when the job starts), and computes the rest; the job takes the
loads plus the prefill by the cost model. When it ends, the prompt's full blocks go into
the host's pool. A prefill group's lead runs the group's jobs: every stage loads its
share of each reused block (the slowest stage's load counts) and the prefill is the cost
model's pipeline over the stages (`CostModel.pipeline_prefill_s`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from yb_tools.sim.job import Job
from yb_tools.sim.kvstore import SimKvstore


class SimPrefill:
    """One prefill instance and its queue. The lead of a prefill group also holds the
    group's stages: each one's share of the layers and its host (`shares`, `hosts`,
    the lead's first; empty for a whole-model instance)."""

    __slots__ = (
        "arrivals",
        "busy_until",
        "current",
        "host",
        "hosts",
        "instance_id",
        "kvstore",
        "paused",
        "queue",
        "shares",
    )

    def __init__(self, instance_id: str, host: str, kvstore: SimKvstore) -> None:
        self.instance_id = instance_id
        self.host = host
        self.kvstore = kvstore
        self.shares: list[float] = []
        self.hosts: list[str] = []
        # A heap of (-priority, arrival number, job): the next job to run first.
        self.queue: list[tuple[int, int, Job]] = []
        self.arrivals = 0
        # Paused jobs queue ahead of their priority's arrivals: numbered below 0.
        self.paused = 0
        self.current: Job | None = None
        self.busy_until = 0.0

    def push(self, job: Job) -> None:
        """Queue `job` behind the running one."""
        self.arrivals += 1
        heapq.heappush(self.queue, (-job.priority, self.arrivals, job))

    def push_back(self, job: Job) -> None:
        """Queue a paused job ahead of every other of its priority."""
        self.paused -= 1
        heapq.heappush(self.queue, (-job.priority, self.paused, job))

    def pop(self) -> Job:
        """The next job to run (the highest priority, the earliest of it)."""
        return heapq.heappop(self.queue)[2]

    def queued(self) -> Iterator[Job]:
        """The waiting jobs (in no particular order)."""
        return (entry[2] for entry in self.queue)

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        return len(self.queue) + (1 if self.current is not None else 0)
