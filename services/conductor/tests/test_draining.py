"""An engine that drains (`InstanceDraining`: it was told to stop) is alive for what it
holds and no candidate for anything new.

Its placed requests finish there and are accounted as any (its load reports still
count), but no admission, re-plan or piggybacked prompt goes to it, and a prefill
group with a draining stage takes nothing new; an announcement of a new process under
its id makes it placeable again. Each scenario is also a small log that replays to
the same decisions. What draining changes is shown against the same log without it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from yb_conductor.replay import replay
from yb_core import events as ev

# conftest's `Crafted` (through the `crafted` fixture: conftest is not importable).
Crafted = Any
BS = 16


def cluster(crafted: type[Crafted]) -> Crafted:
    c = crafted(heartbeat_timeout_s=100.0)
    c.hosts(2, decodes=2)
    c.feed(ev.InstanceUp(instance_id="g", role="gateway", host="h0", epoch=1))
    return c


def scheduled(c: Crafted, rid: str, chain: list[int]) -> ev.RequestScheduled:
    decision = c.admit(rid, chain, max_tokens=8)
    assert isinstance(decision, ev.RequestScheduled), decision
    return decision


def decodes_of(c: Crafted, rids: list[str]) -> list[str]:
    return [scheduled(c, rid, [500 + i]).decode_instance for i, rid in enumerate(rids)]


def test_a_draining_decode_gets_nothing_new_and_finishes_what_it_holds(
    crafted: type[Crafted],
) -> None:
    def run(drain: bool) -> tuple[Crafted, str, list[str]]:
        c = cluster(crafted)
        held = scheduled(c, "held", [11, 12])
        c.progress("held", held.prefill_instance, "prefill_done")
        c.progress("held", held.decode_instance, "kv_committed")
        if drain:
            c.feed(
                ev.InstanceDraining(
                    instance_id=held.decode_instance, reason="stopping", deadline=9.0
                )
            )
        return c, held.decode_instance, decodes_of(c, [f"new-{i}" for i in range(4)])

    _, control, undrained = run(drain=False)
    assert control in undrained  # without the drain, new requests go there too
    c, draining, placed = run(drain=True)
    assert draining not in placed and len(placed) == 4
    state = c.c.state
    inst = state.instances[draining]
    assert inst.alive and inst.draining
    assert draining not in [i.instance_id for i in state.live("decode")]
    # What it holds stays accounted there, its load reports count, and it finishes.
    assert "held" in inst.assigned and inst.decoding_requests == 1
    report = ev.LoadReport(instance_id=draining, role="decode", running_requests=1)
    c.feed(report)
    assert inst.last_report is report
    c.finish("held", draining, output_tokens=8)
    assert "held" not in state.placements and "held" not in inst.assigned
    assert inst.decoding_requests == 0
    assert not replay(c.records).divergences


def test_a_replan_never_goes_to_a_draining_instance(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    held = scheduled(c, "r", [21, 22])
    c.progress("r", held.prefill_instance, "prefill_done")
    c.progress("r", held.decode_instance, "kv_committed")
    other = "d-1" if held.decode_instance == "d-0" else "d-0"
    c.feed(ev.InstanceDraining(instance_id=held.decode_instance, deadline=5.0))
    # The drain's deadline ended the stream with a 503: its gateway re-plans it.
    replan = ev.RequestReplanned(
        request_id="r",
        gateway_id="g",
        attempt=1,
        reason="decode instance shutting down",
        failed_instance=held.decode_instance,
        model="",
        block_size=BS,
        block_hashes=[21, 22, 23],
        prompt_tokens=3 * BS + 1,
        generated_tokens=4,
        max_tokens=4,
    )
    (decision,) = [o for o in c.feed(replan) if isinstance(o, ev.Decision)]
    assert isinstance(decision, ev.RequestScheduled) and decision.decode_instance == other
    # With the other one avoided (its failure), nothing is left to take it.
    c.feed(ev.InstanceDraining(instance_id=other, deadline=5.0))
    again = msgspec.structs.replace(replan, time=0.0, attempt=2, failed_instance="")
    (refused,) = [o for o in c.feed(again) if isinstance(o, ev.Decision)]
    assert isinstance(refused, ev.RequestRejected), refused
    assert "no live decode instance" in refused.reason
    assert not replay(c.records).divergences


def test_a_draining_prefill_gets_no_prefill_even_where_the_prefix_is(
    crafted: type[Crafted],
) -> None:
    chain = [31, 32, 33, 34]

    def run(drain: bool) -> str:
        c = cluster(crafted)
        c.store("kv-0", chain)  # host h0: p-0 would load it locally
        if drain:
            c.feed(ev.InstanceDraining(instance_id="p-0", deadline=5.0))
        decision = scheduled(c, "r", chain)
        assert not replay(c.records).divergences
        return decision.prefill_instance

    assert run(drain=False) == "p-0"
    assert run(drain=True) == "p-1"


def test_a_group_with_a_draining_stage_takes_nothing_new(crafted: type[Crafted]) -> None:
    c = crafted(heartbeat_timeout_s=100.0)
    for stage in range(2):
        c.feed(
            ev.InstanceUp(
                instance_id=f"g-{stage}",
                role="prefill",
                host="h0",
                group="g",
                layer_start=stage,
                layer_end=stage + 1,
                num_layers=2,
                chunk_tokens=64,
            )
        )
    state = c.c.state
    assert [i.instance_id for i in state.live("prefill")] == ["g-0"]
    c.feed(ev.InstanceDraining(instance_id="g-1", deadline=5.0))
    assert state.live("prefill") == [] and state.group_leads() == []


def test_a_new_process_under_the_id_takes_work_again(crafted: type[Crafted]) -> None:
    c = cluster(crafted)
    c.feed(ev.InstanceDraining(instance_id="d-0", deadline=5.0))
    state = c.c.state
    # The same process announcing itself again (a reconnect) still drains.
    c.decode("d-0")
    assert state.instances["d-0"].draining
    c.feed(ev.InstanceDown(instance_id="d-0", reason="stopped"))
    c.feed(ev.InstanceUp(instance_id="d-0", role="decode", host="h-d", max_batch_size=64, epoch=2))
    assert not state.instances["d-0"].draining
    assert "d-0" in decodes_of(c, [f"r-{i}" for i in range(4)])
    assert not replay(c.records).divergences
