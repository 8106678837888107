"""The planner: how many prefill and decode instances the load needs, from the log.

It runs inside the conductor, on the same fold (`Conductor.apply` observes every
event here), so its decisions are a function of the log like placements are: a
replay recomputes them, and a what-if run (`yb replay --set planner_*=...`) shows
what other settings would have decided. Every `planner_interval_s` of log time it
publishes a `PoolPlanned`: what it forecast, each pool's size and target, and the
actions (add, drain, move) that an actuator carries out (`yb up --elastic`, the
compose actuator, or a Kubernetes controller reading the targets).

Two rules size the pools (`planner_rule`):

`forecast` (the default) prices the load with the conductor's cost model.
- The load: over the last `planner_window_s`, the requests admitted (rejected ones
  too: a pool too small to admit them must still see them), and the output tokens of
  the requests that finished. The mix is that of the window's recent half: each
  prompt's prefill seconds as the cost model prices it with the reuse its placement
  planned (a rejected request at the half's mean reuse).
- The forecast: the arrival rate of the window's recent half, extrapolated
  `planner_lead_s` ahead (about how long an instance takes to start) along the
  trend between the halves (once the planner has seen a whole window), but never
  below that recent rate: a pool sized for a falling forecast would miss its SLO if
  the fall does not come.
- The margin: the pools are sized for the forecast rate r plus
  `planner_rate_sigmas` standard deviations of a Poisson count over the span T the
  pool covers alone (until the next plan, and an instance it adds is up:
  `planner_interval_s + planner_lead_s`), r + z sqrt(r / T). The noise, and so the
  margin, is a larger share of a smaller load. Each instance then runs as busy as
  its SLO allows (below). With `planner_rate_sigmas` = 0 (how conductors before
  behaviour version 3 sized), no such margin: each instance runs at
  `planner_utilization` of that.
- Prefill: the prefill seconds per second of that rate, over the utilisation an
  instance may run at: the one at which an M/D/1 queue's mean wait, rho / (2 (1 -
  rho)) service times, plus the service, fits in the TTFT SLO. At least enough
  instances to work off the queued prefill work within the TTFT SLO.
- Decode: the output tokens per second of that rate, over what one instance
  generates at the largest batch that keeps the TBT SLO and fits its KV (the cost
  model's step time at the window's mean context). At least enough instances to
  hold, in such batches, the requests decoding or waiting now as they will be when
  an instance added now is up: their number grown along its growth over the last
  `planner_lead_s` for another `planner_lead_s`, by at most every arrival staying
  (`planner_decode_trend`; off: their number now). When outputs grow longer, the
  batches fill minutes before the longer outputs finish and show in the window's
  mean, and an instance asked for once they are full comes a start time late.

`threshold` is what Kubernetes users run today, for comparison: each pool's
utilisation from its load reports over the window (prefill: the share of reports
that found it busy; decode: the larger of its KV and batch fill), and the
HorizontalPodAutoscaler's rule, desired = ceil(current * utilisation / target), with
`planner_utilization` as the target and a tolerance of 0.1 around it.

Both then apply the same limits.
- Hysteresis: a pool grows at once, but shrinks only to the largest size it needed
  over the last `planner_down_after_s` (as the HorizontalPodAutoscaler's scale-down
  stabilisation window does). A load that dips for a moment does not drain an
  instance that the next minute needs again; instances take minutes to start. Its
  default is the start time: kept idle as long as starting it again would take, an
  instance wastes at most twice what the best choice in hindsight would (the
  ski-rental rule).
- Minimums: `planner_min_prefill` and `planner_min_decode`.
- A budget: `planner_max_instances` in all (0: the instances up when the planner
  first ran). Over budget, the split that loads the busier pool least (its need
  over its instances), then the other (`planner_balanced_share`; off: in proportion
  to their needs, rounded).
- Actions: a pool short of its target takes instances from one over its target by
  moving them (a drain, then a restart in the other role, on the same device), and
  else adds what the budget allows; a pool over its target drains the instances
  holding the least work.
- Bookkeeping: an added or moved instance counts as starting until an instance of
  its role comes up (or `planner_start_timeout_s` passes), and one told to drain
  counts as draining until it is down. So no action is repeated while it is being
  carried out. A pool is never drained below its target in instances serving now
  (one still starting may fail), and the first plan waits until an engine of each
  pool is up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec

from yb_core import events as ev

if TYPE_CHECKING:
    from yb_conductor.cost_model import CostModel
    from yb_conductor.state import ClusterState, InstanceState
    from yb_core.config import ConductorConfig

T = TypeVar("T")
ROLES: tuple[ev.PoolRole, ev.PoolRole] = ("prefill", "decode")
_PAIRS: tuple[tuple[ev.PoolRole, ev.PoolRole], ...] = (("prefill", "decode"), ("decode", "prefill"))
#: The HorizontalPodAutoscaler's default tolerance: no change while the utilisation
#: is within 10% of its target.
THRESHOLD_TOLERANCE = 0.1
#: The batch a decode instance is sized at when none has announced its own.
DEFAULT_MAX_BATCH = 256


class Arrival(msgspec.Struct, array_like=True, gc=False):
    """One admitted request as the planner prices it."""

    request_id: str
    time: float
    prompt_tokens: int
    reused_tokens: int = -1  # -1: not placed (rejected, or not decided yet)
    ttft_slo_s: float = 0.0
    tbt_slo_s: float = 0.0


class Pending(msgspec.Struct, array_like=True, gc=False):
    """An action being carried out: an instance starting in `role`, or draining."""

    role: ev.PoolRole
    decided_at: float
    instance_id: str = ""


def _no_needs() -> dict[ev.PoolRole, list[tuple[float, int]]]:
    return {role: [] for role in ROLES}


class Planner(msgspec.Struct, kw_only=True):
    """The planner's view of the log and its open actions; `plan` decides. A struct,
    so that a conductor's snapshot holds it (`yb_conductor.snapshot`)."""

    # The windows, oldest first (trimmed at each plan).
    arrivals: list[Arrival] = msgspec.field(default_factory=list)
    # (time, output tokens) of the requests that finished, in the window.
    outputs: list[tuple[float, int]] = msgspec.field(default_factory=list)
    # (time, role, utilisation) of engine load reports, in the window (`threshold`).
    reports: list[tuple[float, ev.PoolRole, float]] = msgspec.field(default_factory=list)
    starting: list[Pending] = msgspec.field(default_factory=list)
    draining: dict[str, Pending] = msgspec.field(default_factory=dict)
    # Engines up, by id: their role (a restart of one does not end a pending add).
    up: dict[str, ev.PoolRole] = msgspec.field(default_factory=dict)
    # (time, needed instances) per role over `planner_down_after_s` (hysteresis).
    needs: dict[ev.PoolRole, list[tuple[float, int]]] = msgspec.field(default_factory=_no_needs)
    # (time, requests decoding or waiting in the decode pool) at each plan over the
    # last `planner_lead_s`, and the last one before (`planner_decode_trend`).
    decoding: list[tuple[float, int]] = msgspec.field(default_factory=list)
    first_seen: float = -1.0
    first_plan: float = -1.0
    next_at: float = 0.0
    budget: int = 0

    # --- what the log says ---------------------------------------------------------

    def observe(self, event: ev.AnyEvent) -> None:
        """Take in one folded event."""
        if self.first_seen < 0.0:
            self.first_seen = event.time
        match event:
            case ev.RequestAdmitted():
                self.arrivals.append(
                    Arrival(
                        event.request_id,
                        event.time,
                        event.prompt_tokens,
                        -1,
                        event.slo.ttft_s,
                        event.slo.tbt_s,
                    )
                )
            case ev.RequestFinished(outcome="completed") if event.output_tokens:
                self.outputs.append((event.time, event.output_tokens))
            case ev.LoadReport(role="prefill" | "decode"):
                self.reports.append((event.time, _pool(event.role), _utilisation(event)))
            case ev.InstanceUp(role="prefill" | "decode"):
                self._came_up(event.instance_id, _pool(event.role))
            case ev.InstanceDraining():
                pending = self.draining.get(event.instance_id)
                role = self.up.get(event.instance_id)
                if pending is None and role is not None:
                    self.draining[event.instance_id] = Pending(role, event.time, event.instance_id)
            case ev.InstanceDown():
                self.up.pop(event.instance_id, None)
                self.draining.pop(event.instance_id, None)
            case _:
                pass

    def placed(self, request_id: str, reused_tokens: int) -> None:
        """The conductor placed the request it was just told of, reusing
        `reused_tokens` of its prompt (a decision follows its admission in the fold)."""
        if self.arrivals and self.arrivals[-1].request_id == request_id:
            self.arrivals[-1].reused_tokens = reused_tokens

    def _came_up(self, instance_id: str, role: ev.PoolRole) -> None:
        if self.up.get(instance_id) == role:
            return  # a restart: the instance was counted already
        self.up[instance_id] = role
        self.draining.pop(instance_id, None)
        for i, pending in enumerate(self.starting):
            if pending.role == role:
                del self.starting[i]
                return

    def adopt(self, recorded: ev.PoolPlanned, mine: ev.PoolPlanned | None) -> None:
        """The log recorded another decision than this planner made at the same point
        (a replay by other software): the recorded one's actions are the ones being
        carried out, so they replace this planner's own."""
        if mine is not None:
            self._forget(mine)
        self._open(recorded)

    # --- deciding ------------------------------------------------------------------

    def due(self, cfg: ConductorConfig, now: float) -> bool:
        """Whether a plan is due at log time `now`: the first once the planner has seen
        a full interval of the log and an engine of each pool up (a cluster that is
        still starting would have it add instances for engines about to announce
        themselves), or `planner_start_timeout_s` without one (a pool that never came
        up needs its instances); then every interval."""
        if not cfg.planner or self.first_seen < 0.0:
            return False
        if self.next_at == 0.0:
            started = set(self.up.values()) >= set(ROLES)
            if not started and now - self.first_seen < cfg.planner_start_timeout_s:
                return False
            self.next_at = max(now, self.first_seen + cfg.planner_interval_s)
        return now >= self.next_at

    def plan(
        self, cfg: ConductorConfig, state: ClusterState, cost: CostModel, planner_id: str
    ) -> ev.PoolPlanned:
        """The decision at `state.now`; its actions are counted as open from here."""
        now = state.now
        if self.first_plan < 0.0:
            self.first_plan = now
        self.next_at = now + cfg.planner_interval_s
        self._trim(cfg, now)
        serving = _serving(state, self.draining)
        counts = {role: len(serving[role]) for role in ROLES}
        starting = {role: sum(1 for p in self.starting if p.role == role) for role in ROLES}
        draining = {
            role: sum(1 for p in self.draining.values() if p.role == role) for role in ROLES
        }
        if not self.budget:
            self.budget = cfg.planner_max_instances or sum(counts.values()) + sum(starting.values())
        budget = self.budget
        forecast = self._forecast(cfg, now)
        holding = _holding(state)
        if cfg.planner_rule == "threshold":
            needed = self._threshold_needs(cfg, now, counts)
        else:
            needed = self._forecast_needs(cfg, state, cost, forecast, holding)
        self.decoding.append((now, holding))
        minimum: dict[ev.PoolRole, int] = {
            "prefill": cfg.planner_min_prefill,
            "decode": cfg.planner_min_decode,
        }
        want = {role: max(minimum[role], math.ceil(needed[role] - 1e-9)) for role in ROLES}
        held: dict[ev.PoolRole, str] = {role: "" for role in ROLES}
        if want["prefill"] + want["decode"] > budget:
            want = _share(budget, needed, minimum, balanced=cfg.planner_balanced_share)
            held = {role: "budget" for role in ROLES}
        fitted = dict(want)
        settled = now - self.first_plan >= cfg.planner_down_after_s
        for role in ROLES:
            history = self.needs[role]
            history.append((now, want[role]))
            have = counts[role] + starting[role]
            if want[role] < have:
                # Shrink only to the most needed over the last `planner_down_after_s`,
                # and only once the planner has seen that long.
                target = min(have, max(n for _, n in history)) if settled else have
                if target > want[role]:
                    want[role] = target
                    held[role] = "hysteresis"
        # Held pools give way to a pool that needs more than the budget leaves.
        over = want["prefill"] + want["decode"] - budget
        for role in ROLES:
            if over > 0 and held[role] == "hysteresis":
                give = min(over, want[role] - fitted[role])
                if give > 0:
                    want[role] -= give
                    over -= give
                    held[role] = "budget"
        actions = self._actions(state, serving, counts, starting, draining, want, budget)
        pools = [
            ev.PoolSize(
                role=role,
                current=counts[role],
                starting=starting[role],
                draining=draining[role],
                needed=round(needed[role], 3),
                target=want[role],
                held_by=held[role],
            )
            for role in ROLES
        ]
        decision = ev.PoolPlanned(
            time=now,
            planner_id=planner_id,
            forecast=forecast,
            pools=pools,
            actions=actions,
            max_instances=budget,
            reason=_reason(cfg, pools, actions),
        )
        self._open(decision)
        return decision

    def _trim(self, cfg: ConductorConfig, now: float) -> None:
        horizon = now - cfg.planner_window_s
        _drop_before(self.arrivals, horizon, lambda a: a.time)
        _drop_before(self.outputs, horizon, lambda o: o[0])
        _drop_before(self.reports, horizon, lambda r: r[0])
        for history in self.needs.values():
            _drop_before(history, now - cfg.planner_down_after_s, lambda n: n[0])
        # Keep the last sample at least `planner_lead_s` old: the growth is measured
        # from it.
        while len(self.decoding) > 1 and self.decoding[1][0] <= now - cfg.planner_lead_s:
            del self.decoding[0]
        timeout = now - cfg.planner_start_timeout_s
        self.starting = [p for p in self.starting if p.decided_at >= timeout]
        for instance_id in [i for i, p in self.draining.items() if i not in self.up]:
            if self.draining[instance_id].decided_at < timeout:
                del self.draining[instance_id]

    def _forecast(self, cfg: ConductorConfig, now: float) -> ev.PoolForecast:
        span = min(cfg.planner_window_s, now - self.first_seen)
        arrivals = self.arrivals
        if span <= 0.0 or not arrivals:
            return ev.PoolForecast(window_s=round(span, 3), lead_s=cfg.planner_lead_s)
        rate = len(arrivals) / span
        middle = now - span / 2.0
        recent = sum(1 for a in arrivals if a.time >= middle)
        older_rate = (len(arrivals) - recent) / (span / 2.0)
        recent_rate = recent / (span / 2.0)
        slope = (recent_rate - older_rate) / (span / 2.0)
        if span < cfg.planner_window_s:
            # Before a whole window the older half holds the start-up, not a load:
            # its emptiness would read as a rising trend.
            slope = 0.0
        forecast = max(recent_rate, recent_rate + slope * (cfg.planner_lead_s + span / 4.0))
        # The mix of the recent half too: a change of prompts shows at the rate's pace.
        mix = [a for a in arrivals if a.time >= middle] or arrivals
        placed = [a for a in mix if a.reused_tokens >= 0]
        reuse = (
            sum(a.reused_tokens for a in placed) / max(1, sum(a.prompt_tokens for a in placed))
            if placed
            else 0.0
        )
        prompt = sum(a.prompt_tokens for a in mix) / len(mix)
        computed = sum(
            a.prompt_tokens - (a.reused_tokens if a.reused_tokens >= 0 else reuse * a.prompt_tokens)
            for a in mix
        ) / len(mix)
        output = sum(n for _, n in self.outputs) / len(self.outputs) if self.outputs else 0.0
        return ev.PoolForecast(
            window_s=round(span, 3),
            lead_s=cfg.planner_lead_s,
            arrival_rate=round(rate, 4),
            forecast_rate=round(forecast, 4),
            prompt_tokens=round(prompt, 1),
            computed_tokens=round(computed, 1),
            output_tokens=round(output, 1),
        )

    def _forecast_needs(
        self,
        cfg: ConductorConfig,
        state: ClusterState,
        cost: CostModel,
        forecast: ev.PoolForecast,
        holding: int,
    ) -> dict[ev.PoolRole, float]:
        arrivals = self.arrivals
        if not arrivals or forecast.arrival_rate <= 0.0:
            return {"prefill": 0.0, "decode": 0.0}
        share = forecast.computed_tokens / forecast.prompt_tokens if forecast.prompt_tokens else 1.0
        middle = arrivals[-1].time - forecast.window_s / 2.0
        mix = [a for a in arrivals if a.time >= middle] or arrivals
        work = 0.0
        for a in mix:
            reused = (
                a.reused_tokens if a.reused_tokens >= 0 else int((1.0 - share) * a.prompt_tokens)
            )
            work += cost.prefill_s(a.prompt_tokens - reused, reused)
        service_s = work / len(mix)
        # The strictest SLOs the recent requests ask for (tiers differ): a pool sized
        # for the loosest would fail the others.
        ttft_slo = min((a.ttft_slo_s for a in mix if a.ttft_slo_s > 0), default=0.0)
        tbt_slo = min((a.tbt_slo_s for a in mix if a.tbt_slo_s > 0), default=0.0)
        rate, rho = forecast.forecast_rate, cfg.planner_utilization
        if cfg.planner_rate_sigmas > 0.0:
            # The margin is the forecast's own noise, not a fixed share of each
            # instance: the pool absorbs, with no help, the arrivals until the next
            # plan and an instance it adds then is up. Their count is Poisson, so
            # `planner_rate_sigmas` standard deviations over that span.
            span_s = cfg.planner_interval_s + cfg.planner_lead_s
            rate += cfg.planner_rate_sigmas * math.sqrt(rate / span_s)
            rho = 1.0
        if ttft_slo > service_s > 0.0:
            # Mean wait of an M/D/1 queue at utilisation rho: rho / (2 (1 - rho)) services.
            k = ttft_slo / service_s - 1.0
            rho = min(rho, 2.0 * k / (1.0 + 2.0 * k))
        prefill = rate * service_s / rho
        # What is queued already must also drain within the TTFT SLO.
        backlog_s = sum(
            i.prefill_work_s for i in state.instances.values() if i.alive and i.role == "prefill"
        )
        if ttft_slo > 0.0:
            prefill = max(prefill, backlog_s / ttft_slo)
        output = forecast.output_tokens or float(state.expected_output(0) or 1)
        context = forecast.prompt_tokens + output / 2.0
        batch, step_s = _decode_batch(state, cost, context, tbt_slo)
        # An instance runs the largest batch within the TBT SLO and its KV: the
        # batch's step time holds the SLO, so no other cap than the margin's.
        busy = cfg.planner_utilization if cfg.planner_rate_sigmas <= 0.0 else 1.0
        per_instance = busy * batch / step_s if step_s > 0.0 else math.inf
        decode = rate * output / per_instance
        # The requests decoding now, against the batch an instance runs: a change of
        # output length shows here long before in the outputs of finished requests.
        ahead = float(holding)
        now = state.now
        if cfg.planner_decode_trend and self.decoding and self.decoding[0][0] < now:
            # And as they will be when an instance added now is up: the pool grows
            # along its growth over the last `planner_lead_s`, by at most every
            # arrival staying.
            since, before = self.decoding[0]
            growth = min(max(0.0, (holding - before) / (now - since)), forecast.forecast_rate)
            ahead += growth * cfg.planner_lead_s
        decode = max(decode, ahead / (busy * batch))
        return {"prefill": prefill, "decode": decode}

    def _threshold_needs(
        self, cfg: ConductorConfig, now: float, counts: dict[ev.PoolRole, int]
    ) -> dict[ev.PoolRole, float]:
        out: dict[ev.PoolRole, float] = {}
        for role in ROLES:
            samples = [u for t, r, u in self.reports if r == role]
            current = counts[role]
            if not samples or not current:
                out[role] = float(current)
                continue
            ratio = (sum(samples) / len(samples)) / cfg.planner_utilization
            out[role] = (
                float(current) if abs(ratio - 1.0) <= THRESHOLD_TOLERANCE else current * ratio
            )
        return out

    def _actions(
        self,
        state: ClusterState,
        serving: dict[ev.PoolRole, list[InstanceState]],
        counts: dict[ev.PoolRole, int],
        starting: dict[ev.PoolRole, int],
        draining: dict[ev.PoolRole, int],
        want: dict[ev.PoolRole, int],
        budget: int,
    ) -> list[ev.PoolAction]:
        delta = {role: want[role] - counts[role] - starting[role] for role in ROLES}
        actions: list[ev.PoolAction] = []
        free = budget - sum(counts.values()) - sum(starting.values()) - sum(draining.values())
        for role, other in _PAIRS:
            if delta[role] <= 0:
                continue
            moves = min(delta[role], max(0, min(-delta[other], counts[other] - want[other])))
            moved = _least_loaded(state, serving[other])[:moves]
            actions.extend(ev.PoolAction(action="move", role=role, instance_id=i) for i in moved)
            serving[other] = [i for i in serving[other] if i.instance_id not in moved]
            delta[role] -= moves
            delta[other] += moves
            adds = min(delta[role], max(0, free))
            actions.extend(ev.PoolAction(action="add", role=role) for _ in range(adds))
            free -= adds
        for role in ROLES:
            # Never below the target in instances serving now: one still starting
            # may yet fail to come up.
            drains = min(-delta[role], counts[role] - want[role])
            if drains > 0:
                for inst in _least_loaded(state, serving[role])[:drains]:
                    actions.append(ev.PoolAction(action="drain", role=role, instance_id=inst))
        return actions

    def _open(self, decision: ev.PoolPlanned) -> None:
        for action in decision.actions:
            if action.action in ("add", "move"):
                self.starting.append(Pending(action.role, decision.time))
            if action.action in ("drain", "move") and action.instance_id:
                role = self.up.get(action.instance_id)
                if role is not None:
                    self.draining[action.instance_id] = Pending(
                        role, decision.time, action.instance_id
                    )

    def _forget(self, decision: ev.PoolPlanned) -> None:
        self.starting = [p for p in self.starting if p.decided_at != decision.time]
        for action in decision.actions:
            pending = self.draining.get(action.instance_id)
            if pending is not None and pending.decided_at == decision.time:
                del self.draining[action.instance_id]


