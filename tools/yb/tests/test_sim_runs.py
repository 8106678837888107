"""`yb sim` on a slice of Mooncake's synthetic trace: determinism, conservation, a log
that replays, and the command line writing valid JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from yb_conductor.cost_model import load_cost_model
from yb_conductor.replay import replay
from yb_tools.cli import main as yb_main
from yb_tools.sim.params import SimParams
from yb_tools.sim.results import PolicyResult
from yb_tools.sim.runner import expand
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import TraceItem, load_workload

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
LIMIT = 400
COST = load_cost_model("llama2-70b-a800")
# Overloaded on purpose (half the paper's prefill pool and one decode instance, 4x
# speed, tight SLOs), so that every ending is exercised: completions, rejections at
# arrival and at decode admission (the paper's `reject`: over the TBT SLO after the
# prefill; the engine's own admission never refuses there).
OVERLOAD = SimParams(
    prefill=4, decode=1, speedup=4.0, tbt_slo_s=0.02, ttft_slo_s=10.0, limit=LIMIT, jitter=0.1,
    decode_admission="reject",
)  # fmt: skip


@pytest.fixture(scope="module")
def items() -> list[TraceItem]:
    return load_workload(TRACE, block_size=512, speedup=OVERLOAD.speedup, limit=LIMIT)


def _figures(r: PolicyResult) -> dict[str, Any]:
    """Everything but what the wall clock measured."""
    out: dict[str, Any] = msgspec.to_builtins(r)
    for key in ("wall_s", "conductor_s", "simulated_seconds_per_wall_second"):
        out.pop(key)
    return out


@pytest.mark.parametrize("policy", ["random", "mooncake"])
def test_same_inputs_and_seed_give_the_same_result(items: list[TraceItem], policy: str) -> None:
    runs = [
        Simulation(items, OVERLOAD, COST, policy=policy, admission="early").run() for _ in range(2)
    ]
    assert _figures(runs[0]) == _figures(runs[1])
    # The seed is what the jitter and the random policy draw from: another one differs.
    other = msgspec.structs.replace(OVERLOAD, seed=1)
    third = Simulation(items, other, COST, policy=policy, admission="early").run()
    assert _figures(third) != _figures(runs[0])


@pytest.mark.parametrize(
    ("policy", "admission"),
    [("mooncake", "none"), ("mooncake", "early"), ("mooncake", "predicted"),
     ("random", "none"), ("sglang-cache-aware", "none"), ("dynamo-kv", "none")],
)  # fmt: skip
def test_every_request_ends_finished_or_rejected(
    items: list[TraceItem], policy: str, admission: str
) -> None:
    sim = Simulation(items, OVERLOAD, COST, policy=policy, admission=admission)
    r = sim.run()
    fates = [job.fate for job in sim.jobs]
    assert "" not in fates
    assert r.requests == len(items) == LIMIT
    assert r.completed + r.rejected + r.timed_out == r.requests
    assert r.completed == fates.count("completed")
    assert r.rejected_at_decode == fates.count("decode_rejected")
    assert sum(r.reject_reasons.values()) == r.rejected
    # Nothing is left anywhere: engines idle, and the conductor released every load.
    assert all(
        d.batch == 0 and d.held_pages + d.batch_pages == 0 and not d.pending for d in sim.decodes
    )
    assert all(p.current is None and not p.queue for p in sim.prefills)
    state = sim.conductor.state
    assert state.placements == {}
    assert all(i.decode_requests == 0 and i.prefill_requests_in_flight == 0
               for i in state.instances.values())  # fmt: skip
    if policy == "mooncake" and admission == "none":
        assert r.rejected_at_decode > 0 and r.wasted_prefill_s > 0  # the overload bites


def test_the_simulated_log_replays_decision_for_decision(items: list[TraceItem]) -> None:
    for policy in ("mooncake", "sglang-cache-aware"):
        sim = Simulation(
            items[:150], OVERLOAD, COST, policy=policy, admission="predicted", record_log=True
        )
        sim.run()
        assert sim.records is not None
        result = replay(sim.records)
        assert result.divergences == []
        assert result.decisions == 150


def test_admissions_expand_only_for_the_conductor() -> None:
    specs = expand(["random", "mooncake"], ["none", "early", "predicted"])
    assert [s.label for s in specs] == [
        "random", "mooncake:none", "mooncake:early", "mooncake:predicted",
    ]  # fmt: skip
    assert [s.label for s in expand(["mooncake"], ["early"])] == ["mooncake"]
    with pytest.raises(ValueError, match="unknown policy"):
        expand(["vllm"], ["none"])
    with pytest.raises(ValueError, match="unknown admission"):
        expand(["mooncake"], ["late"])


def _cli(argv: list[str]) -> int:
    """`yb sim ARGV`, in this process: its exit status."""
    return yb_main(["sim", *argv])


def test_the_command_line_writes_the_json_design_md_promises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = [
        "--trace", str(TRACE), "--policy", "least-loaded,mooncake",
        "--admission", "none,predicted", "--prefill", "4", "--decode", "2",
        "--profile", "llama2-70b-a800", "--speedup", "2", "--limit", "200",
        "--json", str(out), "--quiet", "--no-plots",
    ]  # fmt: skip
    assert _cli(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["policies"]) == {"least-loaded", "mooncake:none", "mooncake:predicted"}
    assert doc["simulated_seconds_per_wall_second"] > 0
    required = {
        "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_mean_s", "tbt_p50_s",
        "tbt_p90_s", "tbt_p99_s", "slo_attainment", "goodput_rps", "rejected",
        "wasted_prefill_s", "cache_hit_ratio", "local_reused_tokens", "remote_reused_tokens",
        "reused_tokens", "transfer_bytes", "load_over_time",
    }  # fmt: skip
    for figures in doc["policies"].values():
        assert required <= set(figures)
        assert figures["requests"] == 200
        load = figures["load_over_time"]
        assert len(load["t"]) == len(load["prefill_backlog_s"]) == len(load["decode_tbt_ratio"])
    printed = capsys.readouterr().out
    assert "| mooncake:predicted |" in printed


def test_the_command_line_refuses_unknown_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", str(TRACE), "--policy", "vllm", "--json", str(tmp_path / "x.json")]
    assert _cli(argv) == 2
    assert "unknown policy 'vllm'" in capsys.readouterr().err
    argv = ["--trace", str(TRACE), "--profile", "h100", "--json", str(tmp_path / "x.json")]
    assert _cli([*argv, "--quiet", "--limit", "5"]) == 1


def test_the_command_line_draws_a_priority_mix_and_prints_each_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = [
        "--trace", str(TRACE), "--policy", "mooncake", "--admission", "predicted",
        "--limit", "100", "--json", str(out), "--quiet", "--no-plots",
    ]  # fmt: skip
    assert _cli([*argv, "--priority-mix", "1:0.3,0:0.7"]) == 0
    (run,) = json.loads(out.read_text())["policies"].values()
    assert set(run["by_priority"]) == {"0", "1"}
    assert "| priority |" in capsys.readouterr().out
    assert _cli([*argv, "--priority-mix", "high"]) == 2
    assert "priority mix wants priority:share" in capsys.readouterr().err


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sim.json"
    argv = ["--trace", str(TRACE), "--policy", "random,mooncake", "--limit", "60",
            "--json", str(out), "--quiet"]  # fmt: skip
    assert _cli(argv) == 0
    for name in ("sim_ttft.png", "sim_load.png", "sim_cache.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefill_groups_take_the_long_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = [
        "--trace", str(TRACE), "--policy", "mooncake", "--prefill", "4", "--decode", "2",
        "--limit", "300", "--json", str(out), "--quiet", "--no-plots",
    ]  # fmt: skip
    assert _cli([*argv, "--prefill-groups", "2"]) == 0
    (run,) = json.loads(out.read_text())["policies"].values()
    assert run["group_requests"] > 0
    # The pipeline pays off on long prompts: those are the ones the group gets.
    assert run["group_prompt_p50"] > run["whole_prompt_p50"]
    printed = capsys.readouterr().out
    assert "prefill groups of 2 stages (chunks of 2048 tokens)" in printed
    assert "| mooncake | prefill groups |" in printed
    # Without groups nothing is reported of them.
    assert _cli(argv) == 0
    (plain,) = json.loads(out.read_text())["policies"].values()
    assert plain["group_requests"] == 0
    assert "prefill groups" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ("1", "at least 2 stages"),
        ("3,2", "more than the 4 prefill instances"),
        ("two", "stage counts"),
    ],
)
def test_prefill_groups_that_do_not_fit_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], groups: str, message: str
) -> None:
    argv = [
        "--trace", str(TRACE), "--prefill", "4", "--limit", "5", "--quiet", "--no-plots",
        "--json", str(tmp_path / "x.json"), "--prefill-groups", groups,
    ]  # fmt: skip
    assert _cli(argv) == 2
    assert message in capsys.readouterr().err
    assert _cli([*argv[:-1], "2", "--policy", "coupled"]) == 1
    assert "no prefill groups" in capsys.readouterr().err
