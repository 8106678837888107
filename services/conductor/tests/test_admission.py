"""Admission on crafted states: none / early / predicted, priority classes, t_d.

Each scenario builds one cluster state (admitting everything), then asks the three
admission policies about the same next request: `decide` is a pure function of the
state, so they can all be asked without disturbing it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from yb_conductor.policy import placement_policy
from yb_conductor.quality import reject_code
from yb_conductor.settings import recorded_settings
from yb_core import events as ev

TBT_SLO = 0.030  # 10 ms + 1 ms per sequence: a batch of 20 is the most it allows


def keys(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def _ask(c: Any, admission: str, request: ev.RequestAdmitted) -> ev.Decision:
    cfg = msgspec.structs.replace(c.cfg, admission=admission)
    policy = placement_policy(cfg, c.cost)
    request.time = c.t
    return policy.decide(c.c.state, request, seq=10_000).decision


def _request(
    rid: str, chain: list[int], *, priority: int = 0, max_tokens: int = 10
) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=rid,
        gateway_id="g",
        model="",
        block_size=16,
        block_hashes=chain,
        prompt_tokens=len(chain) * 16 + 1,
        max_tokens=max_tokens,
        priority=priority,
        slo=ev.Slo(ttft_s=100.0, tbt_s=TBT_SLO),
    )


def _codes(c: Any, request: ev.RequestAdmitted) -> dict[str, str]:
    out = {}
    for admission in ("none", "early", "predicted"):
        d = _ask(c, admission, request)
        out[admission] = "admit" if isinstance(d, ev.RequestScheduled) else reject_code(d.reason)
    return out


def test_requests_in_prefill_count_only_for_the_predicted_policy(crafted: Any) -> None:
    c = crafted(admission="none")
    c.hosts(1)
    # 25 short requests wait for prefill; each will decode for a long time.
    for i in range(25):
        c.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10_000, tbt_slo=TBT_SLO)
    assert c.c.state.instances["d-0"].decoding_requests == 0
    # The next request's prefill ends after all of theirs: they will all be decoding.
    verdicts = _codes(c, _request("r", keys(2, base=99_000)))
    assert verdicts == {"none": "admit", "early": "admit", "predicted": "tbt_slo"}
    rejected = _ask(c, "predicted", _request("r", keys(2, base=99_000)))
    assert isinstance(rejected, ev.RequestRejected)
    assert rejected.estimates.decode_batch == 26
    assert "at prefill end" in rejected.reason


def test_decodes_that_end_before_the_prefill_count_only_for_early(crafted: Any) -> None:
    c = crafted(admission="none", decode_now_floor=False)
    c.hosts(2)
    # 25 requests decoding now, each with at most 10 tokens left (~0.35 s).
    for i in range(25):
        d = c.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10, tbt_slo=TBT_SLO)
        c.progress(d.request_id, d.decode_instance, "kv_committed")
    assert c.c.state.instances["d-0"].decoding_requests == 25
    # A long prompt: its prefill (1.6 s) ends after they have all finished.
    verdicts = _codes(c, _request("r", keys(100, base=99_000)))
    assert verdicts == {"none": "admit", "early": "tbt_slo", "predicted": "admit"}
    early = _ask(c, "early", _request("r", keys(100, base=99_000)))
    assert isinstance(early, ev.RequestRejected)
    assert "now" in early.reason
    # Retry-After: when enough of the batch has finished (well under a second here).
    assert early.retry_after_s == 1.0


def test_the_batch_decoding_now_is_the_floor_of_the_prediction(crafted: Any) -> None:
    c = crafted(admission="none")
    c.hosts(2)
    for i in range(25):
        d = c.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10, tbt_slo=TBT_SLO)
        c.progress(d.request_id, d.decode_instance, "kv_committed")
    # They end before the long prompt's prefill does, but requests placed meanwhile
    # would keep the instance as loaded: the batch now (26, 36 ms) is the floor.
    refused = _ask(c, "predicted", _request("r", keys(100, base=99_000)))
    assert isinstance(refused, ev.RequestRejected) and reject_code(refused.reason) == "tbt_slo"
    assert "with batch 26 now (above the 1 at prefill end)" in refused.reason
    assert refused.estimates.decode_batch == 1  # the estimate is still the prediction
    # Where the prediction is the larger, it decides, as without the floor.
    idle = crafted(admission="none")
    idle.hosts(1)
    for i in range(25):
        idle.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10_000, tbt_slo=TBT_SLO)
    assert _codes(idle, _request("r", keys(2, base=99_000)))["predicted"] == "tbt_slo"


def test_lower_priority_classes_are_shed_first(crafted: Any) -> None:
    c = crafted(admission="none", shed_step=0.1)
    c.hosts(1)
    for i in range(17):  # predicted batch 18 with the newcomer: TBT 28 ms
        c.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10_000)
    verdicts = {
        p: isinstance(
            _ask(c, "predicted", _request("r", keys(2, 99_000), priority=p)), ev.RequestScheduled
        )
        for p in (1, 0, -1, -2)
    }
    # 28 ms fits 100% (priority >= 0) of 30 ms, not 90% (27 ms) or 80% (24 ms).
    assert verdicts == {1: True, 0: True, -1: False, -2: False}
    low = _ask(c, "predicted", _request("r", keys(2, 99_000), priority=-1))
    assert isinstance(low, ev.RequestRejected)
    assert "priority -1: 90% of SLO" in low.reason
    assert low.explain is not None and low.explain.tbt_limit_s == pytest.approx(0.027)


def test_predictions_are_published_with_decisions(crafted: Any) -> None:
    c = crafted(admission="predicted")
    c.hosts(1)
    outputs = c.feed(
        ev.RequestAdmitted(
            request_id="r",
            gateway_id="g",
            model="",
            block_size=16,
            block_hashes=keys(2),
            prompt_tokens=33,
            max_tokens=4,
        )
    )
    # Then the retention advice for the kvstore that will hold the blocks.
    decision, prediction, *advice = outputs
    assert all(isinstance(a, ev.RetentionPlanned) for a in advice)
    assert isinstance(decision, ev.RequestScheduled)
    assert isinstance(prediction, ev.LoadPrediction)
    assert prediction.request_id == "r" and prediction.instance_id == decision.decode_instance
    assert prediction.at_time == pytest.approx(c.t + decision.estimates.ttft_s)
    assert prediction.predicted_batch == decision.estimates.decode_batch == 1
    early = crafted(admission="early")
    early.hosts(1)
    outputs = early.feed(_request("r", keys(2)))
    assert not any(isinstance(o, ev.LoadPrediction) for o in outputs)
    assert isinstance(outputs[0], ev.RequestScheduled)


def test_expected_decode_time_is_learned_from_completions(crafted: Any) -> None:
    c = crafted(decode_time_s=10.0, decode_time_alpha=0.5)
    c.hosts(1)
    d = c.admit("a", keys(2), max_tokens=1000)
    c.at(2.0).progress("a", d.decode_instance, "kv_committed")
    c.at(4.0).finish("a", d.decode_instance, output_tokens=200)
    learned = c.c.state.learned
    assert learned.decode_time_s == pytest.approx(10.0 + 0.5 * (2.0 - 10.0))
    assert learned.output_tokens == pytest.approx(64 + 0.5 * (200 - 64))
    assert learned.completions == 1
    # The estimate-vs-outcome comparison was recorded for the metrics.
    (outcome,) = c.c.outcomes
    assert outcome.est_ttft_s == d.estimates.ttft_s and outcome.ttft_s == 0.1
    assert c.c.quality.outcomes == 1


@pytest.mark.parametrize("learn_from_cut_short", [False, True])
def test_a_request_cut_short_for_kv_teaches_no_output_length(
    crafted: Any, learn_from_cut_short: bool
) -> None:
    c = crafted(
        decode_time_s=10.0, decode_time_alpha=0.5, learn_from_cut_short=learn_from_cut_short
    )
    c.hosts(1)
    d = c.admit("a", keys(2), max_tokens=1000)
    c.at(2.0).progress("a", d.decode_instance, "kv_committed")
    c.at(4.0).finish("a", d.decode_instance, output_tokens=20, reason=ev.CUT_SHORT_REASON)
    learned = c.c.state.learned
    if learn_from_cut_short:  # how logs recorded before the setting replay
        assert learned.decode_time_s == pytest.approx(10.0 + 0.5 * (2.0 - 10.0))
        assert learned.output_tokens == pytest.approx(64 + 0.5 * (20 - 64))
    else:
        assert (learned.decode_time_s, learned.output_tokens) == (10.0, 64)
    # Its TTFT and TBT are still outcomes like any other.
    assert learned.completions == 1 and c.c.quality.outcomes == 1


def test_quality_counts_branches_and_reject_codes(crafted: Any) -> None:
    c = crafted()
    c.hosts(2)
    c.store("kv-1", keys(5))
    c.admit("local", keys(6))
    c.admit("fresh", keys(3, base=50_000))
    c.admit("slow", keys(3, base=60_000), ttft_slo=0.001)
    q = c.c.quality
    assert q.branches == {"local": 1, "recompute": 1}
    assert q.reject_codes == {"ttft_slo": 1}
    assert q.reused_blocks == 5 and q.best_blocks == 5 and q.reuse_ratio == 1.0
    assert q.summary()["rejected_ttft_slo"] == 1


def test_hot_prefixes_are_replicated_to_the_least_busy_host(crafted: Any) -> None:
    c = crafted(hot_replicas=2, hot_demand=3, hot_window_s=60.0)
    c.hosts(3)
    c.store("kv-0", keys(6))
    plans = []
    for i in range(5):
        outputs = c.feed(_request(f"r{i}", [*keys(6), 7_000 + i]))
        plans += [o for o in outputs if isinstance(o, ev.ReplicationPlanned)]
    (plan,) = plans  # the third request makes it hot; then once per window
    assert plan.source_instance == "kv-0" and plan.block_hashes == keys(6)
    assert plan.target_instance in ("kv-1", "kv-2") and plan.demand == 3
    # The target reports the copy: two hosts hold it, so no more plans.
    c.store(plan.target_instance, keys(6))
    c.at(100.0)
    for i in range(4):
        outputs = c.feed(_request(f"s{i}", [*keys(6), 8_000 + i]))
        assert not [o for o in outputs if isinstance(o, ev.ReplicationPlanned)]


def test_a_log_recorded_before_the_floor_predicts_alone() -> None:
    assert recorded_settings('{"policy": "mooncake"}').decode_now_floor is False
    assert recorded_settings('{"decode_now_floor": true}').decode_now_floor is True
