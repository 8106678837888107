"""Retention in `yb sim`: the simulated kvstore follows the conductor's advice as the
real one does, Belady's oracle knows each block's next use, and a run with retention
writes a log that replays decision for decision, advice included."""

from __future__ import annotations

import math

import pytest

from yb_conductor.cost_model import load_cost_model
from yb_conductor.replay import replay
from yb_core import events as ev
from yb_tools.sim.kvstore import SimKvstore
from yb_tools.sim.params import SimParams
from yb_tools.sim.retention import FutureUses, run_retention
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem, workload_from
from yb_tools.sim.workloads import generate

COST = load_cost_model("llama2-70b-a800")


def stored(kv: SimKvstore, keys: list[int], t: float) -> list[int]:
    """Store `keys` at `t`; the keys it evicted."""
    out = []
    for event in kv.store(keys, t):
        if isinstance(event, ev.BlockEvicted):
            out += event.block_hashes
    return out


def test_without_advice_the_sim_kvstore_is_lru_and_takes_chain_tails_first() -> None:
    kv = SimKvstore("kv", "h", capacity=4)
    assert stored(kv, [1, 2], 1.0) == []
    assert stored(kv, [3, 4], 2.0) == []
    assert stored(kv, [5], 3.0) == [2]  # the older chain's tail, then its head
    assert stored(kv, [6], 4.0) == [1]


def test_the_sim_kvstore_follows_advice() -> None:
    kv = SimKvstore("kv", "h", capacity=4)
    stored(kv, [1, 2, 3, 4], 1.0)
    # 3 is dropped first though newer; 1 is reused every 10 s: it counts as used
    # 10 s before it was.
    kv.advise(
        ev.RetentionPlanned(instance_id="kv", reuse=[1, 4], reuse_s=[10.0, 0.0], drop=[3, 9]),
        2.0,
    )
    assert stored(kv, [5], 3.0) == [3]
    assert stored(kv, [6], 4.0) == [1]
    # 9 was advised before it arrived: it goes first once held, at once.
    assert stored(kv, [9], 5.0) == [9]
    # 2 and 4 were last used at the advice, alike: the chain's tail goes first.
    assert stored(kv, [7], 6.0) == [4]
    assert set(kv.blocks) == {2, 5, 6, 7}


def test_the_oracle_knows_the_next_use_of_every_block() -> None:
    items = [
        TraceItem(0, "a", 1.0, 3 * 512 + 1, 1, [10, 11, 12, 13]),
        TraceItem(1, "b", 5.0, 2 * 512 + 1, 1, [10, 11, 14]),
        TraceItem(2, "c", 9.0, 512 + 1, 1, [10, 15]),
    ]
    future = FutureUses(items, 512)
    assert future.next_use(10) == 1.0
    assert future.next_use(12) == 1.0 and future.next_use(13) == math.inf  # not reusable
    future.done(0)
    assert future.next_use(10) == 5.0 and future.next_use(12) == math.inf
    future.done(2)  # read out of order: b still wants 10
    assert future.next_use(10) == 5.0
    future.done(1)
    assert future.next_use(10) == math.inf
    assert future.uses_after(10, 4.0) == 2

    kv = SimKvstore("kv", "h", capacity=2)
    kv.oracle = FutureUses(items, 512)
    stored(kv, [10, 11], 0.0)
    assert stored(kv, [13], 0.5) == [13]  # never used again: evicted at once
    assert stored(kv, [12], 0.6) == [11]  # all wanted at 1.0: the chain's tail first


@pytest.fixture(scope="module")
def shared_prefix() -> list[TraceItem]:
    records = generate("shared-prefix:groups=12,users=3,questions=2,qps_start=2,qps_end=6")
    return workload_from(records, block_size=512)


PARAMS = SimParams(prefill=2, decode=2, pool_tokens=30_000)


def test_a_run_with_retention_advises_and_replays_exactly(
    shared_prefix: list[TraceItem],
) -> None:
    sim = Simulation(
        shared_prefix,
        PARAMS,
        COST,
        policy="mooncake",
        record_log=True,
        settings={"retention": True},
    )
    result = sim.run()
    assert sim.records is not None
    advice = [r.event for r in sim.records if isinstance(r.event, ev.RetentionPlanned)]
    placed = [r.event for r in sim.records if isinstance(r.event, ev.RequestScheduled)]
    assert len(placed) == result.completed
    # One advice per placement for the kvstore that stores the request's blocks (the
    # first of its request's), and one for each other kvstore it reads a prefix from.
    stored = {a.request_id: a for a in reversed(advice)}
    assert sorted(stored) == sorted(d.request_id for d in placed)
    assert any(a.needed for a in advice)
    # Groups share 11 blocks; each question is new and never asked again: once that
    # is learnt, the questions' blocks are dropped first.
    last = stored[placed[-1].request_id]
    assert last.drop and set(last.drop).isdisjoint(last.reuse)
    evictions = [r.event for r in sim.records if isinstance(r.event, ev.BlockEvicted)]
    assert evictions, "the pool must be small enough to evict"
    assert replay(sim.records).divergences == []


def test_the_three_modes_play_the_same_requests(shared_prefix: list[TraceItem]) -> None:
    results = {
        mode: run_retention(shared_prefix, PARAMS, COST, mode)
        for mode in ("lru", "retention", "belady")
    }
    assert {r.requests for r in results.values()} == {len(shared_prefix)}
    for r in results.values():
        assert 0.0 < r.cache_hit_ratio < 1.0
    with pytest.raises(ValueError, match="unknown retention mode"):
        run_retention(shared_prefix, PARAMS, COST, "mru")


def test_the_sim_kvstore_keeps_what_a_placed_request_will_read() -> None:
    kv = SimKvstore("kv", "h", capacity=2)
    kv.store([1], 0.0)
    kv.store([2], 1.0)
    # Advice makes the store rank by use and advice; 1, the oldest, is needed.
    kv.advise(ev.RetentionPlanned(instance_id="kv", needed=[1], needed_s=10.0), 2.0)
    evicted = [e for e in kv.store([3], 3.0) if isinstance(e, ev.BlockEvicted)]
    assert evicted[0].block_hashes == [2]
    kv.advise(ev.RetentionPlanned(instance_id="kv", needed=[3], needed_s=1.0), 4.0)
    kv.touch([1])  # read at 4: an ordinary block again, and newer than 3
    assert 1 not in kv.needed
    evicted = [e for e in kv.store([4], 6.0) if isinstance(e, ev.BlockEvicted)]
    assert evicted[0].block_hashes == [3]  # its time ran out at 5: the oldest goes
