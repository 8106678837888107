"""The timeline's data, extracted from a real simulation log: lanes, request rows,
transfers, load series, windows and what-if decisions, each checked against the log
itself; the page is one self-contained file; the commands write it."""

from __future__ import annotations

import base64
import gzip
import json
import re
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from yb_conductor.cost_model import load_cost_model
from yb_conductor.replay import LogRecord, what_if, write_log
from yb_core import events as ev
from yb_tools.cli import main as yb
from yb_tools.sim.params import SimParams
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import load_workload
from yb_tools.timeline.model import (
    OUTCOMES,
    PoolRow,
    Timeline,
    Window,
    build_timeline,
    select_requests,
)
from yb_tools.timeline.page import render_page
from yb_tools.timeline.report import build_report

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
# Overloaded (4x, tight SLOs, small pools) so that every lane has something: refusals
# at admission and at decode (the paper's `reject`: over the TBT SLO after the
# prefill), local and remote prefixes, busy decode batches.
PARAMS = SimParams(
    prefill=8, decode=2, speedup=4.0, tbt_slo_s=0.02, ttft_slo_s=10.0, limit=400,
    pool_tokens=100_000, decode_admission="reject",
)  # fmt: skip


@pytest.fixture(scope="module")
def sim() -> Simulation:
    items = load_workload(TRACE, block_size=512, speedup=PARAMS.speedup, limit=PARAMS.limit)
    s = Simulation(
        items, PARAMS, load_cost_model("llama2-70b-a800"), policy="mooncake",
        admission="early", record_log=True,
    )  # fmt: skip
    s.run()
    return s


@pytest.fixture(scope="module")
def records(sim: Simulation) -> list[LogRecord]:
    assert sim.records is not None
    return sim.records


@pytest.fixture(scope="module")
def timeline(records: list[LogRecord]) -> Timeline:
    return build_timeline(records)


def _col(row: msgspec.Struct, name: str) -> object:
    return getattr(row, name)


def test_one_lane_per_instance_in_role_order(records: list[LogRecord], timeline: Timeline) -> None:
    ups = [r.event for r in records if isinstance(r.event, ev.InstanceUp)]
    assert sorted((u.instance_id, u.role, u.host) for u in ups) == sorted(
        (x.id, x.role, x.host) for x in timeline.lanes
    )
    roles = [x.role for x in timeline.lanes]
    assert roles == sorted(roles, key=["prefill", "decode", "kvstore"].index)
    assert [x.id for x in timeline.lanes if x.role == "prefill"] == [
        f"prefill-{i}" for i in range(PARAMS.prefill)
    ]


def test_each_request_row_is_what_the_log_says(
    sim: Simulation, records: list[LogRecord], timeline: Timeline
) -> None:
    t0 = timeline.meta.t0
    lane = {x.id: i for i, x in enumerate(timeline.lanes)}
    rows = {r.id: r for r in timeline.requests}
    assert len(rows) == PARAMS.limit == timeline.meta.requests_shown
    stages: dict[tuple[str, str], float] = {}
    decisions: dict[str, ev.Decision] = {}
    for r in records:
        e = r.event
        if isinstance(e, ev.RequestProgress):
            stages[(e.request_id, e.stage)] = e.time
        elif isinstance(e, ev.Decision):
            decisions.setdefault(e.request_id, e)
    for rid, row in rows.items():
        d = decisions[rid]
        if isinstance(d, ev.RequestScheduled):
            assert (row.prefill, row.decode) == (
                lane[d.prefill_instance],
                lane[d.decode_instance],
            )
            assert row.est_ttft == pytest.approx(d.estimates.ttft_s, abs=1e-4)
        else:
            assert (row.prefill, row.decode) == (-1, -1)
        for stage, name in (("prefill_started", "started"), ("prefill_done", "prefilled")):
            at = stages.get((rid, stage))
            got = _col(row, name)
            assert (got is None) if at is None else got == pytest.approx(at - t0, abs=1e-4)
    # Outcomes are the simulator's fates, request by request.
    fate_to_outcome = {
        "completed": "completed",
        "rejected": "rejected",
        "decode_rejected": "rejected_at_decode",
        "timed_out": "cancelled",
    }
    for job in sim.jobs:
        row = rows[job.item.request_id]
        assert OUTCOMES[row.outcome] == fate_to_outcome[job.fate], job.item.request_id
    counts = Counter(OUTCOMES[r.outcome] for r in timeline.requests)
    assert counts["rejected"] > 0 and counts["rejected_at_decode"] > 0 and counts["completed"] > 0
    # The decision text is `yb explain`'s, for the right request.
    for row, text in zip(timeline.requests, timeline.decisions, strict=True):
        assert text.startswith(f"request {row.id}: ")


