"""Prefix stickiness: a prefix moves to another host only when the queue it escapes
is worth more than what its copy evicts; ties go to the instance idle longest; a log
recorded without the setting replays as before."""

from __future__ import annotations

from typing import Any

import pytest
from test_placement import _scheduled, keys

from yb_conductor.replay import replay
from yb_conductor.settings import recorded_settings
from yb_core import events as ev


def _holder_busy(c: Any, kv_capacity: int = 0, queued_blocks: int = 3) -> None:
    """Two hosts; kv-1 holds a 10-block prefix; p-1 has a job of `queued_blocks`
    (beyond that prefix) queued, p-0 is idle."""
    for i in range(2):
        c.feed(
            ev.InstanceUp(
                instance_id=f"kv-{i}",
                role="kvstore",
                host=f"h{i}",
                epoch=1,
                kv_capacity_blocks=kv_capacity,
            )
        )
        c.feed(ev.BlocksCleared(instance_id=f"kv-{i}", epoch=1, event_id=c._next(f"kv-{i}")))
        c.prefill(f"p-{i}", f"h{i}")
    c.decode("d-0")
    c.store("kv-1", keys(10))
    busy = _scheduled(c.admit("busy", keys(10) + keys(queued_blocks, base=7000)))
    assert busy.prefill_instance == "p-1"


def test_a_full_pool_keeps_the_prefix_where_it_is(crafted: Any) -> None:
    moving = crafted(prefix_stickiness=0.0)
    _holder_busy(moving)
    pulled = _scheduled(moving.admit("r", keys(10)))
    # By TTFT alone the idle instance pulls the prefix (0.026 s against 0.07 s).
    assert (pulled.prefill_instance, pulled.explain.branch) == ("p-0", "transfer")

    sticky = crafted(prefix_stickiness=1.0)
    _holder_busy(sticky)  # kvstores announce no capacity: full
    kept = _scheduled(sticky.admit("r", keys(10)))
    assert (kept.prefill_instance, kept.explain.branch) == ("p-1", "local")
    # The estimates are still the TTFT's; the reason names the copy cost.
    assert kept.estimates.ttft_s > pulled.estimates.ttft_s
    assert kept.explain.candidates[0].instance_id == "p-1"
    assert "copy 0.000s" in kept.explain.reason
    assert "lowest TTFT + copy cost" in kept.explain.reason
    for c in (moving, sticky):
        assert replay(c.records).divergences == []


def test_a_pool_with_room_takes_the_copy_almost_for_nothing(crafted: Any) -> None:
    c = crafted(prefix_stickiness=1.0)
    _holder_busy(c, kv_capacity=100)  # 10 of 200 blocks held: a copy evicts 5% as much
    d = _scheduled(c.admit("r", keys(10)))
    assert (d.prefill_instance, d.explain.branch) == ("p-0", "transfer")


def test_a_long_queue_is_worth_the_copy(crafted: Any) -> None:
    c = crafted(prefix_stickiness=1.0)
    _holder_busy(c, queued_blocks=100)  # 1.6 s queued on p-1, the copy costs 0.16 s
    d = _scheduled(c.admit("r", keys(10)))
    assert d.prefill_instance == "p-0" and d.explain.branch == "transfer"


def test_ties_go_to_the_instance_idle_longest(crafted: Any) -> None:
    picks: dict[float, list[str]] = {}
    for stickiness in (0.0, 1.0):
        c = crafted(prefix_stickiness=stickiness)
        c.hosts(3)
        picks[stickiness] = []
        for n in range(4):  # one at a time, all idle, nothing cached: all tie
            d = _scheduled(c.at(1.0 + n).admit(f"r{n}", keys(4, base=1000 * n)))
            picks[stickiness].append(d.prefill_instance)
            c.progress(d.request_id, d.prefill_instance, "prefill_done")
        assert replay(c.records).divergences == []
    assert picks[0.0] == ["p-0"] * 4  # by id: one host's pool takes every new prefix
    assert picks[1.0] == ["p-0", "p-1", "p-2", "p-0"]


@pytest.mark.parametrize("recorded", ['{"policy": "mooncake"}', "{}"])
def test_a_log_recorded_without_the_setting_replays_without_stickiness(recorded: str) -> None:
    assert recorded_settings(recorded).prefix_stickiness == 0.0
    assert recorded_settings('{"prefix_stickiness": 0.5}').prefix_stickiness == 0.5


def _evict_unwanted(c: Any, blocks: int) -> None:
    """kv-0 stores `blocks` blocks of a prefix nobody asks for, then evicts them."""
    chain = keys(blocks, base=5000)
    c.store("kv-0", chain)
    c.feed(
        ev.BlockEvicted(instance_id="kv-0", epoch=1, event_id=c._next("kv-0"), block_hashes=chain)
    )


def test_evicting_what_nobody_wants_again_makes_a_copy_cheap(crafted: Any) -> None:
    decided = {}
    for regret in (False, True):
        c = crafted(prefix_stickiness=1.0, eviction_regret=regret)
        _holder_busy(c)  # kvstores announce no capacity: full
        _evict_unwanted(c, 19)
        assert c.c.state.eviction_regret() == pytest.approx(1 / 20)
        d = _scheduled(c.admit("r", keys(10)))
        decided[regret] = (d.prefill_instance, d.explain.branch)
        assert replay(c.records).divergences == []
    # Priced by the share of evicted blocks wanted again (none of 19), the copy costs
    # a twentieth of what it did: the idle instance pulls the prefix.
    assert decided == {False: ("p-1", "local"), True: ("p-0", "transfer")}


def test_evicted_blocks_asked_for_again_raise_the_regret(crafted: Any) -> None:
    c = crafted(prefix_stickiness=1.0)
    _holder_busy(c)
    assert c.c.state.eviction_regret() == 1.0  # nothing evicted yet
    _evict_unwanted(c, 19)
    c.admit("again", keys(19, base=5000))  # all 19 wanted again
    assert c.c.state.eviction_regret() == 1.0
    assert replay(c.records).divergences == []


@pytest.mark.parametrize("recorded", ['{"policy": "mooncake"}', "{}"])
def test_a_log_recorded_without_eviction_regret_replays_without_it(recorded: str) -> None:
    assert recorded_settings(recorded).eviction_regret is False
    assert recorded_settings('{"eviction_regret": true}').eviction_regret is True
