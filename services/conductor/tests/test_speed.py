"""Learned speed: estimates follow what the log shows the engines really take.

The crafted cost model prefills 1 ms per token, so a 1,000-token prompt is priced
at 1 s alone; every scenario's log must also replay to the same decisions. The
scenarios span minutes without heartbeats, so nothing is declared dead.
"""

from __future__ import annotations

from typing import Any

import pytest

from yb_conductor import snapshot
from yb_conductor.conductor import Conductor
from yb_conductor.replay import replay
from yb_conductor.settings import configured_event, from_event
from yb_conductor.speed import InstanceSpeed, SharedSpeed, learn_prefill, slowdown
from yb_core import events as ev
from yb_core.config import ConductorConfig

PROMPT = 1000  # tokens: 1.000 s of prefill by the crafted cost model


def _scheduled(d: ev.Decision) -> ev.RequestScheduled:
    assert isinstance(d, ev.RequestScheduled), d
    return d


def _serve(
    c: Any, rid: str, start: float, prefill_s: float, *, ttft_extra: float = 0.0
) -> ev.RequestScheduled:
    """Admit `rid` at `start` on an idle cluster; its prefill takes `prefill_s`, its
    first token comes `ttft_extra` after that, and it completes."""
    d = _scheduled(c.at(start).admit(rid, prompt=PROMPT, ttft_slo=100.0))
    c.at(start + 0.001).progress(rid, d.prefill_instance, "prefill_started")
    c.at(start + 0.001 + prefill_s).progress(rid, d.prefill_instance, "prefill_done")
    c.at(start + 0.002 + prefill_s).progress(rid, d.decode_instance, "kv_committed")
    c.at(start + 1.0 + prefill_s).feed(
        ev.RequestFinished(
            request_id=rid,
            instance_id=d.decode_instance,
            outcome="completed",
            output_tokens=10,
            tbt_mean_s=0.01,
            ttft_s=0.001 + prefill_s + ttft_extra,
        )
    )
    return d


def _assert_replays(c: Any) -> None:
    result = replay(c.records)
    assert result.divergences == []


def test_prefills_slower_than_the_profile_make_later_estimates_slower(crafted: Any) -> None:
    c = crafted(heartbeat_timeout_s=1e6)
    c.hosts(1)
    first = _serve(c, "a", 1.0, 3.0)
    assert first.estimates.prefill_s == pytest.approx(1.0)  # nothing learned yet
    for i in range(8):
        _serve(c, f"r{i}", 10.0 + 10 * i, 3.0)
    d = _scheduled(c.at(200.0).admit("next", prompt=PROMPT))
    # Nine prefills of 3x the profile: the average has nearly converged on 3x.
    assert 2.8 < d.estimates.prefill_s < 3.0
    assert d.estimates.ttft_s >= d.estimates.prefill_s
    assert f"(x{d.estimates.prefill_s:.2f} the cost model)" in (
        d.explain.reason if d.explain else ""
    )
    _assert_replays(c)


def test_without_learned_speed_the_profile_is_all_there_is(crafted: Any) -> None:
    c = crafted(learn_speed=False, heartbeat_timeout_s=1e6)
    c.hosts(1)
    for i in range(5):
        _serve(c, f"r{i}", 10.0 * (i + 1), 3.0, ttft_extra=0.5)
    d = _scheduled(c.at(100.0).admit("next", prompt=PROMPT))
    assert d.estimates.prefill_s == pytest.approx(1.0)
    assert d.estimates.ttft_s == pytest.approx(1.0)
    _assert_replays(c)


def test_the_lag_to_the_first_token_is_learned_and_added(crafted: Any) -> None:
    c = crafted(heartbeat_timeout_s=1e6)
    c.hosts(1)
    for i in range(10):
        _serve(c, f"r{i}", 10.0 * (i + 1), 1.0, ttft_extra=0.5)
    d = _scheduled(c.at(200.0).admit("next", prompt=PROMPT))
    lag = c.c.state.speeds["d-0"].first_token_s
    assert 0.45 < lag <= 0.5
    assert d.estimates.ttft_s == pytest.approx(d.estimates.queue_s + d.estimates.prefill_s + lag)
    _assert_replays(c)


