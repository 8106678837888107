"""`yb replay` and `yb explain` on a log whose recorded settings do not read: exit 1
with one line naming the event, never a traceback, never a replay with defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from yb_conductor.replay import LogRecord, write_log
from yb_core import events as ev
from yb_tools.cli import main as yb_main


def _log(tmp_path: Path) -> Path:
    admitted = ev.RequestAdmitted(
        time=3.0,
        request_id="r0",
        gateway_id="g",
        model="m",
        block_size=16,
        block_hashes=[],
        prompt_tokens=10,
        max_tokens=4,
    )
    records = [
        LogRecord(seq=1, event=ev.InstanceUp(time=1.0, instance_id="p0", role="prefill", host="h")),
        LogRecord(
            seq=2,
            event=ev.ConductorConfigured(
                time=2.0, instance_id="conductor-9", settings_json='{"learn_speed": "maybe"}'
            ),
        ),
        LogRecord(seq=3, event=admitted),
        LogRecord(
            seq=4,
            event=ev.RequestRejected(
                time=3.0, request_id="r0", gateway_id="g", reason="no live decode instance"
            ),
        ),
    ]
    path = tmp_path / "log.jsonl"
    write_log(path, records)
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["replay"],
        ["replay", "--keep-going"],
        ["replay", "--set", "admission=early"],
        ["explain", "r0", "--full"],
    ],
)
def test_unreadable_recorded_settings_end_the_run_naming_the_event(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    log = _log(tmp_path)
    assert yb_main([*argv, "--file", str(log)]) == 1
    out = capsys.readouterr()
    assert out.err.startswith(f"yb {argv[0]}: ConductorConfigured at stream sequence 2 ")
    assert "'conductor-9'" in out.err and "learn_speed" in out.err
    assert "Traceback" not in out.err + out.out
    assert "reproduced" not in out.out
