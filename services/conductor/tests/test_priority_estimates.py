"""Priority in the conductor's estimates, on crafted states: a request's prefill queue
counts only the work it will not overtake, stretched by the higher-priority load that
will overtake it; its decode room leaves out lower priorities not yet prefilled; with
one priority everywhere nothing changes; and the decisions replay.

With the crafted cost model a 16-token block prefills in 16 ms: `keys(n)` is a
prompt of 16 n + 1 tokens, prefilled in (16 n + 1) ms.
"""

from __future__ import annotations

from typing import Any

import pytest

from yb_conductor.conductor import Conductor
from yb_conductor.policy import MooncakePolicy
from yb_conductor.replay import replay
from yb_core import events as ev


def keys(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def _aware(crafted: Any, **settings: Any) -> Any:
    """A crafted cluster whose conductor knows engines run queues by priority."""
    c = crafted(**settings)
    c.c.policy = MooncakePolicy(c.cfg, c.cost, priority_order=True)
    return c


def _request(rid: str, n: int, *, priority: int, base: int) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=rid,
        gateway_id="g",
        model="",
        block_size=16,
        block_hashes=keys(n, base=base),
        prompt_tokens=n * 16 + 1,
        max_tokens=10,
        priority=priority,
        slo=ev.Slo(ttft_s=10.0, tbt_s=1.0),
    )


def _ask(c: Any, request: ev.RequestAdmitted, *, aware: bool = True) -> ev.Decision:
    """The decision for `request` now, without placing it (a pure function)."""
    request.time = c.t
    policy = MooncakePolicy(c.cfg, c.cost, priority_order=aware)
    return policy.decide(c.c.state, request, seq=10_000).decision


def _queue(d: ev.Decision) -> float:
    return d.estimates.queue_s


def test_a_request_waits_only_for_the_head_and_its_own_priority_or_higher(crafted: Any) -> None:
    c = _aware(crafted)
    c.hosts(1)
    c.admit("head", keys(10, base=100))  # runs: 0.161 s
    c.admit("low-1", keys(20, base=200))  # 0.321 s, waiting
    c.admit("low-2", keys(30, base=300))  # 0.481 s, waiting
    # Priority 0 waits for all three; priority 1 overtakes both waiting ones, but
    # never the head. Nothing of a higher priority was scheduled: no stretch.
    assert _queue(_ask(c, _request("q0", 5, priority=0, base=900))) == pytest.approx(0.963)
    assert _queue(_ask(c, _request("q1", 5, priority=1, base=900))) == pytest.approx(0.161)
    assert _queue(_ask(c, _request("q5", 5, priority=5, base=900))) == pytest.approx(0.161)
    # A conductor that prices queues in arrival order (as before) sees all of it.
    unaware = _ask(c, _request("q1", 5, priority=1, base=900), aware=False)
    assert _queue(unaware) == pytest.approx(0.963)


def test_waiting_work_of_a_higher_priority_is_not_overtaken(crafted: Any) -> None:
    c = _aware(crafted)
    c.hosts(1)
    c.admit("head", keys(10, base=100))  # 0.161 s
    c.admit("high", keys(20, base=200), priority=2)  # 0.321 s
    c.admit("mid", keys(30, base=300), priority=1)  # 0.481 s
    c.admit("low", keys(40, base=400), priority=-1)  # 0.641 s
    rho_by_priority = {2: 0.0, 1: 0.321 / 10.0, 0: (0.321 + 0.481) / 10.0}
    ahead_by_priority = {2: 0.161 + 0.321, 1: 0.161 + 0.321 + 0.481, 0: 0.161 + 0.321 + 0.481}
    for priority, ahead in ahead_by_priority.items():
        d = _ask(c, _request(f"q{priority}", 5, priority=priority, base=900))
        stretched = ahead / (1.0 - rho_by_priority[priority])
        assert _queue(d) == pytest.approx(stretched), priority


