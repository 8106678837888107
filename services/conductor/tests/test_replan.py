"""Re-plans: a request whose engine failed mid-way is decided again, from the log.

A gateway logs `RequestReplanned` (attempt k, the failed instance, the block hashes of
the prompt plus the tokens already streamed); the fold releases the old placement and
decides the request as it stands, avoiding the failed instance, with the pool's
prefix reused as for any admission. The decision carries `attempt`, and the log of
it all replays to the same decisions.
"""

from __future__ import annotations

from typing import Any

from yb_conductor.replay import replay
from yb_conductor.state import REPLAN_GRACE_S
from yb_core import events as ev

# conftest's `Crafted` (through the `crafted` fixture: conftest is not importable).
Crafted = Any
BS = 16


def cluster(crafted: type[Crafted]) -> Crafted:
    c = crafted(heartbeat_timeout_s=100.0)
    c.hosts(2, decodes=2)
    c.feed(ev.InstanceUp(instance_id="g", role="gateway", host="h0", epoch=1))
    return c


def replanned(
    c: Crafted,
    rid: str,
    chain: list[int],
    *,
    attempt: int = 1,
    failed: str = "",
    generated: int = 0,
) -> list[Any]:
    outputs: list[Any] = c.feed(
        ev.RequestReplanned(
            request_id=rid,
            gateway_id="g",
            attempt=attempt,
            reason="decode instance declared down",
            failed_instance=failed,
            model="",
            block_size=BS,
            block_hashes=chain,
            prompt_tokens=len(chain) * BS + 1,
            generated_tokens=generated,
            max_tokens=10 - generated,
        )
    )
    return outputs


def only_decision(outputs: list[Any]) -> ev.Decision:
    decisions = [o for o in outputs if isinstance(o, ev.Decision)]
    assert len(decisions) == 1, outputs
    return decisions[0]


