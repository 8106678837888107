"""Prompts prefilled inside a simulated decode instance's batch, checked by hand, and
`yb sim --piggyback` on a slice of the synthetic trace.

The hand-checked cost model: prefill 1 ms a token, a decode step 10 ms + 1 ms a
sequence, so with a 50 ms TBT SLO a step beside one stream has 39 ms for a chunk.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost
from yb_conductor.replay import replay
from yb_core import events as ev
from yb_tools.cli import main as yb_main
from yb_tools.sim.decode import SimDecode
from yb_tools.sim.job import Job
from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import resolve_cost
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem, load_workload

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
COST = CostModel(
    name="hand",
    kv_bytes_per_token=1,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.001, per_context_token_s=0.0),
)


def job(index: int, prompt: int, output: int) -> Job:
    return Job(TraceItem(index, f"r{index}", 0.0, prompt, output, []))


def step_through(d: SimDecode, until: float) -> list[tuple[float, list[Job], list[Job]]]:
    """Wake the instance at each boundary up to `until`: (time, started, prompted)."""
    seen = []
    while (t := d.next_wake()) <= until:
        _, _, started, prompted, _ = d.wake(t)
        seen.append((t, started, prompted))
    return seen


def test_a_prompt_is_computed_in_chunks_that_keep_each_step_within_the_slo() -> None:
    d = SimDecode(
        "d", COST, kv_capacity=10**6, max_batch=8, tbt_slo_s=0.05, enforce_slo=False,
        block_size=16,
    )  # fmt: skip
    stream = job(0, prompt=10, output=1000)
    d.admit(stream, 0.0)  # alone: an 11 ms step
    prompt = job(1, prompt=100, output=3)
    d.add_prompt(prompt, ready_at=0.005, cached_tokens=0)
    seen = step_through(d, 0.15)
    # Starts at the first boundary after it is ready (11 ms), then chunks of 39, 39
    # and 22 tokens beside the stream: steps of 50, 50 and 33 ms.
    started_at = next(t for t, started, _ in seen if started)
    assert started_at == pytest.approx(0.011)
    first_token = next(t for t, _, prompted in seen if prompted)
    assert first_token == pytest.approx(0.011 + 0.050 + 0.050 + 0.033)
    # Every step kept within the SLO, and the stream got a token from each.
    times = [0.0] + [t for t, _, _ in seen]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 0.05 + 1e-12
    assert seen[-1][0] == first_token and d.steps == 4
    # The prompt joined the batch at its first token: two sequences decode now.
    assert d.batch == 2 and prompt.join_time == pytest.approx(first_token)
    assert d.step_s() == pytest.approx(0.012)


def test_prompts_queue_one_at_a_time_and_an_idle_instance_runs_them_at_once() -> None:
    d = SimDecode(
        "d", COST, kv_capacity=10**6, max_batch=8, tbt_slo_s=0.05, enforce_slo=False,
        block_size=16,
    )  # fmt: skip
    a, b = job(0, prompt=40, output=1), job(1, prompt=30, output=1)
    d.add_prompt(a, ready_at=0.002, cached_tokens=0)
    d.add_prompt(b, ready_at=0.001, cached_tokens=0)
    seen = step_through(d, 1.0)
    firsts = {j.item.request_id: t for t, _, prompted in seen for j in prompted}
    # No stream: each step is its chunk alone (up to 50 tokens), in order.
    assert firsts == pytest.approx({"r0": 0.002 + 0.040, "r1": 0.002 + 0.040 + 0.030})
    # One token each: they finished at their first token and freed their KV.
    assert d.batch == 0 and d.held_pages + d.batch_pages == 0


def _cli(argv: list[str]) -> int:
    """`yb sim ARGV`, in this process: its exit status."""
    return yb_main(["sim", *argv])


def test_the_conductor_piggybacks_short_prompts_and_the_log_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = [
        "--trace", str(TRACE), "--policy", "mooncake", "--prefill", "2", "--decode", "2",
        "--limit", "300", "--json", str(out), "--quiet", "--no-plots", "--piggyback",
    ]  # fmt: skip
    assert _cli(argv) == 0
    (run,) = json.loads(out.read_text())["policies"].values()
    assert run["piggyback_requests"] > 0
    assert run["piggyback_prompt_p50"] < run["whole_prompt_p50"]
    assert run["tbt_p99_s"] <= 0.1  # the streams kept the TBT SLO
    assert "| mooncake | decode batches |" in capsys.readouterr().out
    params = SimParams(prefill=2, decode=2, limit=300, piggyback=True)
    cost = resolve_cost(params)
    items = load_workload(TRACE, block_size=512, speedup=1.0, limit=300)
    sim = Simulation(items, params, cost, policy="mooncake", record_log=True)
    sim.run()
    assert sim.records is not None
    assert replay(sim.records).divergences == []


def test_a_piggybacked_prompts_blocks_go_into_its_hosts_pool_for_later_requests() -> None:
    # Two long prompts keep both prefill instances busy for seconds; a short prompt
    # then goes into a decode batch, and the same prompt after it has ended reuses
    # its block from the pool on that decode instance's host.
    bs = 512
    long_keys = [[1000 * i + k for k in range(32)] for i in (1, 2)]
    short_keys = [7, 8]
    items = [
        TraceItem(0, "long-0", 0.0, 32 * bs, 4, long_keys[0]),
        TraceItem(1, "long-1", 0.0, 32 * bs, 4, long_keys[1]),
        TraceItem(2, "short-0", 0.1, bs + 100, 2, short_keys),
        TraceItem(3, "short-1", 1.0, bs + 100, 2, short_keys),
    ]
    params = SimParams(prefill=2, decode=2, piggyback=True, block_size=bs)
    sim = Simulation(items, params, resolve_cost(params), policy="mooncake", record_log=True)
    sim.run()
    assert sim.records is not None
    decisions = {
        r.event.request_id: r.event for r in sim.records if isinstance(r.event, ev.RequestScheduled)
    }
    first, again = decisions["short-0"], decisions["short-1"]
    assert first.piggyback and first.reused_blocks == 0, first
    pool = sim.decode_pools[sim.decode_index[first.decode_instance]]
    assert pool is not None
    # Its one full block went into that pool when its prefill ended, logged as any
    # stored block is.
    (done,) = [j for j in sim.jobs if j.item.request_id == "short-0"]
    stored = [
        r.event
        for r in sim.records
        if isinstance(r.event, ev.BlockStored) and short_keys[0] in r.event.block_hashes
    ]
    assert [(e.instance_id, e.time) for e in stored] == [(pool.instance_id, done.prefill_end)]
    # The conductor plans the later request to reuse it from there.
    assert again.reused_blocks == 1, again
    assert {plan.source_instance for plan in again.reuse} == {pool.instance_id}
    assert replay(sim.records).divergences == []
