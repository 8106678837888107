"""The workloads whose mix and rate change over time, for sizing the pools: a
prompt-heavy phase then an output-heavy one, and a daily curve with a 4x peak."""

from __future__ import annotations

import statistics

import pytest

from yb_tools.sim.workloads import daily_rate, generate


def test_phase_change_turns_from_long_prompts_to_long_answers() -> None:
    trace = generate("phase-change:phase_s=200,rate=2")
    first = [r for r in trace if r.timestamp < 200_000]
    second = [r for r in trace if r.timestamp >= 200_000]
    assert first and second and trace[-1].timestamp < 400_000
    assert statistics.mean(r.input_length for r in first) == pytest.approx(8000, rel=0.1)
    assert statistics.mean(r.output_length for r in first) == pytest.approx(50, rel=0.15)
    assert statistics.mean(r.input_length for r in second) == pytest.approx(1500, rel=0.1)
    assert statistics.mean(r.output_length for r in second) == pytest.approx(1000, rel=0.1)
    # Every prompt opens with one of the 16 shared system prompts (one 512-token block).
    assert len({r.hash_ids[0] for r in trace}) == 16


def test_daily_curve_peaks_at_midday_at_four_times_the_night() -> None:
    assert daily_rate(0.0, 3600.0, 1.0, 4.0) == pytest.approx(1.0)
    assert daily_rate(1800.0, 3600.0, 1.0, 4.0) == pytest.approx(4.0)
    assert daily_rate(900.0, 3600.0, 1.0, 4.0) == pytest.approx(2.5)
    trace = generate("daily:period_s=3600,rate=1")
    assert trace[-1].timestamp < 3_600_000
    # Expected about (1 + 4) / 2 x 3600 = 9,000 requests; the busiest tenth of the day
    # sees close to 4x the quietest tenth (a Poisson count, seeded: fixed).
    assert len(trace) == pytest.approx(9000, rel=0.05)
    seconds = [r.timestamp / 1000.0 for r in trace]
    night = sum(1 for t in seconds if t < 180.0 or t >= 3420.0)
    noon = sum(1 for t in seconds if 1620.0 <= t < 1980.0)
    assert 3.3 < noon / night < 4.3


def test_a_constant_day_is_a_plain_poisson_process() -> None:
    trace = generate("daily:period_s=1000,rate=2,peak=1")
    assert len(trace) == pytest.approx(2000, rel=0.1)
