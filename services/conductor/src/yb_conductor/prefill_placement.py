"""Prefill placement: Mooncake's Algorithm 1, and where it is cheap, better.

For every prefill instance the paper compares its local prefix with the best prefix
anywhere; if the best beats the local one by `kvcache_balancing_threshold`, it plans a
transfer of the missing blocks, otherwise it computes from the local prefix; TTFT is
queue + transfer + prefill, and the minimum wins. What it never does (its authors say
so, kvcache-ai/Mooncake#749) is ask whether the transfer is worth it once the ratio
passes, nor whether even the local prefix is (an SSD far slower than recomputing a
small model). Here every instance gets three options — recompute, load the local
prefix, pull the rest of the best prefix — each estimated with the cost model, and
the fastest is kept; the ratio stays as a guard on when a transfer is considered
(`weigh_transfer=False` restores the paper's rule exactly, for what-if runs).

What "local" means: the instance's own engine cache (tier "engine", free) and its
host's kvstores (DRAM or SSD over the local path). A transfer pulls the missing
blocks from a kvstore on another host. Engines do not serve other engines.

Cost: the chain is walked once for all holders (`BlockIndex.match`). Instances with
no local prefix, usually nearly all of them, share one "best option" cost, so each
of them costs one subtraction; only the few on hosts that hold the prefix are
estimated one by one. And only the instances that can win are evaluated at all
(`candidates`): the holders, those with a queue, and the few fastest of the idle
rest; the decision and its candidate table are the full scan's, to the bit
(`full_scan=True` evaluates every instance, to compare).

Priority: an engine runs its queue by priority, then arrival, never preempting the
job at its head (running, or about to). A request therefore waits for the head and
for the queued work of its own priority or higher; what waits at a lower priority
it overtakes, so that work is left out of its queue estimate (`overtaken_s`). And
while it waits, work of a higher priority keeps arriving and overtakes it in turn:
if such work took a share rho of the prefill pool's time lately (over the last TTFT
SLO, `overtaking_load`), its wait stretches to wait / (1 - rho), the waiting time
of a lower class in a non-preemptive priority queue (the load counts placements
still in flight, the newest `OVERTAKING_LOOKBACK` at most, over the time they span
when that is shorter). With one priority
everywhere this is the plain queue, to the bit; `priority_order=False` prices every
queue in arrival order, as conductors did before engines ordered by priority (a
log they recorded replays that way).

Speed: with `learn_speed` an instance's work (transfer and prefill) is its
estimate times the slowdown the log taught it (`speed`), beside the engines of its
compute group that are busy now, and its queue is priced at that same speed. The
options compare at the cost model's speed; the slowdown then multiplies the
winner's work, so what is reused and from where stays the cost model's call.

Prefill groups (chunked pipeline parallelism): a group's lead stands for the group
(`ClusterState.live`) and is always evaluated. Its options are the same three, priced
for the pipeline: the prefill by `CostModel.pipeline_prefill_s` over its stages'
shares of the layers and its chunk size, and a load by its slowest stage, each stage
loading its share of every reused block (from its own host's kvstore locally, from
any other over the network). Its local prefix is what its lead's host holds: the
group stores what it computes there.

Tensor parallelism: each instance is priced at the degree and transfer lanes it
announced (`CostModel.at_degree`): its prefill at its compute, its loads over its
lanes; a group at its lead's. A pool of one shape (the usual case: every prefill
instance at one degree) is priced by one model, and everything above holds as it
is. A pool that mixes shapes shares one estimate per shape, and every instance is
evaluated: the quiet non-holders no longer rank by their learned slowdown alone.

Stickiness (`prefix_stickiness` > 0): instances are ranked by TTFT plus what the
copy of the prefix they would make costs (`CopyCost`: the copied blocks, at the
compute a block saves, times how full the pool is), ties going to the instance
idle longest (the earliest `busy_until`); the estimates and the candidate
table stay the TTFT's. 0 ranks by TTFT alone, ties by id, as conductors did before
the setting (a log they recorded replays that way).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from yb_conductor.candidates import PREFILL_PRUNE_ABOVE, Candidates, still_busy
from yb_conductor.cost_model import CostModel, DegreeCosts
from yb_conductor.speed import InstanceSpeed
from yb_conductor.state import ClusterState, InstanceState, usable_blocks
from yb_core import events as ev

RECOMPUTE = "recompute"
LOCAL = "local"
TRANSFER = "transfer"


@dataclass(slots=True)
class Source:
    """A block holder's prefix of the request's chain."""

    instance: InstanceState
    blocks: int
    ssd_blocks: int
    # Blocks a prefill queued or running on the instance is computing
    # (`pending_prefixes`), not yet stored.
    pending: bool = False

    def rank(self) -> tuple[int, int, str]:
        """Longer first, then fewer SSD blocks, then by id: deterministic."""
        return (-self.blocks, self.ssd_blocks, self.instance.instance_id)


@dataclass(slots=True)
class Estimate:
    """One way to prefill the request, before any queue: what it reuses and costs."""

    option: str
    local_blocks: int
    reuse_blocks: int
    transfer_s: float
    prefill_s: float
    local: Source | None = None
    engine: Source | None = None
    remote: Source | None = None

    @property
    def work_s(self) -> float:
        """Transfer plus prefill: what the option costs once the queue has drained."""
        return self.transfer_s + self.prefill_s


@dataclass(slots=True)
class Option:
    """An instance with its queue and the estimate it would take."""

    instance: InstanceState
    queue_s: float
    est: Estimate
    ttft_s: float
    factor: float = 1.0

    @property
    def transfer_s(self) -> float:
        """The estimate's transfer at the instance's expected speed."""
        return self.est.transfer_s * self.factor

    @property
    def prefill_s(self) -> float:
        """The estimate's prefill at the instance's expected speed."""
        return self.est.prefill_s * self.factor


@dataclass(slots=True)
class PrefillChoice:
    """Every instance's best option, as parallel lists (instance order), and the pick.

    Lists of floats rather than an object per instance: this is the hot loop of
    every decision, and 64+ small objects per admission cost more than the rest of
    the decision together.
    """

    instances: list[InstanceState]
    queues: list[float]
    ttfts: list[float]
    estimates: list[Estimate]
    chosen_index: int
    # Each instance's slowdown on its estimate's work (1.0 without `learn_speed`).
    factors: list[float] | None = None
    # When only the candidates that can win were evaluated: how many of the fastest
    # are sure to be the fastest of all, and how to evaluate every instance instead.
    exact_top: int = 0
    full: Callable[[], PrefillChoice] | None = None
    # With `stickiness`: the pick's copy cost, which it won on TTFT plus.
    chosen_copy_s: float = 0.0

    def option(self, i: int) -> Option:
        """Instance `i`'s option as an object."""
        factor = self.factors[i] if self.factors is not None else 1.0
        return Option(self.instances[i], self.queues[i], self.estimates[i], self.ttfts[i], factor)

    @property
    def chosen(self) -> Option:
        """The option with the lowest TTFT (first by id on ties)."""
        return self.option(self.chosen_index)


