"""`yb sim` refuses flags that the run asked for would not read, rather than run
without them: each case exits 2 before simulating, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_tools.cli import main as yb_main

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--matrix", "--capacity"], "--matrix and --capacity"),
        (["--trace", str(TRACE), "--write-trace", "w.jsonl"], "--write-trace"),
        (["--matrix", "--write-trace", "w.jsonl"], "--write-trace"),
        (["--trace", str(TRACE), "--plots", "p", "--no-plots"], "--plots and --no-plots"),
        (["--trace", str(TRACE), "--capacity-iterations", "3"], "--capacity-iterations"),
        (["--trace", str(TRACE), "--capacity-max-speedup", "8"], "--capacity-max-speedup"),
        (["--trace", str(TRACE), "--trace-file", "t.jsonl"], "--trace-file"),
        (["--matrix", "--policy", "random"], "--policy"),
        (["--matrix", "--prefill", "4", "--speedup", "2"], "--prefill, --speedup"),
        (["--matrix", "--log-dir", "logs"], "--log-dir"),
        (["--trace", str(TRACE), "--capacity", "--report", "r.html"], "--report"),
        (["--trace", str(TRACE), "--limit", "-5"], "--limit -5"),
        (["--trace", str(TRACE), "--speedup", "0"], "--speedup 0"),
        (["--trace", str(TRACE), "--seeds", "0-2"], "--seeds"),
        (["--matrix", "--seed", "3", "--seeds", "0-2"], "--seed and --seeds"),
    ],
)
def test_flags_that_would_be_ignored_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "sim.json"
    assert yb_main(["sim", *argv, "--json", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("yb sim: ") and message in err
    assert not out.exists()


def test_flags_given_their_defaults_pass(tmp_path: Path) -> None:
    # What a flag would do when it repeats its default is done anyway.
    out = tmp_path / "sim.json"
    argv = [
        "sim", "--trace", str(TRACE), "--limit", "20", "--json", str(out), "--quiet",
        "--no-plots", "--capacity-iterations", "8", "--limit", "-1", "--limit", "20",
    ]  # fmt: skip
    assert yb_main(argv) == 0
    assert out.exists()
