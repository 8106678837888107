"""The scheduling matrix (issue 18): does the conductor win every setting of `yb sim`?

    python benchmarks/sim_matrix.py --json PATH [--limit N] [--seed S | --seeds LIST]
        [--matrix-json PATH] [--seeds-json PATH] [--docs]

Runs `yb sim --matrix` (`yb_tools.sim.matrix`: every peer policy and the conductor on
the synthetic trace and the three generated workloads, both engine models, 1x and
2x, 8P+8D and 8P+1D, and `shared-prefix-ladder`, llm-d's shape, in its own setting,
`llama2-70b-a800` at 1x, 8P+8D; `--limit 0`, the default here, runs every request of
each workload) and, on the same code, the setting Dynamo published a replay of: the
synthetic trace, the `dynamo-mocker` engine model, 8 + 8, admission `none`, the
conductor against `dynamo-kv` (Dynamo 1.6.1's own replay: mean TTFT 168.5 ms, hit
ratio 0.529).

Figures (`--json`, flat): `wins` of `settings`; `losses`, the settings lost and
the criteria missed (workload/profile/speed/shape: criteria; "" when none);
`matrix_wall_s`; and of the Dynamo setting `dynamo_setting_mooncake_ttft_mean_s`,
`..._ttft_p90_s`, `..._hit_ratio`, the same three for `dynamo_setting_dynamo_kv_`,
and `simulated_seconds_per_wall_second` (the conductor's run there).
`--matrix-json` writes the whole matrix (every policy's figures per setting, the
verdicts); `--docs` puts its table into docs/simulation.md, between the markers
`<!-- sim-matrix:begin -->` and `<!-- sim-matrix:end -->`.

`--seeds 0-5` runs the matrix on each seed (as many at once as there are cores;
the generated workloads draw other requests on each) and tells each setting across
them (`yb sim --matrix --seeds`): the table above is the first seed's, the one across
the seeds goes between `<!-- sim-seeds:begin -->` and `<!-- sim-seeds:end -->`, and
the figures add `seeds`, `wins_by_seed` and `settings_won_on_every_seed`;
`--seeds-json` writes every seed's matrix and the spread.

Everything is simulated in virtual time with fixed seeds: the same code gives the
same figures on any machine, except the wall-clock ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src"):
    sys.path.insert(0, str(ROOT / src))

from yb_tools.sim.matrix import (  # noqa: E402
    Matrix,
    Setting,
    matrix_table,
    parse_seeds,
    run_matrix,
    run_seeds,
    setting_row,
    spread_table,
)
from yb_tools.sim.params import SimParams  # noqa: E402
from yb_tools.sim.results import write_json  # noqa: E402
from yb_tools.sim.runner import PAPER_POLICY, RunSpec, simulate  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"
DOCS = ROOT / "docs" / "simulation.md"
BEGIN, END = "<!-- sim-matrix:begin -->", "<!-- sim-matrix:end -->"
SEEDS_BEGIN, SEEDS_END = "<!-- sim-seeds:begin -->", "<!-- sim-seeds:end -->"


def losses(m: Matrix) -> str:
    """The settings lost, each with the criteria it missed."""
    return "; ".join(
        f"{label(s)}: {'+'.join(s.verdict.missed())}" for s in m.settings if not s.wins
    )


def label(s: Setting) -> str:
    """workload/profile/speed/shape, as `losses` names a setting."""
    return f"{s.workload}/{s.profile}/{s.speedup:g}x/{s.prefill}P+{s.decode}D"


def dynamo_setting(seed: int) -> dict[str, float]:
    """The conductor and `dynamo-kv` on the setting Dynamo published a replay of."""
    params = SimParams(profile="dynamo-mocker", prefill=8, decode=8, seed=seed)
    specs = [RunSpec(PAPER_POLICY, PAPER_POLICY, "none"), RunSpec("dynamo-kv", "dynamo-kv", "none")]
    report = simulate(TRACE, specs, params)
    figures: dict[str, float] = {}
    for name, prefix in ((PAPER_POLICY, "mooncake"), ("dynamo-kv", "dynamo_kv")):
        r = report.policies[name]
        figures[f"dynamo_setting_{prefix}_ttft_mean_s"] = round(r.ttft_mean_s, 4)
        figures[f"dynamo_setting_{prefix}_ttft_p90_s"] = round(r.ttft_p90_s, 4)
        figures[f"dynamo_setting_{prefix}_hit_ratio"] = round(r.cache_hit_ratio, 4)
    ours = report.policies[PAPER_POLICY]
    figures["simulated_seconds_per_wall_second"] = round(ours.simulated_seconds_per_wall_second)
    return figures


def write_docs(table: str, command: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the table between the markers in docs/simulation.md."""
    text = DOCS.read_text()
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(f"{DOCS}: markers {begin} ... {end} not found")
    block = f"{begin}\n```bash\n{command}\n```\n\n{table}\n{end}"
    DOCS.write_text(head + block + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the flat figures here")
    parser.add_argument(
        "--limit", type=int, default=0, help="requests per workload (0: every request)"
    )
    seeding = parser.add_mutually_exclusive_group()
    seeding.add_argument("--seed", type=int, default=0)
    seeding.add_argument("--seeds", help="the matrix on each of these seeds: 0-5, 0,3,7")
    parser.add_argument("--matrix-json", help="write the whole matrix (the first seed's) here")
    parser.add_argument("--seeds-json", help="with --seeds: write every seed's matrix here")
    parser.add_argument("--docs", action="store_true", help="put the table in docs/simulation.md")
    args = parser.parse_args()
    if args.limit < 0:
        parser.error("--limit must be 0 (every request) or more")
    if args.seeds_json and not args.seeds:
        parser.error("--seeds-json writes the matrices of --seeds; give them")
    try:
        seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    except ValueError as exc:
        parser.error(str(exc))

    seeds_matrix = None
    if len(seeds) == 1:
        matrix = run_matrix(
            trace=TRACE,
            limit=args.limit,
            seed=seeds[0],
            on_setting=lambda s: print(setting_row(s), file=sys.stderr),
        )
    else:
        seeds_matrix = run_seeds(
            seeds,
            jobs=min(len(seeds), os.cpu_count() or 1),
            on_matrix=lambda m: print(f"seed {m.seed}: {m.wins} won", file=sys.stderr),
            trace=TRACE,
            limit=args.limit,
        )
        matrix = seeds_matrix.matrices[0]
    table = matrix_table(matrix)
    print(table)
    figures: dict[str, float | int | str] = {
        "wins": matrix.wins,
        "settings": len(matrix.settings),
        "losses": losses(matrix),
        "matrix_wall_s": round(matrix.wall_s, 1),
        "limit": args.limit,
        **dynamo_setting(seeds[0]),
    }
    if seeds_matrix is not None:
        print()
        print(spread_table(seeds_matrix))
        n = len(seeds)
        figures["seeds"] = ",".join(map(str, seeds))
        figures["wins_by_seed"] = ",".join(map(str, seeds_matrix.wins_by_seed))
        figures["settings_won_on_every_seed"] = sum(s.wins == n for s in seeds_matrix.spread)
        figures["seeds_wall_s"] = round(seeds_matrix.wall_s, 1)
    print()
    for name, value in figures.items():
        print(f"{name:<44} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if args.matrix_json:
        write_json(args.matrix_json, matrix)
    if args.seeds_json and seeds_matrix is not None:
        write_json(args.seeds_json, seeds_matrix)
    if args.docs:
        chosen = f"--seeds {args.seeds}" if args.seeds else f"--seed {args.seed}"
        command = f"python benchmarks/sim_matrix.py --limit {args.limit} {chosen}"
        if args.matrix_json:
            command += f" --matrix-json {args.matrix_json}"
        if args.seeds_json:
            command += f" --seeds-json {args.seeds_json}"
        write_docs(table, command + " --docs")
        if seeds_matrix is not None:
            write_docs(spread_table(seeds_matrix), command + " --docs", SEEDS_BEGIN, SEEDS_END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
