"""Pending prefixes: a prefix that a queued or running prefill is computing counts as
held by its instance for the requests placed behind it there, so a burst of requests
sharing a cold prefix queues behind its first prefill instead of computing it again
elsewhere; a request counts only on the prefills it does not overtake; the index
forgets it when that prefill ends or its request leaves; a snapshot carries it; a
log recorded without the setting replays without it."""

from __future__ import annotations

from typing import Any

import pytest
from test_placement import _scheduled, keys

from yb_conductor import snapshot
from yb_conductor.replay import replay
from yb_conductor.settings import recorded_settings
from yb_core import events as ev

PREFIX = keys(50)  # 50 blocks of 16 tokens (+1): 0.801 s to compute, round model
QUESTION = keys(3, base=7000)


def _first_running(c: Any) -> ev.RequestScheduled:
    """Two idle hosts; request `a` with a cold 50-block prefix goes to p-0 and starts."""
    c.hosts(2)
    a = _scheduled(c.admit("a", PREFIX))
    assert (a.prefill_instance, a.reused_blocks) == ("p-0", 0)
    c.progress("a", "p-0", "prefill_started")
    return a


def test_a_request_queues_behind_the_prefill_computing_its_prefix(crafted: Any) -> None:
    c = crafted(pending_prefixes=True)
    _first_running(c)
    assert c.c.state.pending_lengths(PREFIX + QUESTION) == {"p-0": 50}
    # 0.3 s into a's 0.801 s prefill: behind it on p-0, b computes only its question
    # (0.501 s queued, the 50 blocks priced as a local load, 25 ms, then 49 tokens);
    # on idle p-1 it would compute everything (0.849 s).
    b = _scheduled(c.at(1.3).admit("b", PREFIX + QUESTION))
    assert (b.prefill_instance, b.reused_blocks) == ("p-0", 50)
    assert b.reuse == [
        ev.ReusePlan(source_instance="p-0", tier="engine", first_block=0, num_blocks=50)
    ]
    assert b.estimates.queue_s == pytest.approx(0.501)
    assert b.estimates.transfer_s == pytest.approx(0.025)
    assert b.estimates.ttft_s == pytest.approx(0.501 + 0.025 + 0.049)
    assert b.explain is not None and b.explain.candidates[0].instance_id == "p-0"
    assert "50 of them being computed there by a prefill ahead of it" in b.explain.reason
    assert replay(c.records).divergences == []


def test_without_the_setting_the_prefix_is_computed_again_elsewhere(crafted: Any) -> None:
    c = crafted(pending_prefixes=False)
    _first_running(c)
    b = _scheduled(c.at(1.3).admit("b", PREFIX + QUESTION))
    assert (b.prefill_instance, b.reused_blocks) == ("p-1", 0)
    assert b.estimates.ttft_s == pytest.approx(0.849)
    assert replay(c.records).divergences == []


def test_the_index_forgets_a_prefix_when_its_prefill_ends_or_its_request_leaves(
    crafted: Any,
) -> None:
    c = crafted(pending_prefixes=True)
    _first_running(c)
    c.at(1.3).admit("b", PREFIX + QUESTION)
    state = c.c.state
    assert state.pending_lengths(PREFIX + QUESTION) == {"p-0": 53}
    c.at(1.8).progress("a", "p-0", "prefill_done")
    # b's prefill, queued behind a's, still computes all 53 blocks' worth of chain.
    assert state.pending_lengths(PREFIX + QUESTION) == {"p-0": 53}
    c.feed(ev.RequestCancelled(request_id="b", reason="client gone"))
    assert state.pending_prefixes == {} and state.pending_lengths(PREFIX) == {}


def test_a_higher_priority_request_counts_on_a_prefill_running_ahead_of_it(
    crafted: Any,
) -> None:
    c = crafted(pending_prefixes=True)
    _first_running(c)
    # a's prefill runs, and is no batch line's: b (priority 1) cannot overtake it.
    b = _scheduled(c.at(1.3).admit("b", PREFIX + QUESTION, priority=1))
    assert (b.prefill_instance, b.reused_blocks) == ("p-0", 50)
    assert replay(c.records).divergences == []


def test_a_higher_priority_request_does_not_count_on_a_queued_prefill_it_overtakes(
    crafted: Any,
) -> None:
    c = crafted(pending_prefixes=True)
    c.hosts(1)
    _scheduled(c.admit("x", keys(50, base=9000)))
    c.progress("x", "p-0", "prefill_started")
    a = _scheduled(c.at(1.1).admit("a", PREFIX))
    assert a.prefill_instance == "p-0"  # queued behind x
    # Engines run their queues by priority: b (priority 1) overtakes a, queued at
    # 0, so it does not count on what a computes; c (priority 0) runs behind both,
    # and counts on b's whole chain.
    b = _scheduled(c.at(1.2).admit("b", PREFIX + QUESTION, priority=1))
    assert b.reused_blocks == 0
    d = _scheduled(c.at(1.3).admit("c", PREFIX + QUESTION))
    assert d.reused_blocks == 53
    assert replay(c.records).divergences == []


def test_a_lower_priority_placed_elsewhere_leaves_the_rule_to_the_others(crafted: Any) -> None:
    # A batch line (priority -1) placed anywhere no longer takes pending prefixes away
    # from every request of a higher priority; a version-1 log replays without them.
    for by_priority, reused in ((True, 50), (False, 0)):
        c = crafted(pending_prefixes=True, pending_by_priority=by_priority)
        c.hosts(3)
        _scheduled(c.admit("line", keys(4, base=9000), priority=-1))
        c.progress("line", "p-0", "prefill_started")
        a = _scheduled(c.at(1.1).admit("a", PREFIX))
        c.progress("a", a.prefill_instance, "prefill_started")
        b = _scheduled(c.at(1.3).admit("b", PREFIX + QUESTION))
        assert b.reused_blocks == reused, by_priority
        assert replay(c.records).divergences == []


def test_a_snapshot_carries_the_pending_prefixes(crafted: Any) -> None:
    c = crafted(pending_prefixes=True)
    _first_running(c)
    restored = snapshot.restore(snapshot.decode(snapshot.encode(snapshot.take(c.c))))
    assert restored.state.pending_prefixes == c.c.state.pending_prefixes
    b = _scheduled(c.at(1.3).admit("b", PREFIX + QUESTION))
    (record,) = [
        r
        for r in c.records
        if isinstance(r.event, ev.RequestAdmitted) and r.event.request_id == "b"
    ]
    again = [o for o in restored.apply(record.seq, record.event) if isinstance(o, ev.Decision)]
    assert again == [b]


@pytest.mark.parametrize("recorded", ['{"policy": "mooncake"}', "{}"])
def test_a_log_recorded_without_the_setting_replays_without_it(recorded: str) -> None:
    assert recorded_settings(recorded).pending_prefixes is False
    assert recorded_settings('{"pending_prefixes": true}').pending_prefixes is True
