"""The conductor's picture of the cluster, built only by folding logged events.

Nothing here reads a clock or a socket: `ClusterState.apply(event)` is the only way in,
so the same log always yields the same state, which is what makes replay exact.
Time is the event time (the newest `event.time` seen). Nothing that decides iterates
a `set` of strings (its order changes with the process's hash seed): ordered dicts
and sorted lists only.

What is tracked, and why:
- instances, with liveness from heartbeats (`LoadReport`) measured in event time,
  and each engine's tensor-parallel degree and transfer lanes (`InstanceUp`), at
  which the policies price its work (`CostModel.at_degree`); an engine that drains
  (`InstanceDraining`: it was told to stop) stays alive for what it holds (its
  requests finish there, its load counts) but is no candidate for anything new
  until an announcement of a new process under its id;
- the global block index (`BlockIndex`), guarded per instance by (epoch, event_id):
  a gap or a new epoch voids that instance's entries and asks for an inventory;
- placements: every scheduled request until it finishes, with what the conductor
  predicted for it. Per prefill instance its queue in the order the engine runs it
  (with `priority_order`: the head, running, then by priority and arrival; else
  arrival) and the predicted time it drains (`busy_until`), re-anchored whenever
  the engine reports progress, so estimates do not drift; per decode instance the
  requests assigned to it, those already decoding, and their context;
- what completions teach: `t_d` (the expected decode duration) and the mean output
  length, as moving averages, and each completion's estimate-vs-outcome; with
  `learn_speed`, each engine's speed against the cost model (`speed`), alone and
  beside the other busy engines it shares compute with, and each decode
  instance's lag to the first token;
- what the log should be told: instances found dead by their silence
  (`declared_dead`, published as `InstanceDown` so that everyone who follows
  announcements forgets them) and requests left without an owner (`cancel_wanted`,
  published as `RequestCancelled` so that every engine frees them): those queued on
  or prefilling at a prefill instance that died, those assigned to a decode instance
  that died, and those of a gateway that died or restarted (nobody will read their
  tokens). Only the active conductor publishes them; a replay computes the same.
  A request orphaned by an engine while its gateway lives is that gateway's first:
  it re-plans it (`RequestReplanned`, which releases the old placement and so
  withdraws the cancel) or ends it itself, so its cancel waits `REPLAN_GRACE_S`
  (`cancel_not_before`): a cancel logged first would also end the new attempt.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Iterator

import msgspec

from yb_conductor.block_index import BlockIndex
from yb_conductor.candidates import Candidates, solo_factor
from yb_conductor.speed import (
    InstanceSpeed,
    SharedSpeed,
    learn_first_token,
    learn_prefill,
    slowdown,
)
from yb_core import events as ev
from yb_core.config import ConductorConfig

BLOCK_HOLDER_ROLES: tuple[ev.Role, ...] = ("kvstore", "prefill")
# Roles whose silence is a death: they heartbeat from their first moment. Others
# (gateways, conductors) count only once they have sent a load report.
HEARTBEAT_ROLES: tuple[ev.Role, ...] = ("kvstore", "prefill", "decode")
# Policies whose estimates carry the learned slowdown (the others price with the
# cost model alone, so their estimates are the work itself).
SPEED_AWARE: tuple[str, ...] = ("mooncake",)
#: Event-time seconds a live gateway has to re-plan (or cancel) a request that a dead
#: engine orphaned before the conductor cancels it (see the module docstring).
REPLAN_GRACE_S = 5.0


# Evicted blocks remembered for `eviction_regret`, at most (the oldest are forgotten).
MAX_EVICTED_TRACKED = 1 << 20


class InstanceState(msgspec.Struct, kw_only=True):
    """One instance as the log describes it, and the load the conductor sent it."""

    instance_id: str
    role: ev.Role
    host: str
    model: str = ""
    ucx_address: str = ""
    block_size: int = 0
    kv_capacity_blocks: int = 0
    max_batch_size: int = 0
    epoch: int = 0
    up_since: float = 0.0
    last_seen: float = 0.0
    alive: bool = True
    # It drains (`InstanceDraining`): alive for what it holds, never placed on again.
    draining: bool = False
    last_report: ev.LoadReport | None = None
    # Prefill: requests sent here whose prefill has not finished, in order.
    prefill_queue: dict[str, None] = msgspec.field(default_factory=dict)
    prefill_tokens_in_flight: int = 0
    prefill_requests_in_flight: int = 0
    busy_until: float = 0.0
    # The queue's work at the cost model's speed, and since when its head has run:
    # with `learn_speed` the queue is priced at the speed expected now.
    prefill_work_s: float = 0.0
    running_since: float = 0.0
    # Decode: every request assigned here (in prefill or decoding) and those decoding.
    assigned: dict[str, None] = msgspec.field(default_factory=dict)
    decode_requests: int = 0
    decode_context_tokens: int = 0
    decoding_requests: int = 0
    decoding_context_tokens: int = 0
    decode_kv_blocks: int = 0
    # Decode: how many blocks more the conductor accounts for the requests committed
    # here than the instance reports using (its own page accounting), a moving
    # average over its load reports (`KV_CALIBRATION_ALPHA`).
    kv_overcount_blocks: float = 0.0
    # Decode: how many blocks more the instance reports using than the pages its
    # committed requests are projected to hold now (`held_blocks_now`), a moving
    # average over its load reports (`decode_kv_peak`; may be negative).
    kv_unprojected_blocks: float = 0.0
    # Prefill: a stage of a prefill group (`InstanceUp.group`), its layers and the
    # group's chunk size.
    group: str = ""
    layer_start: int = 0
    layer_end: int = 0
    num_layers: int = 0
    chunk_tokens: int = 0
    # A group's lead while live stages cover every layer (`ClusterState.live`): the
    # stages in layer order (the lead first), each one's share of the layers, and
    # their hosts. Empty on every other instance.
    stages: list[str] = msgspec.field(default_factory=list)
    stage_shares: list[float] = msgspec.field(default_factory=list)
    stage_hosts: list[str] = msgspec.field(default_factory=list)
    # Decode: it takes prompts into its batch (`InstanceUp.piggyback`); they queue
    # there as a prefill instance's jobs do (`prefill_queue`, `busy_until`).
    piggyback: bool = False
    # Engines: the ranks it spans and the lanes its KV moves over (`InstanceUp`;
    # 1 and 1 in a log from before tensor parallelism), which price its work
    # (`CostModel.at_degree`).
    tensor_parallel: int = 1
    transfer_lanes: int = 1


class Placement(msgspec.Struct, kw_only=True):
    """A scheduled request until it finishes, with the conductor's predictions."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    prompt_tokens: int
    computed_tokens: int
    # The decision's attempt: a late `RequestFinished` of an earlier one is ignored.
    attempt: int = 0
    gateway_id: str = ""
    max_tokens: int = 0
    priority: int = 0
    scheduled_at: float = 0.0
    deadline: float = 0.0
    prefill_s: float = 0.0
    prefill_end: float = 0.0
    context_tokens: int = 0
    kv_blocks: int = 0
    # The tokens of the request's pages (its admission's block size; 0 in a snapshot
    # from before the field: the decode instance's).
    block_size: int = 0
    est_ttft_s: float = 0.0
    est_tbt_s: float = 0.0
    # Its decode cannot last longer than max_tokens at the estimated TBT.
    duration_cap: float = math.inf
    prefill_done: bool = False
    # Its prefill started: its decode pages are reserved (`kv_reserved_at_start`).
    reserved: bool = False
    decode_started: float = 0.0
    # What learning needs: its prefill's work at the cost model's speed, when it
    # started and beside how many busy engines, and when it ended.
    work_s: float = 0.0
    started_at: float = 0.0
    others_at_start: float = 0.0
    prefill_done_at: float = 0.0
    # The prompt's usable prefix blocks while its prefill runs on a prefill instance
    # (`pending_prefixes`): after it, the instance holds them.
    pending_keys: list[int] = msgspec.field(default_factory=list)
    # A batch line's prefill, which its engine pauses between two layers for work of a
    # higher priority (`batch_preemption`); `paused`: work started ahead of it while
    # it ran, so its duration says nothing of the engine's speed.
    preemptible: bool = False
    paused: bool = False