def test_engines_sharing_a_machine_price_each_other_in(crafted: Any) -> None:
    # Two prefill engines and a decode engine on one machine (`yb up`): with one
    # prefill queued, the other engine's estimate counts it, adding the prior (1.0)
    # times the time alone.
    alone = crafted(compute_sharing="none", heartbeat_timeout_s=1e6)
    shared = crafted(compute_sharing="all", heartbeat_timeout_s=1e6)
    for c in (alone, shared):
        c.hosts(2)
        _scheduled(c.at(1.0).admit("a", prompt=PROMPT, ttft_slo=100.0))
    b_alone = _scheduled(alone.admit("b", prompt=PROMPT, ttft_slo=100.0))
    b_shared = _scheduled(shared.admit("b", prompt=PROMPT, ttft_slo=100.0))
    assert b_alone.prefill_instance == b_shared.prefill_instance == "p-1"
    assert b_alone.estimates.ttft_s == pytest.approx(1.0)
    assert b_shared.estimates.ttft_s == pytest.approx(2.0)
    # Behind a queue, the decode engine counts too: the requests ahead will be
    # decoding. The queue is priced at the speed expected now: 1 s of work beside
    # two busy engines, then this request's own.
    c_shared = _scheduled(shared.admit("c", prompt=PROMPT, ttft_slo=100.0))
    assert c_shared.estimates.queue_s == pytest.approx(3.0)
    assert c_shared.estimates.ttft_s == pytest.approx(6.0)
    _assert_replays(shared)


def test_host_sharing_counts_only_engines_on_the_same_host(crafted: Any) -> None:
    c = crafted(compute_sharing="host", heartbeat_timeout_s=1e6)
    c.prefill("p-0", "h0")
    c.prefill("p-1", "h0")
    c.prefill("p-2", "h1")
    c.decode("d-0", host="h2")
    _scheduled(c.at(1.0).admit("a", prompt=PROMPT, ttft_slo=100.0))  # on p-0
    b = _scheduled(c.admit("b", prompt=PROMPT, ttft_slo=100.0))
    # p-1 shares h0 with the busy p-0; p-2 is alone on h1 and wins.
    assert b.prefill_instance == "p-2"
    assert b.estimates.ttft_s == pytest.approx(1.0)
    table = {cand.instance_id: cand for cand in (b.explain.candidates if b.explain else [])}
    assert table["p-1"].prefill_s == pytest.approx(2.0)
    _assert_replays(c)


def test_a_burst_is_admitted_only_as_far_as_shared_engines_can_serve_it(crafted: Any) -> None:
    # Ten requests at the same instant, TTFT SLO 4 s, 1 s of prefill each alone.
    def burst(sharing: str) -> list[ev.RequestScheduled]:
        c = crafted(compute_sharing=sharing, heartbeat_timeout_s=1e6)
        c.hosts(2)
        c.at(1.0)
        decisions = [c.admit(f"r{i}", prompt=PROMPT, ttft_slo=4.0) for i in range(10)]
        _assert_replays(c)
        return [d for d in decisions if isinstance(d, ev.RequestScheduled)]

    # Priced as if alone: four per prefill engine "fit" in 4 s.
    assert len(burst("none")) == 8
    # Priced as sharing one machine: 1 s, then 2 s on the other engine, then 6 s
    # behind either (two others busy: the other prefill and the decode).
    shared = burst("all")
    assert [round(d.estimates.ttft_s, 3) for d in shared] == [1.0, 2.0]


