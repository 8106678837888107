"""Tensor-parallel instances: the cost model at another degree and over other lanes
(`CostModel.at_degree`), the conductor pricing each instance at the degree it
announced, and logs from before the fields replaying as they did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import ROUND

from yb_conductor.cost_model import (
    DEFAULT,
    DYNAMO_MOCKER,
    LLAMA2_70B_A800,
    DecodeCost,
    DegreeCost,
    DegreeCosts,
    PrefillCost,
    TensorParallelCost,
    load_cost_model,
    save_cost_model,
)
from yb_conductor.replay import LogRecord, read_log, replay
from yb_core import events as ev

FIXTURES = Path(__file__).parent / "fixtures"


def _allreduce_per_token(n: int) -> float:
    """LLaMA2-70B's two all-reduces per layer of one token's hidden state over `n`
    A800s, by the profile's figures (150 GB/s bus bandwidth), seconds."""
    return 2 * 80 * 16384 * (2 * (n - 1) / n) / 150e9


# --- the cost model --------------------------------------------------------------------


def test_an_instance_at_the_models_own_degree_is_priced_by_the_model_itself() -> None:
    assert DEFAULT.at_degree(1, 1) is DEFAULT
    assert LLAMA2_70B_A800.at_degree(8, 8) is LLAMA2_70B_A800
    assert DEFAULT.at_degree(0, 0) is DEFAULT  # below 1 counts as 1


def test_without_all_reduce_figures_each_rank_does_its_share_of_the_work() -> None:
    two = DEFAULT.at_degree(2, 1)
    p, d = DEFAULT.prefill, DEFAULT.decode
    assert two.prefill.per_token_s == pytest.approx(p.per_token_s / 2)
    assert two.prefill.per_pair_s == pytest.approx(p.per_pair_s / 2)
    assert two.prefill.base_s == p.base_s  # a fixed overhead per pass
    assert two.decode.base_s == pytest.approx(d.base_s / 2)  # the weights, split
    assert two.decode.per_seq_s == pytest.approx(d.per_seq_s / 2)
    assert two.decode.per_context_token_s == pytest.approx(d.per_context_token_s / 2)
    assert two.transfer == DEFAULT.transfer  # one lane still
    assert (two.tensor_parallel.degree, two.tensor_parallel.transfer_lanes) == (2, 1)