class PendingAdmission(msgspec.Struct, kw_only=True, gc=False):
    """What an admission says that its decision does not repeat."""

    max_tokens: int
    priority: int
    deadline: float
    block_size: int
    # Its block chain: once placed, its prefill's prefix is pending there.
    keys: list[int] = msgspec.field(default_factory=list)
    # 0 for an admission, k for the k-th re-plan.
    attempt: int = 0
    # A line of the Batch API (`RequestAdmitted.batch`, `RequestReplanned.batch`): its
    # prefill is pre-emptible.
    batch: bool = False


class BlockTracker(msgspec.Struct, kw_only=True, gc=False):
    """Where an instance's block event stream stands, to notice gaps and restarts."""

    epoch: int = -1
    last_event_id: int = 0
    needs_resync: bool = False


class Outcome(msgspec.Struct, kw_only=True, gc=False):
    """A completed request: what was estimated against what happened."""

    request_id: str
    est_ttft_s: float
    ttft_s: float
    est_tbt_s: float
    tbt_s: float
    decode_s: float


# Calibration (see `Calibration`): the moving averages' weight per outcome (a slope
# is a ratio of two noisy averages, so slower than `decode_time_alpha`), and how many
# outcomes it needs before it is trusted at all.
CALIBRATION_ALPHA = 0.02
CALIBRATION_MIN_OUTCOMES = 50
# The weight of each decode load report in `kv_overcount_blocks`: two counts of the
# same requests, so little noise, and a report a second.
KV_CALIBRATION_ALPHA = 0.3


class Calibration(msgspec.Struct, kw_only=True, gc=False):
    """What outcomes say an estimate means: the least-squares line of observed on
    estimated values over completed requests (exponentially weighted moving means,
    variance and covariance, weight `CALIBRATION_ALPHA`).

    `expected(estimate)` is the line's value, but never above the estimate: outcomes
    may show that an estimate overstates (a decode batch predicted large at the end
    of a prefill shrinks again while the request decodes), never make admission
    stricter than the estimate itself, which would starve the outcomes it learns from.
    """

    outcomes: int = 0
    mean_estimate: float = 0.0
    mean_observed: float = 0.0
    var_estimate: float = 0.0
    covariance: float = 0.0

    def learn(self, estimate: float, observed: float) -> None:
        """One completed request's estimate and what it observed."""
        self.outcomes += 1
        if self.outcomes == 1:
            self.mean_estimate, self.mean_observed = estimate, observed
            return
        a = CALIBRATION_ALPHA
        de = estimate - self.mean_estimate
        do = observed - self.mean_observed
        self.mean_estimate += a * de
        self.mean_observed += a * do
        self.var_estimate = (1 - a) * (self.var_estimate + a * de * de)
        self.covariance = (1 - a) * (self.covariance + a * de * do)

    def expected(self, estimate: float) -> float:
        """What an estimate of `estimate` is expected to turn out (at most itself)."""
        if self.outcomes < CALIBRATION_MIN_OUTCOMES or self.var_estimate <= 0.0:
            return estimate
        slope = self.covariance / self.var_estimate
        line = self.mean_observed + (slope if slope > 0.0 else 0.0) * (
            estimate - self.mean_estimate
        )
        return line if line < estimate else estimate


class Learned(msgspec.Struct, kw_only=True, gc=False):
    """Moving averages taught by completions.

    `ttft` and `tbt`: what completed requests' TTFT and mean TBT were against the
    conductor's estimates for them; calibrated admission judges by them.
    """

    decode_time_s: float
    output_tokens: float = 64.0
    completions: int = 0
    ttft: Calibration = msgspec.field(default_factory=Calibration)
    tbt: Calibration = msgspec.field(default_factory=Calibration)