def test_transfers_are_the_plans_remote_runs(records: list[LogRecord], timeline: Timeline) -> None:
    hosts = {
        r.event.instance_id: r.event.host for r in records if isinstance(r.event, ev.InstanceUp)
    }
    expected: Counter[tuple[str, str, str]] = Counter()
    for r in records:
        d = r.event
        if isinstance(d, ev.RequestScheduled):
            for run in d.reuse:
                if hosts[run.source_instance] != hosts[d.prefill_instance]:
                    expected[(d.request_id, run.source_instance, d.prefill_instance)] += 1
    lanes = timeline.lanes
    got = Counter(
        (timeline.requests[t.request].id, lanes[t.source].id, lanes[t.target].id)
        for t in timeline.transfers
        if t.kind == 0
    )
    assert expected and got == expected
    for t in timeline.transfers:
        assert lanes[t.source].role == "kvstore" and lanes[t.target].role == "prefill"
        assert t.end >= t.start


def test_decode_batch_follows_the_load_reports(
    records: list[LogRecord], timeline: Timeline
) -> None:
    t0 = timeline.meta.t0
    by_lane = {s.lane: s for s in timeline.series}
    checked = 0
    for k, lane in enumerate(timeline.lanes):
        if lane.role != "decode":
            continue
        series = by_lane[k]
        assert series.label == "decode batch"
        for r in records:
            e = r.event
            if isinstance(e, ev.LoadReport) and e.instance_id == lane.id and e.time >= t0:
                if e.time > t0 + timeline.meta.t_end:
                    break
                # The step function's value at the report's time is what it reported.
                at = e.time - t0
                i = max(j for j, t in enumerate(series.times) if t <= at + 1e-6)
                assert series.values[i] == e.running_requests
                checked += 1
        assert max(series.values) > 1
    assert checked > 50  # two instances, a report a second


def test_windows_select_the_admissions_they_name(records: list[LogRecord]) -> None:
    admitted = [r for r in records if isinstance(r.event, ev.RequestAdmitted)]
    start = records[0].event.time
    end = max(r.event.time for r in records)

    def ids(window: Window) -> list[str]:
        return [r.id for r in build_timeline(records, window).requests]

    def names(rs: list[LogRecord]) -> list[str]:
        return [r.event.request_id for r in rs if isinstance(r.event, ev.RequestAdmitted)]

    assert ids(Window(since_s=20, for_s=10)) == names(
        [r for r in admitted if start + 20 <= r.event.time < start + 30]
    )
    assert ids(Window(since_s=-15)) == names([r for r in admitted if r.event.time >= end - 15])
    lo, hi = admitted[100].seq, admitted[150].seq
    assert ids(Window(from_seq=lo, until_seq=hi)) == names(admitted[100:151])
    cut = build_timeline(records, Window(last=50))
    assert [r.id for r in cut.requests] == names(admitted[-50:])
    assert cut.meta.requests_in_window == PARAMS.limit
    assert "last 50" in cut.meta.note
    assert build_timeline(records).meta.note == ""
    # A window's span starts at its first admission.
    first = build_timeline(records, Window(since_s=20, for_s=10))
    assert first.meta.t0 == min(r.event.time for r in admitted if r.event.time >= start + 20)
    assert select_requests(records, Window(since_s=1e9))[0] == []


