"""The planner sizes the pools from the log: its forecast, its needs priced with the
cost model, its hysteresis and budget, its open actions, and replay."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from yb_conductor.conductor import Conductor
from yb_conductor.cost_model import DEFAULT
from yb_conductor.replay import LogRecord, replay, what_if
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


def test_the_forecast_and_the_prefill_need_follow_the_load_as_the_cost_model_prices_it() -> None:
    c = _started()
    c.run(60.0, rate=4.0)
    plan = c.plans[-1]
    assert plan.planner_id == "conductor-t"
    assert plan.forecast.arrival_rate == pytest.approx(4.0, rel=0.05)
    assert plan.forecast.forecast_rate == pytest.approx(4.0, rel=0.05)
    assert plan.forecast.output_tokens == OUTPUT
    # Nothing reused (every prompt is new): each prefill is the whole prompt, and an
    # instance runs at `planner_utilization` (the TTFT SLO allows more).
    service = DEFAULT.prefill_s(PROMPT, 0)
    expected = 4.0 * service / c.cfg.planner_utilization
    assert c.pool(plan, "prefill").needed == pytest.approx(expected, rel=0.05)
    # Twice the load needs twice the pool.
    c.run(60.0, rate=8.0)
    assert c.pool(c.plans[-1], "prefill").needed == pytest.approx(2 * expected, rel=0.05)
    assert c.pool(c.plans[-1], "decode").needed == pytest.approx(
        2 * c.pool(plan, "decode").needed, rel=0.05
    )


def test_an_added_instance_counts_as_starting_until_it_is_up_and_is_not_added_twice() -> None:
    c = _started()
    c.run(30.0, rate=8.0)
    need = c.pool(c.plans[-1], "prefill").target
    assert need >= 2
    adds = [a for p in c.plans for a in p.actions if a.action == "add" and a.role == "prefill"]
    assert len(adds) == need - 1  # once each, however many plans came since
    assert c.pool(c.plans[-1], "prefill").starting == need - 1
    c.up("prefill-1", "prefill")
    c.run(10.0, rate=8.0)
    assert c.pool(c.plans[-1], "prefill").starting == need - 2
    assert c.pool(c.plans[-1], "prefill").current == 2


def test_a_pool_shrinks_only_after_it_needed_fewer_for_the_whole_wait() -> None:
    c = _started(planner_max_instances=8)
    for i in range(1, 4):
        c.up(f"prefill-{i}", "prefill")
    c.run(120.0, rate=0.5)  # one prefill instance is plenty
    drains = [(p.time, a.instance_id) for p in c.plans for a in p.actions if a.action == "drain"]
    first = c.plans[0].time
    assert drains, [p.reason for p in c.plans]
    # Held while the planner had seen less than `planner_down_after_s`...
    assert all(t >= first + 60.0 for t, _ in drains)
    held = [p for p in c.plans if p.time < first + 60.0]
    assert all(c.pool(p, "prefill").held_by == "hysteresis" for p in held)
    # ...then the instances holding the least work go, the highest numbered among
    # equals (the one placed on by the admission that triggered the plan stays),
    # each drained once.
    ids = [i for _, i in drains]
    assert len(set(ids)) == len(ids) == 3 and ids[0] == "prefill-3", ids
    assert c.pool(c.plans[-1], "prefill").draining == 3


def test_over_budget_the_pools_share_it_and_a_pool_over_its_target_gives_instances_by_moving() -> (
    None
):
    c = _started(planner_max_instances=4)
    c.up("decode-1", "decode")
    c.up("decode-2", "decode")
    c.run(30.0, rate=20.0)  # far more prefill work than 4 instances serve
    plan = c.plans[0]
    prefill, decode = c.pool(plan, "prefill"), c.pool(plan, "decode")
    assert prefill.held_by == decode.held_by == "budget"
    assert prefill.target + decode.target == 4 and prefill.target > 1
    moves = [a for a in plan.actions if a.action == "move"]
    assert moves and all(a.role == "prefill" for a in moves)
    assert {a.instance_id for a in moves} <= {"decode-1", "decode-2"}
    assert not [a for a in plan.actions if a.action == "add"]  # no device left to add


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
