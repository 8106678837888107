"""The shared-prefix workload's ladder (llm-d's prefix-cache benchmark) and the
conductor's decode KV room on it: the budget of every request at its final length
refused requests whose pages the decode instances would have had; the projected peak
(`decode_kv_peak`) does not. Both logs replay as they were recorded."""

from __future__ import annotations

import msgspec
import pytest

from yb_conductor.conductor import Conductor
from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_tools.sim.matrix import FOCUSED, WORKLOADS
from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import PAPER_POLICY, RunSpec, simulate
from yb_tools.sim.workloads import PRESETS, generate, shared_prefix
from yb_tools.traces import TRACE_BLOCK_TOKENS

LADDER = "shared-prefix-ladder"


def test_a_question_asked_again_is_the_same_prompt() -> None:
    records = shared_prefix(groups=3, users=2, questions=2, repeats=3, seed=4)
    assert len(records) == 3 * 2 * 2 * 3
    prompts: dict[tuple[int, ...], list[int]] = {}
    for r in records:
        prompts.setdefault(tuple(r.hash_ids), []).append(r.input_length)
    assert len(prompts) == 3 * 2 * 2
    assert all(len(lengths) == 3 and len(set(lengths)) == 1 for lengths in prompts.values())
    # The repeats share each group's system prompt, and nothing across groups.
    firsts = {r.hash_ids[0] for r in records}
    assert len(firsts) == 3


def test_steps_hold_each_rate_for_an_equal_share_of_the_requests() -> None:
    records = shared_prefix(groups=40, users=5, questions=8, qps_start=5, qps_end=50, steps=4)
    n = len(records)
    assert n == 1600
    times = [r.timestamp / 1000.0 for r in records]
    assert times == sorted(times)
    # Each quarter runs at one of 5, 20, 35, 50 requests/s (Poisson: within 15%).
    for k, rate in enumerate((5.0, 20.0, 35.0, 50.0)):
        share = times[k * n // 4 : (k + 1) * n // 4]
        measured = (len(share) - 1) / (share[-1] - share[0])
        assert measured == pytest.approx(rate, rel=0.15)


def test_the_ladder_is_llm_d_s_shape_and_a_setting_of_the_matrix() -> None:
    records = generate(LADDER)
    groups = {tuple(r.hash_ids[: 6000 // TRACE_BLOCK_TOKENS]) for r in records}
    assert len(groups) == 150
    assert len(records) == 150 * 5 * 8
    mean_prompt = sum(r.input_length for r in records) / len(records)
    assert mean_prompt == pytest.approx(6000 + 1200, rel=0.02)
    top = [r.timestamp / 1000.0 for r in records[-750:]]  # the last step: 60/s
    assert (len(top) - 1) / (top[-1] - top[0]) == pytest.approx(60.0, rel=0.1)
    assert generate(f"{LADDER}:output=100")[0].output_length < 130  # a preset's own overridden
    assert LADDER in WORKLOADS and LADDER in PRESETS
    assert (LADDER, "llama2-70b-a800", 1.0, 8, 8) in FOCUSED


def _run(peak: bool) -> tuple[int, int, float, list[LogRecord]]:
    """The conductor on the ladder (8 + 8, `llama2-70b-a800`): its refusals at arrival
    for decode KV, requests ended for KV, goodput, and its log."""
    logs: list[list[LogRecord]] = []
    report = simulate(
        LADDER,
        [RunSpec(PAPER_POLICY, PAPER_POLICY, "predicted")],
        SimParams(profile="llama2-70b-a800", prefill=8, decode=8),
        records=generate(LADDER),
        settings={"decode_kv_peak": peak},
        on_log=lambda _spec, records: logs.append(records),
    )
    r = report.policies[PAPER_POLICY]
    return r.reject_reasons.get("decode_kv_full", 0), r.kv_exhausted, r.goodput_rps, logs[0]


def _as_recorded_before_the_setting(records: list[LogRecord]) -> list[LogRecord]:
    out = []
    for rec in records:
        event = rec.event
        if isinstance(event, ev.ConductorConfigured):
            raw = msgspec.json.decode(event.settings_json.encode())
            del raw["decode_kv_peak"]
            # ... by a conductor from before behaviour versions, which recorded none.
            event = msgspec.structs.replace(
                event, settings_json=msgspec.json.encode(raw).decode(), behaviour_version=0
            )
        out.append(LogRecord(seq=rec.seq, event=event, subject=rec.subject))
    return out


def test_the_projected_peak_serves_what_the_budget_refused_and_both_logs_replay() -> None:
    budget_refused, _, budget_goodput, budget_log = _run(False)
    refused, exhausted, goodput, log = _run(True)
    assert budget_refused > 0
    assert refused == 0 and exhausted == 0
    assert goodput > budget_goodput
    # A log from before the setting (no field: the budget) replays decision for
    # decision, and so does one recorded with it; each diverges under the other rule.
    old = _as_recorded_before_the_setting(budget_log)
    assert replay(old).divergences == []
    assert replay(log).divergences == []
    flipped = Conductor(overrides={"decode_kv_peak": True})
    assert replay(old, strict=False, conductor=flipped).divergences != []