def usable_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks can be reused: all but the one holding its last
    token (its logits must be computed)."""
    return max(0, (prompt_tokens - 1) // max(1, block_size))


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading elements `a` and `b` share (`a[0] == b[0]` known): a
    bisection over slice comparisons, each one C's loop."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n - 1  # a[:lo] matches; a[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PlacedPriorities:
    """How many placements of a `placements` dict (by identity: a restored snapshot
    brings its own) have each priority, and the lowest and highest of them: kept
    exact as placements come and go, so that decisions depend on the placements
    alone, not on the order they came in."""

    __slots__ = ("counts", "highest", "lowest", "placements")

    def __init__(self, placements: dict[str, Placement]) -> None:
        self.placements = placements
        self.counts: dict[int, int] = {}
        for p in placements.values():
            self.counts[p.priority] = self.counts.get(p.priority, 0) + 1
        self._bounds()

    def add(self, priority: int) -> None:
        n = self.counts.get(priority, 0)
        self.counts[priority] = n + 1
        if not n:
            self._bounds()

    def remove(self, priority: int) -> None:
        n = self.counts[priority] - 1
        if n:
            self.counts[priority] = n
        else:
            del self.counts[priority]
            self._bounds()

    def _bounds(self) -> None:
        counts = self.counts
        self.lowest = min(counts, default=0)
        self.highest = max(counts, default=0)


class ClusterState:
    """Instances, their loads, scheduled requests and the global block index."""

    def __init__(self, cfg: ConductorConfig | None = None) -> None:
        # The conductor's settings, one object read where needed (`Conductor.configure`
        # swaps it); `decode_time_s` seeds the learned decode time once, here.
        self.cfg = cfg or ConductorConfig()
        # Per engine (by id, kept across restarts: the hardware stays), and per group
        # of engines sharing compute (by group, see `_group`).
        self.speeds: dict[str, InstanceSpeed] = {}
        self.shared_speeds: dict[str, SharedSpeed] = {}
        self.now = 0.0
        self.instances: dict[str, InstanceState] = {}
        self.placements: dict[str, Placement] = {}
        self.admissions: dict[str, PendingAdmission] = {}
        self.index = BlockIndex()
        # (capacity, blocks held) of the live kvstores that announced a capacity;
        # None: to be counted again (`pool_fill`).
        self._pool_totals: tuple[int, int] | None = None
        self.block_trackers: dict[str, BlockTracker] = {}
        # Instances whose block stream broke; the service asks them for an inventory.
        self.resync_wanted: dict[str, None] = {}
        # Instances found silent (id -> reason) and orphaned requests (id -> reason)
        # that the service announces (see the module docstring).
        self.declared_dead: dict[str, str] = {}
        self.cancel_wanted: dict[str, str] = {}
        # Request id -> the event time before which its wanted cancel is not
        # published: its gateway lives and may re-plan it.
        self.cancel_not_before: dict[str, float] = {}
        self.learned = Learned(decode_time_s=self.cfg.decode_time_s)
        # First block key -> the placements whose prefill has not ended and whose
        # prompt starts with it, in placement order (`pending_prefixes`).
        self.pending_prefixes: dict[int, dict[str, None]] = {}
        # Completions not yet collected by whoever exports metrics (bounded).
        self.outcomes: list[Outcome] = []
        self.expired_placements = 0
        self._deadlines: list[tuple[float, str]] = []
        self._next_expiry = math.inf
        self._live_cache: dict[tuple[ev.Role, str, int], list[InstanceState]] = {}
        self._live_positions: dict[int, tuple[list[InstanceState], dict[str, int]]] = {}
        self._min_capacity: dict[int, tuple[list[InstanceState], int]] = {}
        self._shapes: dict[int, tuple[list[InstanceState], tuple[int, int] | None]] = {}
        # Which prefill instances a decision must evaluate (see `candidates`).
        self._candidates = Candidates()
        self._hosts_cache: dict[str, list[InstanceState]] | None = None
        # The leads of the prefill groups that can run (`_resolve_groups`).
        self._group_leads: list[str] = []
        # Eviction regret (`eviction_regret`): blocks evicted from the last instance
        # holding them and not asked for since (oldest first, at most
        # `MAX_EVICTED_TRACKED`), how many blocks were so evicted, and how many of
        # them an admission asked for afterwards.
        self.evicted_unheld: dict[int, None] = {}
        self.evicted_blocks = 0
        self.evicted_wanted = 0
        # How many of `placements` have each priority (see `priorities_placed`).
        self._priorities: PlacedPriorities | None = None

    # --- the fold ---------------------------------------------------------------------

    def apply(self, event: ev.AnyEvent) -> None:
        """Fold one event into the state."""
        if event.time > self.now:
            self.now = event.time
        match event:
            case ev.LoadReport():
                self._load_report(event)
            case ev.RequestProgress():
                self._progress(event)
            case ev.BlockStored() | ev.BlockEvicted() | ev.BlockMoved() | ev.BlocksCleared():
                self._block_event(event)
            case ev.RequestAdmitted():
                if self.evicted_unheld:
                    self._wanted_again(event.block_hashes)
                self.admissions[event.request_id] = PendingAdmission(
                    max_tokens=event.max_tokens,
                    priority=event.priority,
                    deadline=event.deadline,
                    block_size=event.block_size,
                    keys=event.block_hashes,
                    batch=event.batch,
                )
            case ev.RequestScheduled():
                self.place(event)
            case ev.RequestRejected():
                self.admissions.pop(event.request_id, None)
            case ev.RequestReplanned():
                self._replanned(event)
            case ev.RequestFinished():
                self._finished(event)
            case ev.RequestCancelled():
                self._release(event.request_id)
            case ev.InstanceUp():
                self._instance_up(event)
            case ev.InstanceDown():
                self._instance_down(event)
            case ev.InstanceDraining():
                self._instance_draining(event)
            case ev.BlockInventory():
                self._inventory(event)
            case _:
                pass
        if self.now >= self._next_expiry:
            self._expire_silent_instances()
        if self._deadlines and self._deadlines[0][0] < self.now:
            self._expire_placements()

    def place(self, decision: ev.RequestScheduled) -> None:
        """Account a decision's load; idempotent per request id."""
        rid = decision.request_id
        if rid in self.placements:
            return
        pending = self.admissions.pop(rid, None)
        max_tokens = pending.max_tokens if pending else 0
        block_size = pending.block_size if pending and pending.block_size else 1
        deadline = pending.deadline if pending and pending.deadline else 0.0
        if not deadline or deadline > decision.time + self.cfg.request_timeout_s:
            deadline = decision.time + self.cfg.request_timeout_s
        est = decision.estimates
        prefill_s = est.transfer_s + est.prefill_s
        prefill = self.instances.get(decision.prefill_instance)
        start = max(self.now, prefill.busy_until) if prefill is not None else self.now
        work_s = prefill_s
        if self.cfg.learn_speed and prefill is not None and decision.policy in SPEED_AWARE:
            # The estimate was priced at the slowdown expected now (the same state
            # the policy saw); the queue keeps its work at the cost model's speed.
            factor = self.prefill_slowdown(prefill, self.busy_others(prefill))
            if factor > 0.0:
                work_s = prefill_s / factor
        out = self.expected_output(max_tokens)
        context = decision.prompt_tokens + out // 2
        placement = Placement(
            request_id=rid,
            prefill_instance=decision.prefill_instance,
            decode_instance=decision.decode_instance,
            prompt_tokens=decision.prompt_tokens,
            computed_tokens=decision.computed_tokens,
            attempt=decision.attempt,
            gateway_id=decision.gateway_id,
            max_tokens=max_tokens,
            priority=pending.priority if pending else 0,
            scheduled_at=decision.time,
            deadline=deadline,
            prefill_s=prefill_s,
            prefill_end=start + prefill_s,
            context_tokens=context,
            kv_blocks=-(-(decision.prompt_tokens + out) // block_size),
            block_size=block_size,
            est_ttft_s=est.ttft_s,
            est_tbt_s=est.tbt_s,
            duration_cap=max_tokens * est.tbt_s if max_tokens and est.tbt_s else math.inf,
            work_s=work_s,
            preemptible=bool(pending and pending.batch and self.cfg.batch_preemption),
        )
        self.placements[rid] = placement
        if pending and pending.keys and prefill is not None and prefill.role == "prefill":
            usable = usable_blocks(decision.prompt_tokens, block_size)
            if usable > 0:
                placement.pending_keys = pending.keys[:usable]
                self.add_pending(placement)
        priorities = self._priorities
        if priorities is not None and priorities.placements is self.placements:
            priorities.add(placement.priority)
        heapq.heappush(self._deadlines, (deadline, rid))
        if prefill is not None:
            if not prefill.prefill_queue:
                prefill.running_since = self.now
            prefill.prefill_work_s += work_s
            prefill.prefill_tokens_in_flight += decision.computed_tokens
            prefill.prefill_requests_in_flight += 1
            if not (self.cfg.priority_order and self._overtake(prefill, placement)):
                prefill.prefill_queue[rid] = None
                prefill.busy_until = placement.prefill_end
            if prefill.role == "prefill":
                self._candidates.queued(prefill.instance_id)
        decode = self.instances.get(decision.decode_instance)
        if decode is not None:
            self._candidates.decode_busy[decode.instance_id] = None
            decode.assigned[rid] = None
            decode.decode_requests += 1
            decode.decode_context_tokens += context
            decode.decode_kv_blocks += placement.kv_blocks

    def _overtake(self, inst: InstanceState, placement: Placement) -> bool:
        """Queue `placement` ahead of the waiting requests of a lower priority (never
        ahead of the head: it runs, unless it is a batch line's prefill, which its
        engine pauses: `Placement.preemptible`), re-timing them; False if it
        overtakes none."""
        if placement.priority <= self.priorities_placed()[0]:
            return False  # no request placed is of a lower priority
        placements = self.placements
        order = list(inst.prefill_queue)
        at = -1
        for k in range(len(order)):
            p = placements.get(order[k])
            if p is not None and p.priority < placement.priority and (k or p.preemptible):
                at = k
                break
        if at < 0:
            return False
        if at == 0:
            # The batch line pauses at its next chunk: what it has left runs after.
            head = placements[order[0]]
            head.paused = True
            start = self.now
            inst.running_since = self.now
        else:
            ahead = placements.get(order[at - 1])
            start = ahead.prefill_end if ahead is not None else self.now
        t = placement.prefill_end = max(self.now, start) + placement.prefill_s
        order.insert(at, placement.request_id)
        for rid in order[at + 1 :]:
            p = placements.get(rid)
            if p is not None:
                t += p.prefill_s
                p.prefill_end = t
        inst.prefill_queue = dict.fromkeys(order)
        inst.busy_until = t
        return True

    def unplace(self, request_id: str) -> None:
        """Undo `place` (a recomputed decision that the log overruled)."""
        self._release(request_id)

    def _replanned(self, event: ev.RequestReplanned) -> None:
        """A gateway continues a request on a new plan: the old placement's load is
        released (its failed engine is, or soon will be, out of the state anyway) and
        the re-plan waits for its decision as an admission does."""
        self._release(event.request_id)
        self.admissions[event.request_id] = PendingAdmission(
            max_tokens=event.max_tokens,
            priority=event.priority,
            deadline=event.deadline,
            block_size=event.block_size,
            keys=event.block_hashes,
            attempt=event.attempt,
            batch=event.batch,
        )

    @contextlib.contextmanager
    def avoiding(self, *instance_ids: str) -> Iterator[None]:
        """Within the block, `instance_ids` count as not alive (a re-plan avoids the
        engine whose failure ended the request's last attempt, before any verdict on
        it reaches the log; a request for its prompt's logprobs avoids the prefill
        groups)."""
        found = [self.instances.get(i) for i in instance_ids if i]
        avoided = [inst for inst in found if inst is not None and inst.alive]
        if not avoided:
            yield
            return
        for inst in avoided:
            inst.alive = False
        self._topology_changed()
        try:
            yield
        finally:
            for inst in avoided:
                inst.alive = True
            self._topology_changed()

    def expected_output(self, max_tokens: int) -> int:
        """Output tokens a request is expected to produce: the learned mean, capped."""
        mean = int(self.learned.output_tokens)
        return min(max_tokens, mean) if max_tokens > 0 else mean

    # --- instances --------------------------------------------------------------------

    def _instance_up(self, event: ev.InstanceUp) -> None:
        old = self.instances.get(event.instance_id)
        if old is not None and old.role == "gateway" and old.epoch != event.epoch:
            # A new incarnation of the gateway: the old one's clients are gone.
            self._orphan(old, f"gateway {event.instance_id} restarted")
        inst = InstanceState(
            instance_id=event.instance_id,
            role=event.role,
            host=event.host,
            model=event.model,
            ucx_address=event.ucx_address,
            block_size=event.block_size,
            kv_capacity_blocks=event.kv_capacity_blocks,
            max_batch_size=event.max_batch_size,
            epoch=event.epoch,
            up_since=event.time,
            last_seen=event.time,
            group=event.group,
            layer_start=event.layer_start,
            layer_end=event.layer_end,
            num_layers=event.num_layers,
            chunk_tokens=event.chunk_tokens,
            piggyback=event.piggyback,
            tensor_parallel=max(1, event.tensor_parallel),
            transfer_lanes=max(1, event.transfer_lanes),
        )
        if old is not None:
            # Requests in flight there stay accounted until they finish or expire.
            for name in (
                "prefill_queue",
                "prefill_tokens_in_flight",
                "prefill_requests_in_flight",
                "busy_until",
                "prefill_work_s",
                "running_since",
                "assigned",
                "decode_requests",
                "decode_context_tokens",
                "decoding_requests",
                "decoding_context_tokens",
                "decode_kv_blocks",
            ):
                setattr(inst, name, getattr(old, name))
            if old.epoch == event.epoch:
                inst.last_report = old.last_report
                # The same process announced again (a reconnect, a verdict it
                # disputes): a drain goes on; a new process takes work.
                inst.draining = old.draining
            if not old.alive and event.role in BLOCK_HOLDER_ROLES:
                self._forget_blocks(event.instance_id)
        self.instances[event.instance_id] = inst
        if inst.role == "prefill":
            self._candidates.set_speed(
                inst.instance_id, solo_factor(self.speeds.get(inst.instance_id))
            )
            self._candidates.queued(inst.instance_id)
        elif inst.role == "decode" and self.decode_busy(inst):
            self._candidates.decode_busy[inst.instance_id] = None
        self._topology_changed()
        self._next_expiry = min(self._next_expiry, event.time + self.cfg.heartbeat_timeout_s)

    def _load_report(self, event: ev.LoadReport) -> None:
        inst = self.instances.get(event.instance_id)
        if inst is None:
            return
        inst.last_report = event
        if event.time > inst.last_seen:
            inst.last_seen = event.time
        if inst.role == "decode" and event.kv_total_blocks:
            self._learn_kv_overcount(inst, event.kv_used_blocks)
        if not inst.alive:
            inst.alive = True
            self.declared_dead.pop(inst.instance_id, None)
            self._topology_changed()
            if inst.instance_id in self.block_trackers:
                # Back from the dead: what it holds now is unknown, so ask.
                self.resync_wanted[inst.instance_id] = None

    def _learn_kv_overcount(self, inst: InstanceState, used_blocks: int) -> None:
        """Compare what the conductor counts for the requests committed on a decode
        instance, their budgets and the pages they are projected to hold now, with
        what it reports using."""
        placements = self.placements
        committed = projected = 0
        at_start = self.cfg.kv_reserved_at_start
        t_d = self.learned.decode_time_s
        for rid in inst.assigned:
            p = placements.get(rid)
            if p is not None and (p.decode_started or (at_start and p.reserved)):
                committed += p.kv_blocks
                projected += self.held_blocks_now(p, inst, t_d)
        if not committed:
            return  # nothing to compare: an idle instance teaches nothing
        inst.kv_overcount_blocks += KV_CALIBRATION_ALPHA * (
            committed - used_blocks - inst.kv_overcount_blocks
        )
        inst.kv_unprojected_blocks += KV_CALIBRATION_ALPHA * (
            used_blocks - projected - inst.kv_unprojected_blocks
        )

    def held_blocks_now(self, p: Placement, inst: InstanceState, t_d: float) -> int:
        """The pages a request holds on its decode instance now, as the engine holds
        them (`decode_kv_peak`): its prompt's, and once it decodes, one more per
        `block_size` tokens generated, at its expected pace (its expected output over
        its expected decode time, `t_d` or less by its `max_tokens`), up to its
        `max_tokens`. Whether its pages are taken yet is the caller's to judge."""
        bs = p.block_size or inst.block_size or 1
        tokens = p.prompt_tokens
        if p.decode_started:
            out = 2 * (p.context_tokens - p.prompt_tokens)  # its expected output
            duration = p.duration_cap if p.duration_cap < t_d else t_d
            if duration > 0.0 and self.now > p.decode_started:
                generated = int(out * (self.now - p.decode_started) / duration)
                if p.max_tokens and generated > p.max_tokens:
                    generated = p.max_tokens
                tokens += generated
        return -(-tokens // bs)

    def _instance_down(self, event: ev.InstanceDown) -> None:
        # The log says it now: a standby must not say it again when it takes over.
        self.declared_dead.pop(event.instance_id, None)
        inst = self.instances.get(event.instance_id)
        if inst is None or not inst.alive:
            return  # unknown, or declared dead already (our own verdict read back)
        inst.alive = False
        self._forget_blocks(inst.instance_id)
        self._topology_changed()
        self._orphan(inst, f"{inst.role} instance {inst.instance_id} went down: {event.reason}")

    def _instance_draining(self, event: ev.InstanceDraining) -> None:
        """No candidate for new work from here on; what it holds finishes there."""
        inst = self.instances.get(event.instance_id)
        if inst is None or inst.draining:
            return
        inst.draining = True
        self._topology_changed()

    def _expire_silent_instances(self) -> None:
        limit = self.now - self.cfg.heartbeat_timeout_s
        oldest = math.inf
        for inst in self.instances.values():
            if not inst.alive:
                continue
            if inst.last_seen < limit:
                inst.alive = False
                self._forget_blocks(inst.instance_id)
                self._topology_changed()
                if inst.role in HEARTBEAT_ROLES or inst.last_report is not None:
                    reason = f"no heartbeat for {self.cfg.heartbeat_timeout_s:g}s"
                    self.declared_dead[inst.instance_id] = reason
                    self._orphan(inst, f"{inst.role} instance {inst.instance_id}: {reason}")
            elif inst.last_seen < oldest:
                oldest = inst.last_seen
        self._next_expiry = oldest + self.cfg.heartbeat_timeout_s

    def _orphan(self, inst: InstanceState, reason: str) -> None:
        """Mark for cancellation the requests that `inst` was needed to finish."""
        match inst.role:
            case "prefill":
                # Those whose prefill had not ended there; the others are in decode.
                # A stage's group runs its requests on every stage (queued at the lead).
                orphans = list(inst.prefill_queue)
                if inst.group:
                    for other in self.instances.values():
                        if other.group == inst.group and other is not inst:
                            orphans.extend(other.prefill_queue)
            case "decode":
                orphans = list(inst.assigned)
            case "gateway":
                iid = inst.instance_id
                orphans = [r for r, p in self.placements.items() if p.gateway_id == iid]
            case _:
                return
        for request_id in orphans:
            placement = self.placements.get(request_id)
            if placement is None:
                continue
            self.cancel_wanted.setdefault(request_id, reason)
            gateway = self.instances.get(placement.gateway_id)
            if (
                inst.role != "gateway"
                and gateway is not None
                and gateway.role == "gateway"
                and gateway.alive
            ):
                self.cancel_not_before.setdefault(request_id, self.now + REPLAN_GRACE_S)

    def _topology_changed(self) -> None:
        self._pool_totals = None
        self._live_cache.clear()
        self._live_positions.clear()
        self._min_capacity.clear()
        self._shapes.clear()
        self._hosts_cache = None

    # --- requests ---------------------------------------------------------------------

    def _progress(self, event: ev.RequestProgress) -> None:
        placement = self.placements.get(event.request_id)
        if placement is None:
            return
        if event.stage == "prefill_started":
            placement.reserved = True
            if not placement.prefill_done:
                inst = self.instances.get(placement.prefill_instance)
                if self.cfg.priority_order and inst is not None:
                    self._runs_first(inst, event.request_id)
                self._reanchor(placement.prefill_instance, event.request_id, event.time)
                if inst is not None:
                    inst.running_since = event.time
                    if self.cfg.learn_speed and not placement.started_at:
                        placement.started_at = event.time
                        placement.others_at_start = self.busy_others(inst, forward=False)
            return
        if not placement.prefill_done:
            self._prefill_finished(placement, event.time)
        if event.stage == "kv_committed" and not placement.decode_started:
            placement.decode_started = event.time
            decode = self.instances.get(placement.decode_instance)
            if decode is not None:
                decode.decoding_requests += 1
                decode.decoding_context_tokens += placement.context_tokens

    def _runs_first(self, inst: InstanceState, request_id: str) -> None:
        """The engine started `request_id`: it heads the queue now (the engine's
        order may differ from ours, as when jobs reached it in another order, or
        when it paused a batch line's prefill for it)."""
        queue = inst.prefill_queue
        if request_id in queue and (head := next(iter(queue))) != request_id:
            ahead = self.placements.get(head)
            if ahead is not None and ahead.preemptible:
                ahead.paused = True
            del queue[request_id]
            inst.prefill_queue = {request_id: None, **queue}

    def add_pending(self, placement: Placement) -> None:
        """Index a placement whose prefill computes `pending_keys` (by its first key)."""
        key = placement.pending_keys[0]
        rids = self.pending_prefixes.get(key)
        if rids is None:
            self.pending_prefixes[key] = {placement.request_id: None}
        else:
            rids[placement.request_id] = None

    def _drop_pending(self, placement: Placement) -> None:
        keys = placement.pending_keys
        if not keys:
            return
        placement.pending_keys = []
        rids = self.pending_prefixes.get(keys[0])
        if rids is not None:
            rids.pop(placement.request_id, None)
            if not rids:
                del self.pending_prefixes[keys[0]]

    def pending_lengths(self, keys: list[int], floor: int | None = None) -> dict[str, int]:
        """Per prefill instance, how many leading `keys` the prefills queued or running
        there will have computed when they end (`pending_prefixes`). With `floor`,
        only those a request of that priority runs behind: of a priority at or above
        it, or running and not to be paused (`Placement.preemptible`)."""
        if not keys:
            return {}
        rids = self.pending_prefixes.get(keys[0])
        if not rids:
            return {}
        lengths: dict[str, int] = {}
        placements = self.placements
        for rid in rids:
            p = placements[rid]
            if floor is not None and p.priority < floor and not self._runs_ahead(p):
                continue
            n = _common_prefix(keys, p.pending_keys)
            if n > lengths.get(p.prefill_instance, 0):
                lengths[p.prefill_instance] = n
        return lengths

    def _runs_ahead(self, placement: Placement) -> bool:
        """Whether `placement`'s prefill runs before anything placed after it: it
        heads its instance's queue and cannot be paused."""
        if placement.preemptible:
            return False
        inst = self.instances.get(placement.prefill_instance)
        return inst is not None and next(iter(inst.prefill_queue), None) == placement.request_id

    def _prefill_finished(self, placement: Placement, at: float) -> None:
        self._drop_pending(placement)
        placement.prefill_done = True
        placement.prefill_done_at = at
        inst = self.instances.get(placement.prefill_instance)
        if inst is None:
            return
        if (
            self.cfg.learn_speed
            and placement.started_at
            and not placement.paused
            and inst.role == "prefill"
        ):
            others = (placement.others_at_start + self.busy_others(inst, forward=False)) / 2
            group = self._group(inst)
            shared = self.shared_speeds.get(group) or SharedSpeed(per_busy=self.cfg.sharing_prior)
            learn_prefill(
                self.speed_of(inst.instance_id),
                shared,
                at - placement.started_at,
                placement.work_s,
                others,
                alpha=self.cfg.speed_alpha,
            )
            if shared.samples:
                self.shared_speeds[group] = shared
            self._candidates.set_speed(
                inst.instance_id, solo_factor(self.speeds.get(inst.instance_id))
            )
        self._dequeue(inst, placement)
        inst.running_since = at
        self._reanchor(placement.prefill_instance, None, at)

    def _dequeue(self, inst: InstanceState, placement: Placement) -> None:
        inst.prefill_queue.pop(placement.request_id, None)
        inst.prefill_tokens_in_flight -= placement.computed_tokens
        inst.prefill_requests_in_flight -= 1
        # Exactly nothing once empty: a running sum of floats drifts.
        inst.prefill_work_s = inst.prefill_work_s - placement.work_s if inst.prefill_queue else 0.0

    def _reanchor(self, instance_id: str, running: str | None, at: float) -> None:
        """The queue drains from `at` on: `running` (if any) started then, the others
        follow in order. Keeps the queue estimate honest when predictions were off."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        t = at
        started = running is None
        for rid in inst.prefill_queue:
            if not started:
                if rid != running:
                    continue  # ahead of the running one: must be done; its event is late
                started = True
            p = self.placements.get(rid)
            if p is None:
                continue
            t += p.prefill_s
            p.prefill_end = t
        inst.busy_until = t if inst.prefill_queue else at
        if inst.role == "prefill":
            self._candidates.queued(instance_id)

    def _finished(self, event: ev.RequestFinished) -> None:
        if event.attempt is not None and event.attempt < self._attempt_of(event.request_id):
            # The end of an attempt already re-planned (its engine's word reached
            # the log after the re-plan's): the newer attempt lives on.
            return
        placement = self.placements.get(event.request_id)
        if placement is not None and event.outcome == "completed":
            started = placement.decode_started or placement.prefill_end
            decode_s = max(0.0, event.time - started) if event.time and started else 0.0
            if not decode_s:
                decode_s = event.output_tokens * event.tbt_mean_s
            learned = self.learned
            a = self.cfg.decode_time_alpha
            # A request cut short for lack of KV ended before its output did.
            whole = self.cfg.learn_from_cut_short or event.reason != ev.CUT_SHORT_REASON
            if decode_s > 0 and whole:
                learned.decode_time_s += a * (decode_s - learned.decode_time_s)
            if event.output_tokens > 0 and whole:
                learned.output_tokens += a * (event.output_tokens - learned.output_tokens)
            if placement.est_ttft_s > 0 and event.ttft_s > 0:
                learned.ttft.learn(placement.est_ttft_s, event.ttft_s)
            if placement.est_tbt_s > 0 and event.tbt_mean_s > 0:
                learned.tbt.learn(placement.est_tbt_s, event.tbt_mean_s)
            learned.completions += 1
            if self.cfg.learn_speed and placement.prefill_done_at and event.ttft_s > 0:
                # TTFT runs from the decision; what follows the prefill's end is the lag.
                learn_first_token(
                    self.speed_of(placement.decode_instance),
                    event.ttft_s - (placement.prefill_done_at - placement.scheduled_at),
                    alpha=self.cfg.speed_alpha,
                )
            if len(self.outcomes) < 10_000:
                self.outcomes.append(
                    Outcome(
                        request_id=event.request_id,
                        est_ttft_s=placement.est_ttft_s,
                        ttft_s=event.ttft_s,
                        est_tbt_s=placement.est_tbt_s,
                        tbt_s=event.tbt_mean_s,
                        decode_s=decode_s,
                    )
                )
        self._release(event.request_id)

    def _attempt_of(self, request_id: str) -> int:
        """The attempt of `request_id` placed or waiting for its decision (0 if none)."""
        placement = self.placements.get(request_id)
        if placement is not None:
            return placement.attempt
        pending = self.admissions.get(request_id)
        return pending.attempt if pending is not None else 0

    def _release(self, request_id: str) -> None:
        self.admissions.pop(request_id, None)
        self.cancel_wanted.pop(request_id, None)
        self.cancel_not_before.pop(request_id, None)
        placement = self.placements.pop(request_id, None)
        if placement is None:
            return
        priorities = self._priorities
        if priorities is not None and priorities.placements is self.placements:
            priorities.remove(placement.priority)
        self._drop_pending(placement)
        if not placement.prefill_done:
            placement.prefill_done = True
            inst = self.instances.get(placement.prefill_instance)
            if inst is not None and request_id in inst.prefill_queue:
                head = next(iter(inst.prefill_queue))
                self._dequeue(inst, placement)
                if head == request_id:
                    inst.running_since = self.now
                    self._reanchor(inst.instance_id, None, self.now)
        decode = self.instances.get(placement.decode_instance)
        if decode is not None and request_id in decode.assigned:
            del decode.assigned[request_id]
            decode.decode_requests -= 1
            decode.decode_context_tokens -= placement.context_tokens
            decode.decode_kv_blocks -= placement.kv_blocks
            if placement.decode_started:
                decode.decoding_requests -= 1
                decode.decoding_context_tokens -= placement.context_tokens

    def _expire_placements(self) -> None:
        # A request whose end never reached the log (a crashed engine) must not hold
        # load for ever: past its deadline the gateway has given up on it anyway.
        while self._deadlines and self._deadlines[0][0] < self.now:
            deadline, rid = heapq.heappop(self._deadlines)
            placement = self.placements.get(rid)
            if placement is not None and placement.deadline == deadline:
                self.expired_placements += 1
                self._release(rid)
        for rid in [r for r, a in self.admissions.items() if a.deadline < self.now]:
            del self.admissions[rid]

    # --- block index --------------------------------------------------------------------

    def _block_event(self, event: ev.BlockEvent) -> None:
        instance_id = event.instance_id
        before = self.index.blocks_held(instance_id)
        self._apply_block_event(event)
        self._pool_changed(instance_id, before)

    def _apply_block_event(self, event: ev.BlockEvent) -> None:
        instance_id = event.instance_id
        tracker = self.block_trackers.get(instance_id)
        if tracker is None:
            tracker = self.block_trackers[instance_id] = BlockTracker()
        if event.epoch != tracker.epoch:
            # A restart: what we knew of the instance is void until it tells us again.
            self.index.clear(instance_id)
            tracker.epoch = event.epoch
            tracker.last_event_id = 0
            if event.event_id != 1 and not isinstance(event, ev.BlocksCleared):
                tracker.needs_resync = True
                self.resync_wanted[instance_id] = None
        elif event.event_id <= tracker.last_event_id:
            return  # a redelivery
        elif event.event_id != tracker.last_event_id + 1:
            tracker.needs_resync = True
            self.resync_wanted[instance_id] = None
        tracker.last_event_id = event.event_id
        match event:
            case ev.BlockStored():
                self.index.store(instance_id, event.block_hashes, event.tier)
            case ev.BlockMoved():
                self.index.move(instance_id, event.block_hashes, event.to_tier)
            case ev.BlockEvicted():
                self.index.evict(instance_id, event.block_hashes)
                self._evicted(event.block_hashes)
            case ev.BlocksCleared():
                self.index.clear(instance_id)

    def _inventory(self, event: ev.BlockInventory) -> None:
        before = self.index.blocks_held(event.instance_id)
        self._apply_inventory(event)
        self._pool_changed(event.instance_id, before)

    def _apply_inventory(self, event: ev.BlockInventory) -> None:
        tracker = self.block_trackers.get(event.instance_id)
        if (
            tracker is not None
            and tracker.epoch == event.epoch
            and event.event_id < tracker.last_event_id
            and not tracker.needs_resync
        ):
            return  # an old answer: we are already past it
        self.index.clear(event.instance_id)
        tracker = self.block_trackers[event.instance_id] = BlockTracker(
            epoch=event.epoch, last_event_id=event.event_id
        )
        self.resync_wanted.pop(event.instance_id, None)
        self.index.store(event.instance_id, event.dram, "dram")
        self.index.store(event.instance_id, event.ssd, "ssd")
        self.index.store(event.instance_id, event.engine, "engine")

    def _pool_changed(self, instance_id: str, before: int) -> None:
        """Keep the pool's totals in step with what one instance's blocks did."""
        totals = self._pool_totals
        inst = self.instances.get(instance_id)
        if totals is None or inst is None or not self._in_pool(inst):
            return
        self._pool_totals = (totals[0], totals[1] + self.index.blocks_held(instance_id) - before)

    @staticmethod
    def _in_pool(inst: InstanceState) -> bool:
        return inst.alive and inst.role == "kvstore" and inst.kv_capacity_blocks > 0

    def _evicted(self, keys: list[int]) -> None:
        """Remember the blocks that no instance holds any more."""
        lost = self.evicted_unheld
        index = self.index
        for key in keys:
            if not index.held(key):
                lost[key] = None
                self.evicted_blocks += 1
        while len(lost) > MAX_EVICTED_TRACKED:
            del lost[next(iter(lost))]

    def _wanted_again(self, keys: list[int]) -> None:
        """Count the blocks of an admitted chain that were evicted and are wanted."""
        lost = self.evicted_unheld
        for key in keys:
            if key in lost:
                del lost[key]
                self.evicted_wanted += 1

    def eviction_regret(self) -> float:
        """The share of blocks evicted from their last holder that a request asked
        for afterwards: what a block a copy evicts is expected to cost (1 until a
        block was evicted; at most 1)."""
        share = (self.evicted_wanted + 1) / (self.evicted_blocks + 1)
        return share if share < 1.0 else 1.0

    def pool_fill(self) -> float:
        """How full the live kvstores are, together: blocks held over their capacity,
        at most 1 (1 when none announced a capacity: taken as full)."""
        totals = self._pool_totals
        if totals is None:
            capacity = held = 0
            for inst in self.instances.values():
                if self._in_pool(inst):
                    capacity += inst.kv_capacity_blocks
                    held += self.index.blocks_held(inst.instance_id)
            totals = self._pool_totals = (capacity, held)
        capacity, held = totals
        if not capacity or held >= capacity:
            return 1.0
        return held / capacity

    def _forget_blocks(self, instance_id: str) -> None:
        before = self.index.blocks_held(instance_id)
        self.index.clear(instance_id)
        self._pool_changed(instance_id, before)
        tracker = self.block_trackers.get(instance_id)
        if tracker is not None:
            # Whatever comes next from it starts a fresh epoch as far as we know.
            tracker.epoch = -1
            tracker.last_event_id = 0

    # --- queries ------------------------------------------------------------------------

    def live(self, role: ev.Role, model: str = "", block_size: int = 0) -> list[InstanceState]:
        """Live instances of a role (serving `model`, and with pages of `block_size`
        tokens, when given) that take new work (not draining), by id for determinism.

        A prefill group counts as one instance, its lead, while its live stages cover
        every layer (`stages` set); its other stages, and the stages of a group that
        cannot run, are left out. An engine whose pages hold another number of tokens
        than the request's blocks cannot take it: its KV layout differs, and its
        prefix hashes too (a misconfigured process; `yb status` warns of it). An
        instance that announced no block size is not excluded. Cached until the
        topology changes: the policy asks on every admission.
        """
        key = (role, model, block_size)
        found = self._live_cache.get(key)
        if found is None:
            if role == "prefill":
                self._resolve_groups()
            found = sorted(
                (
                    i
                    for i in self.instances.values()
                    if i.alive
                    and not i.draining
                    and i.role == role
                    and (not model or not i.model or i.model == model)
                    and (not block_size or not i.block_size or i.block_size == block_size)
                    and (not i.group or i.stages)
                ),
                key=lambda i: i.instance_id,
            )
            self._live_cache[key] = found
        return found

    def _resolve_groups(self) -> None:
        """Set each prefill group's lead and stages from its live members: the chain
        of stages from layer 0 to the last, each starting where the one before ends
        (the lowest id first among equals); none where a layer is left uncovered. A
        stage that drains leaves its layers uncovered: it takes no new request."""
        groups: dict[str, list[InstanceState]] = {}
        for inst in self.instances.values():
            if inst.group and inst.role == "prefill":
                inst.stages, inst.stage_shares, inst.stage_hosts = [], [], []
                if inst.alive and not inst.draining:
                    groups.setdefault(inst.group, []).append(inst)
        self._group_leads = []
        for members in groups.values():
            members.sort(key=lambda i: (i.layer_start, i.instance_id))
            layers = members[0].num_layers
            chain: list[InstanceState] = []
            end = 0
            for inst in members:
                if inst.layer_start == end and inst.layer_end > end and inst.num_layers == layers:
                    chain.append(inst)
                    end = inst.layer_end
            if not chain or layers <= 0 or end != layers:
                continue
            lead = chain[0]
            lead.stages = [i.instance_id for i in chain]
            lead.stage_shares = [(i.layer_end - i.layer_start) / layers for i in chain]
            lead.stage_hosts = [i.host for i in chain]
            self._group_leads.append(lead.instance_id)
        self._group_leads.sort()

    def group_leads(self) -> list[str]:
        """The leads of the prefill groups that can run, by id."""
        self.live("prefill")
        return self._group_leads

    def positions(self, live: list[InstanceState]) -> dict[str, int]:
        """Each instance of a list `live` gave, by id, with its position there
        (cached with the live lists)."""
        found = self._live_positions.get(id(live))
        if found is None or found[0] is not live:
            found = self._live_positions[id(live)] = (
                live,
                {inst.instance_id: i for i, inst in enumerate(live)},
            )
        return found[1]

    def priorities_placed(self) -> tuple[int, int]:
        """The lowest and highest priority of the requests placed now (0, 0 when none
        is). A request of a priority at or below the lowest overtakes nobody's work,
        and at or above the highest is overtaken by none."""
        priorities = self._priorities
        placements = self.placements
        if priorities is None or priorities.placements is not placements:
            priorities = self._priorities = PlacedPriorities(placements)
        return priorities.lowest, priorities.highest

    def candidates(self) -> Candidates:
        """The structures that say which instances can win a decision
        (`candidates`), in step with the state."""
        found = self._candidates
        instances = self.instances
        if found.indexes(instances, self.speeds):
            return found
        found.sync(
            instances,
            self.speeds,
            (
                (i.instance_id, self.prefill_busy(i), i.busy_until)
                for i in instances.values()
                if i.role == "prefill"
            ),
            (
                i.instance_id
                for i in instances.values()
                if i.role == "decode" and self.decode_busy(i)
            ),
        )
        return found

    def prefill_busy(self, inst: InstanceState) -> bool:
        """Whether a prefill instance would keep a request waiting (a queue, or a
        predicted drain still ahead); else its queue estimate is 0."""
        return bool(inst.prefill_queue) or inst.busy_until > self.now

    @staticmethod
    def decode_busy(inst: InstanceState) -> bool:
        """Whether a decode instance has any work accounted (else it is idle: a
        batch of one, no KV held)."""
        return bool(inst.assigned or inst.decode_kv_blocks or inst.decode_requests)

    def min_decode_capacity(self, decodes: list[InstanceState]) -> int:
        """The smallest KV capacity (in blocks) among `decodes` that has one (0: none
        is bounded); cached with the live lists."""
        key = id(decodes)
        found = self._min_capacity.get(key)
        if found is None or found[0] is not decodes:
            caps = [i.kv_capacity_blocks for i in decodes if i.kv_capacity_blocks]
            found = self._min_capacity[key] = (decodes, min(caps) if caps else 0)
        return found[1]

    def shape_of(self, live: list[InstanceState]) -> tuple[int, int] | None:
        """The (tensor-parallel degree, transfer lanes) every instance of a list
        `live` gave shares; None when they differ or the list is empty (cached with
        the live lists). A pool of one shape is priced by one cost model."""
        key = id(live)
        found = self._shapes.get(key)
        if found is None or found[0] is not live:
            shapes = {(i.tensor_parallel, i.transfer_lanes) for i in live}
            found = self._shapes[key] = (live, shapes.pop() if len(shapes) == 1 else None)
        return found[1]

    def live_by_host(self) -> dict[str, list[InstanceState]]:
        """Live block holders (kvstores, engines) per host, by id."""
        if self._hosts_cache is None:
            hosts: dict[str, list[InstanceState]] = {}
            for inst in sorted(self.instances.values(), key=lambda i: i.instance_id):
                if inst.alive and inst.role in BLOCK_HOLDER_ROLES:
                    hosts.setdefault(inst.host, []).append(inst)
            self._hosts_cache = hosts
        return self._hosts_cache

    def queue_s(self, inst: InstanceState) -> float:
        """Predicted seconds until the instance's prefill queue drains."""
        return inst.busy_until - self.now if inst.busy_until > self.now else 0.0

    # --- learned speed (see `speed`) -------------------------------------------------

    def speed_of(self, instance_id: str) -> InstanceSpeed:
        """The instance's learned speed (created on first use)."""
        speed = self.speeds.get(instance_id)
        if speed is None:
            speed = self.speeds[instance_id] = InstanceSpeed()
        return speed

    def _group(self, inst: InstanceState) -> str:
        match self.cfg.compute_sharing:
            case "all":
                return ""
            case "host":
                return inst.host
        return inst.instance_id

    @staticmethod
    def _busy(inst: InstanceState) -> int:
        """1: busy now (a prefill engine with requests in flight, a decode engine
        decoding); 2: a decode engine that will be, once prefills it waits for end;
        0: idle."""
        if not inst.alive:
            return 0
        match inst.role:
            case "prefill":
                return 1 if inst.prefill_requests_in_flight > 0 else 0
            case "decode":
                if inst.decoding_requests > 0:
                    return 1
                return 2 if inst.decode_requests > 0 else 0
        return 0

    def busy_by_group(self) -> dict[str, tuple[int, int]]:
        """Per compute group: engines busy now, and decode engines busy soon."""
        counts: dict[str, tuple[int, int]] = {}
        if self.cfg.compute_sharing == "none":
            return counts
        for inst in self.instances.values():
            busy = self._busy(inst)
            if busy:
                group = self._group(inst)
                now, soon = counts.get(group, (0, 0))
                counts[group] = (now + 1, soon) if busy == 1 else (now, soon + 1)
        return counts

    def busy_others(
        self,
        inst: InstanceState,
        forward: bool = True,
        counts: dict[str, tuple[int, int]] | None = None,
    ) -> int:
        """Busy engines that share `inst`'s compute, `inst` itself left out.

        `forward`: during a prefill queued on `inst` now. A decode engine waiting for
        prefills counts only when `inst` has a queue: the requests ahead of this one
        will be decoding while it runs; an idle engine starts it at once, before any
        other prefill ends (most often).
        """
        if self.cfg.compute_sharing == "none":
            return 0
        if counts is None:
            counts = self.busy_by_group()
        now, soon = counts.get(self._group(inst), (0, 0))
        n = now - 1 if self._busy(inst) == 1 else now
        if forward and inst.prefill_requests_in_flight > 0:
            n += soon
        return n

    def prefill_slowdown(self, inst: InstanceState, others: int) -> float:
        """The factor on the cost model's prefill time on `inst` beside `others`
        busy engines (1.0 without `learn_speed`)."""
        if not self.cfg.learn_speed:
            return 1.0
        per_busy = self.cfg.sharing_prior
        if others:
            shared = self.shared_speeds.get(self._group(inst))
            if shared is not None:
                per_busy = shared.per_busy
        return slowdown(self.speeds.get(inst.instance_id), per_busy, others)

    def speed_queue_s(self, inst: InstanceState, factor: float) -> float:
        """Predicted seconds until the prefill queue drains with every prefill in it
        `factor` times the cost model's time: what the head has left, then the rest.
        A head already past its estimate is taken to be ending now."""
        if not inst.prefill_queue:
            return 0.0
        head = self.placements.get(next(iter(inst.prefill_queue)))
        head_work = head.work_s if head is not None else 0.0
        rest = inst.prefill_work_s - head_work
        return self.head_left_s(inst, factor) + (rest * factor if rest > 0.0 else 0.0)

    def head_left_s(self, inst: InstanceState, factor: float) -> float:
        """Predicted seconds the head of `inst`'s prefill queue has left, its work
        `factor` times the cost model's (0 past its estimate)."""
        head = self.placements.get(next(iter(inst.prefill_queue)))
        head_work = head.work_s if head is not None else 0.0
        elapsed = self.now - inst.running_since if inst.running_since else 0.0
        left = head_work * factor - elapsed
        return left if left > 0.0 else 0.0

    def first_token_lag_s(self, decode_instance: str) -> float:
        """Learned seconds from a prefill's end to the first token on that decode
        instance (0.0 without `learn_speed`)."""
        if not self.cfg.learn_speed:
            return 0.0
        speed = self.speeds.get(decode_instance)
        return speed.first_token_s if speed is not None else 0.0

    def assigned_placements(self, inst: InstanceState) -> Iterator[Placement]:
        """The placements assigned to a decode instance, in order."""
        placements = self.placements
        for rid in inst.assigned:
            p = placements.get(rid)
            if p is not None:
                yield p

    def prefix_blocks(self, keys: list[int], instance_id: str) -> int:
        """How many leading blocks of `keys` the instance holds (any tier)."""
        return self.index.prefix_length(keys, instance_id)