def test_llama2_at_tp4_adds_its_all_reduces_and_keeps_its_weights_once() -> None:
    m = LLAMA2_70B_A800
    four = m.at_degree(4, 4)
    a8, a4 = _allreduce_per_token(8), _allreduce_per_token(4)
    latency = 160 * 10e-6  # two all-reduces per layer, 80 layers
    assert m.allreduce_s(8) == pytest.approx((a8, latency))
    assert m.allreduce_s(1) == (0.0, 0.0)
    assert four.prefill.per_token_s == pytest.approx((9.4641e-05 - a8) * 2 + a4)
    assert four.prefill.per_pair_s == pytest.approx(4.201e-09 * 2)
    assert four.prefill.base_s == pytest.approx(0.02)
    assert four.decode.base_s == pytest.approx((0.0141 - latency) * 2 + latency)
    assert four.decode.per_seq_s == pytest.approx((0.0001106 - a8) * 2 + a4)
    assert four.decode.per_context_token_s == pytest.approx(3.348e-08 * 2)
    # 8 x 80 GB held 1,310,720 tokens beside 138 GB of weights: half the devices.
    memory = 1_310_720 * 327_680 + 138e9
    assert four.decode.kv_capacity_tokens == int((memory / 2 - 138e9) // 327_680) == 444_788
    assert four.transfer.dram_remote_gbps == pytest.approx(87.0 / 2)
    assert four.transfer.setup_s == m.transfer.setup_s
    # Fewer devices: slower per request, fewer device-seconds (less all-reduce).
    assert 1.5 < four.prefill_s(8192) / m.prefill_s(8192) < 2.0
    # On one A800 the weights leave no room.
    assert m.at_degree(1, 1).decode.kv_capacity_tokens == 1
    # Back to the model's own degree, the same coefficients.
    back = four.at_degree(8, 8)
    assert back.prefill.per_token_s == pytest.approx(m.prefill.per_token_s)
    assert back.decode.base_s == pytest.approx(m.decode.base_s)
    # (less the tokens two roundings down lose)
    assert back.decode.kv_capacity_tokens == pytest.approx(m.decode.kv_capacity_tokens, abs=2)


def test_kv_utilisation_terms_take_the_time_at_a_context_to_its_share() -> None:
    two = DYNAMO_MOCKER.at_degree(2, 1)
    assert two.decode.kv_capacity_tokens == 2 * DYNAMO_MOCKER.decode.kv_capacity_tokens
    for context in (100_000, 500_000, 1_000_000):
        assert two.tbt_s(8, context) == pytest.approx(DYNAMO_MOCKER.tbt_s(8, context) / 2)
    assert two.decode.floor_s == DYNAMO_MOCKER.decode.floor_s


def test_measured_times_at_a_degree_are_taken_as_they_are() -> None:
    measured = DegreeCost(
        tensor_parallel=2,
        prefill=PrefillCost(base_s=0.5, per_token_s=0.01, per_pair_s=0.0),
        decode=DecodeCost(base_s=0.3, per_seq_s=0.0, per_context_token_s=0.0),
    )
    m = msgspec.structs.replace(DEFAULT, tensor_parallel=TensorParallelCost(measured=[measured]))
    two = m.at_degree(2, 1)
    assert two.prefill == measured.prefill and two.decode == measured.decode
    assert m.at_degree(4, 1).prefill.per_token_s == pytest.approx(DEFAULT.prefill.per_token_s / 4)


def test_lanes_multiply_the_bandwidth_and_a_load_pays_its_setup_once() -> None:
    two = ROUND.at_degree(1, 2)
    assert two.prefill == ROUND.prefill and two.decode == ROUND.decode
    one_s, two_s = ROUND.load_s(10, 16, "dram", True), two.load_s(10, 16, "dram", True)
    assert two_s - two.transfer.setup_s == pytest.approx((one_s - ROUND.transfer.setup_s) / 2)
    assert two.load_s(10, 16, "engine", True) == 0.0


def test_a_tensor_parallel_section_is_saved_as_version_3(tmp_path: Path) -> None:
    save_cost_model(LLAMA2_70B_A800, tmp_path / "llama.json")
    assert msgspec.json.decode((tmp_path / "llama.json").read_bytes())["version"] == 3
    assert load_cost_model(tmp_path / "llama.json") == LLAMA2_70B_A800
    # Without the section a model keeps the version it had, and reads as one device.
    assert DEFAULT.min_version() == 1
    assert DYNAMO_MOCKER.tensor_parallel == TensorParallelCost()


def test_derived_models_follow_the_kv_size_the_engines_announce() -> None:
    model = msgspec.structs.replace(DEFAULT)
    costs = DegreeCosts(model)
    assert costs.at(1, 1) is model
    before = costs.at(2, 2)
    assert costs.at(2, 2) is before  # derived once
    model.kv_bytes_per_token *= 2  # as `Conductor._price_kv` does
    after = costs.at(2, 2)
    assert after.kv_bytes_per_token == model.kv_bytes_per_token
    assert after.load_s(4, 16, "dram", False) > before.load_s(4, 16, "dram", False)


# --- the conductor -----------------------------------------------------------------


def _engine(name: str, role: ev.Role, host: str, tp: int, lanes: int = 1) -> ev.InstanceUp:
    return ev.InstanceUp(
        instance_id=name,
        role=role,
        host=host,
        max_batch_size=1 if role == "prefill" else 64,
        tensor_parallel=tp,
        transfer_lanes=lanes,
    )


@pytest.mark.parametrize(
    "settings", [{}, {"prefix_stickiness": 1.0}, {"learn_speed": False, "priority_order": False}]
)
def test_prefill_is_priced_at_each_instances_degree(crafted: Any, settings: dict[str, Any]) -> None:
    c = crafted(**settings)
    c.feed(_engine("p-1", "prefill", "h0", tp=1))
    c.feed(_engine("p-2", "prefill", "h1", tp=2))
    c.decode("d-0")
    d = c.admit("a", prompt=1000)
    assert isinstance(d, ev.RequestScheduled)
    # 1 ms a token on one device, half that on two.
    assert d.prefill_instance == "p-2"
    assert d.estimates.prefill_s == pytest.approx(0.5)
    assert d.explain is not None
    rows = {row.instance_id: row.prefill_s for row in d.explain.candidates}
    assert rows == pytest.approx({"p-2": 0.5, "p-1": 1.0})
    state = c.c.state.instances
    assert (state["p-2"].tensor_parallel, state["p-2"].transfer_lanes) == (2, 1)
    assert replay(c.records).divergences == []


def test_a_prefix_is_pulled_over_the_loading_instances_lanes(crafted: Any) -> None:
    c = crafted()
    chain = list(range(1, 11))
    c.kvstore("kv-9", "h9")
    c.store("kv-9", chain)
    c.feed(_engine("p-1", "prefill", "h0", tp=1, lanes=1))
    c.feed(_engine("p-2", "prefill", "h1", tp=1, lanes=2))
    c.decode("d-0")
    d = c.admit("a", [*chain, 11])
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    # Ten remote blocks: 10 ms over one lane, 5 ms over two.
    rows = {row.instance_id: (row.option, row.transfer_s) for row in d.explain.candidates}
    assert rows["p-1"] == ("transfer", pytest.approx(0.010))
    assert rows["p-2"] == ("transfer", pytest.approx(0.005))
    assert d.prefill_instance == "p-2"


def test_decode_tbt_is_predicted_at_each_instances_degree(crafted: Any) -> None:
    c = crafted()
    c.feed(_engine("p-0", "prefill", "h0", tp=1))
    c.feed(_engine("d-1", "decode", "h-d", tp=1))
    c.feed(_engine("d-2", "decode", "h-d", tp=2))
    d = c.admit("a", prompt=100)
    assert isinstance(d, ev.RequestScheduled) and d.explain is not None
    # A step: 10 ms + 1 ms a sequence on one device, half on two.
    assert d.decode_instance == "d-2"
    assert d.estimates.tbt_s == pytest.approx(0.0055)
    tbts = {row.instance_id: row.tbt_s for row in d.explain.decode_candidates}
    assert tbts == pytest.approx({"d-2": 0.0055, "d-1": 0.011})


@pytest.mark.parametrize("policy", ["least-loaded", "local-prefix", "round-robin"])
def test_baselines_estimate_at_the_chosen_instances_degrees(crafted: Any, policy: str) -> None:
    c = crafted(policy=policy)
    c.feed(_engine("p-0", "prefill", "h0", tp=4))
    c.feed(_engine("d-0", "decode", "h-d", tp=2))
    d = c.admit("a", prompt=1000)
    assert isinstance(d, ev.RequestScheduled)
    assert d.estimates.prefill_s == pytest.approx(0.25)
    assert d.estimates.tbt_s == pytest.approx(0.0055)


# --- logs from before tensor parallelism ------------------------------------------------


def test_a_log_from_before_tensor_parallelism_replays_at_one_device_and_one_lane() -> None:
    path = FIXTURES / "trace_log.jsonl"
    assert "tensor_parallel" not in path.read_text()
    records = read_log(path)
    result = replay(records)
    assert result.divergences == [] and result.decisions == 80
    engines = [
        i for i in result.conductor.state.instances.values() if i.role in ("prefill", "decode")
    ]
    assert engines and all((i.tensor_parallel, i.transfer_lanes) == (1, 1) for i in engines)
    # Its cost model has no section either: one device, one lane, priced as recorded.
    assert result.conductor.policy.cost.tensor_parallel == TensorParallelCost()


def test_the_same_log_with_wider_prefill_instances_decides_otherwise() -> None:
    records = read_log(FIXTURES / "trace_log.jsonl")

    def wider(r: LogRecord) -> LogRecord:
        e = r.event
        if isinstance(e, ev.InstanceUp) and e.role == "prefill":
            return msgspec.structs.replace(r, event=msgspec.structs.replace(e, tensor_parallel=2))
        return r

    result = replay([wider(r) for r in records], strict=False)
    # The degree is priced: the first prefill's work takes half the recorded time
    # (its fixed overhead stays).
    first = result.divergences[0]
    assert isinstance(first.recorded, ev.RequestScheduled)
    assert isinstance(first.recomputed, ev.RequestScheduled)
    base = result.conductor.policy.cost.prefill.base_s
    recorded = first.recorded.estimates.prefill_s
    assert first.recomputed.estimates.prefill_s == pytest.approx(base + (recorded - base) / 2)


def test_an_explicit_degree_of_one_decides_as_the_absent_field() -> None:
    records = read_log(FIXTURES / "trace_log.jsonl")

    def explicit(r: LogRecord) -> LogRecord:
        e = r.event
        if isinstance(e, ev.InstanceUp):
            e = msgspec.structs.replace(e, tensor_parallel=1, transfer_lanes=1)
        return msgspec.structs.replace(r, event=e)

    assert replay([explicit(r) for r in records]).divergences == []
