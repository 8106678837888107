"""Request capacity against the paper's vLLM baseline (issue 19, item 6), in `yb sim`.

    python benchmarks/sim_capacity.py --json PATH [--prefill 8] [--decode 8] [--seed S]

The conductor (`mooncake`, 8 prefill + 8 decode, admission `predicted`) against the
`coupled` baseline on the same total number of instances (16 that each prefill and
decode, chunked prefill piggybacked on decode steps, a prefix cache each), on the
synthetic trace with the paper's engine model (`llama2-70b-a800`) and the simulator's
default SLOs. A policy's capacity is the highest arrival rate at which >= 90% of the
requests meet both SLOs (`yb_tools.sim.capacity`: the trace's arrivals compressed by a
bisected speedup).

Figures (flat): `coupled_capacity_rps`, `mooncake_capacity_rps`, their
`capacity_ratio` (goal >= 1.28, the low end of the paper's +28-62% on its synthetic
workload), each policy's `*_speedup` and `*_slo_attainment` there, the SLOs, the
instances and the requests. Simulated in virtual time with fixed seeds: the same code
gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src"):
    sys.path.insert(0, str(ROOT / src))

from figures import emit  # noqa: E402

from yb_tools.sim.capacity import capacity_table, run_capacity  # noqa: E402
from yb_tools.sim.coupled import COUPLED_POLICY  # noqa: E402
from yb_tools.sim.params import SimParams  # noqa: E402
from yb_tools.sim.runner import PAPER_POLICY, expand  # noqa: E402
from yb_tools.traces import read_trace  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the flat figures here")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = SimParams(
        profile="llama2-70b-a800", prefill=args.prefill, decode=args.decode, seed=args.seed
    )
    report = run_capacity(
        str(TRACE.relative_to(ROOT)),
        read_trace(str(TRACE)),
        expand([COUPLED_POLICY, PAPER_POLICY], ["predicted"]),
        params,
    )
    print(capacity_table(report))
    print()
    coupled = report.policies[COUPLED_POLICY]
    ours = report.policies[PAPER_POLICY]
    figures: dict[str, float | int | str] = {
        "profile": params.profile,
        "prefill_instances": params.prefill,
        "decode_instances": params.decode,
        "coupled_instances": params.prefill + params.decode,
        "requests": report.requests,
        "ttft_slo_s": params.ttft_slo_s,
        "tbt_slo_s": params.tbt_slo_s,
        "target_attainment": report.target_attainment,
    }
    for name, r in (("coupled", coupled), ("mooncake", ours)):
        figures[f"{name}_capacity_rps"] = round(r.capacity_rps, 3)
        figures[f"{name}_speedup"] = round(r.speedup, 4)
        figures[f"{name}_slo_attainment"] = round(r.slo_attainment, 4)
        figures[f"{name}_capped"] = r.capped
    figures["capacity_ratio"] = (
        round(ours.capacity_rps / coupled.capacity_rps, 3) if coupled.capacity_rps else 0.0
    )
    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
