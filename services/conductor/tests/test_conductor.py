"""The conductor's fold and least-loaded policy, driven without I/O."""

from __future__ import annotations

from yb_conductor.baselines import LeastLoadedPolicy
from yb_conductor.conductor import Conductor
from yb_core import events as ev


def _up(instance_id: str, role: ev.Role, t: float = 1.0) -> ev.InstanceUp:
    return ev.InstanceUp(
        instance_id=instance_id, role=role, host="h", model="m", max_batch_size=8, time=t
    )


def _admit(rid: str, tokens: int = 100, t: float = 2.0) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=rid,
        gateway_id="g",
        model="m",
        block_size=16,
        block_hashes=[],
        prompt_tokens=tokens,
        max_tokens=8,
        time=t,
    )


def _cluster() -> tuple[Conductor, int]:
    c = Conductor(LeastLoadedPolicy())
    seq = 0
    for e in (_up("p0", "prefill"), _up("p1", "prefill"), _up("d0", "decode")):
        seq += 1
        assert c.apply(seq, e) == []
    return c, seq


def test_rejects_without_instances() -> None:
    c = Conductor(LeastLoadedPolicy())
    (decision,) = c.apply(1, _admit("r1"))
    assert isinstance(decision, ev.RequestRejected)
    assert "prefill" in decision.reason


def test_spreads_prefill_by_queued_tokens_and_frees_on_progress() -> None:
    c, seq = _cluster()
    (a,) = c.apply(seq + 1, _admit("a", 1000))
    (b,) = c.apply(seq + 2, _admit("b", 10))
    assert isinstance(a, ev.RequestScheduled) and isinstance(b, ev.RequestScheduled)
    assert {a.prefill_instance, b.prefill_instance} == {"p0", "p1"}
    # p0 (1000 tokens queued) finishes its prefill; the next request goes back there.
    c.apply(seq + 3, a)  # the recorded decision comes by
    c.apply(seq + 4, b)
    c.apply(
        seq + 5,
        ev.RequestProgress(
            request_id="a", instance_id=a.prefill_instance, stage="prefill_done", time=3.0
        ),
    )
    (d,) = c.apply(seq + 6, _admit("d", 10, t=3.5))
    assert isinstance(d, ev.RequestScheduled)
    assert d.prefill_instance == a.prefill_instance
    assert c.divergences == []


def test_redelivered_events_are_ignored() -> None:
    c, seq = _cluster()
    assert len(c.apply(seq + 1, _admit("a"))) == 1
    assert c.apply(seq + 1, _admit("a")) == []


def test_silent_instances_expire_by_event_time() -> None:
    c, seq = _cluster()
    # Only d0 keeps reporting; p0 and p1 fall silent past the heartbeat timeout.
    c.apply(seq + 1, ev.LoadReport(instance_id="d0", role="decode", time=30.0))
    (decision,) = c.apply(seq + 2, _admit("a", t=30.0))
    assert isinstance(decision, ev.RequestRejected)


def test_replay_reports_a_divergent_recorded_decision() -> None:
    c, seq = _cluster()
    (mine,) = c.apply(seq + 1, _admit("a"))
    assert isinstance(mine, ev.RequestScheduled)
    other = "p1" if mine.prefill_instance == "p0" else "p0"
    recorded = ev.RequestScheduled(
        request_id="a",
        gateway_id="g",
        prefill_instance=other,
        decode_instance="d0",
        time=mine.time,
        computed_tokens=100,
    )
    c.apply(seq + 2, recorded)
    (div,) = c.divergences
    assert div.seq == seq + 2 and div.recorded == recorded and div.recomputed == mine
    # The recorded decision's load is what the state now carries.
    assert c.state.instances[other].prefill_tokens_in_flight == 100
    assert c.state.instances[mine.prefill_instance].prefill_tokens_in_flight == 0


def test_block_gap_and_new_epoch_ask_for_resync() -> None:
    c, seq = _cluster()
    stored = ev.BlockStored(
        instance_id="kv0", epoch=1, event_id=1, block_hashes=[7, 8], tier="dram", time=2.0
    )
    c.apply(seq + 1, stored)
    assert c.state.prefix_blocks([7, 8, 9], "kv0") == 2
    assert not c.state.resync_wanted
    c.apply(
        seq + 2, ev.BlockEvicted(instance_id="kv0", epoch=1, event_id=3, block_hashes=[8], time=2.0)
    )
    assert list(c.state.resync_wanted) == ["kv0"]
    c.apply(seq + 3, ev.BlockInventory(instance_id="kv0", epoch=1, event_id=3, dram=[7], time=2.0))
    assert not c.state.resync_wanted
    assert c.state.prefix_blocks([7, 8], "kv0") == 1
    # A restart (new epoch) that does not start at event 1 voids the index for it.
    c.apply(
        seq + 4,
        ev.BlockStored(
            instance_id="kv0", epoch=2, event_id=5, block_hashes=[9], tier="dram", time=2.0
        ),
    )
    assert list(c.state.resync_wanted) == ["kv0"]
    assert c.state.prefix_blocks([7], "kv0") == 0


def test_settings_recorded_in_the_log_are_adopted_where_they_stand() -> None:
    from yb_conductor.cost_model import load_cost_model
    from yb_conductor.settings import configured_event
    from yb_core.config import ConductorConfig

    c = Conductor()  # mooncake, predicted admission, built-in cost model
    assert (c.policy.name, c.cfg.admission) == ("mooncake", "predicted")
    paper = load_cost_model("llama2-70b-a800")
    c.apply(1, configured_event(ConductorConfig(admission="early"), paper, "c0"))
    assert c.cfg.admission == "early" and c.policy.cost == paper
    # A what-if conductor lays its overrides over whatever the log says.
    w = Conductor(overrides={"admission": "none"}, follow_recorded=False)
    w.apply(1, configured_event(ConductorConfig(admission="early"), paper, "c0"))
    assert w.cfg.admission == "none" and w.policy.cost == paper


def test_one_decision_per_request_even_when_repeated() -> None:
    c, seq = _cluster()
    (first,) = c.apply(seq + 1, _admit("a"))
    assert c.apply(seq + 2, first) == []  # the recorded copy
    assert c.apply(seq + 3, _admit("a")) == []  # a retried admission: no new decision
    assert c.apply(seq + 4, first) == []  # a second copy of the decision: no new load
    assert c.divergences == []
    assert c.state.instances[first.prefill_instance].prefill_requests_in_flight == 1
    assert c.quality.decisions == 1
