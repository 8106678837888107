"""Replay: the recorded log in, every decision recomputed, the first divergence out.

Like Temporal's replayer, a recorded history is fed to the same code that made it,
and a recomputed decision that differs from the recorded one raises a typed error
naming the stream sequence and both values. Three uses:

- `replay(records)`: verify. A fresh conductor folds the log; each recorded decision
  is compared with the one it computed when it folded the admission.
- `what_if(records, overrides)`: a conductor with other settings (or policy) lives
  with its own decisions and ignores the recorded ones; the two runs are compared
  decision by decision. A request the log rejected but the what-if schedules has no
  progress in the log, so its prefill end and its decode's end are synthesized at
  the times the what-if conductor estimated, to release the load it placed.
- `explain`: the decision for one request, as recorded (its candidate table rides
  in the event) or recomputed with the full table.

The exported log format (`write_log` / `read_log`) is JSON lines, one
`{"seq", "subject", "event"}` per event; a `.msgpack` file holds the same records as
one msgpack array (smaller, faster).
"""

from __future__ import annotations

import heapq
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from yb_conductor.conductor import Conductor, Divergence, Output
from yb_conductor.quality import DecisionQuality, reject_code
from yb_core import events as ev
from yb_core.config import ConductorConfig


class LogRecord(msgspec.Struct, kw_only=True, gc=False):
    """One event of the log with its stream sequence (and subject, for reference)."""

    seq: int
    event: ev.AnyEvent
    subject: str = ""


class NondeterminismError(Exception):
    """A recomputed decision differs from the recorded one.

    `seq` is the stream sequence of the recorded decision; `recomputed` is None when
    the conductor made no decision for that request (it never saw the admission, or
    saw it twice).
    """

    def __init__(self, divergence: Divergence) -> None:
        self.divergence = divergence
        self.seq = divergence.seq
        self.request_id = divergence.request_id
        self.recorded = divergence.recorded
        self.recomputed = divergence.recomputed
        super().__init__(describe_divergence(divergence))


def describe_divergence(d: Divergence) -> str:
    """The divergence as a readable message: where, and which fields differ."""
    what = "decision" if isinstance(d.recorded, ev.Decision) else (type(d.recorded).__name__)
    lines = [f"{what} for request {d.request_id!r} at stream sequence {d.seq} differs"]
    if d.recomputed is None:
        lines.append("  recomputed: (no decision)")
        lines.append(f"  recorded:   {_short(d.recorded)}")
        return "\n".join(lines)
    rec = msgspec.to_builtins(d.recorded)
    mine = msgspec.to_builtins(d.recomputed)
    if type(d.recorded) is not type(d.recomputed):
        lines.append(f"  recorded:   {_short(d.recorded)}")
        lines.append(f"  recomputed: {_short(d.recomputed)}")
        return "\n".join(lines)
    for key in sorted(set(rec) | set(mine)):
        if rec.get(key) != mine.get(key):
            lines.append(f"  {key}: recorded {rec.get(key)!r}")
            lines.append(f"  {' ' * len(key)}  recomputed {mine.get(key)!r}")
    return "\n".join(lines)


def _short(out: Output) -> str:
    match out:
        case ev.RequestScheduled():
            return (
                f"scheduled prefill={out.prefill_instance} decode={out.decode_instance} "
                f"reused={out.reused_blocks} ttft_est={out.estimates.ttft_s:.4f}"
            )
        case ev.RequestRejected():
            return f"rejected ({out.reason})"
        case _:
            return f"{type(out).__name__} {msgspec.to_builtins(out)}"


# --- the log as a file ----------------------------------------------------------------

_record_list = msgspec.msgpack.Decoder(list[LogRecord])
_record_json = msgspec.json.Decoder(LogRecord)


def write_log(path: str | Path, records: Iterable[LogRecord]) -> int:
    """Export records: JSON lines, or one msgpack array for a `.msgpack` path."""
    path = Path(path)
    if path.suffix in (".msgpack", ".mpk"):
        items = list(records)
        path.write_bytes(msgspec.msgpack.encode(items))
        return len(items)
    n = 0
    encoder = msgspec.json.Encoder()
    with path.open("wb") as f:
        for record in records:
            f.write(encoder.encode(record))
            f.write(b"\n")
            n += 1
    return n


def read_log(path: str | Path) -> list[LogRecord]:
    """Read an exported log (either format)."""
    path = Path(path)
    data = path.read_bytes()
    if path.suffix in (".msgpack", ".mpk"):
        return _record_list.decode(data)
    return [_record_json.decode(line) for line in data.splitlines() if line.strip()]


