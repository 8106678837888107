"""Batch lines filling idle capacity in `yb sim` (issue 40, item 4).

    python benchmarks/sim_batch.py --json PATH [--limit N] [--find-capacity]

Two workloads: Mooncake's synthetic trace and the conversation workload
(`multi-turn`, defaults, seed 0), on the paper's engine model (`llama2-70b-a800`),
8 prefill + 8 decode instances, the conductor (`mooncake`, admission `predicted`),
the simulator's default SLOs (TTFT 30 s, TBT 100 ms). Interactive load at 0.5x, 1x
and 1.5x of the cluster's capacity: the trace's arrivals compressed by that multiple
of the workload's unit speedup, the speedup at which `mooncake` keeps >= 90% of the
requests within both SLOs (`yb_tools.sim.capacity`). Searching it costs ten runs a
workload, so by default the unit speedups are `UNIT_SPEEDUP`: the synthetic trace's
is `benchmarks/sim_capacity.py`'s recorded 3.152; the conversation workload's 1.0 is
its generator's own rate, not a searched capacity. `--find-capacity` searches both.

Ways, at each load:
- `none`: the interactive trace alone;
- `idle`: plus a backlog of batch lines queued at t = 0 and due `WINDOW_S` later
  (`yb_tools.sim.batch`), the conductor's idle-only rule on (the default), and
  prefill engines pausing a line's prefill between two layers for interactive work
  (`batch_preemption`, the default). The backlog is `FILL` times the lines whose
  prefills alone would fill every prefill instance over the interactive window (at
  the cost model's mean prefill of the trace's prompts), at most `MAX_LINES`, of
  which `CONCURRENCY` are tried or run at once;
- `naive`: the same backlog with `batch_idle_only=false`, each line decided as any
  request of its tier (`flex`: priority -1, a TTFT SLO four times the default's).

Figures, per workload `<w>_` and load `x<m>_` and way: the interactive requests'
`goodput_rps`, `ttft_p90_s` and `slo_attainment`; with a backlog, `goodput_change`
and `ttft_p90_change` (against `none`, signed fractions, goal within 0.01 for
`idle`), `lines` and `lines_completed` (in their window), `lines_timed_out`,
`idle_used` (the share of the idle prefill instance-seconds over the interactive
window the lines' prefills took, goal >= 0.8 at 0.5x) and `batch_makespan_s`.
The runs above are one exact replay each. A queue at its limit is chaotic: the
synthetic trace's TTFT p90 at 0.5x moves by about 2% between runs whose engines
differ by 0.1% in speed. So each load's `none` and `idle` runs are also repeated
with `--seeds` (5) jitter seeds, every job's time drawn within `JITTER` (0.1%) of the
cost model's, and `<w>_x<m>_idle_ttft_p90_change_mean`, `_sd` and
`goodput_change_mean` are the mean and standard deviation over those seeds of each
seed's change against its own `none` run.

`--limit N` keeps the first N interactive requests (and a backlog of N lines), for a
smoke run. Simulated in virtual time with fixed
seeds: the same code gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src"):
    sys.path.insert(0, str(ROOT / src))

import msgspec  # noqa: E402
from figures import emit  # noqa: E402

from yb_conductor.cost_model import CostModel  # noqa: E402
from yb_tools.sim.batch import BatchResult  # noqa: E402
from yb_tools.sim.capacity import run_capacity  # noqa: E402
from yb_tools.sim.params import SimParams  # noqa: E402
from yb_tools.sim.results import PolicyResult  # noqa: E402
from yb_tools.sim.runner import PAPER_POLICY, expand, resolve_cost  # noqa: E402
from yb_tools.sim.simulator import Simulation, block_size_for  # noqa: E402
from yb_tools.sim.workload import TraceItem, workload_from  # noqa: E402
from yb_tools.sim.workloads import generate  # noqa: E402
from yb_tools.traces import TraceRecord, read_trace  # noqa: E402

PROFILE = "llama2-70b-a800"
TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"
WORKLOADS = ("synthetic", "multi-turn")
#: Each workload's speedup at 1x its capacity (module docstring).
UNIT_SPEEDUP = {"synthetic": 3.152, "multi-turn": 1.0}
LOADS = (0.5, 1.0, 1.5)
#: The backlog (module docstring), its window, and the lines tried or run at once
#: (the gateways' `batch_concurrency` together: 32 gateways at the default 8).
FILL = 1.25
MAX_LINES = 30000
WINDOW_S = 3600.0
CONCURRENCY = 256
WAYS: tuple[tuple[str, bool | None], ...] = (("none", None), ("idle", True), ("naive", False))
#: Each job's time is drawn within this fraction of the cost model's in the seeded
#: repeats (module docstring).
JITTER = 0.001


@dataclass(frozen=True, slots=True)
class Run:
    workload: str
    load: float
    way: str
    result: PolicyResult
    batch: BatchResult | None


def records_of(workload: str, limit: int) -> list[TraceRecord]:
    records = read_trace(TRACE) if workload == "synthetic" else generate(workload)
    return records[:limit] if limit > 0 else records


def unit_speedup(workload: str, records: list[TraceRecord], params: SimParams) -> float:
    """The speedup at which `mooncake` keeps >= 90% of the requests within both SLOs."""
    specs = expand([PAPER_POLICY], ["predicted"])
    report = run_capacity(workload, records, specs, params)
    return report.policies[specs[0].label].speedup


@dataclass(frozen=True, slots=True)
class Load:
    """One workload at one load: its requests and its backlog."""

    workload: str
    load: float
    items: list[TraceItem]
    lines: int
    cost: CostModel

    def run(self, way: str, idle_only: bool | None, params: SimParams) -> Run:
        """The interactive trace alone (`idle_only` None), or beside the backlog."""
        settings = {}
        if idle_only is not None:
            params = msgspec.structs.replace(
                params,
                batch_lines=self.lines,
                batch_window_s=WINDOW_S,
                batch_concurrency=CONCURRENCY,
            )
            settings = {"batch_idle_only": idle_only}
        sim = Simulation(
            self.items, params, self.cost, policy=PAPER_POLICY, label=way, settings=settings
        )
        return Run(self.workload, self.load, way, sim.run(), sim.batch_result)


@dataclass(frozen=True, slots=True)
class Seeded:
    """Each jitter seed's change of the `idle` way against its own `none` run."""

    workload: str
    load: float
    ttft_p90_changes: list[float]
    goodput_changes: list[float]


