"""Prompts prefilled inside a decode instance's batch: the mixed steps' plan, and
when the conductor prefers them to the prefill pool.

The crafted cost model: prefill 1 ms a token, a decode step 10 ms + 1 ms a
sequence, 16-token blocks (conftest).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ROUND

from yb_conductor.piggyback import MAX_STEPS, plan_steps
from yb_conductor.replay import replay
from yb_core import events as ev

TBT = 0.05


def keys(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def test_steps_fill_what_the_tbt_limit_leaves_beside_the_batch() -> None:
    # A batch of 5: a 15 ms step, 35 ms left for the prompt: 35 tokens a step.
    steps = plan_steps(
        ROUND, batch=5, context=0, new_tokens=100, cached_tokens=0, limit_s=TBT, block_size=16
    )
    assert steps is not None
    assert [c for c, _ in steps] == [35, 35, 30]
    assert [s for _, s in steps] == pytest.approx([0.05, 0.05, 0.045])
    # No stream: the limit still bounds each step.
    alone = plan_steps(
        ROUND, batch=0, context=0, new_tokens=100, cached_tokens=0, limit_s=TBT, block_size=16
    )
    assert alone is not None and [c for c, _ in alone] == [50, 50]
    # A batch that leaves less than a block per step takes no prompt.
    full = dict(batch=30, context=0, new_tokens=100, cached_tokens=0, block_size=16)
    assert plan_steps(ROUND, limit_s=TBT, **full) is None
    # Nor one that would need more than MAX_STEPS steps.
    too_long = dict(batch=5, context=0, new_tokens=(MAX_STEPS + 1) * 35, cached_tokens=0)
    assert plan_steps(ROUND, limit_s=TBT, block_size=16, **too_long) is None


def cluster(crafted: Any, streams: int = 5) -> Any:
    """One prefill host (p-0, kv-0) and a decode instance d-0 that takes prompts, with
    `streams` requests decoding there."""
    c = crafted()
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    c.feed(
        ev.InstanceUp(
            instance_id="d-0", role="decode", host="h-d", max_batch_size=64, piggyback=True
        )
    )
    for i in range(streams):
        d = c.admit(f"s{i}", keys(1, base=100 * (i + 1)), max_tokens=10_000, tbt_slo=TBT)
        assert isinstance(d, ev.RequestScheduled) and not d.piggyback
        c.progress(d.request_id, "p-0", "prefill_done")
        c.progress(d.request_id, "d-0", "kv_committed")
    return c


def test_a_short_prompt_joins_the_batch_when_the_prefill_pool_is_busy(crafted: Any) -> None:
    c = cluster(crafted)
    busy = c.admit("busy", keys(40, base=50_000), tbt_slo=TBT)  # 0.641 s on p-0
    assert isinstance(busy, ev.RequestScheduled) and busy.prefill_instance == "p-0"
    d = c.admit("short", keys(2, base=70_000), tbt_slo=TBT)  # 33 tokens
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    assert d.piggyback and d.prefill_instance == d.decode_instance == "d-0"
    assert d.explain.branch == "piggyback"
    # Half a 15 ms step of waiting, then one 48 ms step.
    assert d.estimates.queue_s == pytest.approx(0.0075)
    assert d.estimates.prefill_s == pytest.approx(0.048)
    assert d.estimates.ttft_s == pytest.approx(0.0555)
    row = d.explain.candidates[0]
    assert row.instance_id == "d-0" and row.option == "piggyback"
    assert "d-0 prefills it inside its batch of 5: 1 step(s) of at most 33 tokens" in (
        d.explain.reason
    )
    assert "on p-0" in d.explain.reason
    assert replay(c.records).divergences == []


def test_an_idle_prefill_pool_keeps_the_prompt(crafted: Any) -> None:
    c = cluster(crafted)
    d = c.admit("short", keys(2, base=70_000), tbt_slo=TBT)
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    assert not d.piggyback and d.prefill_instance == "p-0"
    # The piggyback option is weighed and shown second.
    assert [r.option for r in d.explain.candidates[:2]] == ["recompute", "piggyback"]
    assert d.explain.candidates[1].ttft_s > d.estimates.ttft_s


def test_a_full_batch_takes_no_prompt_and_a_plain_decode_is_never_asked(
    crafted: Any,
) -> None:
    full = cluster(crafted, streams=36)  # a 46 ms step: no block fits beside it
    full.admit("busy", keys(40, base=50_000), tbt_slo=TBT)
    d = full.admit("short", keys(2, base=70_000), tbt_slo=TBT)
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    assert not d.piggyback
    assert all(r.option != "piggyback" for r in d.explain.candidates)
    plain = crafted()
    plain.hosts(1)
    plain.admit("busy", keys(40, base=50_000))
    d = plain.admit("short", keys(2, base=70_000))
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    assert not d.piggyback
    assert all(r.option != "piggyback" for r in d.explain.candidates)


def test_the_decode_instance_loads_the_cached_prefix_from_the_pool(crafted: Any) -> None:
    c = cluster(crafted)
    c.store("kv-0", keys(6, base=70_000))
    c.admit("busy", keys(40, base=50_000), tbt_slo=TBT)
    d = c.admit("long-cached", keys(8, base=70_000), tbt_slo=TBT)  # 129 tokens, 96 cached
    assert isinstance(d, ev.RequestScheduled) and d.piggyback
    assert d.reuse == [
        ev.ReusePlan(source_instance="kv-0", tier="dram", first_block=0, num_blocks=6)
    ]
    assert d.reused_blocks == 6 and d.computed_tokens == 129 - 96
    assert d.estimates.transfer_s == pytest.approx(6 * 0.001)  # remote: 1 ms a block
    # Later prompts queue behind it on the decode instance.
    again = c.admit("next", keys(2, base=90_000), tbt_slo=TBT)
    assert isinstance(again, ev.RequestScheduled) and again.piggyback
    assert again.estimates.queue_s > d.estimates.queue_s
    assert replay(c.records).divergences == []


def test_a_request_for_its_prompt_logprobs_goes_to_a_whole_prefill_with_nothing_reused(
    crafted: Any,
) -> None:
    c = cluster(crafted)
    busy = c.admit("busy", keys(40, base=50_000), tbt_slo=TBT)
    assert isinstance(busy, ev.RequestScheduled) and busy.prefill_instance == "p-0"
    # What would join the batch (see above) is planned on the prefill pool instead:
    # only a whole-model prefill computes a prompt's logprobs.
    d = c.admit("scored", keys(2, base=70_000), tbt_slo=TBT, prompt_logprobs=True)
    assert isinstance(d, ev.RequestScheduled)
    assert not d.piggyback and d.prefill_instance == "p-0"
    # A prefix the pool holds is not planned for reuse, and the price is a full prefill.
    c.progress("busy", "p-0", "prefill_done")
    again = c.admit("again", keys(40, base=50_000), tbt_slo=TBT, prompt_logprobs=True)
    assert isinstance(again, ev.RequestScheduled) and again.reuse == []
    plain = c.admit("plain", keys(40, base=50_000), tbt_slo=TBT)
    assert isinstance(plain, ev.RequestScheduled) and plain.reuse != []
    assert again.estimates.prefill_s > plain.estimates.prefill_s
    assert replay(c.records).divergences == []
