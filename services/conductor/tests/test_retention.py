"""Retention advice: what the conductor tells a kvstore to keep and to let go first,
as decisions in the log that replay exactly, and absent from logs recorded before."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest
from conftest import BS, Crafted

from yb_conductor import snapshot
from yb_conductor.conductor import Conductor
from yb_conductor.replay import LogRecord, NondeterminismError, replay
from yb_conductor.retention import BlockUses, Retention
from yb_conductor.settings import configured_event
from yb_core import events as ev
from yb_core.config import ConductorConfig

SHARED = [101, 102, 103, 104]


def advice(outputs: Sequence[ev.AnyEvent]) -> list[ev.RetentionPlanned]:
    return [o for o in outputs if isinstance(o, ev.RetentionPlanned)]


def beat(c: Crafted, hosts: int = 1) -> None:
    """Heartbeats of every instance `Crafted.hosts` made, at the current time."""
    for i in range(hosts):
        c.feed(ev.LoadReport(instance_id=f"p-{i}", role="prefill"))
        c.feed(ev.LoadReport(instance_id=f"kv-{i}", role="kvstore"))
    c.feed(ev.LoadReport(instance_id="d-0", role="decode"))


def shared_prefix_log(c: Crafted, requests: int) -> list[ev.RetentionPlanned]:
    """`requests` requests 10 s apart, each the shared 4-block prefix and 2 blocks of
    its own, placed on one host; the advice each one brought."""
    c.hosts(1)
    out = []
    for i in range(requests):
        c.at(10.0 + 10.0 * i)
        beat(c)
        tail = [1000 + 2 * i, 1001 + 2 * i]
        outputs = c.feed(
            ev.RequestAdmitted(
                request_id=f"r{i}",
                gateway_id="g",
                model="",
                block_size=BS,
                block_hashes=SHARED + tail,
                prompt_tokens=6 * BS,
                max_tokens=4,
            )
        )
        assert any(isinstance(o, ev.RequestScheduled) for o in outputs)
        out += advice(outputs)
        c.store("kv-0", SHARED + tail)
    return out


def test_shared_prefix_is_kept_and_unique_tails_dropped(crafted: type[Crafted]) -> None:
    c = crafted(retention=True)
    plans = shared_prefix_log(c, 16)
    assert len(plans) == 16
    assert all(p.instance_id == "kv-0" for p in plans)
    first = plans[0]
    # Nothing learnt yet (a class is reused half the time, no gap known): the whole
    # chain is advised at interval 0, which is plain LRU.
    assert first.drop == [] and first.reuse_s == [0.0] * 6
    # The head's count grows by one a request up to 8, so until then each tail is of
    # a class never seen: kept.
    assert all(p.drop == [] for p in plans[:8])
    last = plans[-1]
    # From the 9th on, the tails after a head used 8 times or more are of a class
    # whose uses were never followed by another: dropped first. The shared prefix is a
    # class whose every use was followed by another: interval 0, plain LRU among such
    # blocks.
    assert last.drop == [1030, 1031]
    assert last.reuse == SHARED
    assert last.reuse_s == [0.0] * 4
    assert "drop 2 block(s)" in last.reason
    # The class of a block is its uses and its head's, each counted up to 8.
    assert c.c.retention.blocks[SHARED[0]].cls == c.c.retention.blocks[SHARED[3]].cls
    assert c.c.retention.blocks[1030].cls != c.c.retention.blocks[SHARED[0]].cls
    assert replay(c.records).divergences == []


def test_version_3_drops_new_blocks_by_the_share_of_all_new_blocks(
    crafted: type[Crafted],
) -> None:
    # How a log recorded before behaviour version 4 decides (and replays).
    c = crafted(retention=True, retention_by_class=False, retention_drop_below=0.5)
    plans = shared_prefix_log(c, 8)
    first = plans[0]
    assert first.drop == [] and first.reuse_s == [0.0] * 6
    last = plans[-1]
    # Seven tails were never asked for again: new blocks are dropped first, the shared
    # prefix is predicted every 10 s, the gap between its uses.
    assert last.drop == last.reuse[4:] + last.drop[-2:] and last.drop[-2:] == [1014, 1015]
    assert last.reuse == SHARED
    assert last.reuse_s == [10.0] * 4
    assert "drop 2 block(s)" in last.reason
    # Every advice is a logged decision that replays as it was made.
    result = replay(c.records)
    assert result.divergences == []


def test_a_chain_is_never_worth_less_than_its_tail(crafted: type[Crafted]) -> None:
    c = crafted(retention=True, retention_drop_below=0.0)
    c.hosts(1)
    plans = []
    # The head alone, 90 s apart; then head and block 8 twice, 1 s apart.
    for i, (t, chain) in enumerate(((10.0, [7]), (100.0, [7]), (101.0, [7, 8]), (102.0, [7, 8]))):
        c.at(t)
        beat(c)
        plans += advice(c.feed(_admission(f"r{i}", chain)))
    # The head's own mean gap is 90, then 90 + 0.3 * (1 - 90), then that + 0.3 * (1 -
    # that): about 44.6 s; block 8's is 1 s. Neither class has a history (reused half
    # the time: log-odds 0), so each counts half its gap older: the head 22.3 s, block
    # 8 0.5 s. A block without its head is worthless, so the head is advised at 0.5 s.
    assert c.c.retention.blocks[7].gap == pytest.approx(44.61, abs=0.01)
    assert plans[-1].reuse == [7, 8]
    assert plans[-1].reuse_s == [0.5, 0.5]
    assert replay(c.records).divergences == []


def test_a_chain_that_repeats_a_block_is_advised(crafted: type[Crafted]) -> None:
    # Traces may name one block twice in a prompt: each time it is no reuse of its
    # class, and no share may reach 1 (its log-odds would be undefined).
    c = crafted(retention=True)
    c.hosts(1)
    chain = [5, 6, 5, 6, 5, 7]
    for i in range(30):
        c.at(10.0 + i)
        beat(c)
        plans = advice(c.feed(_admission(f"r{i}", chain)))
        assert plans and all(s >= 0.0 for p in plans for s in p.reuse_s)
    retention = c.c.retention
    for cls, uses in retention.class_uses.items():
        assert retention.class_reused.get(cls, 0) <= uses
    assert retention.class_share(retention.blocks[5]) < 1.0
    assert replay(c.records).divergences == []


def test_a_class_halved_while_its_uses_were_pending_stays_below_one() -> None:
    # After a class's counts are halved, uses counted before may still be followed by
    # another: more reuses than uses. Its share stays below 1, its interval defined.
    retention = Retention(class_uses={10: 5}, class_reused={10: 9}, class_gap={10: 4.0})
    seen = BlockUses(uses=1, last=0.0, cls=10)
    assert retention.class_share(seen) == 6 / 7
    assert retention.class_interval(seen) == 0.0  # reused more than 62% of the time


def test_a_copy_pulled_from_another_kvstore_is_demoted(crafted: type[Crafted]) -> None:
    c = crafted(retention=True, prefix_stickiness=0.0)
    c.hosts(2)
    chain = list(range(200, 210))
    c.store("kv-0", chain)
    # p-0 is busy for a long time: the request goes to p-1, which pulls from kv-0.
    c.admit("busy", list(range(900, 960)))
    d = c.admit("r", chain)
    assert isinstance(d, ev.RequestScheduled) and d.prefill_instance == "p-1"
    assert d.reuse and d.reuse[0].source_instance == "kv-0"
    plans = {p.instance_id: p for p in advice([r.event for r in c.records if r.seq > 0])}
    pulled = d.reuse[0].num_blocks
    assert plans["kv-1"].demote == chain[:pulled]
    # kv-0 keeps what the request will read from it until it is read.
    assert plans["kv-0"].needed == chain[:pulled] and plans["kv-0"].needed_s > 0
    assert not (plans["kv-0"].reuse or plans["kv-0"].demote or plans["kv-0"].drop)
    assert replay(c.records).divergences == []


def test_off_by_setting_and_in_logs_recorded_before_it(crafted: type[Crafted]) -> None:
    c = crafted(retention=False)
    assert shared_prefix_log(c, 4) == []
    # A log whose settings do not name `retention` was recorded before it existed: it
    # replays without advice.
    old = ConductorConfig()
    raw = msgspec.json.decode(configured_event(old, Crafted.ROUND, "old").settings_json)
    del raw["retention"]
    records = [
        LogRecord(
            seq=1,
            event=ev.ConductorConfigured(
                instance_id="old",
                settings_json=msgspec.json.encode(raw).decode(),
                cost_model_json=msgspec.json.encode(Crafted.ROUND).decode(),
            ),
        ),
        *c.records[1:],
    ]
    conductor = Conductor()
    produced = []
    for record in records:
        produced += advice(conductor.apply(record.seq, record.event))
    assert not conductor.cfg.retention
    assert produced == []
    assert conductor.divergences == []


def test_a_recorded_advice_that_differs_is_a_divergence(crafted: type[Crafted]) -> None:
    c = crafted(retention=True)
    shared_prefix_log(c, 4)
    records = list(c.records)
    at = next(i for i, r in enumerate(records) if isinstance(r.event, ev.RetentionPlanned))
    recorded = records[at].event
    assert isinstance(recorded, ev.RetentionPlanned)
    changed = msgspec.structs.replace(recorded, drop=[*recorded.drop, 1])
    records[at] = LogRecord(seq=records[at].seq, event=changed)
    with pytest.raises(NondeterminismError) as caught:
        replay(records)
    assert caught.value.seq == records[at].seq
    assert caught.value.recorded == changed
    assert caught.value.recomputed == recorded


def _admission(rid: str, chain: list[int]) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        request_id=rid,
        gateway_id="g",
        model="",
        block_size=BS,
        block_hashes=chain,
        prompt_tokens=len(chain) * BS,
        max_tokens=4,
    )


def test_a_snapshot_midway_keeps_what_retention_learnt(crafted: type[Crafted]) -> None:
    c = crafted(retention=True)
    shared_prefix_log(c, 8)
    records = c.records
    half = len(records) // 2
    head = Conductor()
    for r in records[:half]:
        head.apply(r.seq, r.event)
    tail = snapshot.restore(snapshot.decode(snapshot.encode(snapshot.take(head))))
    whole = Conductor()
    tail_advice, whole_advice = [], []
    for r in records:
        whole_advice += advice(whole.apply(r.seq, r.event))
        if r.seq > records[half - 1].seq:
            tail_advice += advice(tail.apply(r.seq, r.event))
    assert tail_advice and tail_advice == whole_advice[-len(tail_advice) :]
    assert tail.divergences == whole.divergences == []
    assert tail.retention == whole.retention
