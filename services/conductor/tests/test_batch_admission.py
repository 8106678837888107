"""Batch lines use only idle capacity (`yb_conductor.batch_admission`): a batch line is
placed on an idle cluster, held back (`batch_held`, with the reason and a Retry-After)
while interactive work queues on the prefill, brings a decode batch near its TBT SLO or
leaves too little KV, while an interactive request in the same state is still
admitted; once the load has drained the line is admitted again, and every log replays
to the same decisions.

With the crafted cost model a 16-token block prefills in 16 ms (`keys(n)` is a prompt
of 16 n + 1 tokens, (16 n + 1) ms) and a decode step takes 10 ms + 1 ms per sequence.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from yb_conductor.policy import placement_policy
from yb_conductor.replay import replay
from yb_core import events as ev


def keys(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def _line(c: Any, rid: str, n: int = 2, base: int = 500_000, tbt_slo: float = 1.0) -> ev.Decision:
    """A batch line, as the gateway logs it, due in an hour."""
    outputs = c.feed(
        ev.RequestAdmitted(
            request_id=rid,
            gateway_id="g",
            model="",
            block_size=16,
            block_hashes=keys(n, base),
            prompt_tokens=n * 16 + 1,
            max_tokens=10,
            slo=ev.Slo(ttft_s=10.0, tbt_s=tbt_slo),
            service_tier="default",
            batch=True,
            batch_deadline=c.t + 3600.0,
        )
    )
    (decision,) = [o for o in outputs if isinstance(o, ev.Decision)]
    return decision


def _drain(c: Any, rids: list[str], prefill: str = "p-0", decode: str = "d-0") -> None:
    for rid in rids:
        c.progress(rid, prefill, "prefill_started")
        c.progress(rid, prefill, "prefill_done")
        c.finish(rid, decode)


def test_a_batch_line_is_placed_on_an_idle_cluster(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    d = _line(c, "line-0")
    assert isinstance(d, ev.RequestScheduled), d
    assert d.explain is not None
    assert "batch line into idle capacity: queue 0.000s" in d.explain.reason
    assert "due in 3600s" in d.explain.reason
    assert not replay(c.records).divergences


def test_interactive_load_on_the_prefill_holds_a_batch_line_back_until_it_drains(
    crafted: Any,
) -> None:
    c = crafted()
    c.hosts(1)
    c.admit("head", keys(30, base=100))  # runs 0.481 s
    c.admit("queued", keys(30, base=1000))  # waits behind it
    held = _line(c, "line-0")
    assert isinstance(held, ev.RequestRejected), held
    assert held.reason.startswith("batch_held: held back, load on p-0 (queue 0.962s")
    assert "batch_max_queue_s 0.05s" in held.reason
    assert held.retry_after_s >= 1.0
    assert held.explain is not None and held.explain.reason == held.reason
    # An interactive request in the same state is decided as ever: admitted.
    assert isinstance(c.admit("interactive", keys(3, base=5000)), ev.RequestScheduled)
    # The load drains: the same line, tried again, is admitted.
    c.at(5.0)
    _drain(c, ["head", "queued", "interactive"])
    again = _line(c, "line-0-retry")
    assert isinstance(again, ev.RequestScheduled), again
    assert not replay(c.records).divergences


def test_a_decode_batch_near_its_tbt_slo_holds_a_batch_line_back(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    work = [f"w{i}" for i in range(17)]
    for i, rid in enumerate(work):
        c.admit(rid, keys(1, base=100 * i), max_tokens=10_000, tbt_slo=0.030)
        c.progress(rid, "p-0", "prefill_started")
        c.progress(rid, "p-0", "prefill_done")
    # With one more request a batch of 18: TBT 28 ms, within the 30 ms SLO but over
    # 80% of it (24 ms).
    held = _line(c, "line-0", tbt_slo=0.030)
    assert isinstance(held, ev.RequestRejected), held
    assert held.reason.startswith("batch_held: held back, load on d-0 (TBT 0.0280s with batch 18")
    assert "80% of the TBT SLO 0.03s" in held.reason
    assert isinstance(
        c.admit("interactive", keys(2, base=9000), tbt_slo=0.030), ev.RequestScheduled
    )
    c.at(5.0)
    for rid in [*work, "interactive"]:
        c.finish(rid, "d-0")
    assert isinstance(_line(c, "line-1", tbt_slo=0.030), ev.RequestScheduled)
    assert not replay(c.records).divergences


def test_a_batch_line_leaves_decode_kv_for_interactive_requests(crafted: Any) -> None:
    c = crafted()
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    c.decode("d-0", kv_blocks=100)
    fill = [f"f{i}" for i in range(4)]
    for i, rid in enumerate(fill):  # 21 blocks each: 84 of 100
        c.admit(rid, keys(20, base=1000 * (i + 1)))
        c.progress(rid, "p-0", "prefill_started")
        c.progress(rid, "p-0", "prefill_done")
    held = _line(c, "line-0")
    assert isinstance(held, ev.RequestRejected), held
    assert held.reason.startswith("batch_held: held back, KV on d-0 (13 of 100 blocks left")
    assert isinstance(c.admit("interactive", keys(1, base=9000)), ev.RequestScheduled)
    assert not replay(c.records).divergences


def test_a_batch_line_takes_an_idle_prefill_over_a_busy_holder(crafted: Any) -> None:
    c = crafted()
    c.hosts(2)
    chain = keys(300, base=70_000)
    c.store("kv-0", chain)
    c.admit("head", keys(4, base=100))  # p-0 (lowest id): runs 65 ms
    request = ev.RequestAdmitted(
        time=c.t,
        request_id="line-0",
        gateway_id="g",
        model="",
        block_size=16,
        block_hashes=chain,
        prompt_tokens=300 * 16 + 1,
        max_tokens=10,
        batch=True,
    )
    policy = placement_policy(c.cfg, c.cost)
    # As an interactive request it waits for p-0, which holds its prefix on its host.
    interactive = policy.decide(
        c.c.state, msgspec.structs.replace(request, batch=False), seq=10_000
    ).decision
    assert isinstance(interactive, ev.RequestScheduled)
    assert interactive.prefill_instance == "p-0"
    d = policy.decide(c.c.state, request, seq=10_000).decision
    assert isinstance(d, ev.RequestScheduled), d
    assert d.prefill_instance == "p-1"
    assert d.explain is not None and d.explain.candidates[0].instance_id == "p-1"
    assert "(the pick by TTFT had a queue)" in d.explain.reason


def test_off_a_batch_line_is_decided_as_any_request_of_its_tier(crafted: Any) -> None:
    c = crafted(batch_idle_only=False)
    c.hosts(1)
    c.admit("head", keys(30, base=100))
    d = _line(c, "line-0")
    assert isinstance(d, ev.RequestScheduled), d
    assert d.explain is not None and "batch line" not in d.explain.reason
    assert not replay(c.records).divergences


def test_a_replanned_line_runs_as_its_tier_and_still_gives_way(crafted: Any) -> None:
    """A line re-planned after its engine failed is decided as an interactive request
    (it is not held back: it runs already), and its prefill running on an instance
    is still priced as pre-emptible: a request of a higher priority does not wait for
    it. A re-plan that does not say `batch` (a log of schema version 5) is priced as
    any running prefill."""
    for batch, queue_s in ((True, 0.0), (False, 0.451)):
        c = crafted()
        c.hosts(1)
        c.admit("busy", keys(30, base=100))  # interactive work queued: lines are held
        replan = ev.RequestReplanned(
            request_id="line-0",
            gateway_id="g",
            attempt=1,
            reason="prefill engine failed",
            model="",
            block_size=16,
            block_hashes=keys(30, base=500_000),
            prompt_tokens=30 * 16 + 1,
            max_tokens=10,
            priority=-1,
            slo=ev.Slo(ttft_s=40.0, tbt_s=1.0),
            service_tier="flex",
            batch=batch,
        )
        (decision,) = [o for o in c.feed(replan) if isinstance(o, ev.Decision)]
        assert isinstance(decision, ev.RequestScheduled), decision
        c.progress("busy", "p-0", "prefill_started")
        c.progress("busy", "p-0", "prefill_done")
        c.finish("busy", "d-0")
        c.at(1.0).progress("line-0", "p-0", "prefill_started")
        urgent = c.at(1.03).admit("urgent", keys(2, base=900), priority=1)
        assert isinstance(urgent, ev.RequestScheduled)
        assert urgent.estimates.queue_s == pytest.approx(queue_s), batch
        assert not replay(c.records).divergences
