"""`yb replay`: the log, decision by decision.

    yb replay [--file LOG | --nats URL | --data-dir DIR]        verify every decision
    yb replay ... --export LOG                                   dump the log to a file
    yb replay ... --policy NAME --set key=value [--set ...]      what-if table
    yb replay ... --report out.html [--since S --for S | --from-seq N --until SEQ]
                  [--last N] [--policy NAME --set key=value]    timeline report

Verify feeds a fresh conductor the whole log (live stream up to its current end, or
an exported file) and checks every recorded decision; the first divergence is
printed with its stream sequence and both decisions, and the exit code is 1. A
what-if run decides with other settings and prints how decisions, estimated
TTFT/TBT and rejections move. The conductor code is imported only here, so `yb`
works (up, status) without it installed.

The log is bounded (`nats.max_bytes`, `nats.max_age_s`), so its head may be gone.
A replay never presents a partial log as the whole: when the stream starts past
seq 1 it says so and replays from the conductor's latest snapshot, which covers
what was trimmed (decisions after the snapshot are verified), or refuses, naming
the first retained sequence, when no snapshot reaches back to it. A what-if run
and an exported file that starts past seq 1 are refused the same way (both need
the log from its beginning).

Settings the log records (`ConductorConfigured`) that cannot be read end any run
with exit code 1 and a message naming the event: the conductor would decide with
other settings than recorded. `--set` takes any conductor setting, including the
switches that exist only so that old logs replay as recorded
(`yb_conductor.compat`): setting one is how to see what today's behaviour would
have decided on an old log, or the old behaviour on a new one.

`--report` writes the timeline of a window of the log as one self-contained HTML
file (docs/timeline.md): lanes per instance, and each request's decision on a click;
with `--policy`/`--set`, the what-if decision of every request beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yb_core.config import YbConfig
from yb_tools.cli.flags import defaults_of, given

if TYPE_CHECKING:
    from yb_conductor.replay import LogRecord
    from yb_conductor.snapshot import Snapshot


class TrimmedLog(Exception):
    """The log does not reach back to what was asked (the message says how far)."""


@dataclass
class LoadedLog:
    """What a replay reads: the retained records, where the log starts, and the
    conductor's latest snapshot when the head is gone (None otherwise)."""

    records: list[LogRecord]
    first_seq: int = 1
    snapshot: Snapshot | None = None
    source: str = "the log"

    @property
    def trimmed(self) -> bool:
        """Whether events from seq 1 on are missing."""
        return self.first_seq > 1

    def gone(self) -> str:
        """The trimmed part, in words."""
        return (
            f"{self.source} starts at seq {self.first_seq} (seq 1..{self.first_seq - 1} "
            "trimmed by the stream's limits, nats.max_bytes / nats.max_age_s)"
        )

    def start(self, until_seq: int = 0) -> tuple[Snapshot | None, list[LogRecord]]:
        """Where a complete replay starts: (None, every record) for a whole log, or
        (snapshot, the records after it). Raises `TrimmedLog` when neither is."""
        if not self.trimmed:
            return None, self.records
        snap = self.snapshot
        if snap is None or snap.last_seq < self.first_seq - 1:
            latest = f"the latest is at seq {snap.last_seq}" if snap else "there is none"
            raise TrimmedLog(
                f"{self.gone()}, and no conductor snapshot reaches back to it "
                f"({latest}): a replay from seq {self.first_seq} would not be complete"
            )
        if until_seq and until_seq <= snap.last_seq:
            raise TrimmedLog(
                f"{self.gone()}; the conductor's snapshot is at seq {snap.last_seq}, "
                f"past --until {until_seq}"
            )
        return snap, [r for r in self.records if r.seq > snap.last_seq]


def add_parser(sub: Any) -> None:
    """Register `yb replay`."""
    p = sub.add_parser("replay", help="reproduce the conductor's decisions from the log")
    add_source_args(p)
    p.add_argument("--export", metavar="FILE", help="write the log to FILE (.jsonl or .msgpack)")
    p.add_argument("--policy", help="what-if: decide with this policy instead")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="what-if: a conductor setting (repeatable), e.g. admission=early "
        "(or a switch kept for old logs, yb_conductor.compat, e.g. learn_speed=true)",
    )
    p.add_argument("--until", type=int, default=0, metavar="SEQ", help="stop after SEQ")
    p.add_argument("--keep-going", action="store_true", help="list every divergence")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    add_report_args(p)