def _drop_before(items: list[T], horizon: float, time_of: Callable[[T], float]) -> None:
    """Drop the items (oldest first) older than `horizon`."""
    keep = 0
    while keep < len(items) and time_of(items[keep]) < horizon:
        keep += 1
    del items[:keep]


def _pool(role: ev.Role) -> ev.PoolRole:
    return "prefill" if role == "prefill" else "decode"


def _utilisation(report: ev.LoadReport) -> float:
    """How busy one load report found its engine (the `threshold` rule's metric)."""
    if report.role == "prefill":
        return 1.0 if report.running_requests or report.queued_requests else 0.0
    kv = report.kv_used_blocks / report.kv_total_blocks if report.kv_total_blocks else 0.0
    return kv


def _serving(
    state: ClusterState, draining: dict[str, Pending]
) -> dict[ev.PoolRole, list[InstanceState]]:
    """The live engines of each pool that are not draining (a prefill group counts as
    its stages: each is an instance on a device of its own)."""
    out: dict[ev.PoolRole, list[InstanceState]] = {role: [] for role in ROLES}
    for inst in state.instances.values():
        if inst.alive and inst.role in out and inst.instance_id not in draining:
            out[inst.role].append(inst)
    return out


def _least_loaded(state: ClusterState, instances: list[InstanceState]) -> list[str]:
    """Instance ids, the one holding the least work first; among equals the newest,
    then the highest numbered (the instance added last goes first)."""
    by_name = sorted(instances, key=lambda i: _natural(i.instance_id), reverse=True)
    ranked = sorted(by_name, key=lambda i: (len(i.prefill_queue) + len(i.assigned), -i.up_since))
    return [i.instance_id for i in ranked]


