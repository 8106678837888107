"""The baselines `yb sim` compares the conductor with, on crafted states (see conftest: 16-token
blocks, 1 ms per computed token, 0.5 ms per local block load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from yb_conductor.policy import PLACEMENT_POLICIES, placement_policy
from yb_conductor.replay import read_log, what_if
from yb_core import events as ev

FIXTURE = Path(__file__).parent / "fixtures" / "trace_log.jsonl"
BASELINES = [
    "least-loaded",
    "random",
    "round-robin",
    "local-prefix",
    "sglang-cache-aware",
    "dynamo-kv",
]
# The baselines that reuse what the chosen host holds (`least-loaded`, which balances
# load alone, is tested with the conductor itself).
HOST_LOCAL = BASELINES[1:]


def keys(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def _scheduled(d: ev.Decision) -> ev.RequestScheduled:
    assert isinstance(d, ev.RequestScheduled), d
    return d


def test_every_baseline_is_a_registered_placement_policy() -> None:
    assert set(PLACEMENT_POLICIES) == {"mooncake", *BASELINES}
    for name in BASELINES:
        assert placement_policy(name).name == name


@pytest.mark.parametrize("name", HOST_LOCAL)
def test_host_local_baselines_reuse_what_the_chosen_host_holds_and_refuse_only_empty_pools(
    crafted: Any, name: str
) -> None:
    c = crafted(policy=name)
    refused = c.admit("early", keys(4))
    assert isinstance(refused, ev.RequestRejected) and refused.reason.startswith("no_prefill")
    c.hosts(3, decodes=2)
    for i in range(3):
        c.store(f"kv-{i}", keys(6))  # every host holds the prefix: any choice reuses it
    d = _scheduled(c.admit("r", keys(8)))
    assert d.reused_blocks == 6 and d.computed_tokens == d.prompt_tokens - 6 * 16
    assert d.reuse[0].source_instance == "kv-" + d.prefill_instance.split("-")[1]
    assert d.estimates.transfer_s == pytest.approx(6 * 0.0005)
    assert d.policy == name


def test_round_robin_takes_turns_and_random_draws_by_seed(crafted: Any) -> None:
    c = crafted(policy="round-robin")
    c.hosts(3, decodes=2)
    picks = [_scheduled(c.admit(f"r{i}", keys(2, base=100 * i))) for i in range(4)]
    assert [p.prefill_instance for p in picks] == ["p-0", "p-1", "p-2", "p-0"]
    assert [p.decode_instance for p in picks] == ["d-0", "d-1", "d-0", "d-1"]

    def draws(seed: int) -> list[str]:
        r = crafted(policy="random", seed=seed)
        r.hosts(4)
        return [_scheduled(r.admit(f"r{i}", keys(2, base=100 * i))).prefill_instance
                for i in range(12)]  # fmt: skip

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)
    assert len(set(draws(0))) > 1


def test_local_prefix_goes_where_its_own_prefix_is_unless_the_queue_outweighs_it(
    crafted: Any,
) -> None:
    c = crafted(policy="local-prefix")
    c.hosts(3)
    c.store("kv-2", keys(8))
    first = _scheduled(c.admit("a", keys(10)))
    assert first.prefill_instance == "p-2" and first.reused_blocks == 8
    # p-2 is now busy for 0.004 + 0.033 s; the next request holds 8 blocks there too,
    # but a fresh instance computes its 161 tokens in 0.161 s, which is longer.
    second = _scheduled(c.admit("b", keys(10)))
    assert second.prefill_instance == "p-2"
    # A request with no prefix anywhere goes to an idle instance.
    third = _scheduled(c.admit("c", keys(10, base=9000)))
    assert third.prefill_instance == "p-0" and third.reused_blocks == 0


def test_sglang_follows_its_tree_above_the_threshold_and_the_queue_when_imbalanced(
    crafted: Any,
) -> None:
    c = crafted(policy="sglang-cache-aware")
    c.hosts(3)
    a = _scheduled(c.admit("a", keys(10)))
    assert a.prefill_instance == "p-0"  # no match: the smallest tree (all empty: by id)
    b = _scheduled(c.admit("b", keys(10, base=5000)))
    assert b.prefill_instance == "p-1"  # p-0's tree is no longer the smallest
    # 4 of 10 blocks match p-0's tree: 40% > 30%, so p-0 (the router never checks
    # the real cache, which holds nothing yet).
    d = _scheduled(c.admit("d", [*keys(4), *keys(6, base=7000)]))
    assert d.prefill_instance == "p-0" and d.reused_blocks == 0
    # 2 of 10 (20%) is below the threshold: the smallest tree, p-2.
    e = _scheduled(c.admit("e", [*keys(2), *keys(8, base=8000)]))
    assert e.prefill_instance == "p-2"
    # In flight now: p-0 2, p-1 1, p-2 1. With the default thresholds (a spread over
    # 64 and 1.5x) that is balanced: the full match on p-0 wins.
    f = _scheduled(c.admit("f", keys(10)))
    assert f.prefill_instance == "p-0"
    # With an absolute threshold of 1, a spread of 3 vs 1 (> 1 and > 1.5x) is an
    # imbalance: the shortest queue (first by id) takes it whatever the tree says.
    c.c.policy.balance_abs_threshold = 1
    g = _scheduled(c.admit("g", keys(10)))
    assert g.prefill_instance == "p-1"


def test_dynamo_scores_prefill_blocks_and_decode_blocks(crafted: Any) -> None:
    c = crafted(policy="dynamo-kv")
    c.hosts(2, decodes=2)
    c.store("kv-1", keys(6))
    # p-0 would prefill all 10 blocks, p-1 only 4 of them (6 cached): p-1.
    a = _scheduled(c.admit("a", keys(10), prompt=160))
    assert a.prefill_instance == "p-1" and a.reused_blocks == 6
    # Now p-1 has 64 tokens (4 blocks) in flight: 4 + 4 = 8 < 10 blocks on p-0.
    b = _scheduled(c.admit("b", keys(10), prompt=160))
    assert b.prefill_instance == "p-1"
    # A request without prefix: p-0 costs 10, p-1 10 + 8 in flight.
    e = _scheduled(c.admit("e", keys(10, base=4000), prompt=160))
    assert e.prefill_instance == "p-0"
    # Decode: the instance with fewer active blocks.
    assert {a.decode_instance, b.decode_instance} == {"d-0", "d-1"}


@pytest.mark.parametrize("name", ["sglang-cache-aware", "dynamo-kv", "local-prefix"])
def test_yb_replay_asks_what_if_of_a_baseline(name: str) -> None:
    records = read_log(FIXTURE)
    report = what_if(records, {"policy": name})
    assert report.what_if.decisions
    assert all(d.policy == name for d in report.what_if.decisions.values())