@dataclass(slots=True)
class PoolView:
    """What the pool holds of one request's chain, resolved to live instances."""

    keys: list[int]
    best: Source | None
    best_any_blocks: int
    best_any_source: str
    host_best: dict[str, Source]
    engines: dict[str, Source]


class Pricing:
    """One decision's prices on the instances of one shape (tensor-parallel degree,
    transfer lanes): the cost model there, prefill seconds by blocks reused
    (memoised), the estimate every such instance without a local prefix shares, and
    the copy cost (with `prefix_stickiness`)."""

    __slots__ = ("copy", "cost", "prefill_s", "shared")

    def __init__(
        self,
        planner: PrefillPlanner,
        state: ClusterState,
        view: PoolView,
        cost: CostModel,
        prompt: int,
        bs: int,
    ) -> None:
        memo: dict[int, float] = {}

        def prefill_s(reuse_blocks: int) -> float:
            t = memo.get(reuse_blocks)
            if t is None:
                cached = reuse_blocks * bs
                t = memo[reuse_blocks] = cost.prefill_s(prompt - cached, cached)
            return t

        self.cost = cost
        self.prefill_s = prefill_s
        self.shared = planner.estimate(0, None, None, view.best, prefill_s, bs, cost)
        self.copy = CopyCost(planner, state, view, prefill_s) if planner.stickiness > 0.0 else None


def overtaken_s(
    state: ClusterState, inst: InstanceState, priority: int, factor: float | None = None
) -> float:
    """Seconds of `inst`'s queue that a request of `priority` runs before: the waiting
    requests of a lower priority, and the head's rest when it is a batch line's
    prefill (`Placement.preemptible`; any other head is never overtaken).

    `factor`: the queue is priced at `factor` times the cost model's work (as
    `ClusterState.speed_queue_s` does); None prices it as the state's predicted
    prefill times (`busy_until`).
    """
    placements = state.placements
    total = 0.0
    queue = inst.prefill_queue
    head = placements.get(next(iter(queue))) if queue else None
    if head is not None and head.preemptible and head.priority < priority:
        # A batch line's prefill pauses for it at its next chunk (not priced).
        if factor is None:
            total = head.prefill_end - state.now if head.prefill_end > state.now else 0.0
        else:
            total = state.head_left_s(inst, factor)
    for rid in islice(queue, 1, None):
        p = placements.get(rid)
        if p is not None and p.priority < priority:
            total += p.prefill_s if factor is None else p.work_s * factor
    return total


