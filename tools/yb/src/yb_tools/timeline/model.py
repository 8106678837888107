"""What the timeline shows, extracted from the scheduling log in one pass.

A report covers a *window* of the log: the requests admitted in a range of stream
sequences and of event time (and at most the last `last` of them). Everything else
the lanes show (load reports, transfers, instance deaths) is taken over the time
span those requests cover, from the first admission to the last of their endings.

The planner's decisions (`PoolPlanned`) over the same span are the `planner` lane:
when each was made, its actions, its reason and the sizes of both pools.

The payload is compact on purpose: a 10,000-request window is embedded in one HTML
file. Rows are `array_like` structs (JSON arrays); their field names travel once, in
`Meta.request_fields` and friends, and the page finds columns by name. Times are
seconds relative to `Meta.t0` (the window's first admission), rounded to 0.1 ms.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from yb_conductor.replay import LogRecord, what_if
from yb_core import events as ev
from yb_core.config import ConductorConfig

# A window of more requests than this is cut to its last ones unless asked otherwise:
# the page is measured to open 10,000 requests quickly (benchmarks/timeline.py).
DEFAULT_LAST = 10_000

OUTCOMES = (
    "in_flight",  # no ending in the log (yet)
    "completed",
    "failed",
    "cancelled",
    "rejected",  # refused by the conductor at admission
    "rejected_at_decode",  # prefilled, then refused by its decode instance
)
ROLES_SHOWN = ("prefill", "decode", "kvstore")
TRANSFER_KINDS = ("pull", "replication")  # a reuse plan's remote run; a hot-prefix copy
MARKER_KINDS = ("down", "up", "transfer_failed", "draining")
_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Window:
    """Which requests a report covers.

    `from_seq`/`until_seq` bound the admissions' stream sequences (0: open).
    `since_s` is seconds of event time from the log's first event, or, when
    negative, before its last one (None: from the start); `for_s` the length of the
    time window (0: to the end). `last` keeps only the last N admissions of what is
    left (0: all of them).
    """

    from_seq: int = 0
    until_seq: int = 0
    since_s: float | None = None
    for_s: float = 0.0
    last: int = DEFAULT_LAST

    def describe(self) -> str:
        """The window in words, for the report's header."""
        parts = []
        if self.from_seq or self.until_seq:
            parts.append(f"seq {self.from_seq or 1}..{self.until_seq or 'end'}")
        if self.since_s is not None:
            since = f"{abs(self.since_s):g}s" + (" before the end" if self.since_s < 0 else "")
            parts.append(f"from {since}")
        if self.for_s:
            parts.append(f"for {self.for_s:g}s")
        return ", ".join(parts) or "the whole log"


class Lane(msgspec.Struct, array_like=True, gc=False):
    """One instance: a row of the timeline."""

    id: str
    role: str
    host: str


class RequestRow(msgspec.Struct, array_like=True, gc=False):
    """One request of the window. Lanes are indexes into `Timeline.lanes` (-1: none);
    times are relative to `Meta.t0` (None: not in the log). `branch` indexes
    `Meta.branches`, `outcome` `Meta.outcomes`; `what_if` is -1 without a what-if
    run, 0 when it decided the same, 1 when it decided otherwise."""

    id: str
    prefill: int
    decode: int
    admitted: float
    decided: float | None
    started: float | None  # prefill_started
    prefilled: float | None  # prefill_done
    committed: float | None  # kv_committed: the decode instance holds the KV
    ended: float | None
    outcome: int
    branch: int
    est_ttft: float
    est_transfer: float
    ttft: float | None  # measured, as the request's end reported it
    prompt_tokens: int
    reused_blocks: int
    what_if: int


class Transfer(msgspec.Struct, array_like=True, gc=False):
    """KV moving between lanes: a reuse plan's run from another host's kvstore
    (`pull`, drawn from the prefill's start over its estimated transfer time), or a
    planned hot-prefix copy (`replication`). `request` indexes `requests` (-1: none)."""

    kind: int
    source: int
    target: int
    start: float
    end: float
    blocks: int
    request: int


