"""`random`: a prefill and a decode instance drawn uniformly, whatever they hold.

The floor of the comparison (the paper's "random" baseline). The draw is seeded
from `ConductorConfig.seed` and the request id, so a replay draws the same.
"""

from __future__ import annotations

from yb_conductor.baselines.common import BaselinePolicy, draw, local_view, scheduled
from yb_conductor.policy_base import Decided
from yb_conductor.state import ClusterState
from yb_core import events as ev


class RandomPolicy(BaselinePolicy):
    """Uniform random placement on both pools."""

    name = "random"

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Draw both instances."""
        prefills, decodes, missing = self.live_pools(state, request, seq)
        if missing is not None:
            return missing
        seed, rid = self.cfg.seed, request.request_id
        i = draw(seed, rid, "prefill", len(prefills))
        decode = decodes[draw(seed, rid, "decode", len(decodes))]
        view = local_view(state, request, prefills)
        return Decided(
            scheduled(self.name, self.costs, state, request, seq, view, i, decode, "drawn"),
            [],
        )
