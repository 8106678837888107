"""`least-loaded`: the load-balancing baseline, blind to where KV is cached.

The prefill instance with the fewest queued tokens, the decode instance with the
fewest requests per batch slot. It reuses only the prefix the chosen prefill
instance holds in its own engine cache, which it would compute from there anyway.
"""

from __future__ import annotations

from yb_conductor.admission import NO_DECODE, NO_PREFILL, Verdict
from yb_conductor.baselines.common import usable_keys
from yb_conductor.cost_model import CostModel, DegreeCosts, load_cost_model
from yb_conductor.policy_base import Decided, reject
from yb_conductor.state import ClusterState, InstanceState
from yb_core import events as ev
from yb_core.config import ConductorConfig


class LeastLoadedPolicy:
    """Prefill on the instance with the least queued work; decode on the least busy.

    Queued work is what the conductor itself sent and has not seen finish, which the
    log tells exactly, rather than the last periodic load report, which lags.
    """

    name = "least-loaded"

    def __init__(self, cfg: ConductorConfig | None = None, cost: CostModel | None = None) -> None:
        self.cfg = cfg or ConductorConfig()
        self.cost = cost or load_cost_model(self.cfg.cost_model)
        self.costs = DegreeCosts(self.cost)

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Place on the least-loaded pair, or reject when a pool is empty or saturated."""
        prefills = state.live("prefill", request.model)
        decodes = state.live("decode", request.model)
        if not prefills:
            verdict = Verdict(NO_PREFILL, "no live prefill instance", 1.0)
            return Decided(reject(request, seq, self.name, verdict), [])
        if not decodes:
            verdict = Verdict(NO_DECODE, "no live decode instance", 1.0)
            return Decided(reject(request, seq, self.name, verdict), [])
        prefill = min(prefills, key=lambda i: (i.prefill_tokens_in_flight, i.instance_id))
        decode = min(decodes, key=lambda i: (self._decode_load(i), i.instance_id))
        # The prefix an instance holds in its own engine cache is computed from there.
        keys = usable_keys(request)
        cached = state.prefix_blocks(keys, prefill.instance_id)
        computed = request.prompt_tokens - cached * request.block_size
        cost = self.costs.of(prefill)
        queue_s = cost.prefill_s(prefill.prefill_tokens_in_flight)
        prefill_s = cost.prefill_s(computed, cached * request.block_size)
        batch = decode.decode_requests + 1
        context = decode.decode_context_tokens + request.prompt_tokens
        estimates = ev.Estimates(
            queue_s=queue_s,
            prefill_s=prefill_s,
            ttft_s=queue_s + prefill_s,
            tbt_s=self.costs.of(decode).tbt_s(batch, context),
            decode_batch=batch,
        )
        if decode.max_batch_size and decode.decode_requests >= 4 * decode.max_batch_size:
            verdict = Verdict("decode_saturated", "decode pool saturated", 1.0)
            return Decided(reject(request, seq, self.name, verdict, estimates), [])
        reuse = (
            [
                ev.ReusePlan(
                    source_instance=prefill.instance_id,
                    tier="engine",
                    first_block=0,
                    num_blocks=cached,
                )
            ]
            if cached
            else []
        )
        # What a KVCache-aware policy could have reused, for the quality figures.
        lengths = state.index.match(keys).lengths
        best = max(lengths.values(), default=0)
        explain = ev.Explanation(
            branch="local" if cached else "recompute",
            reason=f"{prefill.instance_id} has the fewest queued tokens; "
            f"{decode.instance_id} the fewest requests per batch slot",
            best_blocks=best,
        )
        decision = ev.RequestScheduled(
            time=request.time,
            request_id=request.request_id,
            gateway_id=request.gateway_id,
            prefill_instance=prefill.instance_id,
            decode_instance=decode.instance_id,
            reused_blocks=cached,
            reuse=reuse,
            estimates=estimates,
            policy=self.name,
            admitted_seq=seq,
            prompt_tokens=request.prompt_tokens,
            computed_tokens=computed,
            explain=explain,
        )
        return Decided(decision, [])

    @staticmethod
    def _decode_load(inst: InstanceState) -> float:
        return inst.decode_requests / max(1, inst.max_batch_size)