def _natural(name: str) -> tuple[str, int]:
    """`decode-10` after `decode-9`."""
    stem, _, number = name.rpartition("-")
    return (stem, int(number)) if number.isdigit() else (name, -1)


def _decode_batch(
    state: ClusterState, cost: CostModel, context: float, tbt_slo_s: float
) -> tuple[int, float]:
    """The largest batch a decode instance runs within the TBT SLO and its KV at a mean
    context of `context` tokens, and its step time."""
    max_batch, kv_tokens = DEFAULT_MAX_BATCH, cost.decode.kv_capacity_tokens
    for inst in state.instances.values():
        if inst.alive and inst.role == "decode":
            max_batch = inst.max_batch_size or max_batch
            if inst.kv_capacity_blocks and inst.block_size:
                kv_tokens = inst.kv_capacity_blocks * inst.block_size
            break
    if kv_tokens and context > 0:
        max_batch = max(1, min(max_batch, int(kv_tokens / context)))
    lo, hi = 1, max_batch
    if tbt_slo_s > 0.0:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost.tbt_s(mid, int(mid * context)) <= tbt_slo_s:
                lo = mid
            else:
                hi = mid - 1
    else:
        lo = max_batch
    return lo, cost.tbt_s(lo, int(lo * context))


def _holding(state: ClusterState) -> int:
    """The requests decoding or waiting on the live decode instances, by their last
    load reports."""
    return sum(
        r.running_requests + r.queued_requests
        for i in state.instances.values()
        if i.alive and i.role == "decode" and (r := i.last_report) is not None
    )