class Marker(msgspec.Struct, array_like=True, gc=False):
    """A point event on a lane: an instance going down or (re)appearing, a failed
    transfer, an instance starting to drain (it was told to stop)."""

    kind: int
    lane: int
    time: float
    text: str


class PoolRow(msgspec.Struct, array_like=True, gc=False):
    """One pool as a planner decision saw and sized it (`PoolSize`): instances serving,
    starting and draining, how many the forecast needs, the target, and what held
    the target elsewhere ("" when nothing did)."""

    role: str
    serving: int
    starting: int
    draining: int
    needed: float
    target: int
    held_by: str


class ActionRow(msgspec.Struct, array_like=True, gc=False):
    """One action of a planner decision: `add` to `role`'s pool, `drain` `instance`,
    or `move` `instance` into `role`."""

    action: str
    role: str
    instance: str


class PlanRow(msgspec.Struct, array_like=True, gc=False):
    """One planner decision (`PoolPlanned`) on the `planner` lane: when, what it asked
    for, why (its `reason`), the forecast arrival rate (requests/s, `lead` seconds
    ahead) and each pool as it sized it."""

    time: float
    actions: list[ActionRow]
    reason: str
    rate: float
    forecast_rate: float
    max_instances: int
    pools: list[PoolRow]


class Series(msgspec.Struct, array_like=True, gc=False):
    """A lane's load over time as a step function (change points only): the decode
    batch (`running_requests`), a kvstore's used share of its pool, a prefill
    instance's queue. `scale` is the value drawn as the lane's full height."""

    lane: int
    times: list[float]
    values: list[float]
    scale: float
    label: str


class Meta(msgspec.Struct, kw_only=True):
    """What the report covers and how to read its rows."""

    title: str
    source: str
    window: str
    t0: float  # event time of `0` on the axis
    t_end: float  # relative; the end of the span shown
    wall_clock: bool  # whether event times are Unix seconds (a live log) or virtual
    first_seq: int
    last_seq: int
    requests_in_window: int
    requests_shown: int
    note: str
    policy: str
    what_if: str  # "" without a what-if run, else its settings in words
    outcomes: list[str]
    branches: list[str]
    transfer_kinds: list[str]
    marker_kinds: list[str]
    request_fields: list[str]
    transfer_fields: list[str]
    marker_fields: list[str]
    plan_fields: list[str] = msgspec.field(default_factory=list)
    pool_fields: list[str] = msgspec.field(default_factory=list)
    action_fields: list[str] = msgspec.field(default_factory=list)


class Timeline(msgspec.Struct, kw_only=True):
    """The report's data. `decisions[i]` is `yb explain`'s text for `requests[i]`;
    `what_if_decisions[i]` the other policy's for the same request ("" when none);
    `plans` the planner's decisions over the span (none: no planner lane)."""

    meta: Meta
    lanes: list[Lane]
    requests: list[RequestRow]
    transfers: list[Transfer]
    markers: list[Marker]
    series: list[Series]
    decisions: list[str]
    what_if_decisions: list[str] = msgspec.field(default_factory=list)
    plans: list[PlanRow] = msgspec.field(default_factory=list)


@dataclass
class _Life:
    """What the log says about one request, in absolute event time."""

    seq: int
    admitted: float
    prompt_tokens: int
    decision: ev.Decision | None = None
    decision_seq: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    ended: float | None = None
    outcome: str = "in_flight"
    ttft: float | None = None


def _natural(text: str) -> list[object]:
    """Sort key that puts prefill-2 before prefill-10."""
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(text)]


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 4)


