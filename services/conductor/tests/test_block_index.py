"""The block index: per-instance longest prefix in one walk, tiers, slot reuse, and
the fold's gap/epoch protection."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from yb_conductor import block_index
from yb_conductor.block_index import BlockIndex
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig

INSTANCES = [f"i{n}" for n in range(70)]  # past 64: masks wider than a machine word

Op = tuple[str, str, list[int], ev.Tier]

ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "evict", "clear", "move"]),
        st.sampled_from(INSTANCES),
        st.lists(st.integers(0, 40), max_size=12),
        st.sampled_from(["dram", "ssd", "engine"]),
    ),
    max_size=60,
)


def _model(operations: list[Op]) -> dict[str, dict[int, ev.Tier]]:
    held: dict[str, dict[int, ev.Tier]] = {}
    for op, inst, ks, tier in operations:
        mine = held.setdefault(inst, {})
        if op == "store":
            mine.update({k: tier for k in ks})
        elif op == "evict":
            for k in ks:
                mine.pop(k, None)
        elif op == "clear":
            mine.clear()
        else:
            mine.update({k: tier for k in ks if k in mine})
    return held


def _held_prefix(blocks: dict[int, ev.Tier], chain: list[int]) -> int:
    """How many leading blocks of `chain` one instance of the model holds."""
    n = 0
    while n < len(chain) and chain[n] in blocks:
        n += 1
    return n


def _apply(index: BlockIndex, operations: list[Op]) -> None:
    for op, inst, ks, tier in operations:
        if op == "store":
            index.store(inst, ks, tier)
        elif op == "evict":
            index.evict(inst, ks)
        elif op == "clear":
            index.clear(inst)
        else:
            index.move(inst, ks, tier)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 40), min_size=0, max_size=15))
def test_match_equals_brute_force(operations: list[Op], chain: list[int]) -> None:
    index = BlockIndex()
    _apply(index, operations)
    held = _model(operations)
    match = index.match(chain)
    got = {index.instance(s): n for s, n in match.lengths.items()}
    saved = block_index.FEW_HOLDERS
    try:
        for few in (0, len(INSTANCES)):  # the chain walked for all; each holder scanned
            block_index.FEW_HOLDERS = few
            assert index.match(chain) == match
    finally:
        block_index.FEW_HOLDERS = saved
    for inst, blocks in held.items():
        n = _held_prefix(blocks, chain)
        assert got.get(inst, 0) == n, inst
        assert index.prefix_length(chain, inst) == n
        slot = index.slot_of(inst)
        if n:
            assert slot is not None
            ssd = sum(1 for k in chain[:n] if blocks[k] == "ssd")
            assert match.ssd.get(slot, 0) == ssd
            runs = index.tier_runs(chain, 0, n, slot)
            assert [t for r in runs for t in [r.tier] * r.count] == [blocks[k] for k in chain[:n]]
    # Export and restore rebuild the same index, slot for slot.
    again = BlockIndex.restore(index.export())
    assert again.export() == index.export()
    assert {again.instance(s): n for s, n in again.match(chain).lengths.items()} == got


dram_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "evict", "clear"]),
        st.sampled_from(INSTANCES[:4] + INSTANCES[-4:]),
        st.lists(st.integers(0, 40), max_size=12),
        st.just("dram"),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(dram_ops, st.lists(st.integers(0, 40), min_size=0, max_size=15))
def test_match_scans_few_holders_as_it_walks_many(operations: list[Op], chain: list[int]) -> None:
    """Every block in DRAM: the chain walked once for all holders and each holder's
    own keys scanned give the same lengths, whatever the number of holders."""
    index = BlockIndex()
    _apply(index, operations)
    held = _model(operations)
    expected = {inst: n for inst, blocks in held.items() if (n := _held_prefix(blocks, chain))}
    saved = block_index.FEW_HOLDERS
    try:
        for few in (0, len(INSTANCES)):  # always walk; always scan
            block_index.FEW_HOLDERS = few
            match = index.match(chain)
            assert {index.instance(s): n for s, n in match.lengths.items()} == expected
            assert not match.ssd and not match.engine
    finally:
        block_index.FEW_HOLDERS = saved


def test_a_restored_index_keeps_each_slots_key_order_across_tiers() -> None:
    # Key 1 moves to SSD and keeps its place before key 2; once key 2 follows it
    # there, the restored index must list them as the original does.
    index = BlockIndex()
    index.store("a", [1, 2], "dram")
    index.store("a", [1], "ssd")
    again = BlockIndex.restore(index.export())
    for ix in (index, again):
        ix.move("a", [2], "ssd")
    assert again.export() == index.export() == [("a", [1, 2], [1, 2], [])]


def test_an_index_exported_per_tier_restores_with_its_tiers() -> None:
    # Snapshots written before the held order was exported list DRAM keys first.
    index = BlockIndex.restore([("", [], [], []), ("a", [3], [1], [2])])
    assert index.slot_of("a") == 1
    assert [index.tier_of(k, "a") for k in (1, 2, 3)] == ["ssd", "engine", "dram"]
    assert index.export() == [("", [], [], []), ("a", [3, 1, 2], [1], [2])]


def test_slots_are_reused_after_an_instance_is_emptied() -> None:
    index = BlockIndex()
    index.store("a", [1, 2], "dram")
    index.store("b", [1], "dram")
    assert (index.slot_of("a"), index.slot_of("b")) == (0, 1)
    index.evict("a", [1, 2])
    assert index.slot_of("a") is None
    index.store("c", [2], "dram")
    assert index.slot_of("c") == 0  # the lowest free slot, deterministically
    assert index.holders(1) == ["b"] and index.holders(2) == ["c"]
    assert len(index) == 2


def test_a_million_blocks_match_correctly() -> None:
    # How fast a match is on a production-sized index is measured, not asserted here:
    # benchmarks/conductor.py stores a million blocks (`--pool-blocks`) before timing
    # every decision (`decision_latency_p50_ms`, `decision_latency_p99_ms`).
    index = BlockIndex()
    # 64 instances, 16k blocks each of distinct chains, plus one shared hot chain.
    hot = list(range(10_000_000, 10_000_100))
    for i in range(64):
        index.store(f"kv-{i}", range(i * 16_000, (i + 1) * 16_000), "dram")
        index.store(f"kv-{i}", hot[: 10 + i], "dram")
    assert len(index) >= 1_024_000
    match = index.match(hot)
    assert len(match.lengths) == 64
    for i in range(64):
        assert match.lengths[index.slot_of(f"kv-{i}") or 0] == 10 + i
    # A chain that starts with blocks of one instance's own range matches only there.
    own = index.match([5 * 16_000, 5 * 16_000 + 1, 6 * 16_000])
    assert own.lengths == {index.slot_of("kv-5"): 2}


def test_gaps_and_new_epochs_void_the_instance_and_ask_for_an_inventory() -> None:
    s = ClusterState()
    s.apply(ev.InstanceUp(instance_id="kv", role="kvstore", host="h", time=1.0))
    s.apply(ev.BlockStored(instance_id="kv", epoch=1, event_id=1, block_hashes=[1, 2], tier="dram"))
    s.apply(ev.BlockStored(instance_id="kv", epoch=1, event_id=1, block_hashes=[9], tier="dram"))
    assert s.index.keys_of("kv") == {1, 2}  # a redelivery is ignored
    s.apply(ev.BlockEvicted(instance_id="kv", epoch=1, event_id=3, block_hashes=[2]))
    assert list(s.resync_wanted) == ["kv"]
    s.apply(ev.BlockInventory(instance_id="kv", epoch=1, event_id=3, dram=[1], ssd=[5]))
    assert not s.resync_wanted and s.index.keys_of("kv") == {1, 5}
    assert s.index.tier_of(5, "kv") == "ssd"
    # An instance that dies loses its blocks; when it reports again, it is asked.
    s.apply(ev.InstanceDown(instance_id="kv"))
    assert len(s.index) == 0
    s.apply(ev.LoadReport(instance_id="kv", role="kvstore", time=2.0))
    assert list(s.resync_wanted) == ["kv"]


def test_silent_instances_lose_their_blocks_by_event_time() -> None:
    s = ClusterState(ConductorConfig(heartbeat_timeout_s=5.0))
    s.apply(ev.InstanceUp(instance_id="kv", role="kvstore", host="h", time=1.0))
    s.apply(ev.InstanceUp(instance_id="p", role="prefill", host="h", time=1.0))
    s.apply(ev.BlockStored(instance_id="kv", epoch=1, event_id=1, block_hashes=[1], tier="dram"))
    s.apply(ev.LoadReport(instance_id="p", role="prefill", time=5.5))
    assert s.instances["kv"].alive
    s.apply(ev.LoadReport(instance_id="p", role="prefill", time=6.5))
    assert not s.instances["kv"].alive and s.instances["p"].alive
    assert len(s.index) == 0
    assert [i.instance_id for i in s.live("prefill")] == ["p"]
