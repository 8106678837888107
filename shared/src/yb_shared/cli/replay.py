"""`yb replay`: the log, decision by decision.

    yb replay [--file LOG | --nats URL | --data-dir DIR]        verify every decision
    yb replay ... --export LOG                                   dump the log to a file
    yb replay ... --policy NAME --set key=value [--set ...]      what-if table

Verify feeds a fresh conductor the whole log (live stream up to its current end, or
an exported file) and checks every recorded decision; the first divergence is
printed with its stream sequence and both decisions, and the exit code is 1. A
what-if run decides with other settings and prints how decisions, estimated
TTFT/TBT and rejections move. The conductor code is imported only here, so `yb`
works (up, status) without it installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yb_shared.config import YbConfig

if TYPE_CHECKING:
    from yb_conductor.replay import LogRecord


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
        help="what-if: a conductor setting (repeatable), e.g. admission=early",
    )
    p.add_argument("--until", type=int, default=0, metavar="SEQ", help="stop after SEQ")
    p.add_argument("--keep-going", action="store_true", help="list every divergence")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def add_source_args(p: argparse.ArgumentParser) -> None:
    """Where the log comes from: a file, or the live stream."""
    p.add_argument("--file", help="an exported log (yb replay --export)")
    p.add_argument("--nats", help="NATS URL (default: the running `yb up`'s)")
    p.add_argument("--data-dir", help="data directory of a running `yb up`")


def load_records(cfg: YbConfig, args: argparse.Namespace) -> list[LogRecord]:
    """The log from `--file`, or from the stream up to its end as of now."""
    from yb_conductor.replay import read_log

    if args.file:
        return read_log(args.file)
    return asyncio.run(_read_stream(cfg, args))


async def _read_stream(cfg: YbConfig, args: argparse.Namespace) -> list[LogRecord]:
    from yb_conductor.replay import LogRecord
    from yb_shared.bus import Bus
    from yb_shared.cli.launcher import read_cluster_info
    from yb_shared.credentials import cli_nats_config

    url = args.nats
    if not url:
        info = read_cluster_info(cfg.resolved_data_dir())
        url = info.nats_url if info else cfg.nats.url
    # The data dir of a `yb up` lends its `admin` NATS user unless one is configured.
    cfg.nats = cli_nats_config(cfg, url)
    bus = await Bus.connect(cfg.nats, "yb-replay", timeout_s=5.0)
    records: list[LogRecord] = []
    try:
        last = await bus.last_sequence()
        if last == 0:
            return records
        reader = await bus.read_ordered()
        try:
            while True:
                item = await reader.next(timeout_s=5.0)
                if item is None:
                    break  # the tail was deleted or is out of reach
                records.append(LogRecord(seq=item.seq, event=item.event, subject=item.subject))
                if item.seq >= last:
                    break
        finally:
            await reader.close()
    finally:
        await bus.close()
    return records


def run(cfg: YbConfig, args: argparse.Namespace) -> int:
    """`yb replay`."""
    from yb_conductor.replay import (
        NondeterminismError,
        describe_divergence,
        replay,
        what_if,
        write_log,
    )
    from yb_conductor.settings import SettingsError, parse_assignments
    from yb_shared.bus import BusUnavailable

    try:
        records = load_records(cfg, args)
    except (OSError, BusUnavailable) as exc:
        print(f"yb replay: cannot read the log: {exc}", file=sys.stderr)
        return 1
    if args.export:
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
    if overrides:
        try:
            report = what_if(records, overrides, cfg=cfg.conductor, until_seq=args.until)
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
    started = time.perf_counter()
    try:
        result = replay(
            records, cfg=cfg.conductor, strict=not args.keep_going, until_seq=args.until
        )
    except NondeterminismError as exc:
        print(f"NondeterminismError: {exc}")
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