def select_requests(records: list[LogRecord], window: Window) -> tuple[list[int], int, str]:
    """Indexes (into `records`) of the window's admissions, how many the window held
    before the `last` cut, and a note saying what was cut ("" when nothing)."""
    times = [r.event.time for r in records]
    start, end = (min(times), max(times)) if times else (0.0, 0.0)
    t_from = -math.inf
    if window.since_s is not None:
        t_from = (end + window.since_s) if window.since_s < 0 else (start + window.since_s)
    t_to = t_from + window.for_s if window.for_s > 0 else math.inf
    chosen = [
        i
        for i, r in enumerate(records)
        if isinstance(r.event, ev.RequestAdmitted)
        and r.seq >= window.from_seq
        and (not window.until_seq or r.seq <= window.until_seq)
        and t_from <= r.event.time < t_to
    ]
    total = len(chosen)
    note = ""
    if window.last and total > window.last:
        chosen = chosen[-window.last :]
        note = f"the window holds {total} requests; showing its last {window.last} (--last)"
    return chosen, total, note


def build_timeline(
    records: list[LogRecord],
    window: Window = Window(),
    *,
    title: str = "",
    source: str = "",
    what_if: Mapping[str, ev.Decision] | None = None,
    what_if_label: str = "",
) -> Timeline:
    """The timeline of `records` over `window`. `what_if` maps request ids to the
    decisions another policy made for them (see `what_if_decisions`)."""
    from yb_tools.cli.explain import render  # one way to read a decision, shared

    chosen, total, note = select_requests(records, window)
    lives: dict[str, _Life] = {}
    for i in chosen:
        adm = records[i].event
        assert isinstance(adm, ev.RequestAdmitted)
        lives.setdefault(
            adm.request_id, _Life(records[i].seq, adm.time, prompt_tokens=adm.prompt_tokens)
        )
    first_index = chosen[0] if chosen else len(records)
    lanes: dict[str, Lane] = {}
    policy = ""

    def lane(instance: str, role: str, host: str = "") -> None:
        known = lanes.get(instance)
        if known is None:
            lanes[instance] = Lane(instance, role, host)
        elif host and not known.host:
            known.host = host

    # Pass 1: every request's life, and every instance the log names.
    for r in records:
        e = r.event
        match e:
            case ev.InstanceUp() | ev.LoadReport() if e.role in ROLES_SHOWN:
                lane(e.instance_id, e.role, getattr(e, "host", ""))
            case ev.RequestScheduled() | ev.RequestRejected():
                policy = policy or e.policy
                life = lives.get(e.request_id)
                if life is not None and life.decision is None:
                    life.decision, life.decision_seq = e, r.seq
            case ev.RequestProgress():
                life = lives.get(e.request_id)
                if life is not None:
                    life.stages.setdefault(e.stage, e.time)
            case ev.RequestFinished():
                life = lives.get(e.request_id)
                # A re-planned request's failed attempt ends first; its last one decides.
                if life is not None and (life.ended is None or life.outcome == "failed"):
                    life.ended = e.time
                    rejected_late = e.outcome == "rejected"
                    life.outcome = "rejected_at_decode" if rejected_late else e.outcome
                    life.ttft = e.ttft_s or None
            case ev.RequestCancelled():
                life = lives.get(e.request_id)
                if life is not None and life.ended is None:
                    life.ended, life.outcome = e.time, "cancelled"
    for life in lives.values():
        d = life.decision
        if isinstance(d, ev.RequestRejected):
            life.ended, life.outcome = d.time, "rejected"
        elif isinstance(d, ev.RequestScheduled):
            lane(d.prefill_instance, "prefill")
            lane(d.decode_instance, "decode")

    ordered = sorted(lanes.values(), key=lambda x: (ROLES_SHOWN.index(x.role), _natural(x.id)))
    lane_index = {x.id: i for i, x in enumerate(ordered)}
    host_of = {x.id: x.host for x in ordered}

    t0 = min((life.admitted for life in lives.values()), default=0.0)
    ends = [
        life.ended or max(life.stages.values(), default=life.admitted) for life in lives.values()
    ]
    t_last = max(ends, default=t0)
    if not lives and records:
        t0, t_last = records[0].event.time, records[-1].event.time

    branches: list[str] = []
    rows: list[RequestRow] = []
    texts: list[str] = []
    what_if_texts: list[str] = []
    transfers: list[Transfer] = []
    for rid, life in lives.items():
        d = life.decision
        est = d.estimates if d is not None else ev.Estimates()
        branch = d.explain.branch if d is not None and d.explain else ""
        if isinstance(d, ev.RequestRejected):
            branch = "reject"
        if branch not in branches:
            branches.append(branch)
        sched = d if isinstance(d, ev.RequestScheduled) else None
        index = len(rows)
        start = life.stages.get("prefill_started", d.time if d is not None else None)
        if sched is not None:
            target = lane_index[sched.prefill_instance]
            for run in sched.reuse:
                src = run.source_instance
                remote = src != sched.prefill_instance and (
                    not host_of.get(src) or host_of.get(src) != host_of.get(sched.prefill_instance)
                )
                if remote and src in lane_index and start is not None:
                    transfers.append(
                        Transfer(
                            0, lane_index[src], target, round(start - t0, 4),
                            round(start + est.transfer_s - t0, 4), run.num_blocks, index,
                        )
                    )  # fmt: skip
        other = what_if.get(rid) if what_if is not None else None
        rows.append(
            RequestRow(
                id=rid,
                prefill=lane_index[sched.prefill_instance] if sched else -1,
                decode=lane_index[sched.decode_instance] if sched else -1,
                admitted=round(life.admitted - t0, 4),
                decided=_rel(d.time if d is not None else None, t0),
                started=_rel(life.stages.get("prefill_started"), t0),
                prefilled=_rel(life.stages.get("prefill_done"), t0),
                committed=_rel(life.stages.get("kv_committed"), t0),
                ended=_rel(life.ended, t0),
                outcome=OUTCOMES.index(life.outcome),
                branch=branches.index(branch),
                est_ttft=round(est.ttft_s, 4),
                est_transfer=round(est.transfer_s, 4),
                ttft=None if life.ttft is None else round(life.ttft, 4),
                prompt_tokens=life.prompt_tokens,
                reused_blocks=sched.reused_blocks if sched else 0,
                what_if=-1 if what_if is None else int(_differs(d, other)),
            )
        )
        texts.append(render(life.decision_seq, d) if d is not None else "(no decision in the log)")
        if what_if is not None:
            what_if_texts.append(
                render(other.admitted_seq, other) if other is not None else "(no decision)"
            )

    markers: list[Marker] = []
    plans: list[PlanRow] = []
    series_points: dict[int, tuple[list[float], list[float], float, str]] = {}
    # Pass 2: what the lanes show over the span (load, deaths, copies, failures).
    for r in records[first_index:] if lives else records:
        e = r.event
        if e.time > t_last:
            continue  # publishers' clocks differ a little: not `break`
        in_span = e.time >= t0
        match e:
            case ev.LoadReport() if e.instance_id in lane_index:
                value, scale, label = _load_value(e)
                k = lane_index[e.instance_id]
                times, values, top, _ = series_points.setdefault(k, ([], [], scale, label))
                if values and values[-1] == value:
                    continue
                at = round(max(e.time, t0) - t0, 4)
                times.append(max(at, times[-1]) if times else at)
                values.append(value)
                series_points[k] = (times, values, max(top, scale), label)
            case ev.InstanceDown() if in_span and e.instance_id in lane_index:
                markers.append(
                    Marker(0, lane_index[e.instance_id], round(e.time - t0, 4), e.reason)
                )
            case ev.InstanceUp() if in_span and e.instance_id in lane_index:
                markers.append(Marker(1, lane_index[e.instance_id], round(e.time - t0, 4), e.host))
            case ev.InstanceDraining() if in_span and e.instance_id in lane_index:
                left = f"; {max(0.0, e.deadline - e.time):.1f}s to finish" if e.deadline else ""
                text = f"{e.reason or 'draining'}{left}"
                markers.append(Marker(3, lane_index[e.instance_id], round(e.time - t0, 4), text))
            case ev.TransferFailed() if in_span and e.target_instance in lane_index:
                text = f"{e.request_id}: {e.source_instance} -> {e.target_instance}: {e.reason}"
                markers.append(
                    Marker(2, lane_index[e.target_instance], round(e.time - t0, 4), text)
                )
            case ev.PoolPlanned() if in_span:
                plans.append(_plan_row(e, t0))
            case ev.ReplicationPlanned() if in_span:
                from_lane = lane_index.get(e.source_instance)
                to_lane = lane_index.get(e.target_instance)
                if from_lane is not None and to_lane is not None:
                    at = round(e.time - t0, 4)
                    copy = Transfer(1, from_lane, to_lane, at, at, len(e.block_hashes), -1)
                    transfers.append(copy)

    series = [
        Series(k, times, values, scale if scale > 0 else max(values, default=1.0) or 1.0, label)
        for k, (times, values, scale, label) in sorted(series_points.items())
    ]
    meta = Meta(
        title=title or "Yuebing scheduling timeline",
        source=source,
        window=window.describe(),
        t0=t0,
        t_end=round(max(t_last - t0, 0.0), 4),
        wall_clock=t0 > 1e9,
        first_seq=records[0].seq if records else 0,
        last_seq=records[-1].seq if records else 0,
        requests_in_window=total,
        requests_shown=len(rows),
        note=note,
        policy=policy,
        what_if=what_if_label,
        outcomes=list(OUTCOMES),
        branches=branches,
        transfer_kinds=list(TRANSFER_KINDS),
        marker_kinds=list(MARKER_KINDS),
        request_fields=list(RequestRow.__struct_fields__),
        transfer_fields=list(Transfer.__struct_fields__),
        marker_fields=list(Marker.__struct_fields__),
        plan_fields=list(PlanRow.__struct_fields__),
        pool_fields=list(PoolRow.__struct_fields__),
        action_fields=list(ActionRow.__struct_fields__),
    )
    return Timeline(
        meta=meta,
        lanes=ordered,
        requests=rows,
        transfers=transfers,
        markers=markers,
        series=series,
        decisions=texts,
        what_if_decisions=what_if_texts,
        plans=plans,
    )