def run(workload: str, limit: int, find: bool, seeds: int) -> tuple[list[Run], list[Seeded]]:
    params = SimParams(profile=PROFILE)
    cost = resolve_cost(params)
    records = records_of(workload, limit)
    unit = unit_speedup(workload, records, params) if find else UNIT_SPEEDUP[workload]
    out, seeded = [], []
    for load in LOADS:
        items = workload_from(records, block_size=block_size_for(params, cost), speedup=unit * load)
        lines = limit if limit > 0 else backlog_size(items, params, cost)

        at_load = Load(workload, load, items, lines, cost)
        for way, idle_only in WAYS:
            out.append(at_load.run(way, idle_only, params))
            print(f"{workload} x{load:g} {way}: done", file=sys.stderr)
        ttft, goodput = [], []
        for seed in range(1, seeds + 1):
            at = msgspec.structs.replace(params, jitter=JITTER, seed=seed)
            none = at_load.run("none", None, at).result
            idle = at_load.run("idle", True, at).result
            ttft.append(_ratio(idle.ttft_p90_s, none.ttft_p90_s) - 1)
            goodput.append(_ratio(idle.goodput_rps, none.goodput_rps) - 1)
        if seeds:
            seeded.append(Seeded(workload, load, ttft, goodput))
            print(f"{workload} x{load:g} {seeds} jitter seeds: done", file=sys.stderr)
    return out, seeded


def backlog_size(items: list[TraceItem], params: SimParams, cost: CostModel) -> int:
    """`FILL` times the lines whose prefills fill the prefill pool over the
    interactive window, at most `MAX_LINES`."""
    window = max(item.arrival for item in items)
    mean_s = sum(cost.prefill_s(item.prompt_tokens) for item in items) / len(items)
    return min(MAX_LINES, math.ceil(FILL * params.prefill * window / mean_s))


def with_baseline(runs: list[Run]) -> Iterator[tuple[Run, PolicyResult]]:
    """Each run with the result of its workload and load without a backlog (the
    `none` run, which comes first)."""
    base: dict[tuple[str, float], PolicyResult] = {}
    for r in runs:
        if r.way == "none":
            base[(r.workload, r.load)] = r.result
        yield r, base[(r.workload, r.load)]


