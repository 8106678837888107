"""Service tiers as the conductor sees them: a tier is its SLOs and its priority in
`RequestAdmitted` (the gateway's `gateway.service_tiers`), so the admission and the
priority-aware estimates that step 12 built are the whole mechanism. Under the same
load the built-in `flex` tier is refused first and `priority` last, on the prefill
queue and on the decode batch, and the limits used are in the explanation that
`yb explain` prints.

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
from yb_core.config import FLEX_TTFT_FACTOR, GatewayConfig, ServiceTier
from yb_tools.cli.explain import describe_request, render

TIERS = ("priority", "default", "flex")


def keys(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def _tiers(ttft_slo_s: float, tbt_slo_s: float) -> dict[str, ServiceTier]:
    """The built-in tiers of a gateway with these SLOs."""
    return GatewayConfig(ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s).resolved_service_tiers()


def _request(name: str, tier: ServiceTier, n: int = 5) -> ev.RequestAdmitted:
    """An admission as the gateway logs it for a request of tier `name`."""
    return ev.RequestAdmitted(
        request_id=f"q-{name}",
        gateway_id="g",
        model="",
        block_size=16,
        block_hashes=keys(n, base=90_000),
        prompt_tokens=n * 16 + 1,
        max_tokens=10,
        priority=tier.priority,
        slo=ev.Slo(ttft_s=tier.ttft_slo_s, tbt_s=tier.tbt_slo_s),
        service_tier=name,
    )


def _verdicts(c: Any, tiers: dict[str, ServiceTier], admission: str = "") -> dict[str, str]:
    """Each tier's decision for the same next request now (`decide` is pure), by the
    conductor's admission policy or by `admission`."""
    cfg = msgspec.structs.replace(c.cfg, admission=admission) if admission else c.cfg
    policy = placement_policy(cfg, c.cost)
    out = {}
    for name in TIERS:
        request = _request(name, tiers[name])
        request.time = c.t
        d = policy.decide(c.c.state, request, seq=10_000).decision
        out[name] = "admit" if isinstance(d, ev.RequestScheduled) else d.reason.split(":")[0]
    return out


def test_flex_is_refused_first_on_a_queue_and_priority_last(crafted: Any) -> None:
    c = crafted()  # admission `predicted`, queues priced in the engines' order
    c.hosts(1)
    tiers = _tiers(ttft_slo_s=0.5, tbt_slo_s=1.0)
    assert tiers["flex"].ttft_slo_s == 0.5 * FLEX_TTFT_FACTOR
    c.admit("head", keys(10, base=100))  # runs: 0.161 s
    # Flex work waits behind the head: the other tiers overtake it, flex does not.
    for i in range(4):
        c.admit(f"flex-{i}", keys(30, base=1000 * (i + 1)), priority=-1)  # 0.481 s each
    # The others see the head and their own prefill (0.242 s); flex waits for all of
    # it, stretched by the higher tiers' load (2.35 s), over 90% of its 2 s.
    assert _verdicts(c, tiers) == {"priority": "admit", "default": "admit", "flex": "ttft_slo"}
    # Default work queues: default waits for it (0.884 s), priority overtakes it.
    for i in range(2):
        c.admit(f"default-{i}", keys(20, base=10_000 * (i + 1)))  # 0.321 s each
    assert _verdicts(c, tiers) == {
        "priority": "admit",
        "default": "ttft_slo",
        "flex": "ttft_slo",
    }
    assert not replay(c.records).divergences


def test_flex_is_refused_first_on_the_decode_batch(crafted: Any) -> None:
    c = crafted(admission="none")
    c.hosts(1)
    for i in range(17):  # with the newcomer a predicted batch of 18: TBT 28 ms
        c.admit(f"w{i}", keys(1, base=100 * i), max_tokens=10_000)
    tiers = _tiers(ttft_slo_s=100.0, tbt_slo_s=0.030)
    verdicts = _verdicts(c, tiers, admission="predicted")
    # Flex keeps the default TBT SLO, but sits below the conductor's priority ceiling
    # (0): it may use 90% of it, 27 ms, and is the one refused.
    assert verdicts == {"priority": "admit", "default": "admit", "flex": "tbt_slo"}


def test_the_explanation_carries_the_tier_limits(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    tiers = _tiers(ttft_slo_s=2.0, tbt_slo_s=0.05)
    for name in TIERS:
        request = _request(name, tiers[name])
        request.request_id = f"r-{name}"
        d = c.feed(request)[0]
        assert isinstance(d, ev.RequestScheduled) and d.explain is not None
        # What `yb explain` prints as "limits TTFT ..., TBT ...".
        factor = 0.9 if name == "flex" else 1.0
        assert d.explain.ttft_limit_s == pytest.approx(tiers[name].ttft_slo_s * factor)
        assert d.explain.tbt_limit_s == pytest.approx(tiers[name].tbt_slo_s * factor)
    assert not replay(c.records).divergences


def test_yb_explain_names_the_tier_and_a_batch_lines_due_time(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    tiers = _tiers(ttft_slo_s=2.0, tbt_slo_s=0.05)
    request = _request("flex", tiers["flex"])
    request.request_id = "r-flex"
    d = c.feed(request)[0]
    assert isinstance(d, ev.RequestScheduled)
    (admitted,) = [
        r.event
        for r in c.records
        if isinstance(r.event, ev.RequestAdmitted) and r.event.request_id == "r-flex"
    ]
    text = render(1, d, admitted)
    flex_ttft = 2.0 * FLEX_TTFT_FACTOR
    assert f"tier flex (priority -1; SLO TTFT {flex_ttft:g}s, TBT 0.05s)" in text
    line = msgspec.structs.replace(admitted, batch=True, batch_deadline=admitted.time + 3600)
    assert describe_request(line).endswith("; a Batch API line, due in 3600s")