# The share of a pool's time beyond which a lower priority is taken to wait as if
# higher ones filled it (its wait stretched 1 / (1 - this) = 50 times): finite, so
# that the figures stay numbers.
MAX_OVERTAKING_LOAD = 0.98
# Recent placements looked at for the overtaking load, at most (newest first): every
# decision pays for them (2 us for 64), whatever the priorities.
OVERTAKING_LOOKBACK = 64


def overtaking_load(state: ClusterState, priority: int, window_s: float, instances: int) -> float:
    """The share of each prefill instance's time that requests of a priority above
    `priority`, scheduled over the last `window_s`, took; capped at
    `MAX_OVERTAKING_LOAD`. Only the `OVERTAKING_LOOKBACK` newest placements are
    looked at: when they do not reach back `window_s`, the window is the time they
    span."""
    if window_s <= 0.0 or instances <= 0:
        return 0.0
    now = state.now
    since = now - window_s
    work = 0.0
    seen = 0
    oldest = now
    # Placements are kept in the order they were scheduled: newest last.
    for p in islice(reversed(state.placements.values()), OVERTAKING_LOOKBACK):
        if p.scheduled_at < since:
            break
        seen += 1
        oldest = p.scheduled_at
        if p.priority > priority:
            work += p.prefill_s
    if not work:
        return 0.0
    if seen == OVERTAKING_LOOKBACK and now - oldest > 0.0:
        window_s = now - oldest
    load = work / (window_s * instances)
    return load if load < MAX_OVERTAKING_LOAD else MAX_OVERTAKING_LOAD


class CopyCost:
    """What placing one request on an instance costs beyond its TTFT
    (`prefix_stickiness`).

    An instance that holds only `held` blocks of the longest prefix held anywhere
    stores the rest on its host again (pulled or recomputed). In a pool with free
    room the copy is free; in a full one it evicts as many blocks of other prefixes,
    whose next use must compute them again. So each copied block costs what one
    block of this request saves a prefill (the cost model's), times how full the
    pool is (`ClusterState.pool_fill`: the chance that storing a block evicts
    one), times the stickiness; with `eviction_regret`, also times the share of
    evicted blocks that a request asked for again (`ClusterState.eviction_regret`),
    since an evicted block nobody wants again costs nothing. A prefix then moves to
    another host only when the queue it escapes is worth more than what the copy
    pushes out. The pool's fill and the pool's regret,
    not the host's: every instance holding nothing of the prefix pays the same, so
    only the holders and the queued need evaluating one by one (`candidates`).

    An instance holding `held` blocks pays `(best - held) * per_block` seconds
    (nothing where `held >= best`); the planner reads the two in its loop.
    """

    __slots__ = ("best", "per_block")

    def __init__(
        self,
        planner: PrefillPlanner,
        state: ClusterState,
        view: PoolView,
        prefill_s: Callable[[int], float],
    ) -> None:
        # The longest prefix held anywhere, and what each block of it missing costs.
        self.best = view.best_any_blocks
        self.per_block = 0.0
        blocks = len(view.keys)
        if not self.best or not blocks:
            return
        saved = (prefill_s(0) - prefill_s(blocks)) / blocks
        per_block = planner.stickiness * saved * state.pool_fill()
        if planner.eviction_regret and per_block:
            per_block *= state.eviction_regret()
        self.per_block = per_block


def _slowdown(entry: tuple[float, float, str]) -> float:
    return entry[0]


# The explanation's default candidate table (`ConductorConfig.explain_top_k`) plus
# the one its sort looks past the chosen instance.
DEFAULT_KEEP = 9


