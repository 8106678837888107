"""Cost model version 2: passes, KV-utilisation decode, the built-in profiles, and
files of every version (a version-1 fit stays version 1)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest

from yb_conductor.cost_model import (
    COST_MODEL_VERSION,
    DEFAULT,
    CostModel,
    CostModelError,
    DecodeCost,
    PrefillCost,
    load_cost_model,
    save_cost_model,
)


def _mocker_prefill_ms(tokens: int) -> float:
    return 4.209989e-7 * tokens**2 + 0.01518344 * tokens + 16.50142


def _mocker_decode_ms(active: int) -> float:
    u = active / 1_048_576
    return max(1.0, -25.74 * u * u + 54.01 * u + 5.74)


def test_dynamo_mocker_profile_is_the_mockers_engine_model() -> None:
    m = load_cost_model("dynamo-mocker")
    assert m.block_size == 64
    # One pass up to 8,192 tokens; cached tokens cost nothing and change nothing.
    assert m.prefill_s(5000) * 1000 == pytest.approx(_mocker_prefill_ms(5000))
    assert m.prefill_s(5000, cached_tokens=30000) == m.prefill_s(5000)
    # 20,000 tokens: passes of 8,192 + 8,192 + 3,616, each paying the polynomial.
    expected = 2 * _mocker_prefill_ms(8192) + _mocker_prefill_ms(20000 - 2 * 8192)
    assert m.prefill_s(20000) * 1000 == pytest.approx(expected)
    for active in (0, 100_000, 524_288, 1_048_576):
        assert m.tbt_s(8, active) * 1000 == pytest.approx(_mocker_decode_ms(active))
    # A mixed pass costs the sum (Yuebing never mixes, but the model says so).
    mixed = m.tbt_s(8, 100_000) + m.prefill_s(1000)
    assert mixed * 1000 == pytest.approx(_mocker_decode_ms(100_000) + _mocker_prefill_ms(1000))


def test_llama2_profile_follows_the_papers_flop_count() -> None:
    m = load_cost_model("llama2-70b-a800")
    layers, d, a, b = 80, 8192, 4, 22
    g = 8 * 312e12 * 0.5
    assert m.prefill.per_token_s == pytest.approx(layers * b * d * d / g, rel=1e-4)
    assert m.prefill.per_pair_s == pytest.approx(2 * layers * a * d / g, rel=1e-4)
    assert m.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    # Computing on top of a cached prefix costs what the FLOP difference says.
    flops = lambda n: layers * (a * n * n * d + b * n * d * d)  # noqa: E731
    work = m.prefill_s(3000, 5000) - m.prefill.base_s
    assert work == pytest.approx((flops(8000) - flops(5000)) / g, rel=1e-4)
    assert m.notes and "section 2.2" in m.notes[0]


@pytest.mark.parametrize("profile", ["default", "llama2-70b-a800", "dynamo-mocker"])
def test_closed_form_decode_steps_equal_the_step_by_step_sum(profile: str) -> None:
    m = load_cost_model(profile)
    for batch, context, steps in ((1, 500, 1), (7, 40_000, 300), (64, 900_000, 77)):
        by_step = math.fsum(m.tbt_s(batch, context + batch * i) for i in range(steps))
        assert m.decode_steps_s(batch, context, steps) == pytest.approx(by_step, rel=1e-9)
    assert m.decode_steps_s(0, 100, 10) == 0.0
    assert m.decode_steps_s(3, 100, 0) == 0.0


def test_the_floor_binds_where_the_polynomial_dips() -> None:
    m = CostModel(
        kv_bytes_per_token=1,
        prefill=PrefillCost(base_s=0.0, per_token_s=0.0, per_pair_s=0.0),
        decode=DecodeCost(
            base_s=0.001, per_seq_s=0.0, per_context_token_s=0.0, per_util_s=-0.004,
            per_util_sq_s=0.0, floor_s=0.0005, kv_capacity_tokens=1000,
        ),
    )  # fmt: skip
    assert m.tbt_s(1, 900) == 0.0005  # 0.001 - 0.0036 would be negative
    by_step = math.fsum(m.tbt_s(10, 100 + 10 * i) for i in range(50))
    assert m.decode_steps_s(10, 100, 50) == pytest.approx(by_step)


def test_a_plain_fit_is_saved_as_version_1_and_new_terms_as_2(tmp_path: Path) -> None:
    save_cost_model(DEFAULT, tmp_path / "fit.json")
    assert msgspec.json.decode((tmp_path / "fit.json").read_bytes())["version"] == 1
    assert load_cost_model(tmp_path / "fit.json") == msgspec.structs.replace(DEFAULT, version=1)
    mocker = load_cost_model("dynamo-mocker")
    save_cost_model(mocker, tmp_path / "mocker.json")
    assert msgspec.json.decode((tmp_path / "mocker.json").read_bytes())["version"] == 2
    assert load_cost_model(tmp_path / "mocker.json") == mocker


def test_a_version_1_file_means_what_it_meant(tmp_path: Path) -> None:
    v1 = {
        "version": 1, "name": "old", "kv_bytes_per_token": 100,
        "prefill": {"base_s": 0.1, "per_token_s": 0.001, "per_pair_s": 1e-6},
        "decode": {"base_s": 0.05, "per_seq_s": 0.004, "per_context_token_s": 1e-5},
    }  # fmt: skip
    path = tmp_path / "v1.json"
    path.write_bytes(msgspec.json.encode(v1))
    m = load_cost_model(path)
    assert m.prefill_s(100, 50) == pytest.approx(0.1 + 0.1 + 1e-6 * 100 * (50 + 50))
    assert m.tbt_s(4, 1000) == pytest.approx(0.05 + 0.016 + 0.01)


def test_a_newer_version_is_refused(tmp_path: Path) -> None:
    newer = COST_MODEL_VERSION + 1
    path = tmp_path / f"v{newer}.json"
    doc = msgspec.to_builtins(DEFAULT)
    doc["version"] = newer
    path.write_bytes(msgspec.json.encode(doc))
    with pytest.raises(CostModelError, match=f"version {newer}"):
        load_cost_model(path)


def test_transfers_are_priced_at_the_kv_size_the_engines_announce() -> None:
    from yb_conductor.conductor import Conductor
    from yb_conductor.cost_model import DEFAULT
    from yb_core import events as ev
    from yb_core.config import ConductorConfig
    from yb_core.kv_spec import KVCacheSpec

    before = DEFAULT.kv_bytes_per_token
    conductor = Conductor()
    latent = KVCacheSpec(parts=("latent",), heads=1, dim=576, dtype="bfloat16", num_layers=61)
    up = ev.InstanceUp(
        instance_id="prefill-0", role="prefill", host="h", kv_spec=latent, num_layers=61
    )
    conductor.apply(1, up)
    cost = conductor.policy.cost  # type: ignore[attr-defined]
    assert cost.kv_bytes_per_token == 61 * 576 * 2
    # A reconfiguration keeps what the engines said; the shared built-in is untouched.
    conductor.configure(ConductorConfig())
    assert conductor.policy.cost.kv_bytes_per_token == 61 * 576 * 2  # type: ignore[attr-defined]
    assert before == DEFAULT.kv_bytes_per_token
