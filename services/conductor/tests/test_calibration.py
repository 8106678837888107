"""Calibrated admission: estimates judged by what outcomes showed them to mean, and
decode KV room by what the instance reports using; never stricter than the estimates,
and off for logs recorded before the setting."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from test_admission import TBT_SLO, _request
from test_placement import keys

from yb_conductor.policy import placement_policy
from yb_conductor.quality import reject_code
from yb_conductor.replay import replay
from yb_conductor.settings import recorded_settings
from yb_conductor.state import CALIBRATION_MIN_OUTCOMES, Calibration
from yb_core import events as ev


def _spread(n: int) -> list[float]:
    """`n` estimates between 10 and 50 ms."""
    return [0.010 + 0.040 * (i % 41) / 40 for i in range(n)]


def test_calibration_needs_outcomes_and_never_exceeds_the_estimate() -> None:
    cal = Calibration()
    for est in _spread(CALIBRATION_MIN_OUTCOMES - 1):
        cal.learn(est, 0.020)
    assert cal.expected(0.045) == 0.045  # too few outcomes: the estimate itself
    for est in _spread(400):
        cal.learn(est, 0.020)  # whatever was estimated, 20 ms was observed
    assert cal.expected(0.045) == pytest.approx(0.020, abs=0.002)
    assert cal.expected(0.012) == 0.012  # the line is above: the estimate stands

    understated = Calibration()
    for est in _spread(400):
        understated.learn(est, 2 * est)
    assert understated.expected(0.030) == 0.030  # never stricter than the estimate

    tracking = Calibration()
    for est in _spread(400):
        tracking.learn(est, 0.8 * est)
    assert tracking.expected(0.040) == pytest.approx(0.032, rel=0.05)


def _ask(c: Any, request: ev.RequestAdmitted, **settings: Any) -> ev.Decision:
    cfg = msgspec.structs.replace(c.cfg, **settings)
    request.time = c.t
    return placement_policy(cfg, c.cost).decide(c.c.state, request, seq=10_000).decision


def _verdict(d: ev.Decision) -> str:
    return "admit" if isinstance(d, ev.RequestScheduled) else reject_code(d.reason)


def test_a_tbt_the_outcomes_show_overstated_is_not_refused(crafted: Any) -> None:
    c = crafted(admission="none")
    c.hosts(1)
    for i in range(25):  # all decoding when the next prefill ends: TBT 36 ms predicted
        c.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10_000, tbt_slo=TBT_SLO)
    r = _request("r", keys(2, base=99_000))
    assert _verdict(_ask(c, r, admission="predicted")) == "tbt_slo"
    learned = c.c.state.learned.tbt
    for est in _spread(400):
        learned.learn(est, 0.9 * est)  # outcomes 10% under the estimates: 32 ms
    refused = _ask(c, r, admission="predicted")
    assert _verdict(refused) == "tbt_slo" and "(expected 0.0324s)" in refused.reason
    for est in _spread(400):
        learned.learn(est, 0.022)  # the batch shrinks again while a request decodes
    assert _verdict(_ask(c, r, admission="predicted")) == "admit"
    assert _verdict(_ask(c, r, admission="predicted", calibrated_admission=False)) == "tbt_slo"


def test_decode_room_follows_what_the_instance_reports_using(crafted: Any) -> None:
    c = crafted(admission="none")
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    c.decode("d-0", kv_blocks=40)
    for i in range(20):  # 17 + 10 tokens each: 2 blocks accounted, 40 in all
        d = c.admit(f"w{i}", keys(1, base=100 * i))
        c.progress(d.request_id, "d-0", "kv_committed")
    r = _request("r", keys(1, base=99_000))
    assert _verdict(_ask(c, r)) == "decode_kv_full"
    for t in range(10):  # the engine holds 27 tokens a request: 34 blocks, not 40
        c.at(2.0 + t).feed(
            ev.LoadReport(instance_id="d-0", role="decode", kv_used_blocks=34, kv_total_blocks=40)
        )
    assert c.c.state.instances["d-0"].kv_overcount_blocks == pytest.approx(6, abs=0.2)
    assert _verdict(_ask(c, r)) == "admit"
    assert _verdict(_ask(c, r, calibrated_admission=False)) == "decode_kv_full"
    assert _verdict(c.admit("r", keys(1, base=99_000))) == "admit"
    assert replay(c.records).divergences == []


def test_a_log_recorded_without_the_setting_replays_uncalibrated() -> None:
    assert recorded_settings('{"policy": "mooncake"}').calibrated_admission is False
    assert recorded_settings('{"calibrated_admission": true}').calibrated_admission is True


def test_requests_whose_prefill_ends_later_take_their_pages_later(crafted: Any) -> None:
    c = crafted(admission="none")
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    c.decode("d-0", kv_blocks=340)
    c.admit("long", keys(300, base=50_000))  # 301 blocks; its prefill takes 4.8 s
    for i in range(19):  # 2 blocks each, queued behind it: 339 of 340 accounted
        c.admit(f"w{i}", keys(1, base=100 * i))
    c.prefill("p-1", "h1")  # an idle prefill instance: the next prefill ends first
    r = _request("r", keys(1, base=99_000))
    assert _verdict(_ask(c, r)) == "admit"
    assert _verdict(_ask(c, r, calibrated_admission=False)) == "decode_kv_full"
    assert c.admit("r", keys(1, base=99_000)).prefill_instance == "p-1"
    assert replay(c.records).divergences == []