def _share(
    budget: int,
    needed: dict[ev.PoolRole, float],
    minimum: dict[ev.PoolRole, int],
    *,
    balanced: bool = True,
) -> dict[ev.PoolRole, int]:
    """`budget` instances split between the pools, each at least its minimum.

    `balanced`: the split whose busier pool is least loaded (its need over its
    instances), then the other pool least loaded, then the split nearest the
    proportional one. Otherwise (`planner_balanced_share` off): in proportion to
    the needs, rounded, which can leave the busier pool short of an instance the
    other needs less (needs 6.0 and 1.2: 7 and 1, where 6 and 2 load neither past
    its need).
    """
    total = needed["prefill"] + needed["decode"]
    share = needed["prefill"] / total if total > 0 else 0.5
    prefill = round(budget * share)
    prefill = max(minimum["prefill"], min(prefill, budget - minimum["decode"]))
    if balanced:
        splits = range(minimum["prefill"], budget - minimum["decode"] + 1)
        if splits:
            proportional = budget * share

            def key(p: int) -> tuple[float, float, float]:
                loads = sorted((needed["prefill"] / p, needed["decode"] / (budget - p)))
                return (loads[1], loads[0], abs(p - proportional))

            prefill = min(splits, key=key)
    return {"prefill": prefill, "decode": budget - prefill}


def _reason(cfg: ConductorConfig, pools: list[ev.PoolSize], actions: list[ev.PoolAction]) -> str:
    parts = []
    for p in pools:
        part = f"{p.role} needs {p.needed:.2f} -> target {p.target} (serving {p.current}"
        if p.starting:
            part += f", starting {p.starting}"
        if p.draining:
            part += f", draining {p.draining}"
        part += ")"
        if p.held_by:
            part += f", held by {p.held_by}"
        parts.append(part)
    verbs = [
        f"add a {a.role} instance"
        if a.action == "add"
        else f"{a.action} {a.instance_id}" + (f" to {a.role}" if a.action == "move" else "")
        for a in actions
    ]
    return f"{cfg.planner_rule}: " + "; ".join(parts) + (f"; {', '.join(verbs)}" if verbs else "")
