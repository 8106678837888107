"""Placement policies: given the folded state and an admitted request, decide.

A policy is a pure function of its inputs: no clock, no I/O, ties broken by instance
id, randomness (when a policy wants some) drawn from a generator seeded from the
request itself. That is what lets a replay recompute every decision exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from yb_conductor.state import ClusterState, InstanceState
from yb_shared import events as ev


@dataclass(frozen=True, slots=True)
class CostModel:
    """A first-order engine model: until `yb profile` fits one, rates are configured.

    prefill time = tokens / prefill_tokens_per_s; TBT = base + per_request * batch.
    """

    prefill_tokens_per_s: float = 4000.0
    tbt_base_s: float = 0.02
    tbt_per_request_s: float = 0.002

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens` new tokens."""
        return tokens / self.prefill_tokens_per_s

    def tbt_s(self, batch: int) -> float:
        """Seconds per decode step at batch size `batch`."""
        return self.tbt_base_s + self.tbt_per_request_s * batch


Decision = ev.RequestScheduled | ev.RequestRejected


class Policy(Protocol):
    """What the conductor asks of a placement policy."""

    name: str

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decision:
        """The decision for `request`, admitted at stream sequence `seq`."""
        ...


class LeastLoadedPolicy:
    """Prefill on the instance with the least queued work; decode on the least busy.

    Queued work is what the conductor itself sent and has not seen finish, which the
    log tells exactly, rather than the last periodic load report, which lags.
    """

    name = "least-loaded"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or CostModel()

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decision:
        """Place on the least-loaded pair, or reject when a pool is empty or over SLO."""
        prefills = state.live("prefill", request.model)
        decodes = state.live("decode", request.model)
        if not prefills or not decodes:
            missing = "prefill" if not prefills else "decode"
            return self._reject(request, seq, f"no live {missing} instance", ev.Estimates())
        prefill = min(prefills, key=lambda i: (i.prefill_tokens_in_flight, i.instance_id))
        decode = min(decodes, key=lambda i: (self._decode_load(i), i.instance_id))
        # The prefix an instance holds in its own engine cache is computed from there.
        cached_blocks = state.prefix_blocks(request.block_hashes, prefill.instance_id)
        computed = request.prompt_tokens - cached_blocks * request.block_size
        queue_s = self.cost.prefill_s(prefill.prefill_tokens_in_flight)
        prefill_s = self.cost.prefill_s(computed)
        batch = decode.decode_requests + 1
        estimates = ev.Estimates(
            queue_s=queue_s,
            prefill_s=prefill_s,
            ttft_s=queue_s + prefill_s,
            tbt_s=self.cost.tbt_s(batch),
            decode_batch=batch,
        )
        if decode.max_batch_size and decode.decode_requests >= 4 * decode.max_batch_size:
            return self._reject(request, seq, "decode pool saturated", estimates)
        reuse = (
            [
                ev.ReusePlan(
                    source_instance=prefill.instance_id,
                    tier="engine",
                    first_block=0,
                    num_blocks=cached_blocks,
                )
            ]
            if cached_blocks
            else []
        )
        return ev.RequestScheduled(
            time=request.time,
            request_id=request.request_id,
            gateway_id=request.gateway_id,
            prefill_instance=prefill.instance_id,
            decode_instance=decode.instance_id,
            reused_blocks=cached_blocks,
            reuse=reuse,
            estimates=estimates,
            policy=self.name,
            admitted_seq=seq,
            prompt_tokens=request.prompt_tokens,
            computed_tokens=computed,
        )

    @staticmethod
    def _decode_load(inst: InstanceState) -> float:
        return inst.decode_requests / max(1, inst.max_batch_size)

    def _reject(
        self, request: ev.RequestAdmitted, seq: int, reason: str, estimates: ev.Estimates
    ) -> ev.RequestRejected:
        return ev.RequestRejected(
            time=request.time,
            request_id=request.request_id,
            gateway_id=request.gateway_id,
            reason=reason,
            retry_after_s=1.0,
            estimates=estimates,
            policy=self.name,
            admitted_seq=seq,
        )


POLICIES = {LeastLoadedPolicy.name: LeastLoadedPolicy}


def make_policy(name: str) -> Policy:
    """A policy by name; a clear error for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
