"""The `coupled` policy (the paper's vLLM baseline) and the capacity search, on small
traces with round-number cost models (never timing)."""

from __future__ import annotations

import msgspec
import pytest

from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost
from yb_tools.sim.capacity import CAPACITY_ATTAINMENT, run_capacity
from yb_tools.sim.coupled import CoupledSimulation
from yb_tools.sim.params import SimParams
from yb_tools.sim.runner import RunSpec, expand, simulate
from yb_tools.sim.workload import workload_from
from yb_tools.traces import TraceRecord

# Prefill: 1 ms per computed token; decode: 10 ms per step whatever the batch.
ROUND = CostModel(
    name="round",
    kv_bytes_per_token=1000,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.0, per_context_token_s=0.0),
    block_size=128,
)
# The same with a tenth of the prefill: a block's chunk fits in a step within the SLO.
LIGHT = msgspec.structs.replace(
    ROUND, name="light", prefill=PrefillCost(base_s=0.0, per_token_s=0.0001, per_pair_s=0.0)
)


def _params(**kw: object) -> SimParams:
    base: dict[str, object] = {
        "prefill": 1, "decode": 1, "block_size": 128, "ttft_slo_s": 2.0, "tbt_slo_s": 0.05,
        "decode_kv_tokens": 100_000, "max_tokens": 0, "report_interval_s": 0.0,
        "sample_interval_s": 0.0,
    }  # fmt: skip
    base.update(kw)
    return SimParams(**base)  # type: ignore[arg-type]


def _trace(n: int, gap_ms: int = 100) -> list[TraceRecord]:
    return [
        TraceRecord(
            timestamp=i * gap_ms,
            input_length=384,
            output_length=20,
            hash_ids=[i * 10, i * 10 + 1, i * 10 + 2],
        )
        for i in range(n)
    ]


def test_coupled_serves_every_request() -> None:
    items = workload_from(_trace(40), block_size=128)
    result = CoupledSimulation(items, _params(), ROUND).run()
    assert result.completed == result.requests == 40
    assert result.rejected == 0 and result.timed_out == 0


def test_ttft_holds_the_piggybacked_chunks() -> None:
    """r0 (384 tokens) runs whole on the idle instance: first token at 0.384 s.
    r1 (384 tokens) arrives at 0.1 into r0's prefill and on 2 instances goes to the
    idle one; on one instance it waits for r0's step, then rides r0's decode steps in
    chunks: each step is 10 ms of decode plus at most 40 ms of chunk (40 tokens, the
    TBT SLO 50 ms), but the first chunk of a step is at least a block (128 tokens,
    128 ms). So r1 takes 3 steps of 138 ms: TTFT = 0.384 + 0.414 - 0.1 = 0.698 s."""
    trace = [
        TraceRecord(timestamp=0, input_length=384, output_length=20, hash_ids=[1, 2, 3]),
        TraceRecord(timestamp=100, input_length=384, output_length=2, hash_ids=[4, 5, 6]),
    ]
    items = workload_from(trace, block_size=128)
    sim = CoupledSimulation(items, _params(prefill=1, decode=1, decode_kv_tokens=100_000), ROUND)
    # Both instances: r1 goes to the idle one and prefills alone.
    sim.run()
    assert sim.jobs[1].ttft_s == pytest.approx(0.384)
    one = CoupledSimulation(items, _params(decode=0), ROUND)  # one instance
    one.run()
    r0, r1 = one.jobs
    assert r0.ttft_s == pytest.approx(0.384)
    assert r1.ttft_s == pytest.approx(0.698)
    # r0's tokens during r1's chunks came every 138 ms, the rest every 10 ms.
    assert r0.tbt_s == pytest.approx((3 * 0.138 + 16 * 0.010) / 19)


def test_prefix_routing_and_reuse() -> None:
    """r1 arrives while r0 prefills on the first instance: it goes to the idle second.
    r2, later, shares r1's prefix: it goes to r1's instance, though every instance is
    idle then, and computes only its last block."""
    trace = [
        TraceRecord(timestamp=0, input_length=384, output_length=2, hash_ids=[1]),
        TraceRecord(timestamp=100, input_length=384, output_length=2, hash_ids=[9]),
        TraceRecord(timestamp=10000, input_length=384, output_length=2, hash_ids=[9]),
    ]
    items = workload_from(trace, block_size=128)
    sim = CoupledSimulation(items, _params(), ROUND)
    sim.run()
    r0, r1, r2 = sim.jobs
    assert (r0.prefill, r1.prefill, r2.prefill) == (0, 1, 1)
    assert r2.reused_local == 2
    assert r2.ttft_s == pytest.approx(0.128)


def test_more_load_lowers_goodput_share() -> None:
    records = _trace(200, gap_ms=200)
    spec = expand(["coupled"], [])
    shares = [
        simulate("t", spec, _params(speedup=s), records=records, cost=LIGHT)
        .policies["coupled"]
        .slo_attainment
        for s in (1.0, 4.0, 16.0)
    ]
    assert shares[0] == pytest.approx(1.0)
    assert shares[0] >= shares[1] >= shares[2]
    assert shares[2] < CAPACITY_ATTAINMENT


def test_capacity_search_brackets_the_target() -> None:
    records = _trace(200, gap_ms=200)
    spec = [RunSpec("coupled", "coupled", "none")]
    report = run_capacity(
        "t", records, spec, _params(), cost=LIGHT, min_speedup=0.5, max_speedup=64.0,
        iterations=6,
    )  # fmt: skip
    r = report.policies["coupled"]
    assert not r.capped and 0.5 <= r.speedup < r.next_speedup <= 64.0
    assert r.slo_attainment >= CAPACITY_ATTAINMENT
    # The runs: every speedup that held is below every one that did not.
    held = [p.speedup for p in r.runs if p.slo_attainment >= CAPACITY_ATTAINMENT]
    failed = [p.speedup for p in r.runs if p.slo_attainment < CAPACITY_ATTAINMENT]
    assert max(held) == r.speedup and min(failed) == r.next_speedup
    assert r.next_speedup / r.speedup == pytest.approx(128.0 ** (1 / 64))
    # The rate is the requests over their arrival span at that speedup.
    assert r.capacity_rps == pytest.approx(200 / (199 * 0.2 / r.speedup))
    # Re-run just above: it does not hold.
    over = simulate("t", spec, _params(speedup=r.next_speedup), records=records, cost=LIGHT)
    assert over.policies["coupled"].slo_attainment < CAPACITY_ATTAINMENT


def test_coupled_refuses_an_event_log() -> None:
    with pytest.raises(ValueError, match="no event log"):
        simulate(
            "t", expand(["coupled"], []), _params(), records=_trace(2), cost=ROUND, log_dir="x"
        )