def table(runs: list[Run]) -> str:
    lines = [
        "| workload | load | way | goodput req/s | vs none | TTFT p90 s | vs none "
        "| SLO attainment | lines done | timed out | idle used | makespan s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, none in with_baseline(runs):
        res = r.result
        b = r.batch
        batch = (
            f"{b.completed}/{b.lines} | {b.timed_out} | {b.idle_used:.1%} | {b.makespan_s:.0f}"
            if b is not None
            else "- | - | - | -"
        )
        lines.append(
            f"| {r.workload} | {r.load:g}x | {r.way} | {res.goodput_rps:.3f} "
            f"| {_ratio(res.goodput_rps, none.goodput_rps):.2%} | {res.ttft_p90_s:.2f} "
            f"| {_ratio(res.ttft_p90_s, none.ttft_p90_s):.2%} | {res.slo_attainment:.3f} "
            f"| {batch} |"
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def seeded_table(seeded: list[Seeded]) -> str:
    lines = [
        "| workload | load | seeds | `idle` TTFT p90 change, mean | sd | goodput change, mean |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in seeded:
        lines.append(
            f"| {s.workload} | {s.load:g}x | {len(s.ttft_p90_changes)} "
            f"| {statistics.mean(s.ttft_p90_changes):+.2%} | {_sd(s.ttft_p90_changes):.2%} "
            f"| {statistics.mean(s.goodput_changes):+.2%} |"
        )
    return "\n".join(lines)


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def figures_of(runs: list[Run], seeded: list[Seeded], limit: int) -> dict[str, float | int | str]:
    figures: dict[str, float | int | str] = {
        "profile": PROFILE,
        "window_s": WINDOW_S,
        "limit": limit,
    }
    for s in seeded:
        k = f"{s.workload.replace('-', '_')}_x{str(s.load).replace('.', '_')}_idle"
        figures[f"{k}_seeds"] = len(s.ttft_p90_changes)
        figures[f"{k}_ttft_p90_change_mean"] = round(statistics.mean(s.ttft_p90_changes), 4)
        figures[f"{k}_ttft_p90_change_sd"] = round(_sd(s.ttft_p90_changes), 4)
        figures[f"{k}_goodput_change_mean"] = round(statistics.mean(s.goodput_changes), 4)
    for r, none in with_baseline(runs):
        res = r.result
        k = f"{r.workload.replace('-', '_')}_x{str(r.load).replace('.', '_')}_{r.way}"
        figures[f"{k}_goodput_rps"] = round(res.goodput_rps, 4)
        figures[f"{k}_ttft_p90_s"] = round(res.ttft_p90_s, 3)
        figures[f"{k}_slo_attainment"] = round(res.slo_attainment, 4)
        b = r.batch
        if b is None:
            continue
        figures[f"{k}_goodput_change"] = round(_ratio(res.goodput_rps, none.goodput_rps) - 1, 4)
        figures[f"{k}_ttft_p90_change"] = round(_ratio(res.ttft_p90_s, none.ttft_p90_s) - 1, 4)
        figures[f"{k}_lines"] = b.lines
        figures[f"{k}_lines_completed"] = b.completed
        figures[f"{k}_lines_timed_out"] = b.timed_out
        figures[f"{k}_idle_used"] = round(b.idle_used, 4)
        figures[f"{k}_batch_makespan_s"] = round(b.makespan_s, 1)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the flat figures here")
    parser.add_argument(
        "--limit", type=int, default=0, help="keep the first N requests (and N lines): a smoke run"
    )
    parser.add_argument(
        "--find-capacity", action="store_true", help="search each workload's 1x speedup"
    )
    parser.add_argument(
        "--seeds", type=int, default=5, help="jitter seeds of the repeated none/idle runs"
    )
    args = parser.parse_args()
    runs: list[Run] = []
    seeded: list[Seeded] = []
    for workload in WORKLOADS:
        exact, repeated = run(workload, args.limit, args.find_capacity, args.seeds)
        runs += exact
        seeded += repeated
    print(table(runs))
    if seeded:
        print()
        print(seeded_table(seeded))
    emit(figures_of(runs, seeded, args.limit), args.json, decimals=4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