def test_what_if_decisions_are_a_second_conductors(records: list[LogRecord]) -> None:
    overrides = {"policy": "least-loaded"}
    whole = what_if(records, overrides).what_if.decisions
    report = build_report(records, Window(since_s=12, for_s=20), overrides=overrides)
    assert report.meta.what_if == "policy=least-loaded"
    assert report.requests
    rows = report.requests
    for row, text in zip(rows, report.what_if_decisions, strict=True):
        other = whole[row.id]
        # The window's what-if run replays the log from its start: the same decision
        # the whole log's run made for that request.
        assert text.startswith(f"request {row.id}: ")
        assert f"policy {other.policy}" in text
        if isinstance(other, ev.RequestScheduled):
            assert f"prefill {other.prefill_instance}, decode {other.decode_instance}" in text
    assert {row.what_if for row in rows} == {0, 1}
    recorded = {
        r.event.request_id: r.event for r in records if isinstance(r.event, ev.RequestScheduled)
    }
    for row in rows:
        mine, theirs = recorded.get(row.id), whole[row.id]
        same = (
            isinstance(mine, ev.RequestScheduled)
            and isinstance(theirs, ev.RequestScheduled)
            and (mine.prefill_instance, mine.decode_instance, mine.reuse)
            == (theirs.prefill_instance, theirs.decode_instance, theirs.reuse)
        ) or (mine is None and isinstance(theirs, ev.RequestRejected))
        assert row.what_if == (0 if same else 1), row.id
    assert build_timeline(records).requests[0].what_if == -1


