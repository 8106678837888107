"""The simulated decode instance reserves a request's KV when its prefill starts, as
the real one does (`ReserveKV`, the prefill's first step), and refuses there; a
request that finds the batch full is parked until a slot frees, as the engine's
batcher parks it, and the wait is one of its gaps."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import resolve_cost
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem


def test_a_decode_without_room_refuses_at_the_prefill_start_wasting_nothing(
    uniform_items: Callable[..., list[TraceItem]],
) -> None:
    # Room for two requests: the third finds every page reserved by the first two,
    # whose prefills started before it, and is refused before its prefill runs.
    params = SimParams(prefill=3, decode=1, decode_kv_tokens=2 * 4096, seed=0)
    items = uniform_items(3, prompt=3584, output=512)
    sim = Simulation(items, params, resolve_cost(params), policy="round-robin", admission="none")
    result = sim.run()
    fates = [j.fate for j in sim.jobs]
    assert fates == ["completed", "completed", "decode_rejected"]
    refused = sim.jobs[2]
    assert refused.reason.startswith("decode_kv_full") and refused.prefill_start < 0
    assert result.wasted_prefill_s == 0.0
    assert sim.decodes[0].used_pages(sim.now) == 0


def test_a_full_batch_parks_the_request_and_its_wait_counts_in_its_tbt(
    uniform_items: Callable[..., list[TraceItem]],
) -> None:
    # A batch of one: the second request's KV arrives while the first decodes. The
    # engine parks it (first token reported) and it joins when the first leaves; the
    # paper's `reject` refuses it after its prefill instead.
    params = SimParams(prefill=2, decode=1, decode_max_batch=1, seed=0)
    items = uniform_items(2, prompt=3584, output=64)
    sim = Simulation(items, params, resolve_cost(params), policy="round-robin", admission="none")
    sim.run()
    first, second = sim.jobs
    assert [first.fate, second.fate] == ["completed", "completed"]
    assert second.parked_at == pytest.approx(second.prefill_end)
    assert second.join_time == pytest.approx(first.finish_time)
    assert second.tbt_s == pytest.approx((second.finish_time - second.prefill_end) / 63)
    assert second.tbt_s > first.tbt_s
    assert sim.decodes[0].used_pages(sim.now) == 0

    rejecting = SimParams(
        prefill=2, decode=1, decode_max_batch=1, seed=0, decode_admission="reject"
    )
    sim = Simulation(
        items, rejecting, resolve_cost(rejecting), policy="round-robin", admission="none"
    )
    sim.run()
    assert [j.fate for j in sim.jobs] == ["completed", "decode_rejected"]
    assert sim.jobs[1].reason.startswith("decode_batch_full")
