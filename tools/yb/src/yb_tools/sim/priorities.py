"""The priority run of docs/priorities.md: overload, two classes, four conductors.

    python -m yb_tools.sim.priorities [--limit N] [--json PATH]

1,000 requests of Mooncake's synthetic trace (benchmarks/traces/) at 3x speed on 4
prefill + 2 decode instances of the `llama2-70b-a800` profile, TTFT SLO 10 s, TBT
SLO 100 ms, a fifth of the requests at priority 1 and the rest at 0. The simulated
engines run by priority in every run; what changes is the conductor: whether it
knows (`priority_order`), and whether priority 0 is also held to half its SLO
(`priority_ceiling=1, shed_step=0.5`). Prints the per-priority table (markdown) and
the overall one; `--json` writes every run's figures.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import msgspec

from yb_tools.sim.params import SimParams
from yb_tools.sim.report import markdown_table, priority_table, summary_line
from yb_tools.sim.results import PolicyResult, write_json
from yb_tools.sim.runner import SimReport, resolve_cost
from yb_tools.sim.simulator import Simulation, block_size_for
from yb_tools.sim.workload import load_workload

TRACE = Path(__file__).resolve().parents[5] / "benchmarks" / "traces" / "synthetic_trace.jsonl"
PARAMS = SimParams(
    prefill=4,
    decode=2,
    speedup=3.0,
    ttft_slo_s=10.0,
    tbt_slo_s=0.1,
    limit=1000,
    priority_mix={0: 0.8, 1: 0.2},
)
SHED: dict[str, Any] = {"priority_ceiling": 1, "shed_step": 0.5}
# label -> the conductor's settings
RUNS: dict[str, dict[str, Any]] = {
    "unaware": {"priority_order": False},
    "aware": {"priority_order": True},
    "unaware+shed": {"priority_order": False, **SHED},
    "aware+shed": {"priority_order": True, **SHED},
}


def run(params: SimParams = PARAMS, trace: Path = TRACE) -> SimReport:
    """Every run of `RUNS` on the same workload (mooncake, predicted admission)."""
    cost = resolve_cost(params)
    bs = block_size_for(params, cost)
    items = load_workload(trace, block_size=bs, speedup=params.speedup, limit=params.limit)
    started = time.perf_counter()
    results: dict[str, PolicyResult] = {}
    for label, settings in RUNS.items():
        sim = Simulation(
            items,
            params,
            cost,
            policy="mooncake",
            admission="predicted",
            label=label,
            settings=settings,
        )
        results[label] = sim.run()
    wall = time.perf_counter() - started
    simulated = sum(r.simulated_s for r in results.values())
    return SimReport(
        policies=results,
        simulated_seconds_per_wall_second=simulated / wall if wall > 0 else 0.0,
        trace=str(trace),
        requests=len(items),
        params=params,
        cost_model=cost.name,
        block_size=bs,
        wall_s=wall,
        prefill_tp=params.degrees(cost)[0],
        decode_tp=params.degrees(cost)[1],
        devices=params.devices(cost),
    )


def main(argv: list[str] | None = None) -> None:
    """Run and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=PARAMS.limit, help="requests (1000)")
    parser.add_argument("--json", metavar="PATH", help="write every run's figures here")
    args = parser.parse_args(argv)
    report = run(msgspec.structs.replace(PARAMS, limit=args.limit))
    print(summary_line(report))
    print()
    print(priority_table(report))
    print()
    print(markdown_table(report))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
