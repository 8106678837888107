"""`dynamo-kv`: NVIDIA Dynamo's KV-aware router.

Dynamo scores every worker with `overlap_score_weight * prefill_blocks +
decode_blocks` and takes the lowest (temperature 0): `prefill_blocks` are the blocks
the worker would still have to prefill — this request's tokens beyond the prefix it
caches (known from the engines' KV events, as here) plus the prefill tokens already
in flight there, over the block size — and `decode_blocks` the KV blocks of the
sequences it is decoding, this request's included. In a disaggregated deployment the
prefill router tracks no decode blocks and the decode router no overlap, so here the
prefill pool is scored by the first term and the decode pool by the second. Ties are
drawn (seeded by the request), as Dynamo samples among equal costs.
"""

from __future__ import annotations

from yb_conductor.baselines.common import BaselinePolicy, draw, local_view, scheduled
from yb_conductor.cost_model import CostModel
from yb_conductor.policy_base import Decided
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig

OVERLAP_SCORE_WEIGHT = 1.0


class DynamoKvPolicy(BaselinePolicy):
    """Lowest `weight * prefill_blocks` prefill, lowest `decode_blocks` decode."""

    name = "dynamo-kv"

    def __init__(
        self,
        cfg: ConductorConfig | None = None,
        cost: CostModel | None = None,
        *,
        overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
    ) -> None:
        super().__init__(cfg, cost)
        self.overlap_score_weight = overlap_score_weight

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Score both pools and take the cheapest worker of each."""
        prefills, decodes, missing = self.live_pools(state, request, seq)
        if missing is not None:
            return missing
        bs = max(1, request.block_size)
        view = local_view(state, request, prefills)
        request_blocks = -(-request.prompt_tokens // bs)
        weight = self.overlap_score_weight
        prefill_costs = [
            weight * (request_blocks - view.blocks[i] + p.prefill_tokens_in_flight / bs)
            for i, p in enumerate(prefills)
        ]
        i = self._pick(prefill_costs, request.request_id, "prefill")
        decode_costs = [float(d.decode_kv_blocks + request_blocks) for d in decodes]
        j = self._pick(decode_costs, request.request_id, "decode")
        decode = decodes[j]
        reason = (
            f"cost {prefill_costs[i]:.1f} = {weight:g} x prefill blocks "
            f"({view.blocks[i]} of {request_blocks} cached); decode blocks {decode_costs[j]:.0f}"
        )
        return Decided(
            scheduled(self.name, self.costs, state, request, seq, view, i, decode, reason), []
        )

    def _pick(self, costs: list[float], request_id: str, salt: str) -> int:
        low = min(costs)
        ties = [j for j, c in enumerate(costs) if c == low]
        if len(ties) == 1:
            return ties[0]
        return ties[draw(self.cfg.seed, request_id, salt, len(ties))]
