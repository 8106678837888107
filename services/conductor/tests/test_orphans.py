"""What the fold concludes when instances fail: who is dead, which requests to cancel.

A silent engine (no `LoadReport` past the heartbeat timeout, in event time) is
declared dead and the requests it was needed for are marked for cancellation: those
queued on or prefilling at a dead prefill instance, those assigned to a dead decode
instance, those of a gateway that fell silent or came back as a new process. Pure
folds: the same log gives the same verdicts, and a snapshot keeps them.
"""

from __future__ import annotations

from typing import Any

from yb_conductor import snapshot
from yb_core import events as ev

TIMEOUT = 5.0
# conftest's `Crafted` (through the `crafted` fixture: conftest is not importable).
Crafted = Any


def cluster(crafted: type[Crafted]) -> Crafted:
    c = crafted(heartbeat_timeout_s=TIMEOUT)
    c.hosts(2, decodes=2)
    c.feed(ev.InstanceUp(instance_id="g", role="gateway", host="h0", epoch=1))
    return c


def heartbeat(c: Crafted, *instances: str) -> None:
    for name in instances:
        role = "gateway" if name == "g" else "decode" if name.startswith("d-") else "prefill"
        c.feed(ev.LoadReport(instance_id=name, role=role))  # type: ignore[arg-type]


def scheduled(c: Crafted, rid: str) -> ev.RequestScheduled:
    decision = c.admit(rid, [100 + len(rid)], max_tokens=4)
    assert isinstance(decision, ev.RequestScheduled), decision
    return decision


def test_a_silent_prefill_is_declared_dead_and_its_unfinished_requests_cancelled(
    crafted: type[Crafted],
) -> None:
    c = cluster(crafted)
    done = scheduled(c, "done")
    c.progress("done", done.prefill_instance, "prefill_done")
    queued = scheduled(c, "queued")
    dead = queued.prefill_instance
    others = [i for i in ("p-0", "p-1", "kv-0", "kv-1", "d-0", "d-1", "g") if i != dead]
    c.at(3.0)
    heartbeat(c, *others)
    assert c.c.state.declared_dead == {}
    c.at(7.0)  # past the timeout for `dead` only
    heartbeat(c, *others)
    state = c.c.state
    assert list(state.declared_dead) == [dead]
    assert not state.instances[dead].alive
    wanted = dict(state.cancel_wanted)
    assert "queued" in wanted and dead in wanted["queued"]
    if done.prefill_instance == dead:
        assert "done" not in wanted  # its prefill had ended: decode has it

    # The service publishes the cancel; folded back, the request is released.
    c.feed(ev.RequestCancelled(request_id="queued", reason=wanted["queued"]))
    assert "queued" not in state.cancel_wanted
    assert "queued" not in state.placements
    # Its own verdict, read back, is said: nothing else changes.
    c.feed(ev.InstanceDown(instance_id=dead, reason="no heartbeat"))
    assert state.declared_dead == {}
    assert state.cancel_wanted == {k: v for k, v in wanted.items() if k != "queued"}


def test_a_dead_decode_instance_orphans_every_request_assigned_to_it(
    crafted: type[Crafted],
) -> None:
    c = cluster(crafted)
    first = scheduled(c, "a")
    c.progress("a", first.prefill_instance, "prefill_done")
    c.progress("a", first.decode_instance, "kv_committed")
    dead = first.decode_instance
    c.feed(ev.InstanceDown(instance_id=dead, reason="stopped"))
    state = c.c.state
    assert "a" in state.cancel_wanted
    assert dead not in state.declared_dead  # it said goodbye itself: nothing to declare


def test_a_gateway_that_restarts_or_falls_silent_orphans_its_requests(
    crafted: type[Crafted],
) -> None:
    c = cluster(crafted)
    scheduled(c, "r1")
    state = c.c.state
    # Announced again by the same process (a reconnect): nothing is orphaned.
    c.feed(ev.InstanceUp(instance_id="g", role="gateway", host="h0", epoch=1))
    assert state.cancel_wanted == {}
    # A new process under the same id: the old one's clients are gone.
    c.feed(ev.InstanceUp(instance_id="g", role="gateway", host="h0", epoch=2))
    assert "r1" in state.cancel_wanted and "restarted" in state.cancel_wanted["r1"]

    c.feed(ev.RequestCancelled(request_id="r1"))
    scheduled(c, "r2")
    engines = ["p-0", "p-1", "kv-0", "kv-1", "d-0", "d-1"]
    c.at(2.0)
    heartbeat(c, "g", *engines)
    for t in (5.0, 8.0):  # the engines keep reporting, the gateway does not
        c.at(t)
        heartbeat(c, *engines)
    assert list(state.declared_dead) == ["g"]
    assert "r2" in state.cancel_wanted and "gateway instance g" in state.cancel_wanted["r2"]


def test_a_gateway_that_never_heartbeats_is_not_taken_for_dead(
    crafted: type[Crafted],
) -> None:
    # An older gateway sends no load reports: its silence says nothing.
    c = cluster(crafted)
    scheduled(c, "r")
    engines = ["p-0", "p-1", "kv-0", "kv-1", "d-0", "d-1"]
    for t in (4.0, 8.0):
        c.at(t)
        heartbeat(c, *engines)
    assert c.c.state.cancel_wanted == {}
    assert "g" not in c.c.state.declared_dead


def test_a_paused_instance_that_reports_again_is_alive_again(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    c.at(7.0)
    heartbeat(c, "p-1", "kv-0", "kv-1", "d-0", "d-1")
    state = c.c.state
    assert "p-0" in state.declared_dead
    heartbeat(c, "p-0")
    assert state.instances["p-0"].alive
    assert "p-0" not in state.declared_dead


def test_verdicts_survive_a_snapshot(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    queued = scheduled(c, "q")
    dead = queued.prefill_instance
    c.at(7.0)
    heartbeat(c, *[i for i in ("p-0", "p-1", "kv-0", "kv-1", "d-0", "d-1") if i != dead])
    restored = snapshot.restore(snapshot.decode(snapshot.encode(snapshot.take(c.c))))
    assert restored.state.declared_dead == c.c.state.declared_dead
    assert restored.state.cancel_wanted == c.c.state.cancel_wanted
    assert restored.state.placements["q"].gateway_id == "g"
