"""One definition of "a timeline report of a log": what `yb replay --report` and
`yb sim --report` write."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yb_conductor.replay import LogRecord
from yb_core.config import ConductorConfig
from yb_tools.timeline.model import (
    Timeline,
    Window,
    build_timeline,
    select_requests,
    what_if_decisions,
)
from yb_tools.timeline.page import write_page


def build_report(
    records: list[LogRecord],
    window: Window = Window(),
    *,
    title: str = "",
    source: str = "",
    overrides: Mapping[str, Any] | None = None,
    cfg: ConductorConfig | None = None,
) -> Timeline:
    """The timeline of `records` over `window`; with `overrides` (a policy, settings),
    each request's decision under them as well. The what-if conductor replays the
    log from its start up to the window's last admission (it needs the whole
    history to hold the state the live one had)."""
    what_if = None
    label = ""
    if overrides:
        chosen, _, _ = select_requests(records, window)
        until = records[chosen[-1]].seq if chosen else 0
        what_if = what_if_decisions(records, overrides, until_seq=until, cfg=cfg) if chosen else {}
        label = " ".join(f"{k}={v}" for k, v in overrides.items())
    return build_timeline(
        records, window, title=title, source=source, what_if=what_if, what_if_label=label
    )


def write_report(
    records: list[LogRecord],
    path: str | Path,
    window: Window = Window(),
    *,
    title: str = "",
    source: str = "",
    overrides: Mapping[str, Any] | None = None,
    cfg: ConductorConfig | None = None,
) -> Timeline:
    """Build the report (see `build_report`) and write it to `path` as one HTML file."""
    timeline = build_report(
        records, window, title=title, source=source, overrides=overrides, cfg=cfg
    )
    write_page(timeline, path)
    return timeline
