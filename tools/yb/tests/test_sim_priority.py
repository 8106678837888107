"""`yb sim` with priorities: simulated engines run by priority, and under overload the
conductor keeps the high class within its TTFT SLO while the low class absorbs the
rejections.

The hand-checked part uses round numbers: 1 ms of prefill per prompt token, 10 ms per
decode step. The overload part runs 1,000 requests of Mooncake's synthetic trace
(3x speed, 4 prefill + 2 decode instances of the llama2-70b-a800 profile, TTFT SLO
10 s), a fifth of them at priority 1; the simulator is deterministic, so it asserts
outcomes, not timings.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost, load_cost_model
from yb_conductor.replay import replay
from yb_tools.sim.params import SimParams, parse_priority_mix
from yb_tools.sim.priorities import PARAMS, TRACE
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem, draw_priorities, load_workload

ROUND = CostModel(
    name="round",
    kv_bytes_per_token=1000,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.0, per_context_token_s=0.0),
)

# The overload of docs/priorities.md.
OVERLOAD = PARAMS


def _item(i: int, arrival: float, prompt: int, output: int) -> TraceItem:
    return TraceItem(
        index=i,
        request_id=f"req-{i}",
        arrival=arrival,
        prompt_tokens=prompt,
        output_tokens=output,
        keys=[1000 * (i + 1) + k for k in range(prompt // 100 + 1)],
    )


def _hand_run(priorities: list[int], **params: Any) -> Simulation:
    items = [
        _item(0, 0.0, 1000, 100),  # prefills 0.0-1.0, then decodes 99 steps
        _item(1, 0.1, 200, 3),
        _item(2, 0.2, 300, 3),
    ]
    sim = Simulation(
        items,
        SimParams(prefill=1, decode=1, block_size=100, max_tokens=0, **params),
        ROUND,
        policy="mooncake",
        admission="none",
    )
    for job, priority in zip(sim.jobs, priorities, strict=True):
        job.priority = priority
    sim.run()
    return sim


def test_prefill_runs_the_higher_priority_first_never_preempting() -> None:
    plain = {j.item.request_id: j for j in _hand_run([0, 0, 0]).jobs}
    # Arrival order: req-1 at 1.0 (0.2 s), req-2 at 1.2 (0.3 s).
    assert [plain[f"req-{i}"].prefill_start for i in range(3)] == pytest.approx([0.0, 1.0, 1.2])
    ranked = {j.item.request_id: j for j in _hand_run([0, 0, 1]).jobs}
    # req-2 came later but ranks higher: it runs when req-0 ends, req-1 after it.
    assert [ranked[f"req-{i}"].prefill_start for i in range(3)] == pytest.approx([0.0, 1.3, 1.0])
    assert ranked["req-2"].ttft_s == pytest.approx(1.1)
    assert ranked["req-1"].ttft_s == pytest.approx(1.4)


def test_decode_admits_the_higher_priority_first_when_the_batch_is_full() -> None:
    params = {"decode_max_batch": 1, "decode_admission": "queue"}
    plain = {j.item.request_id: j for j in _hand_run([0, 0, 0], **params).jobs}
    ranked = {j.item.request_id: j for j in _hand_run([0, 0, 1], **params).jobs}
    # req-0 holds the only slot until 1.99; both others have prefilled by then and
    # wait for it. The first to join decodes 2 steps (20 ms), then the other.
    assert [plain[f"req-{i}"].join_time for i in (1, 2)] == pytest.approx([1.99, 2.01])
    assert [ranked[f"req-{i}"].join_time for i in (1, 2)] == pytest.approx([2.01, 1.99])


def test_a_priority_mix_is_drawn_from_the_seed() -> None:
    drawn = draw_priorities(2000, {0: 0.8, 1: 0.2}, seed=3)
    assert drawn == draw_priorities(2000, {0: 0.8, 1: 0.2}, seed=3)
    assert drawn != draw_priorities(2000, {0: 0.8, 1: 0.2}, seed=4)
    assert 300 < drawn.count(1) < 500
    assert draw_priorities(5, {}, seed=3) == [0] * 5
    with pytest.raises(ValueError, match="shares"):
        draw_priorities(5, {0: 0.0}, seed=3)
    assert parse_priority_mix(" 1:0.2, 0:0.8 ") == {1: 0.2, 0: 0.8}
    assert parse_priority_mix("") == {}
    with pytest.raises(ValueError, match="'high'"):
        parse_priority_mix("0:0.8,high")


@pytest.fixture(scope="module")
def items() -> list[TraceItem]:
    return load_workload(TRACE, block_size=512, speedup=OVERLOAD.speedup, limit=OVERLOAD.limit)


def _overload(items: list[TraceItem], **settings: Any) -> tuple[Simulation, PolicyResult]:
    sim = Simulation(
        items,
        OVERLOAD,
        load_cost_model("llama2-70b-a800"),
        policy="mooncake",
        admission="predicted",
        record_log=True,
        settings=settings,
    )
    return sim, sim.run()


def test_under_overload_high_priority_keeps_its_slo_and_low_priority_is_shed(
    items: list[TraceItem],
) -> None:
    sim, r = _overload(items)
    high, low = r.by_priority[1], r.by_priority[0]
    assert high.requests + low.requests == r.requests == 1000
    # Overloaded: a large share of the requests is refused...
    assert r.rejected > 300
    # ... nearly all of them low priority; every high one that ran met its TTFT SLO.
    assert high.rejected / high.requests < 0.1
    assert low.rejected / low.requests > 0.4
    assert high.ttft_within_slo == 1.0 and high.ttft_max_s <= OVERLOAD.ttft_slo_s
    assert high.ttft_p50_s < low.ttft_p50_s
    # A conductor that does not know engines run by priority prices every queue in
    # full and refuses high priority far more often.
    _, unaware = _overload(items, priority_order=False)
    assert unaware.by_priority[1].rejected > 3 * high.rejected
    # The run is a production log: a fresh conductor reproduces every decision.
    assert sim.records is not None
    result = replay(sim.records)
    assert result.divergences == [] and result.decisions == 1000


def test_a_priority_run_is_deterministic(items: list[TraceItem]) -> None:
    runs = [_overload(items)[1] for _ in range(2)]
    figures = [msgspec.to_builtins(r) for r in runs]
    for f in figures:
        for key in ("wall_s", "conductor_s", "simulated_seconds_per_wall_second"):
            f.pop(key)
    assert figures[0] == figures[1]
    assert set(runs[0].by_priority) == {1, 0}
