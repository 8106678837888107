"""benchmarks/conductor.py: an older revision timed beside this code (`--against`), and the
planners pruned below their limits (`--prune-above`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "conductor.py"
# A small cluster and the trace's first requests: seconds, not minutes.
SMALL = [
    "--requests", "80", "--pool-blocks", "2000", "--prefill", "4", "--decode", "2",
    "--repeats", "1", "--no-pin",
]  # fmt: skip

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="--against reads the revision from this checkout's git history",
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )


def test_against_a_revision_times_both_sides_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = run("--against", "HEAD", "--repeats", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["against"] == "HEAD"
    # The revision built its own log of the same requests and decided every one.
    assert figures["against_decisions"] == figures["decisions"] > 0
    assert figures["against_decisions_per_s"] > 0
    ratio = figures["decisions_per_s"] / figures["against_decisions_per_s"]
    assert figures["decisions_per_s_over_against"] == round(ratio, 3)
    assert "decisions_per_s_over_against" in done.stdout
    # The median ratio lies within the spread of the three rounds' own ratios.
    low, high = figures["over_against_lowest_round"], figures["over_against_highest_round"]
    assert 0 < low <= figures["decisions_per_s_over_against"] <= high


def test_an_unknown_revision_is_refused_by_name() -> None:
    done = run("--against", "no-such-revision-here")
    assert done.returncode != 0
    assert "--against no-such-revision-here: git archive failed" in done.stderr


def test_prune_limits_are_read_as_prefill_comma_decode() -> None:
    done = run("--prune-above", "64")
    assert done.returncode == 2
    assert "--prune-above is PREFILL,DECODE, not '64'" in done.stderr


def test_pruning_even_the_smallest_pools_decides_as_the_full_scan(tmp_path: Path) -> None:
    # The log is built with both planners pruned (a 4 + 2 cluster is far below their
    # limits); `--compare` replays it whole, and any decision that differs fails it.
    out = tmp_path / "figures.json"
    done = run("--prune-above", "0,0", "--compare", "--json", str(out))
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["decisions"] > 0
    assert figures["full_scan_decisions_per_s"] > 0