def add_report_args(p: argparse.ArgumentParser) -> None:
    """`--report` and the flags that choose its window."""
    from yb_tools.timeline.model import DEFAULT_LAST

    g = p.add_argument_group(
        "timeline report",
        "a window of the log as one self-contained HTML file (docs/timeline.md); the "
        "window is the requests admitted in it (--until bounds it too)",
    )
    g.add_argument("--report", metavar="PATH", help="write the timeline of the window here")
    g.add_argument(
        "--from-seq", type=int, default=0, metavar="SEQ", help="admissions from this seq on"
    )
    g.add_argument(
        "--since",
        type=float,
        default=None,
        metavar="SECONDS",
        help="admissions from SECONDS of event time after the log's first event; "
        "negative: before its last (--since -300: the last five minutes)",
    )
    g.add_argument(
        "--for",
        dest="for_s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the window's length from --since (default: to the end)",
    )
    g.add_argument(
        "--last",
        type=int,
        default=DEFAULT_LAST,
        metavar="N",
        help=f"at most the window's last N requests (default {DEFAULT_LAST:,}; 0: all)",
    )


# What each kind of run reads besides the log (argparse dest -> how it is spelt).
_WINDOW_FLAGS = {"from_seq": "--from-seq", "since": "--since", "for_s": "--for", "last": "--last"}
_RUN_FLAGS = {
    "policy": "--policy",
    "settings": "--set",
    "until": "--until",
    "keep_going": "--keep-going",
    "json": "--json",
    "report": "--report",
}


def ineffective_flags(args: argparse.Namespace) -> str | None:
    """Why some flags given would not take effect in the run the others ask for, or
    None (a flag is given when it differs from its default: `yb_tools.cli.flags`)."""
    defaults = defaults_of(add_parser)
    window = given(args, defaults, _WINDOW_FLAGS)
    if args.export and (flags := given(args, defaults, _RUN_FLAGS) + window):
        return f"--export writes the log as it is: {', '.join(flags)} would be ignored"
    if window and not args.report:
        return f"{', '.join(window)} choose the window of a --report; give one, or leave them out"
    if args.report and (
        flags := given(args, defaults, {"keep_going": "--keep-going", "json": "--json"})
    ):
        return f"--report writes a timeline, verifying nothing: {', '.join(flags)} would be ignored"
    if (args.policy or args.settings) and args.keep_going:
        return (
            "--keep-going lists the divergences of a replay; a what-if (--policy, --set) has none"
        )
    return None


def add_source_args(p: argparse.ArgumentParser) -> None:
    """Where the log comes from: a file, or the live stream."""
    p.add_argument("--file", help="an exported log (yb replay --export)")
    p.add_argument("--nats", help="NATS URL (default: the running `yb up`'s)")
    p.add_argument("--data-dir", help="data directory of a running `yb up`")


def load_log(cfg: YbConfig, args: argparse.Namespace) -> LoadedLog:
    """The log from `--file`, or from the stream up to its end as of now (with the
    conductor's snapshot when the stream's head is trimmed)."""
    from yb_conductor.replay import read_log

    if args.file:
        records = read_log(args.file)
        first = records[0].seq if records and records[0].seq > 1 else 1
        return LoadedLog(records, first_seq=first, source=f"the exported log {args.file}")
    return asyncio.run(_read_stream(cfg, args))


async def _read_stream(cfg: YbConfig, args: argparse.Namespace) -> LoadedLog:
    from yb_conductor.replay import LogRecord
    from yb_core.bus import Bus
    from yb_core.credentials import cli_nats_config
    from yb_tools.cli.launcher import read_cluster_info

    url = args.nats
    if not url:
        info = read_cluster_info(cfg.resolved_data_dir())
        url = info.nats_url if info else cfg.nats.url
    # The data dir of a `yb up` lends its `admin` NATS user unless one is configured.
    cfg.nats = cli_nats_config(cfg, url)
    bus = await Bus.connect(cfg.nats, "yb-replay", timeout_s=5.0)
    records: list[LogRecord] = []
    loaded = LoadedLog(records)
    try:
        extent = await bus.log_extent()
        last = extent.last_seq
        if extent.trimmed:
            loaded.first_seq = extent.first_seq
            loaded.snapshot = await _latest_snapshot(bus, cfg.conductor.snapshot_bucket)
        if last == 0 or last < extent.first_seq:
            return loaded
        reader = await bus.read_ordered(start_seq=extent.first_seq)
        try:
            while True:
                item = await reader.next(timeout_s=5.0)
                if item is None:
                    break  # the tail was deleted or is out of reach
                if not records and item.seq > loaded.first_seq:
                    # Trimmed further while we opened the reader.
                    loaded.first_seq = item.seq
                records.append(LogRecord(seq=item.seq, event=item.event, subject=item.subject))
                if item.seq >= last:
                    break
        finally:
            await reader.close()
    finally:
        await bus.close()
    return loaded


async def _latest_snapshot(bus: Any, bucket: str) -> Snapshot | None:
    """The conductor's latest snapshot from its object store, or None."""
    import nats.errors
    import nats.js.errors

    from yb_conductor.service import read_snapshot

    try:
        store = await bus.jetstream.object_store(bucket)
    except (nats.errors.Error, nats.js.errors.Error):
        return None  # no conductor ever ran here, or this user may not read it
    return await read_snapshot(store)


