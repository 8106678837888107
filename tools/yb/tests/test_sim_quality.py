"""Needless rejections on a three-request trace worked out by hand; the generated
workloads are seeded and share prefixes as they promise; the matrix's verdict and
command line.

One prefill and one decode instance; prefill costs 1 ms per token, a decode step
10 ms plus 50 ms per request in the batch (60 ms alone, 110 ms for two: two
requests together break the 100 ms TBT SLO). TTFT SLO 2 s. The decode instance
takes one request at a time and queues the next (`decode_max_batch=1`,
`decode_admission="queue"`), which the conductor's TBT estimate does not know.

- r0 at t=0: 100 tokens, 100 out. Admitted by every admission: prefill 0.1 s,
  decodes alone until 0.1 + 99 x 0.06 = 6.04.
- r1 at t=1: 100 tokens, 200 out. `early` sees r0 decoding: a batch of two, TBT
  0.11 s > 0.1 s, rejected. With admission `none` its prefill ends at 1.1 (TTFT
  0.1 s, its first token reported) and it waits for r0 to leave at 6.04, then
  decodes alone until 6.04 + 199 x 0.06 = 17.98: its wait is one of its gaps, so
  its TBT is (17.98 - 1.1) / 199 = 0.0848 s. Both SLOs met: a **needless**
  rejection.
- r2 at t=2: 3000 tokens, 2 out. Estimated TTFT 3 s > 2 s: rejected by `early`;
  with `none` its TTFT is 3 s indeed: a rejection that was needed.

So `early` rejects 2, 1 of them needlessly; `none` rejects nothing.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from yb_conductor.cost_model import CostModel, DecodeCost, PrefillCost, TransferCost
from yb_tools.cli import main as yb_main
from yb_tools.sim.matrix import FOCUSED
from yb_tools.sim.params import SimParams
from yb_tools.sim.quality import needless_rejections
from yb_tools.sim.runner import RunSpec, simulate
from yb_tools.sim.simulator import Simulation
from yb_tools.sim.workload import workload_from
from yb_tools.sim.workloads import generate
from yb_tools.traces import TraceRecord, read_trace

SYNTHETIC = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"

COST = CostModel(
    name="round-batch",
    kv_bytes_per_token=1000,
    prefill=PrefillCost(base_s=0.0, per_token_s=0.001, per_pair_s=0.0),
    decode=DecodeCost(base_s=0.010, per_seq_s=0.050, per_context_token_s=0.0),
    transfer=TransferCost(setup_s=0.0, dram_local_gbps=50.0, dram_remote_gbps=25.0),
)
TRACE = [
    TraceRecord(timestamp=0, input_length=100, output_length=100, hash_ids=[1]),
    TraceRecord(timestamp=1000, input_length=100, output_length=200, hash_ids=[2]),
    TraceRecord(timestamp=2000, input_length=3000, output_length=2, hash_ids=[3, 4, 5, 6, 7, 8]),
]
PARAMS = SimParams(
    prefill=1, decode=1, block_size=512, max_tokens=0, ttft_slo_s=2.0, tbt_slo_s=0.1,
    decode_max_batch=1, decode_admission="queue",
)  # fmt: skip


def _jobs(admission: str) -> dict[str, object]:
    sim = Simulation(workload_from(TRACE, block_size=512), PARAMS, COST, policy="mooncake",
                     admission=admission)  # fmt: skip
    sim.run()
    return {j.item.request_id: j for j in sim.jobs}


def test_the_hand_computed_fates() -> None:
    early, none = _jobs("early"), _jobs("none")
    assert [early[f"req-{i}"].fate for i in range(3)] == ["completed", "rejected", "rejected"]
    assert [none[f"req-{i}"].fate for i in range(3)] == ["completed"] * 3
    assert [none[f"req-{i}"].ttft_s for i in range(3)] == pytest.approx([0.1, 0.1, 3.0])
    assert none["req-1"].tbt_s == pytest.approx((17.98 - 1.1) / 199)
    assert needless_rejections(early.values(), none.values(), ttft_slo_s=2.0, tbt_slo_s=0.1) == [
        "req-1"
    ]


@pytest.mark.parametrize("with_none", [False, True])
def test_the_runner_reports_needless_rejections(with_none: bool) -> None:
    specs = [RunSpec("mooncake:early", "mooncake", "early")]
    if with_none:  # the counterfactual is then the run asked for, not an extra one
        specs.append(RunSpec("mooncake:none", "mooncake", "none"))
    report = simulate("hand", specs, PARAMS, records=TRACE, cost=COST)
    early = report.policies["mooncake:early"]
    assert (early.rejected, early.needless_rejections) == (2, 1)
    assert early.needless_rejection_share == 0.5
    if with_none:
        none = report.policies["mooncake:none"]
        assert (none.rejected, none.needless_rejections) == (0, 0)


def test_generated_workloads_are_seeded_and_share_what_they_promise() -> None:
    from yb_tools.sim.workloads import GENERATORS

    for name in GENERATORS:
        first = generate(f"{name}:seed=3")
        assert first == generate(name, seed=3)
        assert first != generate(name, seed=4)
        assert [r.timestamp for r in first] == sorted(r.timestamp for r in first)
        assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in first)
    groups = generate("shared-prefix:groups=2,users=2,questions=1,system=1024")
    assert len(groups) == 4
    prefixes = {tuple(r.hash_ids[:2]) for r in groups}
    assert len(prefixes) == 2  # two groups, each sharing its two system blocks
    assert len({r.hash_ids[2] for r in groups}) == 4  # questions share nothing
    turns = generate("multi-turn:sessions=1,turns=2,spread=0")
    # turns=2 is a mean: a session runs between 1 and 3 turns; each extends the last.
    assert len(turns) == 2
    for before, after in itertools.pairwise(turns):
        full = before.input_length // 512
        assert after.hash_ids[:full] == before.hash_ids[:full]
        assert after.input_length == before.input_length + 300 + 400
    with pytest.raises(ValueError, match="unknown workload"):
        generate("chat")
    with pytest.raises(ValueError, match="key=value"):
        generate("tool-agent:colour=blue")


def test_the_matrix_judges_the_conductor_by_the_best_peer() -> None:
    from yb_tools.sim.matrix import PolicyFigures, judge, run_matrix

    def figures(
        mean: float, p90: float, goodput: float, slo: float, rejected: int
    ) -> PolicyFigures:
        return PolicyFigures(
            admission="none", ttft_mean_s=mean, ttft_p90_s=p90, goodput_rps=goodput,
            slo_attainment=slo, rejected=rejected, needless_rejections=0, cache_hit_ratio=0.0,
        )  # fmt: skip

    peers = {"a": figures(1.0, 3.0, 5.0, 1.0, 0), "b": figures(2.0, 2.0, 6.0, 0.9, 0)}
    verdict = judge({**peers, "mooncake": figures(1.0, 2.5, 6.0, 0.99, 1)})
    assert (verdict.best_ttft_mean_peer, verdict.best_ttft_p90_peer) == ("a", "b")
    assert (verdict.ttft_mean, verdict.ttft_p90, verdict.goodput) == (True, False, True)
    assert verdict.peers_meeting_every_slo == ["a"] and not verdict.rejections
    assert not verdict.wins
    matrix = run_matrix(
        trace="", limit=40, workloads=("tool-agent",), profiles=("dynamo-mocker",),
        speedups=(2.0,), shapes=((2, 1),), peers=("round-robin", "dynamo-kv"),
    )  # fmt: skip
    (setting,) = matrix.settings
    assert list(setting.policies) == ["round-robin", "dynamo-kv", "mooncake"]
    assert setting.requests == 40 and setting.wins == setting.verdict.wins


def _cli(argv: list[str]) -> int:
    """`yb sim ARGV`, in this process: its exit status."""
    return yb_main(["sim", *argv])


def test_the_command_line_writes_a_workload_and_the_matrix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "agent.jsonl"
    assert _cli(["--workload", "tool-agent:tasks=5,steps=2", "--write-trace", str(trace)]) == 0
    assert read_trace(trace) == generate("tool-agent:tasks=5,steps=2")
    out = tmp_path / "matrix.json"
    argv = ["--matrix", "--limit", "10", "--trace-file", str(SYNTHETIC), "--json", str(out)]
    assert _cli([*argv, "--quiet"]) == 0
    doc = json.loads(out.read_text())
    # Every combination, and the settings of their own (the ladder).
    assert len(doc["settings"]) == 4 * 2 * 2 * 2 + len(FOCUSED)
    assert all(s["requests"] == 10 and len(s["policies"]) == 7 for s in doc["settings"])
    total = len(doc["settings"])
    assert f"mooncake wins {doc['wins']} of {total} settings." in capsys.readouterr().out
    # Conductor settings reach every run, and are recorded; an unknown one is refused.
    settings = ["--set", "prefix_stickiness=0", "--set", "calibrated_admission=false"]
    assert _cli([*argv, "--quiet", *settings]) == 0
    doc = json.loads(out.read_text())
    assert doc["conductor_settings"] == {"prefix_stickiness": "0", "calibrated_admission": "false"}
    assert _cli([*argv, "--quiet", "--set", "no_such_setting=1"]) == 1
    assert _cli([*argv, "--quiet", "--set", "prefix_stickiness=-1"]) == 1  # built, refused


def test_seeds_are_read_as_lists_and_ranges() -> None:
    from yb_tools.sim.matrix import parse_seeds

    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    assert parse_seeds("3, 1,3,0-1") == [3, 1, 0]
    for bad in ("", "x", "2-1", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_the_matrix_across_seeds_counts_each_setting_on_every_seed() -> None:
    from yb_tools.sim.matrix import run_matrix, run_seeds, seed_spread, spread_table

    one = {
        "trace": "", "limit": 60, "workloads": ("shared-prefix",),
        "profiles": ("dynamo-mocker",), "speedups": (2.0,), "shapes": ((2, 1),),
        "peers": ("round-robin", "dynamo-kv"),
    }  # fmt: skip
    spread = run_seeds([0, 1, 2], **one)
    assert spread.seeds == [0, 1, 2] and [m.seed for m in spread.matrices] == [0, 1, 2]
    # Each seed's matrix is the one run alone on that seed, and the workload differs.
    alone = [run_matrix(seed=seed, **one) for seed in (0, 1, 2)]
    assert [m.settings for m in spread.matrices] == [m.settings for m in alone]
    assert alone[0].settings[0].policies != alone[1].settings[0].policies
    assert spread.wins_by_seed == [m.wins for m in alone]
    (row,) = spread.spread
    cells = [m.settings[0] for m in alone]
    assert row.wins == sum(c.wins for c in cells)
    for cell, margin, peers_apart in zip(
        cells, row.goodput_margins, row.peer_goodput_spreads, strict=True
    ):
        goodputs = {name: f.goodput_rps for name, f in cell.policies.items()}
        ours = goodputs.pop("mooncake")
        assert margin == pytest.approx(ours - max(goodputs.values()))
        assert peers_apart == pytest.approx(max(goodputs.values()) - min(goodputs.values()))
    assert sum(row.missed.values()) == sum(len(c.verdict.missed()) for c in cells)
    assert seed_spread(alone) == spread.spread
    table = spread_table(spread)
    assert "| shared-prefix | dynamo-mocker | 2x | 2+1 | " in table
    every = int(row.wins == 3)
    assert f"mooncake wins {every} of 1 settings on every one of 3 seeds" in table


def test_the_command_line_runs_the_matrix_on_several_seeds_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "seeds.json"
    argv = ["--matrix", "--seeds", "0-1", "--limit", "10", "--trace-file", str(SYNTHETIC)]
    assert _cli([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["seeds"] == [0, 1] and [m["seed"] for m in doc["matrices"]] == [0, 1]
    assert len(doc["spread"]) == 32 + len(FOCUSED)
    assert doc["wins_by_seed"] == [m["wins"] for m in doc["matrices"]]
    captured = capsys.readouterr()
    assert "on every one of 2 seeds" in captured.out
    assert "seed 0: mooncake wins" in captured.err and "seed 1: mooncake wins" in captured.err
    # A setting the conductor does not have is refused before any seed runs.
    assert _cli([*argv, "--quiet", "--set", "no_such_setting=1"]) == 1
