"""docs/measurements.md is a fresh render of benchmarks/results/*.json, and every results
file holds to its struct: the page cannot disagree with what the benchmarks wrote."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_DIR = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS_DIR))

import measurements  # noqa: E402
import record  # noqa: E402


def test_every_results_file_decodes_as_its_struct() -> None:
    paths = sorted(record.RESULTS_DIR.glob("*.json"))
    assert paths, f"no results in {record.RESULTS_DIR}"
    for path in paths:
        result = record.read(path)  # raises msgspec.ValidationError on a bad file
        assert result.name == path.stem
        if isinstance(result, record.BenchmarkRecord):
            assert result.name in record.BENCHMARKS
            assert result.command.startswith(f"python benchmarks/{result.name}.py --json ")
            # every figure the page shows has a meaning
            for key in result.figures:
                measurements.describe(result.name, key)


def test_the_page_is_a_fresh_render() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / "measurements.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def a_record(figures: dict[str, record.Figure]) -> record.BenchmarkRecord:
    return record.BenchmarkRecord(
        name="conductor",
        command="python benchmarks/conductor.py --json out.json",
        machine=record.Machine(
            cpu="cpu", cores=2, memory_gib=4.0, gpu="none", os="os", python="3.11", torch="none"
        ),
        provenance=record.Provenance(
            commit="0" * 40, tree_dirty=False, measured_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        ),
        duration_s=1.0,
        load_average_1m=0.5,
        figures=figures,
    )


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    results = tmp_path / "results"
    record.write(a_record({"decisions_per_s": 7000.0}), results)
    page = tmp_path / "measurements.md"
    argv = ["--results", str(results), "--page", str(page)]
    assert measurements.main(argv) == 0
    assert "| `decisions_per_s` | 7,000 |" in page.read_text()
    assert measurements.main([*argv, "--check"]) == 0
    record.write(a_record({"decisions_per_s": 6000.0}), results)
    assert measurements.main([*argv, "--check"]) == 1


def test_a_figure_without_a_meaning_stops_the_render() -> None:
    with pytest.raises(KeyError, match="no_such_figure"):
        measurements.render([a_record({"no_such_figure": 1.0})])


def test_a_results_file_that_breaks_its_struct_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "conductor.json"
    record.write(a_record({"decisions_per_s": 7000.0}), tmp_path)
    broken = path.read_text().replace('"cores": 2', '"cores": "two"')
    path.write_text(broken)
    with pytest.raises(msgspec.ValidationError, match="cores"):
        record.read(path)


def test_nested_figures_flatten_to_one_object() -> None:
    nested = {
        "accepted": 3,
        "memory_mb": {"prefill": {"before": 1.0, "peak": 2.0}},
        "processes_dead": [],
        "later_bursts": [{"accepted": 2}],
        "other_error_kinds": ["timeout", "reset"],
    }
    assert record.flatten(nested) == {
        "accepted": 3,
        "memory_mb_prefill_before": 1.0,
        "memory_mb_prefill_peak": 2.0,
        "processes_dead": "",
        "later_bursts_1_accepted": 2,
        "other_error_kinds": "timeout, reset",
    }