def run(cfg: YbConfig, args: argparse.Namespace) -> int:
    """`yb replay`."""
    from yb_conductor.replay import (
        NondeterminismError,
        describe_divergence,
        replay,
        what_if,
        write_log,
    )
    from yb_conductor.settings import RecordedSettingsError, SettingsError, parse_assignments
    from yb_conductor.snapshot import SnapshotError, restore
    from yb_core.bus import BusUnavailable

    if (why := ineffective_flags(args)) is not None:
        print(f"yb replay: {why}", file=sys.stderr)
        return 2
    try:
        loaded = load_log(cfg, args)
    except (OSError, BusUnavailable) as exc:
        print(f"yb replay: cannot read the log: {exc}", file=sys.stderr)
        return 1
    records = loaded.records
    if args.export:
        if loaded.trimmed:
            print(f"note: {loaded.gone()}; the export holds what remains")
        n = write_log(args.export, records)
        print(f"exported {n} events (seq {records[0].seq if records else 0}..", end="")
        print(f"{records[-1].seq if records else 0}) to {args.export}")
        return 0
    try:
        overrides: dict[str, Any] = parse_assignments(args.settings)
    except SettingsError as exc:
        print(f"yb replay: {exc}", file=sys.stderr)
        return 2
    if args.policy:
        overrides["policy"] = args.policy
    if overrides and loaded.trimmed:
        print(
            f"yb replay: {loaded.gone()}: a what-if run needs the log from seq 1",
            file=sys.stderr,
        )
        return 1
    if args.report:
        return _write_report(cfg, args, loaded, overrides)
    if overrides:
        try:
            report = what_if(records, overrides, cfg=cfg.conductor, until_seq=args.until)
        except RecordedSettingsError as exc:
            print(f"yb replay: {exc}", file=sys.stderr)
            return 1
        except (SettingsError, ValueError) as exc:
            print(f"yb replay: {exc}", file=sys.stderr)
            return 2
        settings = " ".join(f"{k}={v}" for k, v in overrides.items())
        print(f"what-if {settings}: {len(records)} events in {report.seconds:.2f}s")
        print(report.table())
        if args.json:
            rows: dict[str, Any] = {
                name: {"recorded": a, "what_if": b} for name, a, b in report.rows()
            }
            rows.update({name: {"what_if": x} for name, x in report.changes()})
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    try:
        snap, records = loaded.start(args.until)
    except TrimmedLog as exc:
        print(f"yb replay: {exc}", file=sys.stderr)
        return 1
    if snap is not None:
        print(
            f"{loaded.gone()}; replaying from the conductor's snapshot at seq "
            f"{snap.last_seq}: decisions after it are verified"
        )
    started = time.perf_counter()
    try:
        result = replay(
            records,
            cfg=cfg.conductor,
            strict=not args.keep_going,
            until_seq=args.until,
            conductor=restore(snap) if snap is not None else None,
        )
    except NondeterminismError as exc:
        print(f"NondeterminismError: {exc}")
        return 1
    except (RecordedSettingsError, SnapshotError) as exc:
        print(f"yb replay: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    quality = result.conductor.quality.summary()
    print(
        f"replayed {result.events} events, {result.decisions} decisions in {elapsed:.2f}s "
        f"({result.events_per_s:,.0f} events/s)"
    )
    for d in result.divergences:
        print(describe_divergence(d))
    if result.divergences:
        print(f"{len(result.divergences)} divergence(s)")
    else:
        print("every recorded decision reproduced")
    for key, value in quality.items():
        print(f"  {key:<28} {value}")
    if args.json:
        figures = {"events": result.events, "decisions": result.decisions, **quality}
        figures["divergences"] = len(result.divergences)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if result.divergences else 0


def _write_report(
    cfg: YbConfig, args: argparse.Namespace, loaded: LoadedLog, overrides: dict[str, Any]
) -> int:
    """`yb replay --report`: the window's timeline, with what-if decisions when asked."""
    from yb_conductor.settings import RecordedSettingsError, SettingsError
    from yb_tools.timeline.model import Window
    from yb_tools.timeline.report import write_report

    window = Window(
        from_seq=args.from_seq,
        until_seq=args.until,
        since_s=args.since,
        for_s=args.for_s,
        last=args.last,
    )
    if loaded.trimmed:
        print(f"note: {loaded.gone()}; the report covers what remains")
    started = time.perf_counter()
    try:
        timeline = write_report(
            loaded.records,
            args.report,
            window,
            source=loaded.source if args.file else "the live stream",
            overrides=overrides or None,
            cfg=cfg.conductor,
        )
    except RecordedSettingsError as exc:
        print(f"yb replay: {exc}", file=sys.stderr)
        return 1
    except (SettingsError, ValueError) as exc:
        print(f"yb replay: {exc}", file=sys.stderr)
        return 2
    meta = timeline.meta
    print(
        f"timeline of {meta.requests_shown} requests ({meta.window}"
        + (f"; what-if {meta.what_if}" if meta.what_if else "")
        + f") written to {args.report} in {time.perf_counter() - started:.2f}s"
    )
    if meta.note:
        print(f"note: {meta.note}")
    return 0
