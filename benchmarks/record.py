"""Run a benchmark and keep what it measured, with where and when, in benchmarks/results/.

    python benchmarks/record.py NAME [-- ARGS...]        # benchmarks/NAME.py --json ... ARGS
    python benchmarks/record.py --import stability PATH  # what .ci/stability.py wrote
    python benchmarks/record.py --import faults [DIR]    # the fault tests' rows (YB_FAULT_NOTES)

A benchmark writes one flat JSON object of figures (`--json PATH`); this script runs it
with this interpreter in this checkout, and writes `benchmarks/results/NAME.json`: a
`BenchmarkRecord` holding those figures exactly as the benchmark wrote them, the command
that reproduces them, the machine, the interpreter and torch versions, the commit and
the UTC time of the run. `python benchmarks/measurements.py` renders every results file
into docs/measurements.md, so a figure is written down in one place only.

The stability runs and the fault table are produced by other tools (`.ci/stability.py`,
the fault tests' `yb_testkit.faults.record`); `--import` checks their JSON against the
structs here and stores it beside the benchmarks', with the machine it is imported on
(each source also names its own machine, kept as `reported_machine` where it does).

Every results file decodes as `ResultsFile`; tests/test_measurements.py holds each file
in benchmarks/results/ to that.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

from yb_testkit.faults import NOTES_DIR, FaultRecord

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
BENCHMARKS = (
    "engine",
    "transfer",
    "containers_transfer",
    "conductor",
    "timeline",
    "grammar",
    "e2e_chat",
    "e2e_reuse",
    "overhead",
    "overload",
    "compose",
    "cpp",
    "cpp_cluster",
    "piggyback",
    "sim_matrix",
    "sim_capacity",
    "sim_tp",
    "sim_retention",
    "sim_elastic",
    "sim_batch",
    "elastic_live",
    "batch_live",
    "families",
    "hf_backend",
    "tensor_parallel",
    "kv_fp8",
    "prefix_overlap",
)
# The longest benchmark (the default model through `yb up`, on a loaded 2-core machine)
# takes minutes; an hour means something is stuck.
RUN_DEADLINE_S = 3600.0

# One figure as a benchmark writes it: flat, no nesting.
Figure = float | int | str | bool | None


class Machine(msgspec.Struct, kw_only=True, frozen=True):
    """Where a figure was measured."""

    cpu: str
    cores: int
    memory_gib: float
    gpu: str  # "none" when torch sees no CUDA device
    os: str
    python: str
    torch: str  # "none" when the interpreter has no torch

    def summary(self) -> str:
        return (
            f"{self.cpu}, {self.cores} cores, {self.memory_gib:.0f} GiB, GPU: {self.gpu}; "
            f"{self.os}; Python {self.python}, torch {self.torch}"
        )


class Provenance(msgspec.Struct, kw_only=True, frozen=True):
    """The code and the moment: `commit` is HEAD of the checkout that ran; `tree_dirty`
    says whether tracked files differed from it then."""

    commit: str
    tree_dirty: bool
    measured_at: dt.datetime  # UTC


class BenchmarkRecord(msgspec.Struct, kw_only=True, tag="benchmark"):
    """One run of benchmarks/NAME.py and the figures it wrote."""

    name: str
    command: str  # what reproduces it, from the repository root
    machine: Machine
    provenance: Provenance
    duration_s: float
    load_average_1m: float  # the machine's load when the run started (it may be shared)
    figures: dict[str, Figure]


class StabilityRun(msgspec.Struct, kw_only=True, frozen=True):
    """One row of .ci/stability.py: the suite or the stressed modules, run once."""

    run: str
    what: str
    beside: str
    exit: int
    counts: dict[str, int]
    seconds: float
    log: str = ""
    failures: list[str] = msgspec.field(default_factory=list)


class StabilityReport(msgspec.Struct, kw_only=True, frozen=True):
    """The JSON .ci/stability.py writes."""

    commit: str
    machine: str
    docker_engine_running: bool
    date: str  # "%Y-%m-%d %H:%M %Z"
    runs: list[StabilityRun]


class StabilityRecord(msgspec.Struct, kw_only=True, tag="stability"):
    """The stability runs, as imported: `report` is what .ci/stability.py wrote."""

    name: Literal["stability"] = "stability"
    command: str
    machine: Machine
    provenance: Provenance
    report: StabilityReport


class FaultTableRecord(msgspec.Struct, kw_only=True, tag="faults"):
    """The fault tests' rows (`yb_testkit.faults.record`), one per fault, by its name."""

    name: Literal["faults"] = "faults"
    command: str
    machine: Machine
    provenance: Provenance
    rows: dict[str, FaultRecord]


