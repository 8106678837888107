"""The pruned prefill evaluation decides exactly as the full scan does.

`PrefillPlanner` evaluates only the instances that can win (`candidates`); these
tests make logs with one and replay them with the other, over generated logs and
over the simulated cluster on the synthetic trace, and require every decision,
explanation included, to be reproduced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import generated_logs as GEN
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yb_conductor import decode_placement
from yb_conductor.candidates import Candidates
from yb_conductor.decode_placement import DecodeChoice, DecodePlanner
from yb_conductor.prefill_placement import PrefillChoice, PrefillPlanner
from yb_conductor.replay import LogRecord, replay
from yb_conductor.speed import InstanceSpeed
from yb_core import events as ev
from yb_core.config import ConductorConfig
from yb_tools.tracelog import TraceLog, TraceLogCluster
from yb_tools.traces import read_trace

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"


class Planners:
    """Sets how every planner built from now on evaluates, and counts what the pruned
    ones left out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.decisions = 0
        self.pruned = 0
        options = PrefillPlanner.options

        def counting(planner: PrefillPlanner, *args: Any) -> PrefillChoice:
            choice = options(planner, *args)
            self.decisions += 1
            self.pruned += choice.full is not None and len(choice.instances) < len(args[-1])
            return choice

        monkeypatch.setattr(PrefillPlanner, "options", counting)
        choose = DecodePlanner.choose

        def checked(planner: DecodePlanner, *args: Any, **kwargs: Any) -> DecodeChoice:
            choice = choose(planner, *args, **kwargs)
            if choice.evaluated is not None and choice.chosen_index >= 0:
                assert choice.chosen_index in choice.evaluated
            return choice

        monkeypatch.setattr(DecodePlanner, "choose", checked)

    def full(self) -> None:
        self.monkeypatch.setattr(PrefillPlanner, "default_full_scan", True)
        self.monkeypatch.setattr(DecodePlanner, "default_full_scan", True)

    def pruned_with(self, keep: int) -> None:
        self.monkeypatch.setattr(PrefillPlanner, "default_full_scan", False)
        self.monkeypatch.setattr(DecodePlanner, "default_full_scan", False)
        # However small the pool: these clusters are small.
        self.monkeypatch.setattr(PrefillPlanner, "prune_above", 0)
        self.monkeypatch.setattr(DecodePlanner, "prune_above", 0)
        self.monkeypatch.setattr(PrefillPlanner, "default_keep", keep)


@pytest.fixture
def planners(monkeypatch: pytest.MonkeyPatch) -> Planners:
    return Planners(monkeypatch)


def _simulated(params: Any) -> Any:
    """A maker of the mooncake policy's log of 250 requests of the trace at 2x, run by
    `yb sim` with `params` (`SimParams`) on the LLaMA2-70B profile."""
    from yb_conductor.cost_model import LLAMA2_70B_A800
    from yb_tools.sim.simulator import Simulation
    from yb_tools.sim.workload import load_workload

    items = load_workload(TRACE, block_size=512, speedup=2.0, limit=250)

    def make() -> list[LogRecord]:
        sim = Simulation(items, params, LLAMA2_70B_A800, policy="mooncake", record_log=True)
        sim.run()
        assert sim.records is not None
        return sim.records

    return make


def _same_decisions_both_ways(make: Any, planners: Planners, keep: int) -> list[LogRecord]:
    """A log made pruned replays under the full scan, and one made under the full
    scan replays pruned (`replay` raises on the first difference)."""
    planners.pruned_with(keep)
    pruned_log = make()
    planners.full()
    assert replay(pruned_log).divergences == []
    full_log = make()
    planners.pruned_with(keep)
    assert replay(full_log).divergences == []
    return pruned_log


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(st.lists(GEN.steps, max_size=60))
def test_generated_logs_decide_the_same_pruned_and_full(
    planners: Planners, plan: list[tuple[object, ...]]
) -> None:
    # Three prefill instances: keep one idle non-holder so that pruning happens, and
    # start with engines that do not share compute (with sharing nothing is pruned;
    # the plan's own settings steps still switch it).
    planners.monkeypatch.setattr(
        GEN, "ConductorConfig", lambda **kw: ConductorConfig(**{**kw, "compute_sharing": "none"})
    )
    _same_decisions_both_ways(lambda: GEN.live_log(plan), planners, keep=1)


def _trace_log(cfg: ConductorConfig, requests: int = 250) -> list[LogRecord]:
    log = TraceLog(
        cfg=cfg,
        cluster=TraceLogCluster(prefill=24, decode=6, kvstore_blocks=20_000),
        speedup=2.0,
        slo=ev.Slo(ttft_s=30.0, tbt_s=0.2),
        seed=0,
    )
    return log.run(read_trace(TRACE, limit=requests))


