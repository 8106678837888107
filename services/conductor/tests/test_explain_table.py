"""The explanation's decode table: the chosen instance, then the lowest predicted
TBT, `explain_decode_top_k` in all; every instance for logs recorded before it."""

from __future__ import annotations

from typing import Any

from yb_conductor.replay import recompute_decision, replay
from yb_conductor.settings import recorded_settings
from yb_core import events as ev


def _decode_table(d: ev.Decision) -> list[str]:
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    return [c.instance_id for c in d.explain.decode_candidates]


def _cluster(c: Any) -> None:
    c.kvstore("kv-0", "h0")
    c.prefill("p-0", "h0")
    for j in range(4):
        c.decode(f"d-{j}")


def test_the_table_lists_the_chosen_then_the_lowest_tbt(crafted: Any) -> None:
    c = crafted(explain_decode_top_k=2)
    _cluster(c)
    for n in range(3):  # d-0, d-1, d-2 each get one request: d-3 is the idle one
        c.admit(f"w{n}", [100 * n + 1], max_tokens=10_000)
    d = c.admit("r", [9001])
    assert isinstance(d, ev.RequestScheduled) and d.decode_instance == "d-3"
    table = _decode_table(d)
    assert table[0] == "d-3" and len(table) == 2
    assert d.explain is not None
    assert d.explain.decode_candidates[0].tbt_s <= d.explain.decode_candidates[1].tbt_s
    # `yb explain --full` lists every instance, in order.
    full = recompute_decision(c.records, "r", top_k=0)
    assert full is not None and _decode_table(full) == ["d-0", "d-1", "d-2", "d-3"]
    assert replay(c.records).divergences == []


def test_every_instance_without_the_setting(crafted: Any) -> None:
    c = crafted(explain_decode_top_k=0)
    _cluster(c)
    assert _decode_table(c.admit("r", [9001])) == ["d-0", "d-1", "d-2", "d-3"]
    assert recorded_settings('{"policy": "mooncake"}').explain_decode_top_k == 0