def test_a_dead_decode_instance_is_replanned_with_the_pool_prefix(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    prompt = [11, 12, 13, 14]
    first = c.admit("r", prompt)
    assert isinstance(first, ev.RequestScheduled) and first.attempt == 0
    c.progress("r", first.prefill_instance, "prefill_done")
    c.progress("r", first.decode_instance, "kv_committed")
    # The prompt's blocks reached its host's kvstore; the tokens streamed so far make
    # one more block.
    c.store("kv-" + first.prefill_instance[-1], prompt)
    dead = first.decode_instance
    c.feed(ev.InstanceDown(instance_id=dead, reason="no heartbeat"))
    state = c.c.state
    # Its gateway lives: the cancel waits for it to re-plan or end the request.
    assert "r" in state.cancel_wanted
    assert state.cancel_not_before["r"] == state.now + REPLAN_GRACE_S

    continued = [*prompt, 15]
    decision = only_decision(replanned(c, "r", continued, failed=dead, generated=16))
    assert isinstance(decision, ev.RequestScheduled), decision
    assert decision.attempt == 1
    assert decision.decode_instance != dead
    replan_seq = next(r.seq for r in c.records if isinstance(r.event, ev.RequestReplanned))
    assert decision.admitted_seq == replan_seq  # the re-plan's own position
    assert decision.prompt_tokens == len(continued) * BS + 1
    # The prompt's prefix comes from the pool; only the rest is computed.
    assert decision.reused_blocks == len(prompt), decision
    # The old placement is gone, and with it the wanted cancel: one placement, on the
    # new instances.
    assert "r" not in state.cancel_wanted and "r" not in state.cancel_not_before
    assert state.placements["r"].decode_instance == decision.decode_instance
    assert "r" not in state.instances[dead].assigned
    # Logged apart from the first plan's decision (JetStream de-duplicates by it).
    assert ev.message_id_for(decision) != ev.message_id_for(first)


def test_a_replan_avoids_the_failed_instance_before_any_verdict(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    first = c.admit("r", [21, 22])
    assert isinstance(first, ev.RequestScheduled)
    failed = first.prefill_instance
    decision = only_decision(replanned(c, "r", [21, 22], failed=failed))
    assert isinstance(decision, ev.RequestScheduled)
    assert decision.prefill_instance != failed
    # Avoided for that decision only: nothing declared it dead.
    assert c.c.state.instances[failed].alive
    assert failed in [i.instance_id for i in c.c.state.live("prefill")]


def test_a_repeated_replan_is_answered_once(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    c.admit("r", [31])
    only_decision(replanned(c, "r", [31]))
    assert replanned(c, "r", [31]) == []
    second = only_decision(replanned(c, "r", [31], attempt=2))
    assert second.attempt == 2
    assert len(c.c.state.placements) == 1


def test_a_replan_nothing_can_take_is_rejected_with_its_attempt(crafted: type[Crafted]) -> None:
    c = crafted(heartbeat_timeout_s=100.0)
    c.hosts(1, decodes=1)
    first = c.admit("r", [41])
    assert isinstance(first, ev.RequestScheduled)
    c.feed(ev.InstanceDown(instance_id=first.decode_instance, reason="stopped"))
    decision = only_decision(replanned(c, "r", [41], failed=first.decode_instance))
    assert isinstance(decision, ev.RequestRejected), decision
    assert decision.attempt == 1
    assert "r" not in c.c.state.placements and "r" not in c.c.state.admissions


def test_a_log_with_replans_replays_to_the_same_decisions(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    for i in range(4):
        c.at(1.0 + i)
        c.admit(f"r{i}", [100 + i, 200 + i])
    c.at(6.0)
    c.feed(ev.InstanceDown(instance_id="d-0", reason="no heartbeat"))
    moved = [rid for rid, p in c.c.state.placements.items() if p.decode_instance == "d-0"]
    assert moved
    for rid in moved:
        c.at(6.5)
        i = int(rid[1:])
        replanned(c, rid, [100 + i, 200 + i, 300 + i], failed="d-0", generated=BS)
    c.at(7.0)
    c.admit("after", [500])
    # A late copy of a first plan's decision (a retried publish) changes nothing.
    late = next(
        r.event
        for r in c.records
        if isinstance(r.event, ev.RequestScheduled) and r.event.request_id == moved[0]
    )
    c.feed(late)
    assert c.c.divergences == []
    assert c.c.state.placements[moved[0]].decode_instance == "d-1"

    result = replay(c.records)
    assert result.divergences == []
    recorded = [r.event for r in c.records if isinstance(r.event, ev.Decision)]
    assert result.decisions == len(recorded) - 1  # the late copy was not a decision
    assert sorted(d.attempt for d in recorded if d.request_id == moved[0]) == [0, 0, 1]
    assert result.conductor.state.placements.keys() == c.c.state.placements.keys()


def test_the_end_of_a_replanned_request_releases_its_last_attempt(
    crafted: type[Crafted],
) -> None:
    c = cluster(crafted)
    first = c.admit("r", [51, 52])
    assert isinstance(first, ev.RequestScheduled)
    failed = first.prefill_instance
    decision = only_decision(replanned(c, "r", [51, 52], failed=failed))
    assert isinstance(decision, ev.RequestScheduled) and decision.attempt == 1
    state = c.c.state
    # The failed prefill's word on attempt 0 reaches the log after the re-plan's
    # decision: attempt 1 stays placed, its decode pages counted.
    stale = ev.RequestFinished(
        request_id="r", instance_id=failed, outcome="failed", reason="gone", attempt=0
    )
    c.feed(stale)
    assert state.placements["r"].attempt == 1
    assert "r" in state.instances[decision.decode_instance].assigned
    # The last attempt's end is logged apart from the failed one's (JetStream
    # de-duplicates by the id) and releases it.
    done = ev.RequestFinished(
        request_id="r",
        instance_id=decision.decode_instance,
        outcome="completed",
        output_tokens=10,
        attempt=1,
    )
    assert ev.message_id_for(done) != ev.message_id_for(stale)
    c.feed(done)
    assert "r" not in state.placements
    assert "r" not in state.instances[decision.decode_instance].assigned
    assert replay(c.records).divergences == []


def test_an_end_logged_before_ends_carried_their_attempt_ends_the_placed_one(
    crafted: type[Crafted],
) -> None:
    c = cluster(crafted)
    first = c.admit("r", [61])
    assert isinstance(first, ev.RequestScheduled)
    only_decision(replanned(c, "r", [61], failed=first.decode_instance))
    old = ev.RequestFinished(request_id="r", instance_id=first.decode_instance, outcome="failed")
    assert old.attempt is None
    assert ev.message_id_for(old) == "request_finished:r"  # as such logs were written
    c.feed(old)
    assert "r" not in c.c.state.placements
