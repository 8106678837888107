"""Run benchmarks in two checkouts alternately and compare their figures.

    python benchmarks/compare.py --before DIR [--rounds 2] [--name NAME] [--record]
                                 BENCHMARK[=ARGS] ...

For each benchmark, `--rounds` times: DIR's benchmarks/BENCHMARK.py with DIR's
`.venv/bin/python`, then this checkout's with this interpreter (A B A B ...), so both
see the same load on a shared machine as nearly as the order allows. ARGS (one string,
split as a shell would) go to both sides. Every numeric figure present on both sides is
compared by its median; the rows go to `benchmarks/results/NAME.json` (a
`ComparisonRecord`) and are printed as a table. With `--record`, this checkout's last
run of each benchmark is also written as its results file (record.py's).

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
    Comparison,
    ComparisonRecord,
    machine,
    provenance,
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


def compare(
    name: str, before: list[BenchmarkRecord], after: list[BenchmarkRecord]
) -> list[Comparison]:
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
                benchmark=name,
                figure=key,
                before=old,
                after=new,
                before_median=old_median,
                after_median=new_median,
                after_over_before=round(new_median / old_median, 3) if old_median else None,
            )
        )
    return rows


def print_table(rows: list[Comparison]) -> None:
    width = max(len(f"{r.benchmark}.{r.figure}") for r in rows)
    print(f"\n{'figure':<{width}} {'before median':>14} {'after median':>14} {'after/before':>13}")
    for r in rows:
        ratio = f"{r.after_over_before:.3f}" if r.after_over_before is not None else "-"
        print(
            f"{r.benchmark + '.' + r.figure:<{width}} {r.before_median:>14.4g} "
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

    started = dt.datetime.now(dt.UTC).replace(microsecond=0)
    rows: list[Comparison] = []
    commands = {}
    for name, args in plan:
        commands[name] = reproduce_command(name, args)
        before: list[BenchmarkRecord] = []
        after: list[BenchmarkRecord] = []
        for round_no in range(1, options.rounds + 1):
            print(f"\n=== {name} round {round_no}: before ({options.before})", flush=True)
            before.append(run_benchmark(name, args, options.before, str(before_python), flat=False))
            print(f"\n=== {name} round {round_no}: after ({ROOT})", flush=True)
            after.append(run_benchmark(name, args))
        found = compare(name, before, after)
        print_table(found)
        rows += found
        if options.record:
            print(f"written {write(after[-1])}")
        # Kept after every benchmark, so a later failure loses nothing measured.
        write(merged(options.name, options.before, started, commands, rows))
    print_table(rows)
    return 0


def merged(
    name: str, before: Path, started: dt.datetime, commands: dict[str, str], rows: list[Comparison]
) -> ComparisonRecord:
    """This invocation's rows, with the rows of other benchmarks already in the results
    file NAME kept (when it compares the same two commits): one file can be filled by
    several invocations."""
    fresh = ComparisonRecord(
        name=name,
        before_commit=provenance(before).commit,
        after_commit=provenance(ROOT).commit,
        machine=machine(),
        measured_from=started,
        measured_to=dt.datetime.now(dt.UTC).replace(microsecond=0),
        commands=commands,
        rows=rows,
    )
    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        return fresh
    old = read(path)
    if not isinstance(old, ComparisonRecord) or (old.before_commit, old.after_commit) != (
        fresh.before_commit,
        fresh.after_commit,
    ):
        return fresh
    kept = [r for r in old.rows if r.benchmark not in commands]
    return ComparisonRecord(
        name=name,
        before_commit=fresh.before_commit,
        after_commit=fresh.after_commit,
        machine=fresh.machine,
        measured_from=min(old.measured_from, started),
        measured_to=fresh.measured_to,
        commands={k: v for k, v in old.commands.items() if k not in commands} | commands,
        rows=kept + rows,
    )


if __name__ == "__main__":
    sys.exit(main())
