"""Elastic pools in `yb sim`: the conductor's planner against every static split of the
same budget of instances, and against a utilisation-threshold autoscaler.

    python benchmarks/sim_elastic.py --json PATH

Two workloads whose load changes over time (`yb sim` workloads, defaults, seed 0):
`daily`, a day compressed into an hour with a 4x peak at midday, and `phase-change`,
ten minutes of long prompts then ten minutes of long answers. The paper's engine
model (`llama2-70b-a800`), a budget of `BUDGET` instances, one kvstore per budget
slot (every run has the same pool), the conductor (`mooncake`, admission
`predicted`), SLOs TTFT 30 s and TBT 100 ms, an instance `start_s` = 60 s from the
decision to its first request.

Ways:
- `P<p>/D<d>`: every static split of the budget, held the whole run (the best one,
  most goodput, is what a user with hindsight would pick: `best_static`);
- `threshold`: the HorizontalPodAutoscaler's rule on each pool's utilisation
  (`planner_rule=threshold`), as Kubernetes ships it: a decision every 15 s and a
  scale-down stabilisation window of 300 s;
- `forecast`: the planner with its default settings.

The elastic runs start at `START` and may hold up to the budget: the day at 2 + 2
(its night), the phase change at an even split and at the best static split (the
operator's fixed configuration, made elastic). Each elastic way is labelled
`<rule>_from_<start>`. Figures, per workload `<w>_`
and way: `goodput_rps` (requests a second finished within both SLOs),
`instance_hours` (engine instances held, starting and draining included),
`slo_attainment`, `ttft_p90_s`, `actions` (the planner's adds, drains and moves carried
out); and per elastic way `goodput_vs_best` and `hours_saved_vs_best` (1 - its
instance-hours over the best static split's). Simulated in virtual time with fixed
seeds: the same code gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src"):
    sys.path.insert(0, str(ROOT / src))

import msgspec  # noqa: E402
from figures import emit  # noqa: E402

from yb_tools.sim.params import SimParams  # noqa: E402
from yb_tools.sim.results import PolicyResult  # noqa: E402
from yb_tools.sim.runner import resolve_cost  # noqa: E402
from yb_tools.sim.simulator import Simulation, block_size_for  # noqa: E402
from yb_tools.sim.static_split import best_static_split, static_splits  # noqa: E402
from yb_tools.sim.workload import workload_from  # noqa: E402
from yb_tools.sim.workloads import generate  # noqa: E402

PROFILE = "llama2-70b-a800"
BUDGET = 8
WORKLOADS = ("daily", "phase-change")
#: Where each elastic run starts, by name: (prefill, decode), or None for the best
#: static split (the operator's fixed configuration, made elastic).
START: dict[str, tuple[tuple[str, tuple[int, int] | None], ...]] = {
    "daily": (("night", (2, 2)),),
    "phase-change": (("even", (4, 4)), ("best", None)),
}
#: The HorizontalPodAutoscaler's own defaults: its sync period and its scale-down
#: stabilisation window.
HPA = {"planner_interval_s": 15.0, "planner_down_after_s": 300.0}
ELASTIC: tuple[tuple[str, dict[str, Any]], ...] = (
    ("threshold", {"planner_rule": "threshold", **HPA}),
    ("forecast", {}),
)


@dataclass(frozen=True, slots=True)
class Way:
    label: str
    result: PolicyResult
    instance_hours: float
    start: str = ""  # an elastic run's first split


def run(workload: str) -> tuple[list[Way], Way]:
    """Every way on one workload, and the best static split."""
    params = SimParams(profile=PROFILE, hosts=BUDGET)
    cost = resolve_cost(params)
    items = workload_from(generate(workload), block_size=block_size_for(params, cost))
    splits = static_splits(items, params, cost, BUDGET)
    ways = [Way(s.label, s.result, s.instance_hours) for s in splits]
    best = best_static_split(splits)
    for start, split in START[workload]:
        prefill, decode = split or (best.prefill, best.decode)
        elastic = msgspec.structs.replace(
            params, prefill=prefill, decode=decode, max_instances=BUDGET
        )
        for rule, settings in ELASTIC:
            label = f"{rule}_from_{start}"
            sim = Simulation(
                items,
                elastic,
                cost,
                policy="mooncake",
                label=label,
                settings={"planner": True, "planner_max_instances": BUDGET, **settings},
            )
            result = sim.run()
            ways.append(Way(label, result, result.instance_hours, f"P{prefill}/D{decode}"))
            print(f"{workload} {label}: done", file=sys.stderr)
    return ways, Way(best.label, best.result, best.instance_hours)


def table(workload: str, ways: list[Way], best: Way) -> str:
    lines = [
        f"{workload} (best static: {best.label})",
        "| way | start | goodput req/s | vs best | instance-hours | saved | SLO attainment "
        "| TTFT p90 s | actions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in ways:
        r = w.result
        lines.append(
            f"| {w.label} | {w.start or '-'} | {r.goodput_rps:.3f} "
            f"| {r.goodput_rps / best.result.goodput_rps:.1%} "
            f"| {w.instance_hours:.2f} | {1 - w.instance_hours / best.instance_hours:.1%} "
            f"| {r.slo_attainment:.3f} | {r.ttft_p90_s:.1f} | {r.pool_actions} |"
        )
    return "\n".join(lines)


def figures_of(runs: dict[str, tuple[list[Way], Way]]) -> dict[str, float | int | str]:
    figures: dict[str, float | int | str] = {"profile": PROFILE, "budget": BUDGET}
    for workload, (ways, best) in runs.items():
        k = workload.replace("-", "_")
        figures[f"{k}_best_static"] = best.label
        for w in ways:
            label = w.label.replace("/", "_").lower()
            r = w.result
            figures[f"{k}_{label}_goodput_rps"] = round(r.goodput_rps, 4)
            figures[f"{k}_{label}_instance_hours"] = round(w.instance_hours, 3)
            figures[f"{k}_{label}_slo_attainment"] = round(r.slo_attainment, 4)
            figures[f"{k}_{label}_ttft_p90_s"] = round(r.ttft_p90_s, 3)
            if w.start:
                figures[f"{k}_{label}_start"] = w.start
                figures[f"{k}_{label}_actions"] = r.pool_actions
                figures[f"{k}_{label}_goodput_vs_best"] = round(
                    r.goodput_rps / best.result.goodput_rps, 4
                )
                figures[f"{k}_{label}_hours_saved_vs_best"] = round(
                    1 - w.instance_hours / best.instance_hours, 4
                )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the flat figures here")
    args = parser.parse_args()
    runs = {workload: run(workload) for workload in WORKLOADS}
    for workload, (ways, best) in runs.items():
        print(table(workload, ways, best))
        print()
    emit(figures_of(runs), args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
