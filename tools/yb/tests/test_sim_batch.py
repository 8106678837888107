"""`yb sim` with a batch backlog (`yb_tools.sim.batch`): lines fill an idle cluster,
are held back and retried under interactive load without changing the interactive
figures, hurt interactive TTFT less than the naive way (`batch_idle_only=false`),
and the log of such a run replays.

200 requests of Mooncake's synthetic trace at half speed on 2 prefill + 2 decode
instances of the llama2-70b-a800 profile, beside 100 lines due in 300 s; the
simulator is deterministic, so the tests assert outcomes, not timings.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from yb_conductor.replay import replay
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.runner import resolve_cost
from yb_tools.sim.simulator import Simulation, block_size_for
from yb_tools.sim.workload import TraceItem, load_workload

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
PARAMS = SimParams(prefill=2, decode=2)
BACKLOG = msgspec.structs.replace(PARAMS, batch_lines=100, batch_window_s=300.0)
COST = resolve_cost(PARAMS)


@pytest.fixture(scope="module")
def items() -> list[TraceItem]:
    return load_workload(TRACE, block_size=block_size_for(PARAMS, COST), speedup=0.5, limit=200)


def _run(
    items: list[TraceItem], params: SimParams, *, idle_only: bool = True, log: bool = False
) -> Simulation:
    sim = Simulation(
        items,
        params,
        COST,
        policy="mooncake",
        record_log=log,
        settings={"batch_idle_only": idle_only},
    )
    sim.run()
    return sim


@pytest.fixture(scope="module")
def runs(items: list[TraceItem]) -> dict[str, tuple[PolicyResult, Simulation]]:
    out = {}
    for way, params, idle_only in (
        ("none", PARAMS, True),
        ("idle", BACKLOG, True),
        ("naive", BACKLOG, False),
    ):
        sim = Simulation(
            items, params, COST, policy="mooncake", settings={"batch_idle_only": idle_only}
        )
        out[way] = (sim.run(), sim)
    return out


def test_backlog_on_an_idle_cluster_is_served() -> None:
    sim = _run([], msgspec.structs.replace(PARAMS, batch_lines=50, batch_window_s=600.0))
    batch = sim.batch_result
    assert batch is not None
    assert (batch.lines, batch.completed, batch.timed_out, batch.failed) == (50, 50, 0, 0)
    assert batch.tries >= batch.lines
    assert batch.makespan_s < 600.0
    # Nothing interactive: the whole run is idle capacity, and the lines used some.
    assert batch.interactive_prefill_s == 0.0
    assert 0.0 < batch.idle_used <= 1.0
    # Each try is a batch line of its own request id, the gateway's form.
    ids = [j.item.request_id for j in sim.batch_jobs]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("cmpl-batch_sim-") for i in ids)


def test_held_back_lines_are_retried_and_interactive_figures_hold(
    runs: dict[str, tuple[PolicyResult, Simulation]],
) -> None:
    none, _ = runs["none"]
    idle, sim = runs["idle"]
    batch = sim.batch_result
    assert batch is not None
    # Interactive load held lines back; they were tried again and all finished in time.
    assert batch.held_back > 0
    assert batch.tries == batch.lines + batch.held_back
    assert batch.completed == batch.lines
    assert all(j.reason.startswith("batch_held") for j in sim.batch_jobs if j.fate == "rejected")
    # The interactive figures are over interactive requests only, within 1%.
    assert idle.requests == none.requests
    assert idle.goodput_rps >= none.goodput_rps * 0.99
    assert idle.ttft_p90_s <= none.ttft_p90_s * 1.01
    assert idle.slo_attainment >= none.slo_attainment - 0.01


def test_naive_way_hurts_interactive_ttft_more(
    runs: dict[str, tuple[PolicyResult, Simulation]],
) -> None:
    idle, _ = runs["idle"]
    naive, sim = runs["naive"]
    assert sim.batch_result is not None and sim.batch_result.completed > 0
    assert naive.ttft_p90_s > idle.ttft_p90_s
    assert naive.goodput_rps < idle.goodput_rps


def test_a_run_with_a_backlog_replays(items: list[TraceItem]) -> None:
    sim = _run(items[:80], BACKLOG, log=True)
    assert sim.records
    assert any(getattr(r.event, "batch", False) for r in sim.records), "the log holds batch lines"
    assert replay(sim.records).divergences == []