class Comparison(msgspec.Struct, kw_only=True, frozen=True):
    """One figure measured in two checkouts, run alternately; values in run order."""

    figure: str
    before: list[float]
    after: list[float]
    before_median: float
    after_median: float
    after_over_before: float | None  # None when the before median is 0


class ComparedBenchmark(msgspec.Struct, kw_only=True, frozen=True):
    """One benchmark run alternately in two checkouts: the code each side ran (the
    after side's working tree, with `after_tree_dirty` when it had uncommitted changes)
    and every numeric figure both sides wrote."""

    command: str
    before_commit: str
    after_commit: str
    after_tree_dirty: bool
    measured_from: dt.datetime
    measured_to: dt.datetime
    rows: list[Comparison]


class ComparisonRecord(msgspec.Struct, kw_only=True, tag="comparison"):
    """Two checkouts' figures from interleaved runs (benchmarks/compare.py), by benchmark.
    Kept as evidence beside the results; the measurements page shows only the current
    figures."""

    name: str
    machine: Machine
    benchmarks: dict[str, ComparedBenchmark]


ResultsFile = BenchmarkRecord | StabilityRecord | FaultTableRecord | ComparisonRecord

# Prints the interpreter's version, torch's and the CUDA device's name, one a line.
_PROBE = """
import platform
print(platform.python_version())
try:
    import torch
except ImportError:
    print("none"); print("none")
else:
    print(torch.__version__)
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
"""


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20), 1)
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _os_name() -> str:
    pretty = platform.system()
    release = Path("/etc/os-release")
    if release.exists():
        for line in release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip('"')
    return f"{pretty}, kernel {platform.release()}"


def machine(python: str = sys.executable) -> Machine:
    """This machine, with the versions `python` (the interpreter that runs) reports."""
    probe = subprocess.run(
        [python, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    version, torch_version, gpu = probe.stdout.split()[-3:]
    return Machine(
        cpu=_cpu_model(),
        cores=os.cpu_count() or 1,
        memory_gib=_memory_gib(),
        gpu=gpu,
        os=_os_name(),
        python=version,
        torch=torch_version,
    )


def provenance(checkout: Path) -> Provenance:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=checkout, capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()

    return Provenance(
        commit=git("rev-parse", "HEAD"),
        tree_dirty=bool(git("status", "--porcelain", "--untracked-files=no")),
        measured_at=dt.datetime.now(dt.UTC).replace(microsecond=0),
    )


def flatten(figures: Mapping[str, object], prefix: str = "") -> dict[str, Figure]:
    """One flat object from nested figures: a nested object's keys join its key with
    `_`, the N-th (from 1) object of a list becomes `KEY_N_...`, a list of plain values
    (or an empty list) one comma-separated string. Flat figures come back unchanged."""
    flat: dict[str, Figure] = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{name}_")
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for n, item in enumerate(value, 1):
                flat |= flatten(item, f"{name}_{n}_")
        elif isinstance(value, list):
            flat[name] = ", ".join(str(v) for v in value)
        else:
            flat[name] = msgspec.convert(value, Figure)
    return flat


def reproduce_command(name: str, args: list[str]) -> str:
    return shlex.join(["python", f"benchmarks/{name}.py", "--json", "out.json", *args])


def run_benchmark(
    name: str,
    args: list[str],
    checkout: Path = ROOT,
    python: str = sys.executable,
    flat: bool = True,
) -> BenchmarkRecord:
    """Run `checkout`/benchmarks/NAME.py with `python`, its output passing through, and
    return its record. Raises if it fails, or (with `flat`) if its figures are not one
    flat object; without `flat`, nested figures are flattened (another checkout's)."""
    script = checkout / "benchmarks" / f"{name}.py"
    if not script.exists():
        raise SystemExit(f"no benchmark {script}")
    where = machine(python)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"yb-record-{name}-") as tmp:
        out = Path(tmp) / "figures.json"
        started = time.monotonic()
        done = subprocess.run(
            [python, str(script), "--json", str(out), *args], cwd=checkout, timeout=RUN_DEADLINE_S
        )
        duration = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"{name} exited with {done.returncode}")
        written = msgspec.json.decode(out.read_bytes())
        try:
            figures = msgspec.convert(written, dict[str, Figure]) if flat else flatten(written)
        except msgspec.ValidationError as error:
            raise SystemExit(f"{name}'s figures are not one flat object: {error}") from None
    return BenchmarkRecord(
        name=name,
        command=reproduce_command(name, args),
        machine=where,
        provenance=provenance(checkout),
        duration_s=round(duration, 1),
        load_average_1m=round(load, 2),
        figures=figures,
    )


