"""`yb replay` refuses flags that the run asked for would not read, rather than run
without them: each case exits 2 before reading any log, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_tools.cli import main as yb_main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--export", "x.jsonl", "--policy", "random"],
            "--export writes the log as it is: --policy",
        ),
        (["--export", "x.jsonl", "--until", "9"], "--until"),
        (["--export", "x.jsonl", "--report", "r.html"], "--report"),
        (["--export", "x.jsonl", "--since", "-60"], "--since"),
        (["--since", "-300"], "--since choose the window of a --report"),
        (["--last", "5", "--for", "10"], "--for, --last"),
        (["--from-seq", "4"], "--from-seq"),
        (["--report", "r.html", "--keep-going"], "--report writes a timeline"),
        (["--report", "r.html", "--json", "f.json"], "--json"),
        (["--policy", "random", "--keep-going"], "a what-if (--policy, --set) has none"),
        (["--set", "admission=early", "--keep-going"], "--keep-going"),
    ],
)
def test_flags_that_would_be_ignored_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    missing = tmp_path / "no-such-log.jsonl"  # never read: the flags are refused first
    assert yb_main(["replay", "--file", str(missing), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("yb replay: ") and message in err, err


def test_a_window_with_its_report_goes_on_to_read_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-log.jsonl"
    argv = ["replay", "--file", str(missing), "--report", str(tmp_path / "r.html")]
    assert yb_main([*argv, "--since", "-300", "--last", "10"]) == 1  # the log is missing
    assert "cannot read the log" in capsys.readouterr().err
