"""What the host-local baselines share: local prefixes, seeded draws, the decision itself.

These baselines are the routers `yb sim` compares the conductor with. They run on the same
disaggregated cluster and see the same log, but none of them moves KV between hosts:
a prefill instance reuses only what its own host holds (its engine cache and its
host's kvstore), which is also what the simulated engines do on their own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from yb_conductor.admission import NO_DECODE, NO_PREFILL, Verdict
from yb_conductor.cost_model import CostModel, DegreeCosts, load_cost_model
from yb_conductor.policy_base import Decided, reject
from yb_conductor.state import ClusterState, InstanceState, usable_blocks
from yb_core import events as ev
from yb_core.config import ConductorConfig


@dataclass(slots=True)
class LocalView:
    """For each live prefill instance (`prefills`, by id): the prefix of the request
    its host holds, in blocks, and where from (the engine itself or its host's
    kvstore); and the longest prefix held anywhere (for the decision-quality figures)."""

    keys: list[int]
    prefills: list[InstanceState]
    blocks: list[int]
    sources: list[InstanceState | None]
    best_anywhere: int


def usable_keys(request: ev.RequestAdmitted) -> list[int]:
    """The prompt's blocks that can be reused: all but the one holding the last token
    (its logits must be computed)."""
    return request.block_hashes[: usable_blocks(request.prompt_tokens, request.block_size)]


def local_view(
    state: ClusterState, request: ev.RequestAdmitted, prefills: list[InstanceState]
) -> LocalView:
    """One walk of the chain for every holder, resolved to each prefill's host."""
    keys = usable_keys(request)
    n = len(prefills)
    blocks = [0] * n
    sources: list[InstanceState | None] = [None] * n
    view = LocalView(keys, prefills, blocks, sources, 0)
    if not keys or not len(state.index):
        return view
    match = state.index.match(keys)
    if not match.lengths:
        return view
    by_host: dict[str, tuple[int, InstanceState]] = {}
    by_engine: dict[str, tuple[int, InstanceState]] = {}
    best = 0
    instances, index = state.instances, state.index
    for slot, held in match.lengths.items():
        inst = instances.get(index.instance(slot))
        if inst is None or not inst.alive:
            continue
        best = max(best, held)
        if inst.role == "kvstore":
            old = by_host.get(inst.host)
            if old is None or held > old[0]:
                by_host[inst.host] = (held, inst)
        elif inst.role == "prefill":
            by_engine[inst.instance_id] = (held, inst)
    view.best_anywhere = best
    if by_host or by_engine:
        for i, p in enumerate(prefills):
            engine = by_engine.get(p.instance_id)
            host = by_host.get(p.host)
            # The engine's own blocks are free, so they win a tie.
            pick = engine if engine and (host is None or engine[0] >= host[0]) else host
            if pick is not None:
                blocks[i], sources[i] = pick
    return view


def draw(seed: int, request_id: str, salt: str, n: int) -> int:
    """A uniform pick in [0, n) that depends only on the seed and the request: a
    replay draws the same, whatever the process's hash seed."""
    digest = hashlib.blake2b(f"{seed}:{salt}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def missing_pool(
    request: ev.RequestAdmitted,
    seq: int,
    name: str,
    prefills: list[InstanceState],
    decodes: list[InstanceState],
) -> Decided | None:
    """The rejection when a pool is empty (the only one a host-local baseline makes)."""
    if not prefills:
        verdict = Verdict(NO_PREFILL, "no live prefill instance", 1.0)
        return Decided(reject(request, seq, name, verdict), [])
    if not decodes:
        verdict = Verdict(NO_DECODE, "no live decode instance", 1.0)
        return Decided(reject(request, seq, name, verdict), [])
    return None


class BaselinePolicy:
    """What every host-local baseline has: its settings, its cost model (for the estimates
    a decision carries) and the live pools of a request, or the rejection when one
    is empty."""

    name = "baseline"

    def __init__(self, cfg: ConductorConfig | None = None, cost: CostModel | None = None) -> None:
        self.cfg = cfg or ConductorConfig()
        self.cost = cost or load_cost_model(self.cfg.cost_model)
        self.costs = DegreeCosts(self.cost)

    def live_pools(
        self, state: ClusterState, request: ev.RequestAdmitted, seq: int
    ) -> tuple[list[InstanceState], list[InstanceState], Decided | None]:
        """The live prefill and decode instances serving the request's model, and
        the rejection to return instead when either pool is empty."""
        prefills = state.live("prefill", request.model)
        decodes = state.live("decode", request.model)
        return prefills, decodes, missing_pool(request, seq, self.name, prefills, decodes)


def least_busy_decode(decodes: list[InstanceState]) -> InstanceState:
    """The decode instance with the fewest requests per batch slot (first by id)."""
    return min(decodes, key=lambda i: i.decode_requests / max(1, i.max_batch_size))


def _reuse_plan(state: ClusterState, view: LocalView, i: int) -> tuple[int, list[ev.ReusePlan]]:
    """What prefill `i` of the view reuses locally, as runs of one source and tier."""
    blocks = view.blocks[i]
    source = view.sources[i]
    if not blocks or source is None:
        return 0, []
    if source.instance_id == view.prefills[i].instance_id:
        run = ev.ReusePlan(
            source_instance=source.instance_id, tier="engine", first_block=0, num_blocks=blocks
        )
        return blocks, [run]
    slot = state.index.slot_of(source.instance_id)
    runs = state.index.tier_runs(view.keys, 0, blocks, slot) if slot is not None else []
    plan = [
        ev.ReusePlan(
            source_instance=source.instance_id,
            tier=run.tier,
            first_block=run.first,
            num_blocks=run.count,
        )
        for run in runs
    ]
    return blocks, plan


def scheduled(
    name: str,
    costs: DegreeCosts,
    state: ClusterState,
    request: ev.RequestAdmitted,
    seq: int,
    view: LocalView,
    i: int,
    decode: InstanceState,
    reason: str,
) -> ev.RequestScheduled:
    """The decision to run the request on prefill `i` of the view (reusing its local
    prefix) and on `decode`, with the cost model's estimates (each instance's at its
    degree)."""
    prefill = view.prefills[i]
    cost = costs.of(prefill)
    bs = max(1, request.block_size)
    reused, plan = _reuse_plan(state, view, i)
    transfer_s = 0.0
    for run in plan:
        if run.tier != "engine":
            transfer_s += cost.load_s(run.num_blocks, bs, run.tier, remote=False)
    cached = reused * bs
    queue_s = state.queue_s(prefill)
    prefill_s = cost.prefill_s(request.prompt_tokens - cached, cached)
    batch = decode.decode_requests + 1
    estimates = ev.Estimates(
        queue_s=queue_s,
        transfer_s=transfer_s,
        prefill_s=prefill_s,
        ttft_s=queue_s + transfer_s + prefill_s,
        tbt_s=costs.of(decode).tbt_s(batch, decode.decode_context_tokens + request.prompt_tokens),
        decode_batch=batch,
    )
    explain = ev.Explanation(
        branch="local" if reused else "recompute",
        reason=reason,
        best_blocks=view.best_anywhere,
    )
    return ev.RequestScheduled(
        time=request.time,
        request_id=request.request_id,
        gateway_id=request.gateway_id,
        prefill_instance=prefill.instance_id,
        decode_instance=decode.instance_id,
        reused_blocks=reused,
        reuse=plan,
        estimates=estimates,
        policy=name,
        admitted_seq=seq,
        prompt_tokens=request.prompt_tokens,
        computed_tokens=request.prompt_tokens - cached,
        explain=explain,
    )