def test_higher_priority_load_stretches_a_lower_priority_wait(crafted: Any) -> None:
    c = _aware(crafted)
    c.hosts(2)
    c.admit("high-a", keys(100, base=100), priority=1)  # 1.601 s on p-0
    c.admit("high-b", keys(50, base=300), priority=1)  # 0.801 s on p-1
    c.admit("low", keys(10, base=500))  # 0.161 s behind high-b on p-1
    # Over the last TTFT SLO (10 s) priority 1 took 2.402 s of 2 instances' 20 s:
    # rho = 0.1201, and a priority-0 wait of 0.801 s (p-1's head) stretches.
    rho = (1.601 + 0.801) / 20.0
    d = _ask(c, _request("q", 5, priority=0, base=900))
    assert isinstance(d, ev.RequestScheduled)
    assert d.prefill_instance == "p-1"
    assert _queue(d) == pytest.approx((0.801 + 0.161) / (1.0 - rho))
    # Past the window that work no longer counts: the wait is the queue itself
    # (both engines started late, so their queues are still whole).
    c.at(11.7)
    c.progress("high-a", "p-0", "prefill_started")
    c.progress("high-b", "p-1", "prefill_started")
    later = _ask(c, _request("q", 5, priority=0, base=900))
    assert isinstance(later, ev.RequestScheduled) and later.prefill_instance == "p-1"
    assert _queue(later) == pytest.approx(0.801 + 0.161)


def test_the_estimates_of_one_priority_are_those_of_arrival_order(crafted: Any) -> None:
    c = _aware(crafted)
    c.hosts(2, decodes=2)
    c.store("kv-1", keys(6))
    for i in range(8):
        c.admit(f"r{i}", keys(4 + i, base=100 * i), priority=3)
    # Everything is of priority 3: a request of 3 overtakes nothing and nothing
    # overtakes it, so the aware conductor decides as the plain one, to the bit.
    request = _request("q", 7, priority=3, base=1000)
    assert _ask(c, request) == _ask(c, request, aware=False)
    # A request of priority 0 waits for the same queues, stretched by their load.
    low = _ask(c, _request("q", 7, priority=0, base=1000))
    assert _queue(low) > _queue(_ask(c, request)) > 0.0


def test_decode_room_leaves_out_lower_priorities_before_their_prefill(crafted: Any) -> None:
    c = _aware(crafted)
    c.hosts(1, decodes=0)
    c.decode("d-0", kv_blocks=20)
    # 161 prompt + 10 output tokens: 11 blocks of the 20, not yet prefilled.
    c.admit("low", keys(10, base=100))
    # The next needs 10 blocks (145 + 10 tokens): room only if "low" waits for it.
    assert isinstance(_ask(c, _request("q0", 9, priority=0, base=900)), ev.RequestRejected)
    d = _ask(c, _request("q1", 9, priority=1, base=900))
    assert isinstance(d, ev.RequestScheduled) and d.decode_instance == "d-0"
    unaware = _ask(c, _request("q1", 9, priority=1, base=900), aware=False)
    assert isinstance(unaware, ev.RequestRejected)
    assert unaware.reason.startswith("decode_kv_full")
    # Once its prefill ran, "low" holds its pages: nobody overtakes that.
    c.at(2.0).progress("low", "p-0", "prefill_done")
    assert isinstance(_ask(c, _request("q1", 9, priority=1, base=900)), ev.RequestRejected)


def test_priority_decisions_replay(crafted: Any) -> None:
    c = _aware(crafted)
    c.hosts(2, decodes=1)
    for i in range(12):
        c.at(1.0 + 0.05 * i).admit(f"r{i}", keys(10 + 7 * i, base=100 * i), priority=i % 3 - 1)
    c.at(1.3).progress("r0", "p-0", "prefill_started")
    c.at(1.5).progress("r0", "p-0", "prefill_done")
    for i in range(12, 18):
        c.at(1.6 + 0.05 * i).admit(f"r{i}", keys(12, base=100 * i), priority=i % 3 - 1)
    decisions = [r.event for r in c.records if isinstance(r.event, ev.Decision)]
    # Some of these overtook: the aware conductor decided otherwise than the plain one.
    plain = Conductor(
        MooncakePolicy(c.cfg, c.cost, priority_order=False),
        cfg=c.cfg,
        cost=c.cost,
        adopt_logged_config=False,
    )
    assert replay(c.records, strict=False, conductor=plain).divergences
    aware = Conductor(
        MooncakePolicy(c.cfg, c.cost, priority_order=True),
        cfg=c.cfg,
        cost=c.cost,
        adopt_logged_config=False,
    )
    result = replay(c.records, conductor=aware)
    assert result.divergences == [] and result.decisions == len(decisions) == 18