def import_stability(path: Path) -> StabilityRecord:
    report = msgspec.json.decode(path.read_bytes(), type=StabilityReport)
    when = dt.datetime.strptime(report.date.replace(" UTC", ""), "%Y-%m-%d %H:%M")
    return StabilityRecord(
        command="python3 .ci/stability.py --json stability.json",
        machine=machine(),
        # The commit and time the stability script ran, not the import's.
        provenance=Provenance(
            commit=report.commit, tree_dirty=False, measured_at=when.replace(tzinfo=dt.UTC)
        ),
        report=report,
    )


# The test modules that write rows of the fault table (`yb_testkit.faults.record`).
FAULT_TESTS = " ".join(
    f"tests/{name}.py"
    for name in (
        "test_faults",
        "test_nats_outage",
        "test_replan",
        "test_piggyback",
        "test_prefill_groups",
    )
)


def import_faults(directory: Path, commit: str) -> FaultTableRecord:
    """The rows in `directory`; they do not say which code wrote them, so `commit` does
    (`--commit`, else "unrecorded"; `HEAD`: this checkout as it is now)."""
    here = provenance(ROOT) if commit == "HEAD" else None
    rows = {
        path.stem: msgspec.json.decode(path.read_bytes(), type=FaultRecord)
        for path in sorted(directory.glob("*.json"))
    }
    if not rows:
        raise SystemExit(f"no fault rows in {directory} (run {FAULT_TESTS} first)")
    # The rows carry no time of their own: the newest file's is when the table was complete.
    newest = max(path.stat().st_mtime for path in directory.glob("*.json"))
    return FaultTableRecord(
        command=f"YB_FAULT_NOTES={directory} python -m pytest {FAULT_TESTS}",
        machine=machine(),
        provenance=Provenance(
            commit=here.commit if here else commit,
            tree_dirty=here.tree_dirty if here else False,
            measured_at=dt.datetime.fromtimestamp(int(newest), dt.UTC),
        ),
        rows=rows,
    )


def write(record: ResultsFile, results_dir: Path = RESULTS_DIR) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{record.name}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n")
    return path


def read(path: Path) -> ResultsFile:
    """A results file, checked against its struct (raises msgspec.ValidationError)."""
    record: ResultsFile = msgspec.json.decode(path.read_bytes(), type=ResultsFile)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", choices=BENCHMARKS, help="the benchmark to run")
    parser.add_argument(
        "--import",
        dest="source",
        nargs="+",
        metavar=("KIND", "PATH"),
        help="stability PATH, or faults [DIR] (default $YB_FAULT_NOTES or /tmp/notes/faults)",
    )
    parser.add_argument(
        "--commit",
        default="unrecorded",
        help="the commit the fault rows ran at (HEAD: this checkout)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where to write")
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `--` goes to the benchmark untouched.
    ours, passed = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    options = parser.parse_args(ours)

    record: ResultsFile
    if options.source:
        kind, *paths = options.source
        if options.name or len(paths) > 1:
            parser.error("--import takes a kind and at most one path, and no benchmark")
        if kind == "stability" and paths:
            record = import_stability(Path(paths[0]))
        elif kind == "faults":
            record = import_faults(Path(paths[0]) if paths else NOTES_DIR, options.commit)
        else:
            parser.error("--import stability PATH | --import faults [DIR]")
    elif options.name:
        record = run_benchmark(options.name, passed)
    else:
        parser.error("name a benchmark or --import")
    print(f"written {write(record, options.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