def test_deaths_drains_and_failed_transfers_become_markers(records: list[LogRecord]) -> None:
    # The simulated cluster never loses an instance; a live conductor logs these.
    mid = records[len(records) // 2]
    t = mid.event.time
    extra = [
        LogRecord(seq=mid.seq, event=ev.InstanceDraining(
            time=t - 1, instance_id="decode-1", reason="stopping", deadline=t + 19,
        )),
        LogRecord(seq=mid.seq, event=ev.InstanceDown(
            time=t, instance_id="decode-1", reason="heartbeat timeout",
        )),
        LogRecord(seq=mid.seq, event=ev.TransferFailed(
            time=t, request_id="req-1", source_instance="kvstore-3",
            target_instance="prefill-2", reason="peer unreachable",
        )),
    ]  # fmt: skip
    log = records[: len(records) // 2] + extra + records[len(records) // 2 :]
    tl = build_timeline(log)
    lanes = [x.id for x in tl.lanes]
    markers = {(tl.meta.marker_kinds[m.kind], lanes[m.lane]): m for m in tl.markers}
    assert markers[("down", "decode-1")].text == "heartbeat timeout"
    assert markers[("down", "decode-1")].time == pytest.approx(t - tl.meta.t0, abs=1e-4)
    drain = markers[("draining", "decode-1")]
    assert drain.text == "stopping; 20.0s to finish"
    assert drain.time == pytest.approx(t - 1 - tl.meta.t0, abs=1e-4)
    assert "peer unreachable" in markers[("transfer_failed", "prefill-2")].text
    assert not build_timeline(records).markers


def _plan(t: float, actions: list[ev.PoolAction], prefill: int, decode: int) -> ev.PoolPlanned:
    """A planner decision on pools of `prefill` and `decode` serving instances."""
    return ev.PoolPlanned(
        time=t, planner_id="conductor-0", max_instances=4,
        forecast=ev.PoolForecast(window_s=30, lead_s=10, arrival_rate=3.5, forecast_rate=4.25),
        pools=[
            ev.PoolSize(role="prefill", current=prefill, needed=2.6, target=3),
            ev.PoolSize(role="decode", current=decode, draining=1, needed=0.4, target=1,
                        held_by="hysteresis"),
        ],
        actions=actions, reason=f"prefill {prefill} -> 3",
    )  # fmt: skip


def with_plans(records: list[LogRecord]) -> tuple[list[LogRecord], list[ev.PoolPlanned]]:
    """The simulation's log with three planner decisions in it (the simulated cluster
    here runs no planner): an add, one without actions, a drain and a move."""
    at = [records[len(records) * k // 4] for k in (1, 2, 3)]
    plans = [
        _plan(at[0].event.time, [ev.PoolAction(action="add", role="prefill")], 1, 2),
        _plan(at[1].event.time, [], 2, 2),
        _plan(at[2].event.time, [
            ev.PoolAction(action="drain", role="decode", instance_id="decode-1"),
            ev.PoolAction(action="move", role="prefill", instance_id="decode-0"),
        ], 3, 2),
    ]  # fmt: skip
    log = list(records)
    for record, plan in sorted(zip(at, plans, strict=True), key=lambda x: -x[0].seq):
        i = log.index(record)
        log.insert(i + 1, LogRecord(seq=record.seq, event=plan))
    return log, plans


def test_planner_decisions_become_the_planner_lane(records: list[LogRecord]) -> None:
    log, plans = with_plans(records)
    tl = build_timeline(log)
    assert not build_timeline(records).plans
    assert len(tl.plans) == len(plans)
    assert tl.meta.plan_fields[0] == "time" and "pools" in tl.meta.plan_fields
    for row, plan in zip(tl.plans, plans, strict=True):
        assert row.time == pytest.approx(plan.time - tl.meta.t0, abs=1e-4)
        assert row.reason == plan.reason
        assert (row.rate, row.forecast_rate, row.max_instances) == (3.5, 4.25, 4)
        assert [(a.action, a.role, a.instance) for a in row.actions] == [
            (a.action, a.role, a.instance_id) for a in plan.actions
        ]
        assert [
            (p.role, p.serving, p.starting, p.draining, p.needed, p.target, p.held_by)
            for p in row.pools
        ] == [
            (p.role, p.current, p.starting, p.draining, p.needed, p.target, p.held_by)
            for p in plan.pools
        ]
    # A window shows the decisions made over its span only.
    for window in (Window(since_s=5, for_s=5), Window(since_s=-10)):
        part = build_timeline(log, window)
        t0, t_end = part.meta.t0, part.meta.t0 + part.meta.t_end
        assert [r.reason for r in part.plans] == [p.reason for p in plans if t0 <= p.time <= t_end]
    # The page carries them, with their column names.
    data = re.search(r'id="yb-data">(.*?)</script>', render_page(tl), re.S)
    assert data is not None
    embedded = json.loads(data.group(1))
    assert embedded["plans"] == msgspec.to_builtins(tl.plans)
    assert embedded["meta"]["pool_fields"] == list(PoolRow.__struct_fields__)


def test_the_page_is_one_file_that_fetches_nothing(timeline: Timeline) -> None:
    page = render_page(timeline)
    # Nothing refers outside the file: no external script, style, image or fetch.
    assert not re.search(r"<(link|img|iframe)\b", page)
    assert not re.search(r"<script[^>]+src=", page)
    assert "fetch(" not in page and "XMLHttpRequest" not in page
    assert not re.search(r"https?://", page)
    data = re.search(r'<script type="application/json" id="yb-data">(.*?)</script>', page, re.S)
    assert data is not None
    embedded = json.loads(data.group(1))
    assert embedded["meta"]["requests_shown"] == len(timeline.requests)
    assert embedded["requests"][0] == msgspec.to_builtins(timeline.requests[0])
    packed = re.search(r'id="yb-decisions">(.*?)</script>', page, re.S)
    assert packed is not None
    texts = json.loads(gzip.decompress(base64.b64decode(packed.group(1))))
    assert texts == [timeline.decisions, timeline.what_if_decisions]
    # The same log gives the same file.
    assert render_page(timeline) == page


def test_replay_and_sim_write_reports(records: list[LogRecord], tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    write_log(log, records)
    out = tmp_path / "replay.html"
    argv = ["replay", "--file", str(log), "--report", str(out), "--since", "10", "--for", "20"]
    assert yb([*argv, "--policy", "least-loaded"]) == 0
    assert "policy=least-loaded" in out.read_text()
    assert yb(["replay", "--file", str(log), "--report", str(out), "--set", "no_such=1"]) == 2

    report = tmp_path / "sim.html"
    sim_argv = [
        "sim", "--trace", str(TRACE), "--policy", "mooncake,round-robin", "--limit", "60",
        "--prefill", "2", "--decode", "1", "--json", str(tmp_path / "sim.json"),
        "--no-plots", "--quiet", "--report", str(report),
    ]  # fmt: skip
    assert yb(sim_argv) == 0
    written = sorted(p.name for p in tmp_path.glob("sim-*.html"))
    assert written == ["sim-mooncake.html", "sim-round-robin.html"]
    assert "yb sim: round-robin" in (tmp_path / "sim-round-robin.html").read_text()
