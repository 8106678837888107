"""`local-prefix`: every prefill instance has a prefix cache of its own, no global pool.

What vLLM-style prefix caching behind a TTFT-aware router amounts to: each instance
reuses only the prefix its own host holds, and the request goes where queue + local
load + the remaining prefill is shortest. It is Mooncake's choice with the pool taken
away (no instance ever pulls blocks from another host), so comparing the two isolates
what the global pool is worth. Decode: the least busy instance.
"""

from __future__ import annotations

import math

from yb_conductor.baselines.common import (
    BaselinePolicy,
    least_busy_decode,
    local_view,
    scheduled,
)
from yb_conductor.policy_base import Decided
from yb_conductor.state import ClusterState
from yb_core import events as ev


class LocalPrefixPolicy(BaselinePolicy):
    """Shortest estimated TTFT using each instance's local prefix only."""

    name = "local-prefix"

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """The instance whose local prefix gives the earliest first token."""
        prefills, decodes, missing = self.live_pools(state, request, seq)
        if missing is not None:
            return missing
        view = local_view(state, request, prefills)
        bs = max(1, request.block_size)
        prompt = request.prompt_tokens
        # Most instances hold nothing of this prompt: they share one prefill estimate
        # (one per degree and lanes).
        memo: dict[tuple[int, int, int], float] = {}
        best, best_t = 0, math.inf
        now = state.now
        for i, inst in enumerate(prefills):
            blocks = view.blocks[i]
            key = (blocks, inst.tensor_parallel, inst.transfer_lanes)
            work = memo.get(key)
            if work is None:
                cost = self.costs.of(inst)
                cached = blocks * bs
                work = cost.prefill_s(prompt - cached, cached)
                source = view.sources[i]
                if blocks and source is not None and source.instance_id != inst.instance_id:
                    work += cost.load_s(blocks, bs, "dram", remote=False)
                memo[key] = work
            busy = inst.busy_until
            t = (busy - now if busy > now else 0.0) + work
            if t < best_t:
                best, best_t = i, t
        decode = least_busy_decode(decodes)
        reason = (
            f"{prefills[best].instance_id}: local prefix {view.blocks[best]} blocks, "
            f"estimated TTFT {best_t:.3f}s"
        )
        return Decided(
            scheduled(self.name, self.costs, state, request, seq, view, best, decode, reason), []
        )