# --- verify ---------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """What a replay did."""

    events: int
    decisions: int
    divergences: list[Divergence]
    seconds: float
    conductor: Conductor

    @property
    def events_per_s(self) -> float:
        """Replay speed."""
        return self.events / self.seconds if self.seconds > 0 else float("inf")


def replay(
    records: Iterable[LogRecord],
    *,
    cfg: ConductorConfig | None = None,
    strict: bool = True,
    until_seq: int = 0,
    conductor: Conductor | None = None,
) -> ReplayResult:
    """Feed the log to a fresh conductor and check every recorded decision.

    `strict` raises `NondeterminismError` at the first divergence; otherwise they are
    collected. `until_seq` stops after that sequence (0: the whole log).
    """
    c = conductor or Conductor(cfg=cfg)
    events = decisions = 0
    started = time.perf_counter()
    for record in records:
        if until_seq and record.seq > until_seq:
            break
        outputs = c.apply(record.seq, record.event)
        events += 1
        decisions += sum(1 for o in outputs if isinstance(o, ev.Decision))
        if strict and c.divergences:
            raise NondeterminismError(c.divergences[0])
    return ReplayResult(events, decisions, list(c.divergences), time.perf_counter() - started, c)


# --- what if --------------------------------------------------------------------------


@dataclass
class RunSummary:
    """Decisions of one run, by request id."""

    decisions: dict[str, ev.Decision] = field(default_factory=dict)
    plans: list[ev.PoolPlanned] = field(default_factory=list)

    def add(self, d: ev.Decision) -> None:
        """Record one decision (the first for a request wins)."""
        self.decisions.setdefault(d.request_id, d)

    def figures(self) -> dict[str, float]:
        """The row values of the what-if table."""
        scheduled = [d for d in self.decisions.values() if isinstance(d, ev.RequestScheduled)]
        rejected = [d for d in self.decisions.values() if isinstance(d, ev.RequestRejected)]
        ttft = [d.estimates.ttft_s for d in scheduled]
        tbt = [d.estimates.tbt_s for d in scheduled]
        quality = DecisionQuality()
        for d in self.decisions.values():
            quality.record(d)
        out: dict[str, float] = {
            "decisions": len(self.decisions),
            "scheduled": len(scheduled),
            "rejected": len(rejected),
            "est_ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
            "est_ttft_p90_s": _pct(ttft, 0.9),
            "est_tbt_mean_s": statistics.fmean(tbt) if tbt else 0.0,
            "est_tbt_p90_s": _pct(tbt, 0.9),
            "reused_blocks": quality.reused_blocks,
            "reuse_ratio": quality.reuse_ratio,
        }
        for branch, n in sorted(quality.branches.items()):
            out[f"branch {branch}"] = n
        for code in sorted({reject_code(d.reason) for d in rejected}):
            out[f"rejected {code}"] = sum(1 for d in rejected if reject_code(d.reason) == code)
        if self.plans:
            out.update(_plan_figures(self.plans))
        return out


def _plan_figures(plans: list[ev.PoolPlanned]) -> dict[str, float]:
    """The planner's rows: its decisions, their actions by kind, and each pool's mean
    target. A what-if planner decides on the cluster the log recorded (its actions
    change no instance there): what it would have asked for at each point."""
    actions = [a for p in plans for a in p.actions]
    out: dict[str, float] = {"planner decisions": len(plans)}
    for kind in ("add", "drain", "move"):
        out[f"planner {kind}s"] = sum(1 for a in actions if a.action == kind)
    for role in ("prefill", "decode"):
        targets = [s.target for p in plans for s in p.pools if s.role == role]
        out[f"planner {role} target mean"] = statistics.fmean(targets) if targets else 0.0
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class WhatIf:
    """A recorded run against a what-if run, request by request."""

    recorded: RunSummary
    what_if: RunSummary
    changed: int
    outcome_changed: int
    prefill_changed: int
    decode_changed: int
    seconds: float

    def rows(self) -> list[tuple[str, float, float]]:
        """(metric, recorded, what-if) rows, before the change counts."""
        a = self.recorded.figures()
        b = self.what_if.figures()
        keys = list(a) + [k for k in b if k not in a]
        return [(k, a.get(k, 0.0), b.get(k, 0.0)) for k in keys]

    def changes(self) -> list[tuple[str, float]]:
        """How many decisions the what-if run made differently."""
        n = len(self.what_if.decisions)
        return [
            ("changed decisions", float(self.changed)),
            ("  scheduled <-> rejected", float(self.outcome_changed)),
            ("  other prefill instance", float(self.prefill_changed)),
            ("  other decode instance", float(self.decode_changed)),
            ("changed share", self.changed / n if n else 0.0),
        ]

    def table(self) -> str:
        """The comparison as a text table."""
        lines = [f"{'metric':<28} {'recorded':>12} {'what-if':>12} {'delta':>12}"]
        for name, a, b in self.rows():
            lines.append(f"{name:<28} {_fmt(a):>12} {_fmt(b):>12} {_fmt(b - a):>12}")
        for name, x in self.changes():
            lines.append(f"{name:<28} {'':>12} {_fmt(x):>12}")
        return "\n".join(lines)