@pytest.mark.parametrize(
    "cfg",
    [
        ConductorConfig(),
        ConductorConfig(learn_speed=False),
        ConductorConfig(priority_order=False, explain_top_k=3, explain_decode_top_k=2),
        ConductorConfig(compute_sharing="host"),
        ConductorConfig(prefix_stickiness=0.0),
    ],
    ids=[
        "defaults",
        "no-learned-speed",
        "arrival-order-short-table",
        "shared-compute",
        "not-sticky",
    ],
)
def test_the_simulated_trace_decides_the_same_pruned_and_full(
    planners: Planners, cfg: ConductorConfig
) -> None:
    log = _same_decisions_both_ways(lambda: _trace_log(cfg), planners, keep=9)
    assert any(isinstance(r.event, ev.RequestScheduled) for r in log)
    if cfg.compute_sharing == "none":
        assert planners.pruned > 0  # the pruning was exercised, not bypassed
    else:
        assert planners.pruned == 0  # an idle engine's speed depends on its group


def test_a_decode_table_longer_than_the_idle_kept_looks_further(
    planners: Planners, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The explanation lists 8 decode instances; the choice keeps only 2 idle ones, so
    # the table must look for the rest itself to list what the full scan lists.
    monkeypatch.setattr(decode_placement, "IDLE_KEPT", 2)
    log = _same_decisions_both_ways(lambda: _trace_log(ConductorConfig()), planners, keep=9)
    assert any(isinstance(r.event, ev.RequestScheduled) for r in log)


def test_speed_order_follows_learning() -> None:
    index = Candidates()
    instances: dict[str, object] = {}
    speeds = {"p1": InstanceSpeed(solo=1.5)}
    index.sync(instances, speeds, iter([("p0", False, 0.0), ("p1", True, 0.0), ("p2", False, 0.0)]))
    assert [i for _, i in index.by_speed()] == ["p0", "p2", "p1"]
    assert list(index.may_be_queued) == ["p1"]
    assert index.next_factor(1.0) == 1.5 and index.next_factor(1.5) is None
    index.set_speed("p0", 2.0)
    assert [i for _, i in index.by_speed()] == ["p2", "p1", "p0"]
    # The same dicts: nothing rebuilt; replaced ones (a restored snapshot): rebuilt.
    index.sync(instances, speeds, iter([]))
    assert len(list(index.by_speed())) == 3
    index.sync({}, {}, iter([("p9", False, 0.0)]))
    assert [i for _, i in index.by_speed()] == ["p9"]


def test_idle_order_follows_speed_and_drain_times() -> None:
    index = Candidates()
    index.sync({}, {}, iter([("p0", False, 5.0), ("p1", False, 2.0), ("p2", False, 2.0)]))
    assert [i for _, _, i in index.by_idle()] == ["p1", "p2", "p0"]
    index.set_idle_since("p1", 9.0)  # found drained again, later
    assert [i for _, _, i in index.by_idle()] == ["p2", "p0", "p1"]
    index.set_speed("p2", 1.5)  # keeps its idle time, moves to its slowdown's group
    assert index.by_idle() == [(1.0, 5.0, "p0"), (1.0, 9.0, "p1"), (1.5, 2.0, "p2")]


def test_a_cluster_with_prefill_groups_decides_the_same_pruned_and_full(
    planners: Planners,
) -> None:
    from yb_tools.sim.params import SimParams

    params = SimParams(prefill=24, decode=6, prefill_groups=[2, 2, 3], speedup=2.0)

    log = _same_decisions_both_ways(_simulated(params), planners, keep=9)
    grouped = [
        r.event for r in log if isinstance(r.event, ev.RequestScheduled) and r.event.prefill_stages
    ]
    assert grouped  # the groups took work, so they were weighed both ways
    assert planners.pruned > 0


def test_a_tensor_parallel_cluster_decides_the_same_pruned_and_full(
    planners: Planners,
) -> None:
    from yb_tools.sim.params import SimParams

    # Every instance at TP=4: one model prices the pool, not the profile's own.
    params = SimParams(prefill=24, prefill_tp=4, decode=6, decode_tp=4, speedup=2.0)

    log = _same_decisions_both_ways(_simulated(params), planners, keep=9)
    ups = [r.event for r in log if isinstance(r.event, ev.InstanceUp) and r.event.role != "kvstore"]
    assert ups and all(e.tensor_parallel == 4 for e in ups)
    assert planners.pruned > 0
