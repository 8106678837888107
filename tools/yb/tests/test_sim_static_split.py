"""The best static split of a budget of instances, found with hindsight: every split
played on the same requests, the one with the most goodput chosen."""

from __future__ import annotations

import pytest

from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import resolve_cost
from yb_tools.sim.simulator import block_size_for
from yb_tools.sim.static_split import best_static_split, static_splits
from yb_tools.sim.workload import TraceItem, workload_from
from yb_tools.sim.workloads import generate

PARAMS = SimParams(profile="llama2-70b-a800")


def _phases(spec: str) -> list[TraceItem]:
    cost = resolve_cost(PARAMS)
    return workload_from(generate(spec), block_size=block_size_for(PARAMS, cost))


def test_every_split_is_played_and_the_best_has_the_most_goodput() -> None:
    cost = resolve_cost(PARAMS)
    items = _phases("phase-change:phase_s=60,rate=8")
    splits = static_splits(items, PARAMS, cost, 4)
    assert [s.label for s in splits] == ["P1/D3", "P2/D2", "P3/D1"]
    assert {s.result.requests for s in splits} == {len(items)}
    for s in splits:
        assert s.instance_hours == pytest.approx(4 * s.result.simulated_s / 3600.0)
    best = best_static_split(splits)
    assert best.result.goodput_rps == max(s.result.goodput_rps for s in splits)
    with pytest.raises(ValueError, match="cannot hold a prefill and a decode"):
        static_splits(items, PARAMS, cost, 1)


def test_long_prompts_want_prefill_and_long_answers_want_decode() -> None:
    cost = resolve_cost(PARAMS)
    prompts = _phases("phase-change:phase_s=60,rate=8,long_output=50,short_prompt=8000")
    answers = _phases("phase-change:phase_s=60,rate=8,long_prompt=1500,short_output=1000")
    # Long prompts: the most goodput takes six prefill instances or more.
    assert best_static_split(static_splits(prompts, PARAMS, cost, 8)).prefill >= 6
    # Long answers: one decode instance loses goodput that two or more keep.
    by_decode = {s.decode: s.result.goodput_rps for s in static_splits(answers, PARAMS, cost, 8)}
    assert by_decode[1] < min(by_decode[d] for d in range(2, 8))