class PrefillPlanner:
    """Estimates the prefill instances that can win a request and keeps the fastest
    option.

    `default_full_scan` and `default_keep` are what planners built without those
    arguments use (policies build their planner themselves): benchmarks and tests
    set them to compare the pruned evaluation with the full scan. Pools of at most
    `prune_above` instances are always scanned in full (it is cheaper there).
    """

    default_full_scan: bool = False
    default_keep: int = DEFAULT_KEEP
    prune_above: int = PREFILL_PRUNE_ABOVE

    def __init__(
        self,
        cost: CostModel,
        *,
        balancing_threshold: float = 1.0,
        weigh_transfer: bool = True,
        priority_order: bool = False,
        full_scan: bool | None = None,
        keep: int | None = None,
        stickiness: float = 0.0,
        eviction_regret: bool = False,
        pending_prefixes: bool = False,
        load_overlap: bool = False,
    ) -> None:
        self.cost = cost
        self.costs = DegreeCosts(cost)
        self.threshold = balancing_threshold
        self.weigh_transfer = weigh_transfer
        self.priority_order = priority_order
        # The weight of what a copy of the prefix displaces (`prefix_stickiness`).
        self.stickiness = stickiness
        # Whether an evicted block costs the share of them wanted again
        # (`eviction_regret`), rather than each one its recompute.
        self.eviction_regret = eviction_regret
        self.pending_prefixes = pending_prefixes
        # Whether a one-process prefill computes on a prefix as it lands
        # (`prefix_load_overlap`), and over how many layers: what the engines
        # announce (`KVCacheSpec.num_layers`); 1 until then, which prices no overlap.
        self.load_overlap = load_overlap
        self.overlap_layers = 1
        # Evaluate every instance (the reference the pruned evaluation must equal).
        self.full_scan = self.default_full_scan if full_scan is None else full_scan
        # How many of the fastest idle non-holders a decision evaluates: the
        # explanation's candidate table (`explain_top_k`) needs its length plus one;
        # a longer table evaluates every instance.
        self.keep = max(1, self.default_keep if keep is None else keep)

    def view(self, state: ClusterState, request: ev.RequestAdmitted) -> PoolView:
        """Walk the chain once and resolve every holder's prefix."""
        keys = request.block_hashes[: usable_blocks(request.prompt_tokens, request.block_size)]
        pending = self.pending_prefixes and bool(state.pending_prefixes)
        if not keys or not (len(state.index) or pending):
            return PoolView(keys, None, 0, "", {}, {})
        match = state.index.match(keys)
        best: Source | None = None
        best_any: Source | None = None
        host_best: dict[str, Source] = {}
        engines: dict[str, Source] = {}
        instances = state.instances
        index = state.index
        for slot, blocks in match.lengths.items():
            inst = instances.get(index.instance(slot))
            if inst is None or not inst.alive:
                continue
            if inst.model and request.model and inst.model != request.model:
                continue
            src = Source(inst, blocks, match.ssd.get(slot, 0))
            if best_any is None or src.rank() < best_any.rank():
                best_any = src
            if inst.role == "kvstore":
                if best is None or src.rank() < best.rank():
                    best = src
                held = host_best.get(inst.host)
                if held is None or src.rank() < held.rank():
                    host_best[inst.host] = src
            elif inst.role == "prefill":
                engines[inst.instance_id] = src
        # A request overtakes the queued prefills of a lower priority: what they
        # compute is not there in time for it (`pending_by_priority`).
        floor: int | None = None
        if pending and self.priority_order and request.priority > state.priorities_placed()[0]:
            if state.cfg.pending_by_priority:
                floor = request.priority
            else:
                pending = False
        if pending:
            for instance_id, blocks in state.pending_lengths(keys, floor).items():
                inst = instances.get(instance_id)
                if inst is None or not inst.alive or inst.stages:
                    continue
                stored = engines.get(instance_id)
                if stored is None or stored.blocks < blocks:
                    engines[instance_id] = Source(inst, blocks, 0, pending=True)
        return PoolView(
            keys,
            best,
            best_any.blocks if best_any else 0,
            best_any.instance.instance_id if best_any else "",
            host_best,
            engines,
        )

    # --- estimates -------------------------------------------------------------------

    @staticmethod
    def load_s(
        cost: CostModel,
        src: Source,
        blocks: int,
        block_size: int,
        remote: bool,
        share: float = 1.0,
    ) -> float:
        """Seconds to load `blocks` of a source's prefix at `cost` (the loading
        instance's: its lanes) (its SSD share pro rata; `share` of each block's
        layers, a pipeline stage's)."""
        if blocks <= 0 or src.instance.role != "kvstore":
            return 0.0
        ssd = round(blocks * src.ssd_blocks / src.blocks) if src.ssd_blocks else 0
        dram = blocks - ssd
        t = cost.load_s(dram, block_size, "dram", remote, share) if dram else 0.0
        if ssd:
            t += cost.load_s(ssd, block_size, "ssd", remote, share)
        return t

    def options(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        view: PoolView,
        prefills: list[InstanceState],
    ) -> PrefillChoice:
        """The best option of every instance that can win, and the fastest of all.

        Instances with no local prefix share one estimate (plus their own queue), so
        each costs a subtraction; of those with nothing queued only the few fastest
        are evaluated (`candidates`). Ties go to the first instance by id.
        """
        bs = max(1, request.block_size)
        shape = state.shape_of(prefills)
        # One shape: one pricing for all. Several: one per shape, every instance evaluated.
        pricing = None
        if shape is not None:
            pricing = Pricing(self, state, view, self.costs.at(*shape), request.prompt_tokens, bs)
        subset: list[int] | None = None
        exact_top = 0
        if pricing is not None and not self.full_scan and len(prefills) > self.prune_above:
            picked = self._candidates(state, view, prefills, pricing.shared.work_s)
            if picked is not None:
                subset, exact_top = picked
        choice = self._evaluate(state, request, view, prefills, subset, pricing, bs)
        if subset is not None:
            choice.exact_top = exact_top
            choice.full = lambda: self._evaluate(state, request, view, prefills, None, pricing, bs)
        return choice

    def _candidates(
        self,
        state: ClusterState,
        view: PoolView,
        prefills: list[InstanceState],
        shared_work: float,
    ) -> tuple[list[int], int] | None:
        """Positions in `prefills` that can win, in order, and how many of the fastest
        are sure to be the fastest of all; None when every instance must be evaluated
        (see `candidates` for why it is exact)."""
        if state.cfg.learn_speed and state.cfg.compute_sharing != "none":
            return None  # an idle engine's speed depends on its group's load
        positions = state.positions(prefills)
        index = state.candidates()
        found = self._table_candidates(state, view, prefills, positions, index, shared_work)
        if found is None:
            return None
        picked, taken, holding_or_queued = found
        if self.stickiness <= 0.0:
            return picked, taken
        # With stickiness the pick is not always among the fastest by id: ties go to
        # the instance idle longest. Every quiet non-holder pays the same copy cost,
        # so the one that ranks first is the fastest, idle longest among equals.
        winner = self._quiet_winner(
            state, prefills, positions, index, holding_or_queued, shared_work
        )
        if winner is not None and winner not in picked:
            picked = sorted([*picked, winner])
        return picked, taken

    def _quiet_winner(
        self,
        state: ClusterState,
        prefills: list[InstanceState],
        positions: dict[str, int],
        index: Candidates,
        skip: set[int],
        shared_work: float,
    ) -> int | None:
        """The position of the quiet non-holder (not in `skip`) whose TTFT, `w * f`
        (`w` without learned speed), is lowest, idle longest among equals (the
        earliest `busy_until`, then the lowest position: the tie order of
        `_evaluate`). `positions` and `index`: the state's, for `prefills`."""
        queued = index.may_be_queued
        learned = state.cfg.learn_speed
        best: tuple[float, int] | None = None  # (busy_until, position)
        best_t = math.inf
        # One pass over (slowdown, idle since, id): the first quiet entry of a
        # slowdown beats the rest of it, so the pass jumps to the next slowdown, which
        # can only tie (without learned speed, or by rounding) or lose.
        entries = index.by_idle()
        k = 0
        while k < len(entries):
            factor, _, instance_id = entries[k]
            t = shared_work * factor if learned else shared_work
            if t > best_t:
                break  # slower: so is every entry after it
            at = positions.get(instance_id)
            if at is None or at in skip or instance_id in queued:
                k += 1
                continue
            key = (prefills[at].busy_until, at)
            if best is None or t < best_t or key < best:
                best, best_t = key, t
            k = bisect.bisect_right(entries, factor, lo=k, key=_slowdown)
        return best[1] if best is not None else None

    def _table_candidates(
        self,
        state: ClusterState,
        view: PoolView,
        prefills: list[InstanceState],
        positions: dict[str, int],
        index: Candidates,
        shared_work: float,
    ) -> tuple[list[int], int, set[int]] | None:
        """`_candidates` for the explanation's table and the pick by TTFT, with the
        positions of the holders and the queued."""
        picked: set[int] = set()
        if view.host_best or view.engines:
            hosts = state.live_by_host()
            for host in view.host_best:
                for inst in hosts.get(host, ()):
                    i = positions.get(inst.instance_id)
                    if i is not None:
                        picked.add(i)
            for instance_id in view.engines:
                i = positions.get(instance_id)
                if i is not None:
                    picked.add(i)
        queued = index.may_be_queued
        picked.update(
            still_busy(
                queued,
                state.instances,
                state.prefill_busy,
                positions,
                lambda inst: index.set_idle_since(inst.instance_id, inst.busy_until),
            )
        )
        # A group's options are its own (the pipeline's): never the shared one.
        for lead in state.group_leads():
            i = positions.get(lead)
            if i is not None:
                picked.add(i)
        holding_or_queued = set(picked)
        # The quiet non-holders, fastest first: each one's TTFT is `0.0 + w * f`.
        learned = state.cfg.learn_speed
        order = index.by_speed() if learned else ((1.0, i.instance_id) for i in prefills)
        keep = self.keep
        taken = 0
        last_t = -math.inf
        last_f = math.nan
        mixed = False  # a tie of TTFTs between different factors (rounding) was taken
        for factor, instance_id in order:
            i = positions.get(instance_id)
            if i is None or i in picked or instance_id in queued:
                continue
            t = shared_work * factor if learned else shared_work
            if taken >= keep:
                if t > last_t:
                    return sorted(picked), taken, holding_or_queued
                if factor == last_f and not mixed:
                    # Later ones with this factor tie and come later by id; the next
                    # factor up must be strictly slower for the rest to be left out.
                    following = index.next_factor(factor) if learned else None
                    if following is None or shared_work * following > last_t:
                        return sorted(picked), taken, holding_or_queued
            if t == last_t and factor != last_f:
                mixed = True
            picked.add(i)
            taken += 1
            last_t, last_f = t, factor
        return None  # every instance is a candidate

    def _evaluate(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        view: PoolView,
        prefills: list[InstanceState],
        subset: list[int] | None,
        pricing: Pricing | None,
        bs: int,
    ) -> PrefillChoice:
        """The options of the instances at `subset`'s positions in `prefills` (None:
        all of them), in that order, and the fastest. `pricing`: the prices of every
        instance (a pool of one shape); None prices each at its own shape."""
        pool = len(prefills)
        if subset is not None:
            prefills = [prefills[i] for i in subset]
        now = state.now
        best = view.best
        by_shape: dict[tuple[int, int], Pricing] = {}
        if pricing is None:
            for inst in prefills:
                key = (inst.tensor_parallel, inst.transfer_lanes)
                if key not in by_shape:
                    cost = self.costs.at(*key)
                    by_shape[key] = Pricing(self, state, view, cost, request.prompt_tokens, bs)
            pricing = by_shape[(prefills[0].tensor_parallel, prefills[0].transfer_lanes)]
        shared = pricing.shared
        prefill_s = pricing.prefill_s
        cost = pricing.cost
        shared_work = shared.work_s
        host_best = view.host_best
        engines = view.engines
        any_local = bool(host_best or engines)
        n = len(prefills)
        queues = [0.0] * n
        ttfts = [0.0] * n
        estimates = [shared] * n
        factors: list[float] | None = None
        counts: dict[str, tuple[int, int]] = {}
        # Without shared compute an engine's slowdown is its `solo` alone.
        solo: dict[str, InstanceSpeed] | None = None
        if state.cfg.learn_speed:
            factors = [1.0] * n
            if state.cfg.compute_sharing == "none":
                solo = state.speeds
            else:
                counts = state.busy_by_group()
        priority = request.priority
        by_priority = self.priority_order
        stretch = 1.0
        overtakes = False
        if by_priority:
            lowest, highest = state.priorities_placed()
            # Work is overtaken only when placed at a lower priority, and overtakes
            # only from a higher one: elsewhere both terms are exactly zero.
            overtakes = priority > lowest
            if priority < highest:
                rho = overtaking_load(state, priority, request.slo.ttft_s, pool)
                if rho > 0.0:
                    stretch = 1.0 / (1.0 - rho)
        chosen = 0
        chosen_rank = math.inf
        copy = pricing.copy
        copy_best, copy_per_block = (copy.best, copy.per_block) if copy else (0, 0.0)
        for i, inst in enumerate(prefills):
            if by_shape:
                pricing = by_shape[(inst.tensor_parallel, inst.transfer_lanes)]
                shared, prefill_s, cost = pricing.shared, pricing.prefill_s, pricing.cost
                shared_work = shared.work_s
                estimates[i] = shared
                if pricing.copy is not None:
                    copy_per_block = pricing.copy.per_block
            factor = 1.0
            if factors is not None:
                if solo is not None:
                    learned = solo.get(inst.instance_id)
                    factor = learned.solo if learned is not None else 1.0
                else:
                    factor = state.prefill_slowdown(inst, state.busy_others(inst, counts=counts))
                factors[i] = factor
                queue = state.speed_queue_s(inst, factor) if inst.prefill_queue else 0.0
            else:
                busy = inst.busy_until
                queue = busy - now if busy > now else 0.0
            if by_priority and queue > 0.0:
                if overtakes:
                    speed = factor if factors is not None else None
                    ahead = queue - overtaken_s(state, inst, priority, speed)
                    queue = ahead if ahead > 0.0 else 0.0
                if stretch != 1.0:
                    queue *= stretch
            work = shared_work
            held = 0
            if inst.stages:
                est = self.group_estimate(inst, view, request.prompt_tokens, bs, cost)
                estimates[i] = est
                work = est.transfer_s + est.prefill_s
                held = est.local_blocks
            elif any_local:
                local = host_best.get(inst.host)
                engine = engines.get(inst.instance_id)
                if local is not None or engine is not None:
                    held = max(local.blocks if local else 0, engine.blocks if engine else 0)
                    est = self.estimate(held, local, engine, best, prefill_s, bs, cost)
                    estimates[i] = est
                    work = est.transfer_s + est.prefill_s
            t = queue + work * factor if factors is not None else queue + work
            queues[i] = queue
            ttfts[i] = t
            if copy is None:
                if t < chosen_rank:
                    chosen_rank = t
                    chosen = i
                continue
            # The copy's cost: each block of the longest prefix that it lacks.
            copied = copy_best - held
            rank = t + copied * copy_per_block if copied > 0 else t
            if rank < chosen_rank or (
                # Ties go to the instance idle longest (then by id): new prefixes
                # spread over the hosts' pools instead of filling the first host's.
                rank == chosen_rank and inst.busy_until < prefills[chosen].busy_until
            ):
                chosen_rank = rank
                chosen = i
        choice = PrefillChoice(prefills, queues, ttfts, estimates, chosen, factors)
        if copy is not None:
            choice.chosen_copy_s = chosen_rank - ttfts[chosen]
        return choice

    def estimate(
        self,
        local_blocks: int,
        local: Source | None,
        engine: Source | None,
        best: Source | None,
        prefill_s: Callable[[int], float],
        bs: int,
        cost: CostModel,
    ) -> Estimate:
        """The option an instance with this local prefix takes: the fastest of
        recompute / local / transfer (or the paper's rule when `weigh_transfer` is off),
        its loads at `cost` (the instance's)."""
        # The local load: engine blocks are free, the host's kvstore covers the rest.
        # Blocks still being computed there are priced as a load from the host's
        # DRAM: the engine's page cache may keep them, the host's pool will.
        engine_blocks = engine.blocks if engine else 0
        local_load = 0.0
        if engine is not None and engine.pending:
            local_load = cost.load_s(engine_blocks, bs, "dram", False)
        if local is not None and local.blocks > engine_blocks:
            local_load += self.load_s(cost, local, local.blocks - engine_blocks, bs, remote=False)
        recompute = Estimate(RECOMPUTE, local_blocks, 0, 0.0, prefill_s(0))
        local_est: Estimate | None = None
        overlaps = self.load_overlap and cost.tensor_parallel.degree <= 1
        if local_blocks > 0:
            compute_s = prefill_s(local_blocks)
            local_est = Estimate(
                LOCAL,
                local_blocks,
                local_blocks,
                self._exposed(local_load, compute_s) if overlaps else local_load,
                compute_s,
                local=local,
                engine=engine,
            )
        transfer_est: Estimate | None = None
        # The guard: a remote prefix is considered only when it beats the local one
        # by more than the balancing threshold (any local prefix of 0 is beaten).
        if (
            best is not None
            and best.blocks > local_blocks
            and (local_blocks == 0 or best.blocks / local_blocks > self.threshold)
        ):
            remote_load = self.load_s(cost, best, best.blocks - local_blocks, bs, remote=True)
            compute_s = prefill_s(best.blocks)
            load = local_load + remote_load
            transfer_est = Estimate(
                TRANSFER,
                local_blocks,
                best.blocks,
                self._exposed(load, compute_s) if overlaps else load,
                compute_s,
                local=local,
                engine=engine,
                remote=best,
            )
        return self._fastest(recompute, local_est, transfer_est)

    def _exposed(self, load_s: float, compute_s: float) -> float:
        """What a prefix load adds to the compute when the compute runs on it as it
        lands, layer by layer: the whole takes the longer of the two plus one layer's
        share of the shorter (the first layer's load, or the last layer's compute)."""
        if load_s <= 0.0:
            return 0.0
        layers = max(1, self.overlap_layers)
        whole = max(load_s, compute_s) + min(load_s, compute_s) / layers
        return whole - compute_s

    def _fastest(
        self, recompute: Estimate, local: Estimate | None, transfer: Estimate | None
    ) -> Estimate:
        """The option taken: the fastest, or with `weigh_transfer` off the paper's
        rule (transfer whenever the ratio passes, else the local prefix)."""
        if not self.weigh_transfer:
            return transfer or local or recompute
        chosen = recompute
        for est in (local, transfer):
            if est is not None and est.work_s < chosen.work_s:
                chosen = est
        return chosen

    def group_estimate(
        self, lead: InstanceState, view: PoolView, prompt: int, bs: int, cost: CostModel
    ) -> Estimate:
        """The option a prefill group takes (see the module docstring): as `estimate`,
        with the pipeline's prefill and each stage loading its share of the blocks,
        at `cost` (the lead's)."""
        shares, hosts, chunk = lead.stage_shares, lead.stage_hosts, lead.chunk_tokens

        def prefill_s(reuse_blocks: int) -> float:
            cached = reuse_blocks * bs
            return cost.pipeline_prefill_s(prompt - cached, cached, shares, chunk)

        def load_s(parts: list[tuple[Source, int]]) -> float:
            """The slowest stage's load of `parts` ((source, blocks) each)."""
            worst = 0.0
            for share, host in zip(shares, hosts, strict=True):
                t = 0.0
                for src, blocks in parts:
                    t += self.load_s(cost, src, blocks, bs, src.instance.host != host, share)
                if t > worst:
                    worst = t
            return worst

        local = view.host_best.get(lead.host)
        held = local.blocks if local is not None else 0
        recompute = Estimate(RECOMPUTE, held, 0, 0.0, prefill_s(0))
        local_est: Estimate | None = None
        local_parts: list[tuple[Source, int]] = []
        if local is not None and held > 0:
            local_parts = [(local, held)]
            local_est = Estimate(
                LOCAL, held, held, load_s(local_parts), prefill_s(held), local=local
            )
        best = view.best
        transfer_est: Estimate | None = None
        if (
            best is not None
            and best.blocks > held
            and (held == 0 or best.blocks / held > self.threshold)
        ):
            transfer_est = Estimate(
                TRANSFER,
                held,
                best.blocks,
                load_s([*local_parts, (best, best.blocks - held)]),
                prefill_s(best.blocks),
                local=local,
                remote=best,
            )
        return self._fastest(recompute, local_est, transfer_est)

    # --- the plan --------------------------------------------------------------------

    def reuse_plan(self, state: ClusterState, view: PoolView, opt: Option) -> list[ev.ReusePlan]:
        """Where each reused block comes from, as runs of one source and tier."""
        est = opt.est
        if est.reuse_blocks <= 0:
            return []
        keys = view.keys
        index = state.index
        plan: list[ev.ReusePlan] = []
        done = 0
        engine = est.engine
        if engine is not None and engine.blocks > 0:
            n = min(engine.blocks, est.reuse_blocks)
            plan.append(
                ev.ReusePlan(
                    source_instance=opt.instance.instance_id,
                    tier="engine",
                    first_block=0,
                    num_blocks=n,
                )
            )
            done = n
        for src in (est.local, est.remote):
            if src is None or done >= est.reuse_blocks:
                continue
            end = min(src.blocks, est.reuse_blocks)
            if end <= done:
                continue
            slot = index.slot_of(src.instance.instance_id)
            assert slot is not None
            for run in index.tier_runs(keys, done, end, slot):
                plan.append(
                    ev.ReusePlan(
                        source_instance=src.instance.instance_id,
                        tier=run.tier,
                        first_block=run.first,
                        num_blocks=run.count,
                    )
                )
            done = end
        return plan

    def candidates(self, choice: PrefillChoice, best_blocks: int, top_k: int) -> list[ev.Candidate]:
        """The chosen option first, then the next best by TTFT (`top_k` in all; 0: all)."""
        if choice.full is not None and (top_k <= 0 or top_k + 1 > choice.exact_top):
            choice = choice.full()  # a longer table than the candidates evaluated
        ttfts = choice.ttfts
        k = len(ttfts) if top_k <= 0 else top_k
        # A stable sort of indices: ties stay in instance-id order.
        order = sorted(range(len(ttfts)), key=ttfts.__getitem__)
        picked = [choice.chosen_index]
        picked.extend(i for i in order[: k + 1] if i != choice.chosen_index)
        return [self._candidate(choice, i, best_blocks) for i in picked[:k]]

    @staticmethod
    def _candidate(choice: PrefillChoice, i: int, best_blocks: int) -> ev.Candidate:
        """Instance `i` of a choice as a row of the explanation's table."""
        est = choice.estimates[i]
        inst = choice.instances[i]
        instance_id = inst.instance_id
        factor = choice.factors[i] if choice.factors is not None else 1.0
        source = ""
        if est.option == TRANSFER and est.remote is not None:
            source = est.remote.instance.instance_id
        elif est.option == LOCAL:
            # The plan takes what the engine holds first (free), the rest from the host.
            if est.engine is not None and est.engine.blocks >= est.reuse_blocks:
                source = instance_id
            elif est.local is not None:
                source = est.local.instance.instance_id
        return ev.Candidate(
            instance_id=instance_id,
            option=est.option,
            local_blocks=est.local_blocks,
            best_blocks=best_blocks,
            reuse_blocks=est.reuse_blocks,
            source=source,
            queue_s=choice.queues[i],
            # As `Option` prices them: the estimate's work at the instance's speed.
            transfer_s=est.transfer_s * factor,
            prefill_s=est.prefill_s * factor,
            ttft_s=choice.ttfts[i],
            stages=len(inst.stages),
        )