def _fmt(x: float) -> str:
    if float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.4f}"


def what_if(
    records: list[LogRecord],
    overrides: Mapping[str, Any],
    *,
    cfg: ConductorConfig | None = None,
    until_seq: int = 0,
) -> WhatIf:
    """Replay with other settings (`overrides`, e.g. {"admission": "early"}) and
    compare with the recorded decisions."""
    recorded = RunSummary()
    fate: dict[str, bool] = {}
    for r in records:
        if until_seq and r.seq > until_seq:
            break
        if isinstance(r.event, ev.Decision):
            recorded.add(r.event)
            fate.setdefault(r.event.request_id, isinstance(r.event, ev.RequestScheduled))
        elif isinstance(r.event, ev.PoolPlanned):
            recorded.plans.append(r.event)
    c = Conductor(cfg=cfg, follow_recorded=False, overrides=overrides)
    mine = RunSummary()
    synthetic: list[tuple[float, int, ev.AnyEvent]] = []
    counter = 0
    started = time.perf_counter()
    for r in records:
        if until_seq and r.seq > until_seq:
            break
        t = r.event.time
        while synthetic and synthetic[0][0] <= t:
            c.apply(0, heapq.heappop(synthetic)[2])
        for out in c.apply(r.seq, r.event):
            if isinstance(out, ev.PoolPlanned):
                mine.plans.append(out)
            if not isinstance(out, ev.Decision):
                continue
            mine.add(out)
            if isinstance(out, ev.RequestScheduled) and not fate.get(out.request_id, False):
                # The log has no life for this request: give it the estimated one.
                for e in _synthetic_life(c, out):
                    counter += 1
                    heapq.heappush(synthetic, (e.time, counter, e))
    elapsed = time.perf_counter() - started
    changed = outcome = prefill = decode = 0
    for rid, d in mine.decisions.items():
        rec = recorded.decisions.get(rid)
        if rec is None:
            continue
        differs = False
        if type(rec) is not type(d):
            outcome += 1
            differs = True
        elif isinstance(rec, ev.RequestScheduled) and isinstance(d, ev.RequestScheduled):
            if rec.prefill_instance != d.prefill_instance:
                prefill += 1
                differs = True
            if rec.decode_instance != d.decode_instance:
                decode += 1
                differs = True
            if rec.reuse != d.reuse:
                differs = True
        changed += differs
    return WhatIf(recorded, mine, changed, outcome, prefill, decode, elapsed)


def _synthetic_life(c: Conductor, d: ev.RequestScheduled) -> list[ev.AnyEvent]:
    placement = c.state.placements.get(d.request_id)
    t0 = d.time
    prefill_end = t0 + d.estimates.ttft_s
    t_d = c.state.learned.decode_time_s
    if placement is not None and placement.max_tokens and d.estimates.tbt_s:
        t_d = min(t_d, placement.max_tokens * d.estimates.tbt_s)
    return [
        ev.RequestProgress(
            time=prefill_end,
            request_id=d.request_id,
            instance_id=d.decode_instance,
            stage="kv_committed",
        ),
        ev.RequestCancelled(time=prefill_end + t_d, request_id=d.request_id, reason="what-if"),
    ]


# --- explain --------------------------------------------------------------------------


def find_decision(records: Iterable[LogRecord], request_id: str) -> tuple[int, ev.Decision] | None:
    """The recorded decision for a request, with its sequence."""
    for r in records:
        event = r.event
        if isinstance(event, ev.Decision) and (event.request_id == request_id):
            return r.seq, event
    return None


def recompute_decision(
    records: list[LogRecord], request_id: str, *, top_k: int = 0
) -> ev.Decision | None:
    """The decision for one request recomputed from the log, with `top_k` candidates
    of each pool in its explanation (0: every instance)."""
    c = Conductor(
        overrides={"explain_top_k": top_k, "explain_decode_top_k": top_k}, ignore_explain=True
    )
    for r in records:
        for out in c.apply(r.seq, r.event):
            if isinstance(out, ev.Decision) and (out.request_id == request_id):
                return out
    return None


def to_json(obj: Any) -> str:
    """Pretty JSON of any event or struct (for `yb explain --json`)."""
    return json.dumps(msgspec.to_builtins(obj), indent=2, sort_keys=True)