def test_contended_prefills_teach_the_cost_of_sharing(crafted: Any) -> None:
    c = crafted(compute_sharing="all", heartbeat_timeout_s=1e6)
    c.hosts(2)
    # Two prefills at once, one per engine, each taking 4x the profile beside one
    # busy engine (the other prefill, then the decode of the first to end), where
    # the prior says 2x: the slowdown per busy engine is learned upwards, for the
    # machine they share.
    for i in range(6):
        t = 10.0 * (i + 1)
        a = _scheduled(c.at(t).admit(f"a{i}", prompt=PROMPT, ttft_slo=100.0))
        b = _scheduled(c.admit(f"b{i}", prompt=PROMPT, ttft_slo=100.0))
        assert (a.prefill_instance, b.prefill_instance) == ("p-0", "p-1")
        for d in (a, b):
            c.at(t + 0.01).progress(d.request_id, d.prefill_instance, "prefill_started")
        c.at(t + 4.01).progress(a.request_id, a.prefill_instance, "prefill_done")
        c.progress(a.request_id, a.decode_instance, "kv_committed")
        c.at(t + 4.02).progress(b.request_id, b.prefill_instance, "prefill_done")
        for d in (a, b):
            c.at(t + 5.0).finish(d.request_id, d.decode_instance)
    state = c.c.state
    assert state.speeds["p-0"].solo_samples == state.speeds["p-1"].solo_samples == 0
    shared = state.shared_speeds[""]
    assert shared.samples == 12 and 2.9 < shared.per_busy <= 3.0
    # The next pair is priced with it: the second one at 1 + 3 x 1 busy engine.
    a = _scheduled(c.at(100.0).admit("a", prompt=PROMPT, ttft_slo=100.0))
    b = _scheduled(c.admit("b", prompt=PROMPT, ttft_slo=100.0))
    assert a.estimates.ttft_s == pytest.approx(1.0)
    assert 3.8 < b.estimates.ttft_s <= 4.0
    _assert_replays(c)


def test_learning_survives_a_snapshot(crafted: Any) -> None:
    c = crafted(compute_sharing="all", heartbeat_timeout_s=1e6)
    c.hosts(2)
    for i in range(3):
        _serve(c, f"r{i}", 10.0 * (i + 1), 2.0, ttft_extra=0.3)
    a = _scheduled(c.at(40.0).admit("a", prompt=PROMPT, ttft_slo=100.0))
    b = _scheduled(c.admit("b", prompt=PROMPT, ttft_slo=100.0))
    for d in (a, b):
        c.at(40.01).progress(d.request_id, d.prefill_instance, "prefill_started")
    for d in (a, b):
        c.at(45.0).progress(d.request_id, d.prefill_instance, "prefill_done")
    cut = len(c.records)
    _scheduled(c.at(50.0).admit("x", prompt=PROMPT, ttft_slo=100.0))
    _scheduled(c.admit("y", prompt=PROMPT, ttft_slo=100.0))
    head = Conductor()
    for r in c.records[:cut]:
        head.apply(r.seq, r.event)
    restored = snapshot.restore(snapshot.decode(snapshot.encode(snapshot.take(head))))
    assert restored.state.speeds == head.state.speeds != {}
    assert restored.state.shared_speeds == head.state.shared_speeds != {}
    for r in c.records[cut:]:
        restored.apply(r.seq, r.event)
    assert restored.divergences == []


def test_a_log_recorded_before_learned_speed_replays_without_it(crafted: Any) -> None:
    current = configured_event(ConductorConfig(), crafted.ROUND, "c")
    assert from_event(current)[0].learn_speed
    # An older conductor's record does not name the setting: it decided without it.
    legacy = ev.ConductorConfigured(
        instance_id="c", settings_json='{"policy": "mooncake", "admission": "predicted"}'
    )
    assert not from_event(legacy)[0].learn_speed


def test_the_model_of_one_engine() -> None:
    s, shared = InstanceSpeed(), SharedSpeed(per_busy=1.0)
    assert slowdown(None, 1.0, 0) == 1.0
    assert slowdown(None, 1.0, 2) == 3.0
    learn_prefill(s, shared, 2.0, 1.0, 0.0, alpha=1.0)  # alone: twice the profile
    assert s.solo == 2.0 and shared.samples == 0
    assert slowdown(s, shared.per_busy, 1) == 4.0  # the prior, on top of alone
    learn_prefill(s, shared, 8.0, 1.0, 1.0, alpha=1.0)  # beside one: 4x alone
    assert shared.per_busy == 3.0 and slowdown(s, shared.per_busy, 2) == 14.0
    learn_prefill(s, shared, 1000.0, 1.0, 0.0, alpha=1.0)  # an outlier is bounded
    assert s.solo == 4.0
    learn_prefill(s, shared, 1000.0, 1.0, 0.0, alpha=0.3)  # and weighs alpha at most
    assert s.solo == pytest.approx(5.2)
    learn_prefill(s, shared, 0.0001, 1.0, 0.0, alpha=1.0)  # either way
    assert s.solo == pytest.approx(2.6)
