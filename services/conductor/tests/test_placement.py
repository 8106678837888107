"""Prefill and decode placement on crafted states: every branch of Algorithm 1, the
improvement (transfer weighed against recompute), and the threshold guard."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from conftest import BS

from yb_conductor.replay import replay
from yb_conductor.settings import recorded_settings
from yb_core import events as ev


def keys(n: int, base: int = 1000) -> list[int]:
    """A chain of `n` block keys (as the crafted cluster's helper)."""
    return [base + i for i in range(n)]


def _scheduled(d: ev.Decision) -> ev.RequestScheduled:
    assert isinstance(d, ev.RequestScheduled), d
    assert d.explain is not None
    return d


def test_no_prefix_anywhere_recomputes_on_the_least_queued(crafted: Any) -> None:
    c = crafted()
    c.hosts(3)
    a = _scheduled(c.admit("a", keys(10)))
    assert a.explain.branch == "recompute" and a.reuse == [] and a.reused_blocks == 0
    assert a.prefill_instance == "p-0"  # all idle: the first by id
    # p-0 is now busy: the next request (other prefix) goes elsewhere.
    b = _scheduled(c.admit("b", keys(10, base=5000)))
    assert b.prefill_instance == "p-1"
    assert b.estimates.queue_s == 0.0
    assert a.estimates.prefill_s == pytest.approx(0.001 * (10 * 16 + 1))
    assert "no prefix cached anywhere" in a.explain.reason


def test_local_prefix_is_loaded_from_the_hosts_kvstore(crafted: Any) -> None:
    c = crafted()
    c.hosts(3)
    c.store("kv-2", keys(8))
    d = _scheduled(c.admit("r", keys(10)))
    assert d.prefill_instance == "p-2"
    assert d.explain.branch == "local"
    assert d.reuse == [
        ev.ReusePlan(source_instance="kv-2", tier="dram", first_block=0, num_blocks=8)
    ]
    assert d.computed_tokens == d.prompt_tokens - 8 * 16
    assert d.estimates.transfer_s == pytest.approx(8 * 0.0005)
    assert d.explain.best_blocks == 8 and d.explain.best_source == "kv-2"


def test_longer_remote_prefix_is_pulled_beyond_the_local_one(crafted: Any) -> None:
    c = crafted()
    c.hosts(2)
    c.store("kv-0", keys(2))
    c.store("kv-1", keys(9))
    # Keep host 1 busy so that the remote prefix must travel to host 0 to be worth it.
    c.admit("busy", keys(30, base=9000))  # lands on p-0 (idle, first)
    c.admit("busy2", keys(30, base=7000))  # p-1
    c.progress("busy", "p-0", "prefill_done")
    d = _scheduled(c.admit("r", keys(10)))
    assert d.prefill_instance == "p-0"
    assert d.explain.branch == "transfer"
    assert d.reuse == [
        ev.ReusePlan(source_instance="kv-0", tier="dram", first_block=0, num_blocks=2),
        ev.ReusePlan(source_instance="kv-1", tier="dram", first_block=2, num_blocks=7),
    ]
    assert d.reused_blocks == 9
    assert d.estimates.transfer_s == pytest.approx(2 * 0.0005 + 7 * 0.001)
    first = d.explain.candidates[0]
    assert (first.instance_id, first.option, first.local_blocks, first.source) == (
        "p-0",
        "transfer",
        2,
        "kv-1",
    )


def _with_transfer(crafted: Any, **bandwidths: float) -> Any:
    """The crafted cost model with other bandwidths."""
    base = crafted.ROUND
    return msgspec.structs.replace(
        base, transfer=msgspec.structs.replace(base.transfer, **bandwidths)
    )


def _slow_network(crafted: Any) -> Any:
    # Remote loads at 100 ms a block: far slower than recomputing a block (16 ms).
    return _with_transfer(crafted, dram_remote_gbps=1048576 / 0.1 / 1e9)


def test_transfer_slower_than_recompute_is_not_taken(crafted: Any) -> None:
    c = crafted(cost=_slow_network(crafted))
    c.hosts(2)
    c.store("kv-1", keys(9))
    c.admit("busy", keys(30, base=9000))  # p-0 busy for 0.48 s
    c.admit("busy2", keys(100, base=7000))  # p-1 busy for 1.6 s
    c.progress("busy", "p-0", "prefill_done")
    d = _scheduled(c.admit("r", keys(10)))
    # p-1 holds the prefix locally but is busy (1.6 s); p-0 is idle: pulling 9 blocks
    # there (0.9 s) is slower than recomputing them (0.144 s).
    assert (d.prefill_instance, d.explain.branch) == ("p-0", "recompute")
    assert d.explain.candidates[0].option == "recompute"
    assert "faster than loading" in d.explain.reason


def test_paper_rule_transfers_whenever_the_ratio_passes(crafted: Any) -> None:
    c = crafted(cost=_slow_network(crafted), weigh_transfer=False)
    c.hosts(2)
    c.store("kv-1", keys(9))
    c.admit("busy", keys(30, base=9000))
    c.admit("busy2", keys(100, base=7000))
    c.progress("busy", "p-0", "prefill_done")
    d = _scheduled(c.admit("r", keys(10)))
    # Algorithm 1 as published: p-0's only option is the transfer, which still beats
    # p-1's queue, so it is taken even though recomputing would be faster.
    assert (d.prefill_instance, d.explain.branch) == ("p-0", "transfer")
    assert d.estimates.transfer_s == pytest.approx(0.9)


def test_threshold_guards_when_a_transfer_is_considered(crafted: Any) -> None:
    for threshold, expected in ((1.0, "transfer"), (2.0, "local")):
        c = crafted(kvcache_balancing_threshold=threshold)
        c.hosts(2)
        c.store("kv-0", keys(6))
        c.store("kv-1", keys(9))
        c.admit("busy", keys(30, base=9000))
        c.admit("busy2", keys(30, base=7000))
        c.progress("busy", "p-0", "prefill_done")
        d = _scheduled(c.admit("r", keys(10)))
        # 9/6 = 1.5: past a threshold of 1, not past 2.
        assert (d.prefill_instance, d.explain.branch) == ("p-0", expected), threshold


def test_engine_tier_prefix_is_reused_in_place(crafted: Any) -> None:
    c = crafted()
    c.hosts(2)
    c.feed(
        ev.BlockStored(instance_id="p-1", epoch=1, event_id=1, block_hashes=keys(4), tier="engine")
    )
    c.store("kv-1", keys(7))
    d = _scheduled(c.admit("r", keys(10)))
    assert d.prefill_instance == "p-1" and d.explain.branch == "local"
    assert d.reuse == [
        ev.ReusePlan(source_instance="p-1", tier="engine", first_block=0, num_blocks=4),
        ev.ReusePlan(source_instance="kv-1", tier="dram", first_block=4, num_blocks=3),
    ]
    assert d.estimates.transfer_s == pytest.approx(3 * 0.0005)  # engine blocks are free


def test_slow_local_ssd_is_skipped_for_recompute(crafted: Any) -> None:
    ssd_crawl = _with_transfer(crafted, ssd_local_gbps=1048576 / 0.05 / 1e9)
    c = crafted(cost=ssd_crawl)
    c.hosts(1)
    c.store("kv-0", keys(8), tier="ssd")
    d = _scheduled(c.admit("r", keys(10)))
    assert d.explain.branch == "recompute"  # 50 ms a block from SSD vs 16 ms to compute
    c2 = crafted()
    c2.hosts(1)
    c2.store("kv-0", keys(8), tier="ssd")
    d2 = _scheduled(c2.admit("r", keys(10)))
    assert d2.explain.branch == "local"
    assert d2.reuse[0].tier == "ssd"


def test_a_long_queue_outweighs_a_local_prefix(crafted: Any) -> None:
    c = crafted()
    c.hosts(2)
    c.store("kv-0", keys(3))
    c.admit("big", keys(100, base=9000))  # 1.6 s of prefill queued on p-0
    d = _scheduled(c.admit("r", keys(10)))
    # Recomputing 3 blocks elsewhere (48 ms) beats waiting 1.6 s; but pulling them
    # from kv-0 to p-1 is cheaper still.
    assert d.prefill_instance == "p-1"
    assert d.explain.branch == "transfer"
    by_id = {cand.instance_id: cand for cand in d.explain.candidates}
    assert by_id["p-0"].queue_s == pytest.approx(1.601)
    assert by_id["p-0"].option == "local"


def test_queue_estimate_reanchors_on_progress(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    a = _scheduled(c.admit("a", keys(10, base=1)))  # 0.161 s
    b = _scheduled(c.admit("b", keys(10, base=100)))
    assert b.estimates.queue_s == pytest.approx(a.estimates.prefill_s)
    # The engine starts "a" late: at t=2 it has not finished; the queue follows.
    c.at(2.0).progress("a", "p-0", "prefill_started")
    inst = c.c.state.instances["p-0"]
    assert inst.busy_until == pytest.approx(2.0 + a.estimates.prefill_s + b.estimates.prefill_s)
    c.at(2.05).progress("a", "p-0", "prefill_done")
    assert inst.busy_until == pytest.approx(2.05 + b.estimates.prefill_s)
    assert list(inst.prefill_queue) == ["b"]


def test_decode_goes_to_the_lowest_predicted_tbt(crafted: Any) -> None:
    c = crafted()
    c.hosts(1, decodes=2)
    first = _scheduled(c.admit("a", keys(2, base=1)))
    assert first.decode_instance == "d-0"
    second = _scheduled(c.admit("b", keys(2, base=100)))
    assert second.decode_instance == "d-1"
    table = {d.instance_id: d for d in second.explain.decode_candidates}
    assert table["d-1"].tbt_s < table["d-0"].tbt_s
    assert second.estimates.tbt_s == pytest.approx(0.011)


def test_decode_without_kv_room_is_not_a_candidate(crafted: Any) -> None:
    c = crafted()
    c.hosts(1, decodes=0)
    c.decode("d-small", kv_blocks=4)
    c.decode("d-large", kv_blocks=100)
    d = _scheduled(c.admit("r", keys(10)))
    assert d.decode_instance == "d-large"
    c2 = crafted()
    c2.hosts(1, decodes=0)
    c2.decode("d-small", kv_blocks=4)
    rejected = c2.admit("r", keys(10))
    assert isinstance(rejected, ev.RequestRejected)
    assert rejected.reason.startswith("decode_kv_full")


def test_rejects_when_ttft_estimate_exceeds_the_slo(crafted: Any) -> None:
    c = crafted(admit_unqueued_overrun=False)
    c.hosts(1)
    d = c.admit("r", keys(10), ttft_slo=0.1)  # needs 0.161 s
    assert isinstance(d, ev.RequestRejected)
    assert d.reason.startswith("ttft_slo:")
    assert d.estimates.ttft_s == pytest.approx(0.161)
    assert d.retry_after_s == 1.0  # 61 ms over: retry as soon as allowed
    assert d.explain is not None and d.explain.branch == "reject"
    assert d.explain.candidates[0].instance_id == "p-0"


def test_a_ttft_overrun_with_nothing_queued_ahead_is_admitted(crafted: Any) -> None:
    c = crafted()  # admit_unqueued_overrun on by default
    c.hosts(1)
    # Alone on an idle instance the prompt needs 0.161 s: waiting cannot help it and
    # a refusal sheds no load, so it is admitted and its reason says why.
    d = c.admit("r", keys(10), ttft_slo=0.1)
    assert isinstance(d, ev.RequestScheduled)
    assert d.estimates.queue_s == 0.0 and d.estimates.ttft_s == pytest.approx(0.161)
    assert d.explain is not None
    assert "admitted over its TTFT limit 0.100s (estimated 0.161s)" in d.explain.reason
    assert "admit_unqueued_overrun" in d.explain.reason
    # The same prompt behind it waits for that prefill: now the wait is what misses
    # the SLO, and it is refused.
    queued = c.admit("r2", keys(10, base=50_000), ttft_slo=0.1)
    assert isinstance(queued, ev.RequestRejected)
    assert queued.reason.startswith("ttft_slo:") and queued.estimates.queue_s > 0.0
    # A request within its SLO carries no such note.
    fine = crafted()
    fine.hosts(1)
    ok = fine.admit("r", keys(10), ttft_slo=1.0)
    assert isinstance(ok, ev.RequestScheduled) and ok.explain is not None
    assert "TTFT limit" not in ok.explain.reason


def test_logs_recorded_before_unqueued_overruns_replay_refusing_them() -> None:
    assert recorded_settings("{}").admit_unqueued_overrun is False
    assert recorded_settings('{"admit_unqueued_overrun": true}').admit_unqueued_overrun is True


def test_no_live_instances_rejects_with_a_code(crafted: Any) -> None:
    c = crafted()
    d = c.admit("r", keys(1))
    assert isinstance(d, ev.RequestRejected) and d.reason.startswith("no_prefill")
    c.prefill("p", "h")
    d = c.admit("r2", keys(1))
    assert isinstance(d, ev.RequestRejected) and d.reason.startswith("no_decode")


def test_the_last_prompt_token_is_always_computed(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    c.store("kv-0", keys(4))
    # 64 tokens, all four blocks cached: the last block is recomputed for its logits.
    d = _scheduled(c.admit("r", keys(4), prompt=64))
    assert d.reused_blocks == 3 and d.computed_tokens == 16


def test_every_crafted_log_replays_to_the_same_decisions(crafted: Any) -> None:
    c = crafted()
    c.hosts(3, decodes=2)
    c.store("kv-1", keys(6))
    for i in range(12):
        c.admit(f"r{i}", keys(4 + i % 5, base=1000 if i % 2 else 50_000 + i))
    result = replay(c.records)
    assert result.divergences == [] and result.decisions == 12


def test_an_engine_with_another_block_size_takes_no_request(crafted: Any) -> None:
    c = crafted()
    c.kvstore("kv-0", "h0")
    c.feed(ev.InstanceUp(instance_id="p-0", role="prefill", host="h0", block_size=BS * 4))
    c.feed(ev.InstanceUp(instance_id="p-1", role="prefill", host="h0", block_size=BS))
    c.feed(ev.InstanceUp(instance_id="d-0", role="decode", host="h-d", block_size=BS * 4))
    c.feed(ev.InstanceUp(instance_id="d-1", role="decode", host="h-d", max_batch_size=64))
    # p-0 is first by id and idle, but its pages hold another number of tokens; an
    # instance that announced no block size (d-1) is not excluded.
    d = _scheduled(c.admit("a", keys(4)))
    assert (d.prefill_instance, d.decode_instance) == ("p-1", "d-1")
    c.feed(ev.InstanceDown(instance_id="p-1"))
    refused = c.admit("b", keys(4))
    assert isinstance(refused, ev.RequestRejected), refused
    assert refused.reason == f"no_prefill: no live prefill instance with {BS}-token pages"
    assert replay(c.records).divergences == []


def test_a_request_starting_now_finds_the_room_started_prefills_reserved(crafted: Any) -> None:
    # `a` (31 blocks with its output) started its prefill, which ends after `r`'s:
    # a decode instance reserves a request's pages when its prefill starts, so `r`
    # (11 blocks) does not fit beside it in 41.
    c = crafted()
    c.hosts(2, decodes=0)
    c.decode("d", kv_blocks=41)
    _scheduled(c.admit("a", keys(30, base=9000)))
    c.progress("a", "p-0", "prefill_started")
    refused = c.admit("r", keys(10))
    assert isinstance(refused, ev.RequestRejected)
    assert refused.reason.startswith("decode_kv_full")
    # Counted at the prefill's end (logs recorded before the setting), `a` takes its
    # pages after `r` and is left out of the room.
    old = crafted(kv_reserved_at_start=False)
    old.hosts(2, decodes=0)
    old.decode("d", kv_blocks=41)
    _scheduled(old.admit("a", keys(30, base=9000)))
    old.progress("a", "p-0", "prefill_started")
    assert _scheduled(old.admit("r", keys(10))).decode_instance == "d"


def test_logs_recorded_before_reservations_at_start_replay_counting_at_the_end() -> None:
    assert recorded_settings("{}").kv_reserved_at_start is False
    assert recorded_settings('{"kv_reserved_at_start": true}').kv_reserved_at_start is True
