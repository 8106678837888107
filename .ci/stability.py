#!/usr/bin/env python3
"""Proof of stability: the whole suite several times back to back on a clean clone, then
the fault and multi-host modules several times more while a CPU hog runs beside them.

    python3 .ci/stability.py [--suite-runs 5] [--stress-runs 5] [--json PATH] [--keep]

It clones HEAD of this checkout into a temporary folder (with `../shared` beside it, as
CI has it), runs `./run-tests.sh` there (which sets the clone up first), and prints one
row per run: what ran, beside what, its exit code, pytest's counts and how long it took.
The CPU hog is `stress-ng --cpu N` (N = the machine's cores) when stress-ng is
installed, else one busy-looping process per core. Standard library only, so it runs
with the system's python3 before any set-up.

Exit status 0 only when every run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRESSED_MODULES = ["tests/test_faults.py", "tests/test_multihost.py"]
SUMMARY = re.compile(r"=+ (?P<body>.*\b(passed|failed|error|errors|skipped)\b.*) in [\d.]+s")
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def counts(output: str) -> dict[str, int]:
    """pytest's closing counts ({'passed': 495, 'skipped': 1, ...}); empty if none."""
    found: dict[str, int] = {}
    for line in output.splitlines():
        match = SUMMARY.search(line)
        if match:
            found = {}
            for number, kind in COUNT.findall(match.group("body")):
                found["errors" if kind.startswith("error") else kind] = int(number)
    return found


def clone(into: Path) -> Path:
    """A clean clone of HEAD at `into/main`, with this checkout's `../shared` beside it."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(into / "main")], check=True)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (into / "shared").symlink_to(shared)
    return into / "main"


class CpuHog:
    """Keeps every core busy until stopped."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 2
        self._processes: list[subprocess.Popen[bytes]] = []
        self.kind = ""

    def __enter__(self) -> CpuHog:
        if shutil.which("stress-ng"):
            self.kind = f"stress-ng --cpu {self.cores}"
            argv = ["stress-ng", "--cpu", str(self.cores), "--timeout", "3h", "--quiet"]
            self._processes.append(subprocess.Popen(argv))
        else:
            self.kind = f"{self.cores} busy loops"
            loop = [sys.executable, "-c", "while True: pass"]
            self._processes += [subprocess.Popen(loop) for _ in range(self.cores)]
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run(checkout: Path, label: str, beside: str, args: list[str], log_dir: Path) -> dict:
    started = time.monotonic()
    log = log_dir / f"{label}.log"
    with log.open("w") as out:
        done = subprocess.run(
            ["./run-tests.sh", *args], cwd=checkout, stdout=out, stderr=subprocess.STDOUT
        )
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    row = {
        "run": label,
        "what": " ".join(args) or "whole suite",
        "beside": beside,
        "exit": done.returncode,
        "counts": counts(text),
        "seconds": round(seconds, 1),
        "log": str(log),
    }
    failed = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if failed:
        row["failures"] = failed
    print(
        f"{label:<10} {row['what']:<48} {beside or '-':<22} exit {done.returncode:<3} "
        f"{json.dumps(row['counts']):<44} {seconds / 60:6.1f} min",
        flush=True,
    )
    for line in failed:
        print(f"           {line}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite-runs", type=int, default=5)
    parser.add_argument("--stress-runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("/tmp/notes/stability.json"))
    parser.add_argument("--keep", action="store_true", help="keep the clone and its logs")
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="yb-stability-"))
    checkout = clone(work)
    logs = work / "logs"
    logs.mkdir()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True
    ).stdout.strip()
    docker = shutil.which("docker") is not None and (
        subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )
    print(f"clean clone of {commit} in {checkout}; Docker engine running: {docker}", flush=True)
    rows = []
    started = time.monotonic()
    with (logs / "setup.log").open("w") as out:
        subprocess.run(
            ["./setup.sh"], cwd=checkout, stdout=out, stderr=subprocess.STDOUT, check=True
        )
    print(f"set-up took {(time.monotonic() - started) / 60:.1f} min", flush=True)
    try:
        for i in range(1, options.suite_runs + 1):
            rows.append(run(checkout, f"suite-{i}", "", [], logs))
        for i in range(1, options.stress_runs + 1):
            with CpuHog() as hog:
                rows.append(run(checkout, f"stress-{i}", hog.kind, STRESSED_MODULES, logs))
    finally:
        report = {
            "commit": commit,
            "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.platform()}",
            "docker_engine_running": docker,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "runs": rows,
        }
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(report, indent=2))
        print(f"written {options.json}", flush=True)
        if not options.keep:
            shutil.rmtree(work / "main", ignore_errors=True)
    return 0 if rows and all(row["exit"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
