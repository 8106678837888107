"""`round-robin`: prefill and decode instances in turn.

Each pool keeps its own turn; the turn advances once per decision, which the
conductor asks exactly once per admission in log order, so a replay takes the same
turns.
"""

from __future__ import annotations

from yb_conductor.baselines.common import BaselinePolicy, local_view, scheduled
from yb_conductor.cost_model import CostModel
from yb_conductor.policy_base import Decided
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig


class RoundRobinPolicy(BaselinePolicy):
    """The next prefill and the next decode instance, by id, cyclically."""

    name = "round-robin"

    def __init__(self, cfg: ConductorConfig | None = None, cost: CostModel | None = None) -> None:
        super().__init__(cfg, cost)
        self.turn = 0

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Take the next turn on both pools."""
        prefills, decodes, missing = self.live_pools(state, request, seq)
        if missing is not None:
            return missing
        turn = self.turn
        self.turn += 1
        view = local_view(state, request, prefills)
        decode = decodes[turn % len(decodes)]
        i = turn % len(prefills)
        return Decided(
            scheduled(self.name, self.costs, state, request, seq, view, i, decode, f"turn {turn}"),
            [],
        )
