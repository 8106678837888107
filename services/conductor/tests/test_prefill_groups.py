"""Prefill groups (chunked pipeline parallelism): the pipeline's cost, and how the
conductor weighs a group against whole-model instances.

The crafted cluster's cost model prefills 1 ms a token with no fixed or attention
cost, so a chunk's time is its length in ms; a hand-off costs nothing unless the
model says how large a hidden state is.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from conftest import ROUND

from yb_conductor.cost_model import PrefillCost
from yb_conductor.replay import replay
from yb_core import events as ev
from yb_tools.cli.explain import render


def keys(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


# --- the pipeline's cost ----------------------------------------------------------------


def test_one_stage_in_one_chunk_is_the_plain_prefill() -> None:
    cost = msgspec.structs.replace(
        ROUND, prefill=PrefillCost(base_s=0.02, per_token_s=0.001, per_pair_s=1e-6)
    )
    assert cost.pipeline_prefill_s(1000, 300, [1.0], 0) == pytest.approx(cost.prefill_s(1000, 300))


def test_equal_stages_fill_then_advance_a_chunk_per_stage_time() -> None:
    # 8 chunks of 100 tokens (0.1 s of the whole model each) over 2 equal stages:
    # the first chunk takes 0.05 s on each stage, then one 0.05 s per chunk.
    assert ROUND.pipeline_prefill_s(800, 0, [0.5, 0.5], 100) == pytest.approx(0.05 * 9)
    # Over 4 stages: 3 stage-times of fill, then 8.
    assert ROUND.pipeline_prefill_s(800, 0, [0.25] * 4, 100) == pytest.approx(0.025 * 11)
    # A last partial chunk takes its own length.
    assert ROUND.pipeline_prefill_s(850, 0, [0.5, 0.5], 100) == pytest.approx(0.05 * 9 + 0.025)


def test_the_slowest_stage_sets_the_pace_and_hand_offs_add_up() -> None:
    # Shares 0.25 and 0.75: the second stage is the bottleneck, 0.075 s a chunk.
    assert ROUND.pipeline_prefill_s(400, 0, [0.25, 0.75], 100) == pytest.approx(0.025 + 4 * 0.075)
    # 100 tokens x 1 MB of hidden state at the remote bandwidth (1 MiB per ms here).
    heavy = msgspec.structs.replace(ROUND, hidden_bytes_per_token=10_000)
    handoff = heavy.handoff_s(100)
    assert handoff == pytest.approx(1e6 / (ROUND.transfer.dram_remote_gbps * 1e9))
    assert heavy.pipeline_prefill_s(400, 0, [0.5, 0.5], 100) == pytest.approx(
        0.05 + handoff + 4 * 0.05
    )
    assert heavy.min_version() == 2


# --- the conductor ----------------------------------------------------------------------


def stage(c: Any, name: str, host: str, span: tuple[int, int], group: str = "g0") -> None:
    c.feed(
        ev.InstanceUp(
            instance_id=name,
            role="prefill",
            host=host,
            max_batch_size=1,
            group=group,
            layer_start=span[0],
            layer_end=span[1],
            num_layers=8,
            chunk_tokens=64,
        )
    )


def grouped(crafted: Any, **settings: Any) -> Any:
    """Hosts h0 (p-0) and h1, h2 (a group of two stages, s-a then s-b), a kvstore on
    each host, one decode instance."""
    c = crafted(**settings)
    c.hosts(1)
    c.kvstore("kv-1", "h1")
    c.kvstore("kv-2", "h2")
    stage(c, "s-b", "h2", (4, 8))  # out of order: layer order decides the lead
    stage(c, "s-a", "h1", (0, 4))
    return c


def test_a_long_prompt_goes_to_the_group_a_short_one_stays_whole(crafted: Any) -> None:
    c = grouped(crafted)
    # 40 blocks (641 tokens): 0.641 s alone, about half over two stages.
    long = c.admit("long", keys(40))
    assert isinstance(long, ev.RequestScheduled) and long.explain is not None
    assert long.prefill_instance == "s-a" and long.prefill_stages == ["s-a", "s-b"]
    assert long.estimates.prefill_s == pytest.approx(
        ROUND.pipeline_prefill_s(641, 0, [0.5, 0.5], 64)
    )
    assert long.estimates.prefill_s < 0.641 * 0.6
    assert "prefill group over 2 stages: s-a, s-b" in long.explain.reason
    rows = {cand.instance_id: cand for cand in long.explain.candidates}
    assert rows["s-a"].stages == 2 and rows["p-0"].stages == 0
    assert "s-b" not in rows  # a stage that does not lead is no candidate of its own
    # One chunk (a 3-block prompt): the pipeline only adds; but the group is busy now.
    short = c.admit("short", keys(3, base=9000))
    assert isinstance(short, ev.RequestScheduled)
    assert short.prefill_instance == "p-0" and short.prefill_stages == []
    assert replay(c.records).divergences == []


def test_the_group_reuses_what_its_lead_host_holds(crafted: Any) -> None:
    c = grouped(crafted)
    c.store("kv-1", keys(30))  # the lead's host
    d = c.admit("r", keys(40))
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    assert d.prefill_instance == "s-a" and d.explain.branch == "local"
    assert d.reused_blocks == 30
    # Each stage loads half of each block: s-a from its own host, s-b over the network.
    row = d.explain.candidates[0]
    assert row.transfer_s == pytest.approx(30 * 0.001 * 0.5)  # remote: 1 ms a block
    assert d.reuse == [
        ev.ReusePlan(source_instance="kv-1", tier="dram", first_block=0, num_blocks=30)
    ]
    assert replay(c.records).divergences == []


def test_a_group_missing_a_stage_is_no_candidate_and_a_dead_stage_ends_its_work(
    crafted: Any,
) -> None:
    c = crafted()
    c.hosts(1)
    stage(c, "s-a", "h1", (0, 4))
    alone = c.admit("alone", keys(40))
    assert isinstance(alone, ev.RequestScheduled) and alone.prefill_instance == "p-0"
    stage(c, "s-b", "h2", (4, 8))
    on_group = c.admit("grouped", keys(40, base=5000))
    assert isinstance(on_group, ev.RequestScheduled) and on_group.prefill_instance == "s-a"
    # The second stage dies: the request queued at the lead is orphaned, and the
    # group is no candidate until a stage covers its layers again.
    c.feed(ev.InstanceDown(instance_id="s-b", reason="killed"))
    assert "grouped" in c.c.state.cancel_wanted
    after = c.admit("after", keys(40, base=7000))
    assert isinstance(after, ev.RequestScheduled) and after.prefill_instance == "p-0"
    stage(c, "s-c", "h3", (4, 8))
    back = c.admit("back", keys(40, base=8000))
    assert isinstance(back, ev.RequestScheduled) and back.prefill_stages == ["s-a", "s-c"]
    assert replay(c.records).divergences == []


def test_stages_that_leave_a_gap_form_no_group(crafted: Any) -> None:
    c = crafted()
    c.hosts(1)
    stage(c, "s-a", "h1", (0, 3))
    stage(c, "s-b", "h2", (4, 8))
    d = c.admit("r", keys(40))
    assert isinstance(d, ev.RequestScheduled) and d.prefill_instance == "p-0"
    assert c.c.state.group_leads() == []


def test_explain_shows_the_stages(crafted: Any) -> None:
    c = grouped(crafted)
    d = c.admit("long", keys(40))
    assert isinstance(d, ev.RequestScheduled)
    text = render(42, d)
    assert "prefill group: 2 pipeline stages, s-a -> s-b" in text
    header = next(line for line in text.splitlines() if "option" in line)
    assert header.rstrip().endswith("stages")
    row = next(line for line in text.splitlines() if line.startswith("* s-a"))
    assert row.rstrip().endswith(" 2")
