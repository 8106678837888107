"""`random`: a prefill and a decode instance drawn uniformly, whatever they hold.

The floor of the comparison (the paper's "random" baseline). The draw is seeded
from `ConductorConfig.seed` and the request id, so a replay draws the same.
"""

from __future__ import annotations

from yb_conductor.cost_model import CostModel, load_cost_model
from yb_conductor.peer_policies.common import draw, local_view, missing_pool, scheduled
from yb_conductor.policy_base import Decided
from yb_conductor.state import ClusterState
from yb_shared import events as ev
from yb_shared.config import ConductorConfig


class RandomPolicy:
    """Uniform random placement on both pools."""

    name = "random"

    def __init__(self, cfg: ConductorConfig | None = None, cost: CostModel | None = None) -> None:
        self.cfg = cfg or ConductorConfig()
        self.cost = cost or load_cost_model(self.cfg.cost_model)

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Draw both instances."""
        prefills = state.live("prefill", request.model)
        decodes = state.live("decode", request.model)
        missing = missing_pool(request, seq, self.name, prefills, decodes)
        if missing is not None:
            return missing
        seed, rid = self.cfg.seed, request.request_id
        i = draw(seed, rid, "prefill", len(prefills))
        decode = decodes[draw(seed, rid, "decode", len(decodes))]
        view = local_view(state, request, prefills)
        return Decided(
            scheduled(self.name, self.cost, state, request, seq, view, i, decode, "drawn"),
            [],
        )
