"""The planner sizes the pools from the log: its forecast, its needs priced with the
cost model, its hysteresis and budget, its open actions, and replay."""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgspec
import pytest

from yb_conductor.conductor import Conductor
from yb_conductor.cost_model import DEFAULT
from yb_conductor.planner import _share
from yb_conductor.replay import LogRecord, NondeterminismError, replay, what_if
from yb_conductor.settings import configured_event, with_overrides
from yb_core import events as ev
from yb_core.config import ConductorConfig

BLOCK = 16
PROMPT = 400
OUTPUT = 40
#: The planner's settings in these tests: a plan every 10 s from the last 60 s,
#: no lead (the forecast is the recent rate), shrinking after 60 s.
SETTINGS: dict[str, Any] = {
    "planner": True,
    "planner_interval_s": 10.0,
    "planner_window_s": 60.0,
    "planner_lead_s": 0.0,
    "planner_down_after_s": 60.0,
    "planner_max_instances": 6,
}


class Cluster:
    """A log fed to a conductor by hand: engines that report every second, requests
    that arrive at a set rate and finish `OUTPUT` tokens later."""

    def __init__(self, **overrides: Any) -> None:
        self.cfg = with_overrides(ConductorConfig(), {**SETTINGS, **overrides})
        self.conductor = Conductor(cfg=self.cfg, cost=DEFAULT)
        self.records: list[LogRecord] = []
        self.plans: list[ev.PoolPlanned] = []
        self.now = 0.0
        self.engines: dict[str, str] = {}
        self.ids = itertools.count()
        self.emit(configured_event(self.cfg, DEFAULT, "conductor-t", time=0.0))

    def emit(self, event: ev.AnyEvent) -> list[Any]:
        self.records.append(LogRecord(seq=len(self.records) + 1, event=event))
        out = self.conductor.apply(len(self.records), event)
        for o in out:
            if isinstance(o, ev.PoolPlanned):
                self.plans.append(o)
            self.emit(o)  # logged back, as the live service publishes it
        return out

    def up(self, instance_id: str, role: ev.Role) -> None:
        self.engines[instance_id] = role
        self.emit(
            ev.InstanceUp(
                time=self.now, instance_id=instance_id, role=role, host=f"h-{instance_id}",
                epoch=1, block_size=BLOCK, kv_capacity_blocks=4096, max_batch_size=64,
            )
        )  # fmt: skip

    def down(self, instance_id: str) -> None:
        del self.engines[instance_id]
        self.emit(ev.InstanceDown(time=self.now, instance_id=instance_id, reason="drained"))

    def run(self, seconds: float, rate: float) -> None:
        """`seconds` of log: reports every second, `rate` arrivals a second."""
        end = self.now + seconds
        gap = 1.0 / rate if rate > 0 else seconds + 1.0
        next_arrival = self.now + gap
        while self.now < end:
            self.now = min(self.now + 1.0, end)
            while next_arrival <= self.now:
                self._request(next_arrival)
                next_arrival += gap
            for instance_id, role in self.engines.items():
                self.emit(ev.LoadReport(time=self.now, instance_id=instance_id, role=role))

    def _request(self, at: float) -> None:
        rid = f"r{next(self.ids)}"
        hashes = [hash((rid, i)) for i in range(PROMPT // BLOCK)]
        for out in self.emit(
            ev.RequestAdmitted(
                time=at, request_id=rid, gateway_id="gw", model="m", block_size=BLOCK,
                block_hashes=hashes, prompt_tokens=PROMPT, max_tokens=OUTPUT,
            )
        ):  # fmt: skip
            if isinstance(out, ev.RequestScheduled):
                self.emit(
                    ev.RequestProgress(
                        time=at, request_id=rid, instance_id=out.prefill_instance,
                        stage="prefill_done", computed_tokens=PROMPT,
                    )
                )  # fmt: skip
                self.emit(
                    ev.RequestFinished(
                        time=at, request_id=rid, instance_id=out.decode_instance,
                        outcome="completed", prompt_tokens=PROMPT, output_tokens=OUTPUT,
                    )
                )  # fmt: skip

    def pool(self, plan: ev.PoolPlanned, role: str) -> ev.PoolSize:
        return next(p for p in plan.pools if p.role == role)


def _started(**overrides: Any) -> Cluster:
    c = Cluster(**overrides)
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        c.up(name, role)  # type: ignore[arg-type]
    return c


def _prefill_need(rate: float, sigmas: float, span_s: float, utilization: float) -> float:
    """The prefill pool for `rate` prompts of `PROMPT` new tokens a second, with the
    default TTFT SLO: `sigmas` Poisson deviations over `span_s` on the rate, each
    instance at most at the M/D/1 utilisation whose mean wait fits the SLO."""
    service = DEFAULT.prefill_s(PROMPT, 0)
    k = ev.Slo().ttft_s / service - 1.0
    rho = min(utilization, 2.0 * k / (1.0 + 2.0 * k))
    return (rate + sigmas * math.sqrt(rate / span_s)) * service / rho


def test_the_forecast_and_the_prefill_need_follow_the_load_as_the_cost_model_prices_it() -> None:
    c = _started()
    c.run(60.0, rate=4.0)
    plan = c.plans[-1]
    assert plan.planner_id == "conductor-t"
    assert plan.forecast.arrival_rate == pytest.approx(4.0, rel=0.05)
    assert plan.forecast.forecast_rate == pytest.approx(4.0, rel=0.05)
    assert plan.forecast.output_tokens == OUTPUT
    # Nothing reused (every prompt is new): each prefill is the whole prompt. The
    # margin is two Poisson deviations of the arrivals until the next plan's instance
    # is up (a plan every 10 s, no lead: 10 s), and an instance runs as busy as the
    # TTFT SLO's queue allows.
    rate = plan.forecast.forecast_rate
    expected = _prefill_need(rate, 2.0, 10.0, 1.0)
    assert c.pool(plan, "prefill").needed == pytest.approx(expected, rel=0.01)
    # Twice the load needs twice the pool, less the margin's share: the noise of a
    # count grows as its square root.
    c.run(60.0, rate=8.0)
    later = c.plans[-1]
    doubled = _prefill_need(later.forecast.forecast_rate, 2.0, 10.0, 1.0)
    assert c.pool(later, "prefill").needed == pytest.approx(doubled, rel=0.01)
    assert 1.5 * expected < doubled < 2.0 * expected
    assert 1.5 < c.pool(later, "decode").needed / c.pool(plan, "decode").needed < 2.0


def test_without_the_noise_margin_an_instance_runs_at_planner_utilization() -> None:
    # How conductors of behaviour version 2 sized (`planner_rate_sigmas` = 0).
    c = _started(planner_rate_sigmas=0.0)
    c.run(60.0, rate=4.0)
    plan = c.plans[-1]
    expected = _prefill_need(plan.forecast.forecast_rate, 0.0, 10.0, c.cfg.planner_utilization)
    assert c.pool(plan, "prefill").needed == pytest.approx(expected, rel=0.01)
    c.run(60.0, rate=8.0)
    assert c.pool(c.plans[-1], "prefill").needed == pytest.approx(2 * expected, rel=0.05)


def test_the_margin_is_the_noise_of_the_arrivals_over_the_next_plan_and_a_start() -> None:
    # The relative margin shrinks with the load and with the span it must cover.
    needs = {}
    for rate, lead in ((2.0, 0.0), (8.0, 0.0), (8.0, 50.0)):
        c = _started(planner_lead_s=lead)
        c.run(60.0, rate=rate)
        plan = c.plans[-1]
        bare = _prefill_need(plan.forecast.forecast_rate, 0.0, 1.0, 1.0)
        needs[rate, lead] = c.pool(plan, "prefill").needed / bare
    assert needs[2.0, 0.0] > needs[8.0, 0.0] > needs[8.0, 50.0] > 1.0
    assert needs[8.0, 50.0] == pytest.approx(1.0 + 2.0 / math.sqrt(8.0 * 60.0), rel=0.02)


def test_over_budget_the_split_loads_the_busier_pool_least() -> None:
    minimum: dict[ev.PoolRole, int] = {"prefill": 1, "decode": 1}
    # 6.0 and 1.2 instances' worth in 8: 6 and 2 load no pool past its need; the
    # proportional split (6.7 -> 7 and 1) leaves decode 20% over.
    needed: dict[ev.PoolRole, float] = {"prefill": 6.0, "decode": 1.2}
    assert _share(8, needed, minimum) == {"prefill": 6, "decode": 2}
    assert _share(8, needed, minimum, balanced=False) == {"prefill": 7, "decode": 1}
    # Far over: the split evens the loads (9 / 7 = 1.29 against 1 / 1 = 1; 8 / 6 =
    # 1.33 against 2 / 2 = 1 is worse).
    assert _share(8, {"prefill": 9.0, "decode": 1.0}, minimum) == {"prefill": 7, "decode": 1}
    # Each keeps its minimum; nothing needed at all: an even split.
    assert _share(4, {"prefill": 10.0, "decode": 0.0}, minimum) == {"prefill": 3, "decode": 1}
    assert _share(4, {"prefill": 0.0, "decode": 0.0}, minimum) == {"prefill": 2, "decode": 2}


def _decode_reports(c: Cluster, seconds: int, start: int, growth: int) -> None:
    """`seconds` of reports and an arrival a second, the decode instance holding
    `start` requests and `growth` more each second (longer outputs: they arrive and
    none ends yet)."""
    for k in range(seconds):
        c.now += 1.0
        c._request(c.now)
        held = start + growth * (k + 1)
        c.emit(ev.LoadReport(time=c.now, instance_id="prefill-0", role="prefill"))
        c.emit(
            ev.LoadReport(time=c.now, instance_id="decode-0", role="decode", running_requests=held)
        )


def _decode_need_while_it_grows(trend: bool) -> tuple[float, float]:
    """The decode pool's need while it holds 40 requests, and once it has held 4
    more each second for 30 s (the last plan's, and its time)."""
    c = _started(planner_lead_s=30.0, planner_decode_trend=trend, planner_max_instances=12)
    c.run(20.0, rate=1.0)
    _decode_reports(c, 40, start=40, growth=0)
    steady = c.pool(c.plans[-1], "decode").needed
    _decode_reports(c, 30, start=40, growth=4)
    return steady, c.pool(c.plans[-1], "decode").needed


def test_a_growing_decode_pool_is_sized_for_its_occupancy_a_start_time_ahead() -> None:
    batch = 64  # the instance's announced batch: within its KV and the TBT SLO
    steady, growing = _decode_need_while_it_grows(trend=True)
    old_steady, now = _decode_need_while_it_grows(trend=False)
    # Steady, the trend adds nothing: both hold the 40 requests decoding.
    assert steady == old_steady == pytest.approx(40 / batch, abs=0.01)
    # Growing: the requests held at the plan (4 a second for about 30 s)...
    assert 150 / batch < now <= 160 / batch
    # ...and, with the trend, those a start time (30 s) later: the growth since the
    # plan `planner_lead_s` before, capped at the arrival rate (1/s: every arrival
    # staying).
    assert growing == pytest.approx(now + 1.0 * 30.0 / batch, rel=0.03)


def test_a_log_recorded_by_the_version_2_planner_replays_as_recorded() -> None:
    old = {
        "planner_rate_sigmas": 0.0,
        "planner_balanced_share": False,
        "planner_decode_trend": False,
    }
    c = _started(planner_max_instances=4, **old)
    c.up("decode-1", "decode")
    c.run(40.0, rate=6.0)
    c.run(60.0, rate=0.5)
    assert any(p.actions for p in c.plans)
    # As a version 2 conductor recorded it: without the settings it did not know.
    first = c.records[0].event
    assert isinstance(first, ev.ConductorConfigured)
    settings = msgspec.json.decode(first.settings_json)
    for name in old:
        del settings[name]
    recorded = msgspec.structs.replace(
        first, settings_json=msgspec.json.encode(settings).decode(), behaviour_version=2
    )
    records = [LogRecord(seq=1, event=recorded), *c.records[1:]]
    assert not replay(records).divergences
    # Read as today's record, the same log plans otherwise.
    today = msgspec.structs.replace(recorded, behaviour_version=3)
    with pytest.raises(NondeterminismError, match="PoolPlanned"):
        replay([LogRecord(seq=1, event=today), *c.records[1:]])


def test_the_plans_replay_and_a_what_if_on_the_planner_settings_decides_otherwise() -> None:
    c = _started(planner_max_instances=8)
    for i in range(1, 4):
        c.up(f"prefill-{i}", "prefill")
    c.run(60.0, rate=6.0)
    c.run(120.0, rate=0.5)
    assert any(p.actions for p in c.plans)
    result = replay(c.records)
    assert not result.divergences
    assert sum(isinstance(r.event, ev.PoolPlanned) for r in c.records) == len(c.plans)
    patient = what_if(c.records, {"planner_down_after_s": "600"})
    rows = {name: (a, b) for name, a, b in patient.rows()}
    recorded, patient_drains = rows["planner drains"]
    assert recorded > 0 and patient_drains < recorded


def test_a_pool_is_never_drained_below_its_target_while_an_added_instance_is_starting() -> None:
    c = _started()
    c.run(30.0, rate=8.0)  # the prefill pool grows: its adds never come up here
    assert c.pool(c.plans[-1], "prefill").starting >= 1
    c.run(120.0, rate=0.5)  # then it needs one instance, which is serving
    drained = [a.instance_id for p in c.plans for a in p.actions if a.action == "drain"]
    assert "prefill-0" not in drained and "decode-0" not in drained, drained


def test_the_first_plan_waits_for_an_engine_of_each_pool() -> None:
    c = Cluster()
    c.up("prefill-0", "prefill")
    c.run(60.0, rate=1.0)  # no decode instance yet: a cluster still starting
    assert not c.plans
    c.up("decode-0", "decode")
    c.run(10.0, rate=1.0)
    assert c.plans and c.pool(c.plans[0], "decode").current == 1