def _plan_row(e: ev.PoolPlanned, t0: float) -> PlanRow:
    """A `PoolPlanned` as the planner lane shows it."""
    return PlanRow(
        time=round(e.time - t0, 4),
        actions=[ActionRow(a.action, a.role, a.instance_id) for a in e.actions],
        reason=e.reason,
        rate=round(e.forecast.arrival_rate, 4),
        forecast_rate=round(e.forecast.forecast_rate, 4),
        max_instances=e.max_instances,
        pools=[
            PoolRow(p.role, p.current, p.starting, p.draining, round(p.needed, 3), p.target,
                    p.held_by)
            for p in e.pools
        ],
    )  # fmt: skip


def _load_value(e: ev.LoadReport) -> tuple[float, float, str]:
    """(value, full-height value, what it is) of one load report for its lane."""
    if e.role == "decode":
        return float(e.running_requests), 0.0, "decode batch"
    if e.role == "kvstore":
        used = e.dram_blocks or e.kv_used_blocks
        share = used / e.kv_total_blocks if e.kv_total_blocks else 0.0
        return round(share, 3), 1.0, "pool used"
    return float(e.queued_requests), 0.0, "queued"


def _differs(a: ev.Decision | None, b: ev.Decision | None) -> bool:
    """Whether another policy's decision differs in what it does (not its estimates)."""
    if a is None or b is None or type(a) is not type(b):
        return a is not b
    if isinstance(a, ev.RequestScheduled) and isinstance(b, ev.RequestScheduled):
        return (a.prefill_instance, a.decode_instance, a.reuse) != (
            b.prefill_instance,
            b.decode_instance,
            b.reuse,
        )
    return False


def what_if_decisions(
    records: list[LogRecord],
    overrides: Mapping[str, object],
    *,
    until_seq: int = 0,
    cfg: ConductorConfig | None = None,
) -> dict[str, ev.Decision]:
    """Each request's decision under other settings or another policy: a second
    conductor over the same log (`yb_conductor.replay.what_if`, the same run
    `yb replay --policy` makes)."""
    report = what_if(records, overrides, cfg=cfg, until_seq=until_seq)
    return dict(report.what_if.decisions)
