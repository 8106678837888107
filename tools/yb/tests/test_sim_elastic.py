"""Elastic pools in `yb sim`: the production planner's actions are carried out (added
instances come up after their start time, drained ones stop once empty, moved ones
restart in the other role), nothing placed on an instance after it drains, and the
instance-hours count what was held."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from yb_core import events as ev
from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import resolve_cost
from yb_tools.sim.simulator import Simulation, block_size_for
from yb_tools.sim.workload import workload_from
from yb_tools.sim.workloads import generate

PARAMS = SimParams(profile="llama2-70b-a800", hosts=6, prefill=2, decode=2, max_instances=6)
PLANNER = {"planner": True, "planner_max_instances": 6, "planner_interval_s": 15.0,
           "planner_window_s": 60.0, "planner_down_after_s": 60.0}  # fmt: skip


@pytest.fixture(scope="module")
def elastic() -> Simulation:
    """One elastic run, shared by the tests that read it (it is not changed by them)."""
    cost = resolve_cost(PARAMS)
    items = workload_from(
        generate("phase-change:phase_s=180,rate=6"), block_size=block_size_for(PARAMS, cost)
    )
    sim = Simulation(items, PARAMS, cost, policy="mooncake", record_log=True, settings=PLANNER)
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_the_planner_resizes_the_pools_and_the_simulation_carries_it_out(
    elastic: Simulation,
) -> None:
    sim = elastic
    result = sim.result  # type: ignore[attr-defined]
    assert sim.records is not None
    events = [r.event for r in sim.records]
    plans = [e for e in events if isinstance(e, ev.PoolPlanned)]
    assert plans and result.pool_actions > 0
    kinds = {a.action for p in plans for a in p.actions}
    assert "add" in kinds or "move" in kinds
    # Long prompts first: the prefill pool grows past its start.
    prefill_up = {
        e.instance_id for e in events if isinstance(e, ev.InstanceUp) and e.role == "prefill"
    }
    assert len(prefill_up) > PARAMS.prefill
    # Every drained instance gets nothing new after its drain, and stops.
    drained_at = {e.instance_id: e.time for e in events if isinstance(e, ev.InstanceDraining)}
    assert drained_at
    for e in events:
        if isinstance(e, ev.RequestScheduled):
            for instance_id in (e.prefill_instance, e.decode_instance):
                at = drained_at.get(instance_id)
                restarted = [
                    u.time for u in events
                    if isinstance(u, ev.InstanceUp) and u.instance_id == instance_id
                    and at is not None and u.time > at
                ]  # fmt: skip
                assert at is None or e.time < at or (restarted and e.time >= restarted[0])
    stopped = {e.instance_id for e in events if isinstance(e, ev.InstanceDown)}
    assert set(drained_at) <= stopped
    # Nothing lost: every request ends one way or another.
    assert result.completed + result.rejected + result.timed_out + result.kv_exhausted == len(
        sim.jobs
    )
    # Held less than the whole budget for the whole run, more than the start.
    hours = result.simulated_s / 3600.0
    assert (PARAMS.prefill + PARAMS.decode) * hours < result.instance_hours < 6 * hours


def test_the_log_of_an_elastic_run_replays_its_plans(elastic: Simulation) -> None:
    from yb_conductor.replay import replay

    sim = elastic
    assert sim.records is not None
    result = replay(sim.records, strict=False)
    plans = [d for d in result.divergences if isinstance(d.recorded, ev.PoolPlanned)]
    assert not plans, plans[:1]


def test_a_static_run_holds_every_instance_for_the_whole_run() -> None:
    cost = resolve_cost(PARAMS)
    items = workload_from(
        generate("phase-change:phase_s=60,rate=4"), block_size=block_size_for(PARAMS, cost)
    )
    static = msgspec.structs.replace(PARAMS, max_instances=0, hosts=0)
    result = Simulation(items, static, cost, policy="mooncake").run()
    assert result.pool_actions == 0
    assert abs(result.instance_hours - 4 * result.simulated_s / 3600.0) < 1e-9


def test_yb_replay_reproduces_and_yb_explain_shows_the_plans_of_an_elastic_run(
    elastic: Simulation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from yb_conductor.replay import write_log
    from yb_tools.cli import main as yb_main

    sim = elastic
    assert sim.records is not None
    log = tmp_path / "elastic.jsonl"
    write_log(log, sim.records)
    assert yb_main(["explain", "planner", "--file", str(log)]) == 0
    out = capsys.readouterr().out
    acted = [p for p in sim.plans if p.actions]
    assert out.count("planner conductor-sim, budget 6") == len(acted)
    assert "action: add prefill" in out or "action: move" in out
    assert "forecast:" in out and "prefill" in out and "decode" in out
    # A what-if on the planner's settings shows its rows.
    assert yb_main(["replay", "--file", str(log), "--set", "planner_down_after_s=600"]) == 0
    table = capsys.readouterr().out
    assert "planner drains" in table and "planner prefill target mean" in table


def test_yb_sim_runs_elastic_pools_from_its_flags(tmp_path: Path) -> None:
    import json

    from yb_tools.cli import main as yb_main

    out = tmp_path / "sim.json"
    argv = [
        "sim", "--workload", "phase-change:phase_s=120,rate=6", "--policy", "mooncake",
        "--prefill", "1", "--decode", "1", "--max-instances", "4", "--start-s", "30",
        "--set", "planner=true", "--set", "planner_max_instances=4",
        "--set", "planner_interval_s=15", "--json", str(out), "--quiet", "--no-plots",
    ]  # fmt: skip
    assert yb_main(argv) == 0
    (run,) = json.loads(out.read_text())["policies"].values()
    assert run["pool_actions"] > 0
    hours = run["simulated_s"] / 3600.0
    assert 2 * hours < run["instance_hours"] <= 4 * hours


def test_elastic_flags_without_the_planner_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from yb_tools.cli import main as yb_main

    argv = ["sim", "--workload", "daily", "--max-instances", "8", "--quiet", "--no-plots"]
    assert yb_main(argv) == 2
    assert "need --set planner=true" in capsys.readouterr().err


def test_a_conductor_restored_from_a_snapshot_plans_as_one_that_read_everything(
    elastic: Simulation,
) -> None:
    from yb_conductor import snapshot
    from yb_conductor.conductor import Conductor

    records = elastic.records
    assert records is not None
    whole = Conductor()
    expected = [out for r in records for out in whole.apply(r.seq, r.event)]
    assert any(isinstance(out, ev.PoolPlanned) for out in expected)
    cut = len(records) // 2  # the planner has windows and open actions by then
    head = Conductor()
    got = [out for r in records[:cut] for out in head.apply(r.seq, r.event)]
    assert head.planner.arrivals and head.planner.up
    tail = snapshot.restore(snapshot.decode(snapshot.encode(snapshot.take(head))))
    got += [out for r in records[cut:] for out in tail.apply(r.seq, r.event)]
    assert got == expected
    assert tail.divergences == whole.divergences == []


def test_at_a_change_to_long_answers_the_decode_pool_grows_sooner_than_version_2s() -> None:
    # Version 2's planner (the switches' old values) against today's, on the
    # fixture's phase change (long prompts for 180 s, then long answers).
    cost = resolve_cost(PARAMS)
    items = workload_from(
        generate("phase-change:phase_s=180,rate=6"), block_size=block_size_for(PARAMS, cost)
    )
    version_2 = {
        "planner_rate_sigmas": 0.0,
        "planner_balanced_share": False,
        "planner_decode_trend": False,
    }
    grown: dict[str, tuple[float, float]] = {}
    goodput: dict[str, float] = {}
    for name, settings in (("today", PLANNER), ("version 2", {**PLANNER, **version_2})):
        sim = Simulation(items, PARAMS, cost, policy="mooncake", settings=settings)
        goodput[name] = sim.run().goodput_rps
        decode = [
            (p.time, next(s.target for s in p.pools if s.role == "decode"))
            for p in sim.plans
            if p.time >= 180.0
        ]
        # When the decode pool's target first grew, and when it first reached 3.
        grown[name] = (
            next(t for t, target in decode if target >= 2),
            next(t for t, target in decode if target >= 3),
        )
    # The occupancy a start time ahead, and a split that loads the busier pool
    # least: a plan sooner to the first decode instance, and to the third.
    assert grown["today"][0] < grown["version 2"][0]
    assert grown["today"][1] < grown["version 2"][1]
    assert goodput["today"] > goodput["version 2"]
