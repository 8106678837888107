"""`yb sim` with tensor-parallel engine profiles: instances of a degree are timed by the
cost model at that degree, announce it, and the log they make replays exactly."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from yb_conductor.cost_model import (
    LLAMA2_70B_A800,
    TensorParallelCost,
)
from yb_conductor.replay import replay
from yb_core import events as ev
from yb_testkit.cost_models import ROUND_512
from yb_tools.cli import main as yb_main
from yb_tools.sim.coupled import CoupledSimulation
from yb_tools.sim.params import SimParams, lanes_at
from yb_tools.sim.runner import expand, simulate
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import workload_from
from yb_tools.traces import TraceRecord, read_trace

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
ROUND = ROUND_512


def _ups(sim: Simulation) -> dict[str, ev.InstanceUp]:
    assert sim.records is not None
    return {r.event.instance_id: r.event for r in sim.records if isinstance(r.event, ev.InstanceUp)}


def _records() -> list[TraceRecord]:
    return read_trace(str(TRACE), limit=300)


def test_instances_default_to_the_profiles_degree_and_lanes() -> None:
    params = SimParams(limit=50)
    items = workload_from([], block_size=512)
    sim = Simulation(items, params, LLAMA2_70B_A800, policy="mooncake", record_log=True)
    sim._start_cluster()
    ups = _ups(sim)
    assert (ups["prefill-0"].tensor_parallel, ups["prefill-0"].transfer_lanes) == (8, 8)
    assert (ups["decode-0"].tensor_parallel, ups["decode-0"].transfer_lanes) == (8, 8)
    assert ups["kvstore-0"].tensor_parallel == 1
    # At its own degree the profile times the instances unchanged.
    assert sim.prefill_cost is LLAMA2_70B_A800 and sim.decode_cost is LLAMA2_70B_A800
    assert params.devices(LLAMA2_70B_A800) == 128


def test_a_prompt_on_a_wider_instance_takes_its_share_of_the_time() -> None:
    trace = [TraceRecord(timestamp=0, input_length=1124, output_length=3, hash_ids=[1, 2, 3])]
    items = workload_from(trace, block_size=512)
    ttfts = {}
    for tp in (1, 2, 4):
        params = SimParams(prefill=1, decode=1, block_size=512, max_tokens=0, prefill_tp=tp)
        sim = Simulation(items, params, ROUND, policy="mooncake", admission="none")
        sim.run()
        ttfts[tp] = sim.jobs[0].ttft_s
    assert ttfts == pytest.approx({1: 1.124, 2: 0.562, 4: 0.281})


def test_a_tensor_parallel_run_announces_its_degrees_and_replays_exactly() -> None:
    params = SimParams(prefill=4, prefill_tp=4, decode=4, decode_tp=4, limit=300, speedup=2.0)
    items = workload_from(
        [r for i, r in enumerate(_records()) if i < params.limit], block_size=512, speedup=2.0
    )
    sim = Simulation(items, params, LLAMA2_70B_A800, policy="mooncake", record_log=True)
    result = sim.run()
    assert result.completed > 0
    ups = _ups(sim)
    assert (ups["prefill-3"].tensor_parallel, ups["prefill-3"].transfer_lanes) == (4, 4)
    assert (ups["decode-3"].tensor_parallel, ups["decode-3"].transfer_lanes) == (4, 4)
    # The KV room of four A800s beside LLaMA2-70B's weights, in 512-token blocks.
    assert ups["decode-0"].kv_capacity_blocks == 444_788 // 512
    # A host pool is its share of an 8-device host's.
    assert sim.kvstores[0].capacity == params.pool_tokens // 2 // 512
    assert sim.records is not None
    assert replay(sim.records).divergences == []


def test_the_report_says_what_the_cluster_spans() -> None:
    params = SimParams(prefill=2, prefill_tp=8, decode=4, decode_tp=2, limit=40)
    report = simulate(TRACE, expand(["mooncake"], ["predicted"]), params)
    assert (report.prefill_tp, report.decode_tp, report.devices) == (8, 2, 24)


def test_weights_that_leave_no_kv_room_are_refused() -> None:
    params = SimParams(decode_tp=1, limit=10)
    with pytest.raises(ValueError, match="weights do not fit"):
        Simulation([], params, LLAMA2_70B_A800, policy="mooncake")


def test_the_coupled_baseline_runs_one_degree() -> None:
    with pytest.raises(ValueError, match="one degree"):
        CoupledSimulation([], SimParams(prefill_tp=8, decode_tp=4), LLAMA2_70B_A800)
    coupled = CoupledSimulation([], SimParams(prefill_tp=4, decode_tp=4), LLAMA2_70B_A800)
    assert coupled.cost.tensor_parallel.degree == 4
    assert coupled.kv_capacity == 444_788


def test_lanes_follow_the_profiles_lanes_per_device() -> None:
    assert lanes_at(LLAMA2_70B_A800, 4) == 4
    assert lanes_at(ROUND, 2) == 2
    half = msgspec.structs.replace(
        ROUND, tensor_parallel=TensorParallelCost(degree=4, transfer_lanes=2)
    )
    assert lanes_at(half, 2) == 1 and lanes_at(half, 1) == 1


def test_the_flags_set_the_degrees(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = [
        "sim", "--trace", str(TRACE), "--limit", "40", "--prefill", "2", "--prefill-tp", "8",
        "--decode", "2", "--decode-tp", "4", "--json", str(out), "--no-plots", "--quiet",
    ]  # fmt: skip
    assert yb_main(argv) == 0
    figures = msgspec.json.decode(out.read_bytes())
    assert (figures["prefill_tp"], figures["decode_tp"], figures["devices"]) == (8, 4, 24)
    assert figures["params"]["decode_tp"] == 4
    assert yb_main(["sim", "--matrix", "--decode-tp", "4", "--quiet"]) == 2
    assert yb_main([*argv, "--prefill-tp", "-1"]) == 2
