"""`yb sim` with a batch backlog (`yb_tools.sim.batch`): lines fill an idle cluster,
are held back and retried under interactive load without changing the interactive
figures, slow interactive decoding less than the naive way (`batch_idle_only=false`),
and the log of such a run replays; a line's prefill pauses at a layer boundary for an
interactive request (`batch_preemption`), which the conductor prices.

200 requests of Mooncake's synthetic trace at half speed on 2 prefill + 2 decode
instances of the llama2-70b-a800 profile, beside 100 lines due in 300 s; the
simulator is deterministic, so the tests assert outcomes, not timings.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from yb_conductor.replay import replay
from yb_core import events as ev
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


def test_naive_way_slows_interactive_decoding_more(
    runs: dict[str, tuple[PolicyResult, Simulation]],
) -> None:
    none, _ = runs["none"]
    idle, _ = runs["idle"]
    naive, sim = runs["naive"]
    assert sim.batch_result is not None and sim.batch_result.completed > 0
    # Pre-empted between two layers, neither way's lines move the interactive TTFT
    # p90 here; sent as ordinary flex requests, they crowd the decode batches more.
    assert idle.ttft_p90_s == naive.ttft_p90_s == none.ttft_p90_s
    assert naive.tbt_p90_s > idle.tbt_p90_s >= none.tbt_p90_s


def test_a_run_with_a_backlog_replays(items: list[TraceItem]) -> None:
    sim = _run(items[:80], BACKLOG, log=True)
    assert sim.records
    assert any(getattr(r.event, "batch", False) for r in sim.records), "the log holds batch lines"
    assert replay(sim.records).divergences == []


def _preemption_run(preempt: bool) -> tuple[Simulation, float, float]:
    """One 4,096-token batch line on one prefill instance, and an interactive
    request of the same length arriving a third of the way into the line's
    prefill, in engine chunks of 512 tokens of a model of 80 layers: (the run, the
    line's compute, one layer of one chunk)."""
    params = SimParams(prefill=1, decode=1, preempt_tokens=512, model_layers=80, batch_lines=1)
    params = msgspec.structs.replace(params, batch_window_s=600.0)
    bs = block_size_for(params, COST)
    compute = COST.prefill_s(4096)
    item = TraceItem(
        index=0,
        request_id="interactive-0",
        arrival=compute / 3,
        prompt_tokens=4096,
        output_tokens=4,
        keys=list(range(1, 4096 // bs + 1)),
    )
    sim = Simulation(
        [item],
        params,
        COST,
        policy="mooncake",
        record_log=True,
        settings={"batch_preemption": preempt},
    )
    sim.run()
    return sim, compute, compute * 512 / 4096 / 80


def _queue_priced(sim: Simulation) -> float:
    """The queue the conductor priced for the interactive request."""
    assert sim.records is not None
    (decision,) = [
        r.event
        for r in sim.records
        if isinstance(r.event, ev.RequestScheduled) and r.event.request_id == "interactive-0"
    ]
    return decision.estimates.queue_s


def test_a_batch_lines_prefill_pauses_at_its_next_layer_for_an_interactive_request() -> None:
    sim, compute, step = _preemption_run(True)
    (line,) = sim.batch_jobs
    (job,) = sim.jobs
    assert line.fate == job.fate == "completed"
    # The interactive prefill starts once the layer the line is computing ends (its
    # 214th step: 640 in all, the request arriving after a third of them), not at
    # the end of its chunk or of its prefill; the line pauses there and resumes when
    # it ends.
    assert job.prefill_start == pytest.approx(214 * step)
    assert 0 <= job.prefill_start - job.item.arrival <= step
    assert line.runs == [(0.0, pytest.approx(214 * step))]
    assert line.prefill_end == pytest.approx(compute + job.prefill_s)
    # The prefill time it took is its own compute, not its pause.
    spans = line.busy_spans()
    assert sum(end - start for start, end in spans) == pytest.approx(line.prefill_s)
    # The conductor priced the pause (the layer in progress is not priced), and the
    # log replays.
    assert _queue_priced(sim) == 0.0
    assert sim.records is not None and replay(sim.records).divergences == []


def test_without_preemption_the_interactive_request_waits_for_the_whole_line() -> None:
    sim, compute, _ = _preemption_run(False)
    (line,) = sim.batch_jobs
    (job,) = sim.jobs
    assert line.runs == []
    assert job.prefill_start == pytest.approx(compute)
    assert line.prefill_end == pytest.approx(compute)
    assert _queue_priced(sim) == pytest.approx(compute - job.item.arrival)


def test_at_most_batch_concurrency_lines_are_in_flight_at_once() -> None:
    params = msgspec.structs.replace(
        PARAMS, batch_lines=12, batch_window_s=600.0, batch_concurrency=3
    )
    sim = _run([], params)
    batch = sim.batch_result
    assert batch is not None and batch.completed == 12
    # Each line from its first try to its end; never more than 3 overlap.
    spans = []
    for line in sim.batch_lines:
        first = line.jobs[0].item.arrival
        spans.append((first, line.end))
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    assert peak == 3
