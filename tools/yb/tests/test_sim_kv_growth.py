"""The simulated decode instance holds KV pages as the engine does: a request reserves
its prompt's pages only, takes a page each time its tokens cross a page boundary,
and when the batch needs a page that is not free the running request of lowest
priority, the newest among those, is ended (`kv_exhausted`) and its pages freed.

The hand-checked cost model: a decode step takes 10 ms + 1 ms a sequence; pages of 4
tokens, 10 of them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost
from yb_core import events as ev
from yb_tools.sim.decode import SimDecode
from yb_tools.sim.job import Job
from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import resolve_cost
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem

COST = CostModel(
    name="hand",
    kv_bytes_per_token=1,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.001, per_context_token_s=0.0),
)


def _decode() -> SimDecode:
    return SimDecode(
        "d", COST, kv_capacity=40, max_batch=8, tbt_slo_s=1.0, enforce_slo=False, block_size=4
    )


def _job(index: int, prompt: int, output: int, priority: int = 0, kv_at: float = 0.0) -> Job:
    """A request whose KV reaches the decode instance at `kv_at`."""
    job = Job(TraceItem(index, f"r{index}", 0.0, prompt, output, []), priority=priority)
    job.prefill_end = kv_at
    return job


def test_a_reservation_holds_the_prompts_pages_only() -> None:
    d = _decode()
    a = _job(0, prompt=10, output=1000)  # 3 pages, whatever its output
    assert d.kv_refusal(a, 0.0) == ""
    d.reserve(a)
    assert d.held_pages == 3 and d.used_pages(0.0) == 3
    assert d.kv_refusal(_job(1, prompt=28, output=1000), 0.0) == ""  # 3 + 7 pages
    assert d.kv_refusal(_job(2, prompt=29, output=1), 0.0).startswith("decode_kv_full: 11 > 10")
    d.release(a)
    assert d.used_pages(0.0) == 0 and not a.kv_held


def test_growth_past_the_pages_ends_the_newest_lowest_priority_request() -> None:
    d = _decode()
    # a (priority 1) joins at step 0; b then c (priority 0) at step 1. At boundary n
    # a holds (8 + n) // 4 + 1 pages and b, c (7 + n) // 4 + 1 each: 9 pages at
    # steps 1-3, 10 at step 4, 12 at step 5. Steps take 11 ms alone, 13 ms for three.
    a = _job(0, prompt=8, output=20, priority=1)
    b = _job(1, prompt=8, output=100, kv_at=0.005)
    c = _job(2, prompt=8, output=100, kv_at=0.005)
    for j in (a, b, c):
        d.admit(j, j.prefill_end)
    assert d.used_pages(0.005) == 3 + 2 + 2  # a's third page for position 8; b, c prompts
    finished: list[tuple[float, str]] = []
    ended: list[tuple[float, str, int, int]] = []
    while (t := d.next_wake()) < 1.0:
        done, _, _, _, gone = d.wake(t)
        finished += [(t, j.item.request_id) for j in done]
        ended += [(t, j.item.request_id, j.generated, d.used_pages(t)) for j in gone]
    # Step 5 (11 + 4 * 13 ms) needs 12 pages: c, the newer of the two of priority 0,
    # is ended after 5 tokens; a and b hold 4 each. At step 12 (7 steps of 12 ms more)
    # a needs 6 and b 5: b is ended, though a is older, for its lower priority. a
    # finishes alone at step 19 (7 steps of 11 ms more), within its 10 pages.
    assert [e[:3] for e in ended] == [
        (pytest.approx(0.063), "r2", 5),
        (pytest.approx(0.147), "r1", 12),
    ]
    assert [e[3] for e in ended] == [8, 6]  # what the rest hold then
    assert finished == [(pytest.approx(0.224), "r0")]
    assert d.exhausted == 2 and d.batch == 0 and d.used_pages(1.0) == 0


def test_pages_in_use_between_boundaries_are_the_last_boundarys() -> None:
    d = _decode()
    a, b = _job(0, prompt=8, output=100), _job(1, prompt=5, output=100, kv_at=0.005)
    d.admit(a, 0.0)  # joins at once: 3 pages (position 8 opens the third)
    d.admit(b, 0.005)  # 2 prompt pages until it joins at step 1 (11 ms)
    assert d.used_pages(0.005) == 5
    d.wake(d.next_wake())
    # Steps of 12 ms from 11 ms. Step 1: a (8 + 1) // 4 + 1 = 3, b (5 + 0) // 4 + 1
    # = 2; step 3 (35 ms): a 3, b (5 + 2) // 4 + 1 = 2; step 4 (47 ms): a 4, b 3.
    assert d.used_pages(0.011) == 5
    assert d.used_pages(0.035) == 5
    assert d.used_pages(0.0469) == 5
    assert d.used_pages(0.0471) == 7


def test_the_simulator_counts_a_request_ended_for_pages_as_failed(
    uniform_items: Callable[..., list[TraceItem]],
) -> None:
    # 16 pages of 512 tokens. Both prompts' 7 pages fit at reservation (output is not
    # known then); decoding 2048 tokens each would take 11 pages each, so the newer
    # one is ended when the pages run out, and the older completes in all 16.
    params = SimParams(prefill=2, decode=1, decode_kv_tokens=16 * 512, seed=0)
    items = uniform_items(2, prompt=3584, output=2048)
    sim = Simulation(
        items, params, resolve_cost(params), policy="round-robin", admission="none",
        record_log=True,
    )  # fmt: skip
    result = sim.run()
    first, second = sim.jobs
    assert [first.fate, second.fate] == ["completed", "kv_exhausted"]
    assert result.completed == 1 and result.kv_exhausted == 1 and result.rejected == 0
    # Both joined with 8 pages (a 3584-token prompt fills 7; its first token opens the
    # 8th); the second is ended at the first boundary where one more page is wanted.
    assert 1 < second.generated < 2048
    assert second.reason == f"kv_exhausted: after {second.generated} of 2048 tokens"
    assert result.slo_attainment <= 0.5
    assert sim.decodes[0].used_pages(sim.now) == 0
    assert sim.records is not None
    finished = [
        r.event
        for r in sim.records
        if isinstance(r.event, ev.RequestFinished) and r.event.request_id == "r1"
    ]
    assert [(f.reason, f.output_tokens) for f in finished] == [("kv_exhausted", second.generated)]
