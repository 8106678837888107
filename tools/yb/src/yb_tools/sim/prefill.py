"""A prefill instance as the simulator plays it: one job at a time, in arrival order.

Like the real engine it reuses the longest prefix its own host's pool holds, pulls
from another host's pool what the conductor's plan names (when the source still
holds it when the job starts), and computes the rest; the job takes the loads plus
the prefill by the cost model. When it ends, the prompt's full blocks go into the
host's pool.
"""

from __future__ import annotations

from collections import deque

from yb_tools.sim.job import Job
from yb_tools.sim.kvstore import SimKvstore


class SimPrefill:
    """One prefill instance and its queue."""

    __slots__ = ("busy_until", "current", "host", "instance_id", "kvstore", "queue")

    def __init__(self, instance_id: str, host: str, kvstore: SimKvstore) -> None:
        self.instance_id = instance_id
        self.host = host
        self.kvstore = kvstore
        self.queue: deque[Job] = deque()
        self.current: Job | None = None
        self.busy_until = 0.0

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        return len(self.queue) + (1 if self.current is not None else 0)

    def backlog_s(self, now: float, estimate: dict[int, float]) -> float:
        """Seconds of work ahead of a new job: the running job's rest plus the queued
        jobs' estimated work (`estimate` by request index)."""
        rest = self.busy_until - now if self.current is not None and self.busy_until > now else 0.0
        return rest + sum(estimate.get(j.item.index, 0.0) for j in self.queue)
