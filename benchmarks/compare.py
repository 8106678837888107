"""Run benchmarks in two checkouts alternately and compare their figures.

    python benchmarks/compare.py --before DIR [--rounds 2] [--name NAME] [--record]
                                 BENCHMARK[=ARGS] ...

For each benchmark, `--rounds` times: DIR's benchmarks/BENCHMARK.py with DIR's
`.venv/bin/python`, then this checkout's with this interpreter (A B A B ...), so both
see the same load on a shared machine as nearly as the order allows. ARGS (one string,
split as a shell would) go to both sides. Every numeric figure present on both sides is
compared by its median, printed as a table and kept in `benchmarks/results/NAME.json`
(a `ComparisonRecord`: one entry per benchmark, with the commit each side ran; a later
invocation replaces only the entries of the benchmarks it runs). With `--record`, this
checkout's last run of each benchmark is also written as its results file (record.py's).

A benchmark that fails on either side stops the comparison: a figure missing on one
side is no comparison.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
from pathlib import Path

from record import (
    BENCHMARKS,
    RESULTS_DIR,
    ROOT,
    BenchmarkRecord,
    ComparedBenchmark,
    Comparison,
    ComparisonRecord,
    machine,
    read,
    reproduce_command,
    run_benchmark,
    write,
)


def numeric(record: BenchmarkRecord) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in record.figures.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def compare(before: list[BenchmarkRecord], after: list[BenchmarkRecord]) -> list[Comparison]:
    """Rows for every numeric figure that every run on both sides wrote."""
    sides = [numeric(r) for r in before + after]
    keys = [k for k in sides[0] if all(k in side for side in sides)]
    rows = []
    for key in keys:
        old = [numeric(r)[key] for r in before]
        new = [numeric(r)[key] for r in after]
        old_median, new_median = statistics.median(old), statistics.median(new)
        rows.append(
            Comparison(
                figure=key,
                before=old,
                after=new,
                before_median=old_median,
                after_median=new_median,
                after_over_before=round(new_median / old_median, 3) if old_median else None,
            )
        )
    return rows


def print_table(name: str, rows: list[Comparison]) -> None:
    width = max(len(f"{name}.{r.figure}") for r in rows)
    print(f"\n{'figure':<{width}} {'before median':>14} {'after median':>14} {'after/before':>13}")
    for r in rows:
        ratio = f"{r.after_over_before:.3f}" if r.after_over_before is not None else "-"
        print(
            f"{name + '.' + r.figure:<{width}} {r.before_median:>14.4g} "
            f"{r.after_median:>14.4g} {ratio:>13}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmarks", nargs="+", metavar="BENCHMARK[=ARGS]")
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="comparison", help="results file name")
    parser.add_argument("--record", action="store_true", help="record this side's last run")
    options = parser.parse_args(argv)
    before_python = options.before / ".venv" / "bin" / "python"
    if not before_python.exists():
        parser.error(f"{before_python} does not exist (run setup.sh there)")

    plan: list[tuple[str, list[str]]] = []
    for item in options.benchmarks:
        name, _, args = item.partition("=")
        if name not in BENCHMARKS:
            parser.error(f"unknown benchmark {name!r} (one of {', '.join(BENCHMARKS)})")
        plan.append((name, shlex.split(args)))

    for name, args in plan:
        started = dt.datetime.now(dt.UTC).replace(microsecond=0)
        before: list[BenchmarkRecord] = []
        after: list[BenchmarkRecord] = []
        for round_no in range(1, options.rounds + 1):
            print(f"\n=== {name} round {round_no}: before ({options.before})", flush=True)
            before.append(run_benchmark(name, args, options.before, str(before_python), flat=False))
            print(f"\n=== {name} round {round_no}: after ({ROOT})", flush=True)
            after.append(run_benchmark(name, args))
        rows = compare(before, after)
        print_table(name, rows)
        if options.record:
            print(f"written {write(after[-1])}")
        compared = ComparedBenchmark(
            command=reproduce_command(name, args),
            before_commit=before[-1].provenance.commit,
            after_commit=after[-1].provenance.commit,
            after_tree_dirty=any(r.provenance.tree_dirty for r in after),
            measured_from=started,
            measured_to=dt.datetime.now(dt.UTC).replace(microsecond=0),
            rows=rows,
        )
        # Written after every benchmark, so a later failure loses nothing measured.
        write(merged(options.name, name, compared))
    return 0


def merged(name: str, benchmark: str, compared: ComparedBenchmark) -> ComparisonRecord:
    """The results file NAME with `benchmark`'s entry replaced by `compared` (the other
    benchmarks' entries kept: one file is filled by several invocations)."""
    path = RESULTS_DIR / f"{name}.json"
    old = read(path) if path.exists() else None
    kept = old.benchmarks if isinstance(old, ComparisonRecord) else {}
    return ComparisonRecord(name=name, machine=machine(), benchmarks=kept | {benchmark: compared})


if __name__ == "__main__":
    sys.exit(main())
