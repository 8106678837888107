"""Conductor benchmark: decision latency, decisions per second, replay speed.

    python benchmarks/conductor.py --json PATH [--requests N] [--prefill 64] [--decode 16]
        [--full-scan | --compare] [--shapes 1024x256,...]

The cluster is simulated around the real conductor (`yb_tools.tracelog`): the
trace's requests (Mooncake's synthetic trace, benchmarks/traces/, with its prefix
structure: 512-token blocks whose ids chain) arrive at their timestamps on 64 prefill
instances, each with its host's kvstore (an LRU pool that logs what it stores and
evicts), and `--decode` decode instances; every instance heartbeats once a second;
engines answer at the times the conductor's own estimates give, with seeded noise.
The conductor decides every admission and its decisions are written into the log,
as the live service does. Then, on one pinned core:

- `decision_latency_p50_ms`, `decision_latency_p99_ms`: a fresh conductor replays the
  log; each admission's `apply` (fold + Algorithm 1 over every instance + decode
  prediction + admission + explanation) is timed;
- `decisions_per_s`: admissions decided per second of time spent deciding;
- `replay_events_per_s`: events per second of a verifying replay of the whole log
  (every recorded decision recomputed and compared), from decoded events in memory
  (reading the stream from NATS is not included).

The planners evaluate only the instances that can win (`yb_conductor.candidates`;
pools of up to 64 prefill or 48 decode instances whole, cheaper there);
`--full-scan` times them evaluating every instance, as Algorithm 1 reads, and
`--compare` times both on the same log (the full scan's figures get the prefix
`full_scan_`): the decisions are the same, only their cost differs.

`--prune-above P,D` evaluates pools of at most P prefill or D decode instances whole
instead of the planners' own limits: with `--compare`, `--prune-above 0,100000` times
the prefill planner pruned and whole (the decode planner whole both times), and
`--prune-above 100000,0` the decode planner (this code's planners only: the revision of
`--against` keeps its own).

`--shapes PxD,...` measures further clusters in the same run, each on a log of its own
(P prefill instances with their kvstores, D decode instances): their figures get the
suffix `_PxD` (`decisions_per_s_1024x256`), with `--compare` too.

Before the trace starts, `--pool-blocks` (default a million) unrelated blocks are
stored across the kvstores, so the index the decisions walk is production-sized.

`--against REV` also times the conductor as it was at git revision REV (its own
`benchmarks/conductor.py`, run from `git archive` of REV on the same core), a round of
REV and a round of this code in turn, `--repeats` rounds of each: the machine's speed
changes from minute to minute, so the two sides of the ratio share every minute. REV
builds its own log from the same trace (its decisions are its own). Its figures get the
prefix `against_`; `decisions_per_s_over_against` is this code's rate over REV's (a
shape's too, with `--shapes`), and `over_against_lowest_round` and
`over_against_highest_round` the lowest and highest ratio of one round's pair: the
noise the median ratio carries. Against its own revision (`--against HEAD`, with a
clean tree) the median ratio reads as 1 within that spread.

Figures are the median of `--repeats` runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Runs from a checkout without installing the packages.
for src in ("shared/core/src", "services/conductor/src", "tools/yb/src"):
    sys.path.insert(0, str(ROOT / src))

from yb_conductor.conductor import Conductor  # noqa: E402
from yb_conductor.decode_placement import DecodePlanner  # noqa: E402
from yb_conductor.prefill_placement import PrefillPlanner  # noqa: E402
from yb_conductor.replay import LogRecord, replay  # noqa: E402
from yb_core import events as ev  # noqa: E402
from yb_core.config import ConductorConfig  # noqa: E402
from yb_tools.tracelog import TraceLog, TraceLogCluster  # noqa: E402
from yb_tools.traces import read_trace  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "synthetic_trace.jsonl"


def build_log(args: argparse.Namespace) -> tuple[list[LogRecord], TraceLog, float]:
    started = time.perf_counter()
    log = TraceLog(
        cfg=ConductorConfig(cost_model=args.cost_model, admission=args.admission),
        cluster=TraceLogCluster(
            prefill=args.prefill,
            decode=args.decode,
            kvstore_blocks=args.pool_blocks // args.prefill + 20_000,
        ),
        speedup=args.speedup,
        slo=ev.Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo),
        seed=0,
    )
    if args.pool_blocks:
        log.fill_pool(args.pool_blocks // args.prefill)
    records = log.run(read_trace(args.trace, limit=args.requests))
    return records, log, time.perf_counter() - started


def time_decisions(records: list[LogRecord]) -> list[float]:
    """Seconds spent in `apply` for each admission, replaying the whole log."""
    c = Conductor()
    clock = time.perf_counter
    samples = []
    for r in records:
        if isinstance(r.event, ev.RequestAdmitted):
            start = clock()
            c.apply(r.seq, r.event)
            samples.append(clock() - start)
        else:
            c.apply(r.seq, r.event)
    assert not c.divergences, c.divergences[0]
    return samples


def full_scan(on: bool) -> None:
    """Make every planner built from now on evaluate every instance (or only the
    candidates that can win)."""
    PrefillPlanner.default_full_scan = on
    DecodePlanner.default_full_scan = on


def timed(records: list[LogRecord], repeats: int) -> dict[str, float]:
    """Decision latency and rate, and replay speed: the median of `repeats` runs."""
    p50s, p99s, rates, replay_rates = [], [], [], []
    for _ in range(repeats):
        gc.collect()
        samples = time_decisions(records)
        p50s.append(pct(samples, 0.5))
        p99s.append(pct(samples, 0.99))
        rates.append(len(samples) / sum(samples))
        gc.collect()
        result = replay(records)
        assert not result.divergences
        replay_rates.append(result.events_per_s)
    return {
        "decision_latency_p50_ms": round(statistics.median(p50s) * 1e3, 4),
        "decision_latency_p99_ms": round(statistics.median(p99s) * 1e3, 4),
        "decisions_per_s": round(statistics.median(rates), 1),
        "replay_events_per_s": round(statistics.median(replay_rates), 1),
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_limits(text: str) -> tuple[int, int]:
    """`64,48` as (64, 48): the prefill and decode planners' `prune_above`."""
    prefill, sep, decode = text.strip().partition(",")
    if not sep or not prefill.isdigit() or not decode.isdigit():
        raise argparse.ArgumentTypeError(f"--prune-above is PREFILL,DECODE, not {text!r}")
    return int(prefill), int(decode)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`1024x256,256x64` as [(1024, 256), (256, 64)]."""
    shapes = []
    for part in filter(None, text.split(",")):
        prefill, sep, decode = part.strip().partition("x")
        if not sep or not prefill.isdigit() or not decode.isdigit():
            raise argparse.ArgumentTypeError(f"a shape is PREFILLxDECODE, not {part!r}")
        shapes.append((int(prefill), int(decode)))
    return shapes


def measure(args: argparse.Namespace) -> dict[str, float | int | bool | str]:
    """Build the log of one cluster shape and time its decisions (and the full scan's)."""
    full_scan(args.full_scan)
    records, log, build_s = build_log(args)
    kinds = Counter(type(r.event).__name__ for r in records)
    quality = log.conductor.quality
    index_blocks = len(log.conductor.state.index)
    print(
        f"log: {len(records)} events ({kinds['RequestAdmitted']} admissions, "
        f"{kinds['LoadReport']} load reports, {kinds['BlockStored']} block stores, "
        f"{kinds['BlockEvicted']} evictions) built in {build_s:.1f}s; "
        f"{args.prefill} prefill + {args.prefill} kvstores + {args.decode} decode instances; "
        f"{index_blocks} blocks indexed at the end"
    )
    print(f"decisions: {quality.summary()}")

    ratios: list[float] = []
    if args.against_src is not None:
        ours, theirs, ratios = alternate(records, args)
    else:
        ours, theirs = timed(records, args.repeats), {}
    figures: dict[str, float | int | bool | str] = {
        **ours,
        "full_scan": args.full_scan,
        "prefill_instances": args.prefill,
        "decode_instances": args.decode,
        "log_events": len(records),
        "decisions": kinds["RequestAdmitted"],
        "index_blocks": index_blocks,
    }
    if args.compare:
        full_scan(True)
        figures.update({f"full_scan_{k}": v for k, v in timed(records, args.repeats).items()})
        full_scan(False)
    if theirs:
        figures["against"] = args.against
        figures.update({f"against_{k}": v for k, v in theirs.items()})
        figures["decisions_per_s_over_against"] = round(
            float(ours["decisions_per_s"]) / float(theirs["decisions_per_s"]), 3
        )
        # The spread of the rounds: how far one round's ratio strays from another's.
        figures["over_against_lowest_round"] = round(min(ratios), 3)
        figures["over_against_highest_round"] = round(max(ratios), 3)
    return figures


# What the code at `--against` reports that this run compares.
AGAINST_FIGURES = (
    "decision_latency_p50_ms",
    "decision_latency_p99_ms",
    "decisions_per_s",
    "replay_events_per_s",
    "decisions",
)
# The flags passed on to the code at `--against` (each has been in the script since
# before the candidates were pruned).
PASSED_ON = (
    "trace",
    "requests",
    "prefill",
    "decode",
    "speedup",
    "cost_model",
    "admission",
    "ttft_slo",
    "tbt_slo",
    "pool_blocks",
)


def unpack(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` (the parts the benchmark runs), under `into`."""
    parts = ["benchmarks", "shared/core", "services/conductor", "tools/yb"]
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, *parts],
        capture_output=True,
        check=False,
        timeout=120,
    )
    if archive.returncode:
        raise SystemExit(f"--against {rev}: git archive failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_against(args: argparse.Namespace) -> dict[str, float]:
    """One run of the code at `--against` on this cluster shape: its figures."""
    out = args.against_src / f"against_{args.prefill}x{args.decode}.json"
    command = [sys.executable, str(args.against_src / "benchmarks" / "conductor.py")]
    for name in PASSED_ON:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    # The child inherits this process's core: both sides run on it.
    command += ["--repeats", "1", "--no-pin", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode:
        raise SystemExit(f"--against {args.against} failed:\n{done.stderr[-3000:]}")
    found = json.loads(out.read_text())
    return {k: found[k] for k in AGAINST_FIGURES}


def alternate(
    records: list[LogRecord], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, float], list[float]]:
    """This code's figures and the `--against` revision's, a round of each in turn:
    the median of `--repeats` rounds per figure; and each round's ratio of
    decisions per second (this code's over the revision's)."""
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for _ in range(args.repeats):
        theirs.append(run_against(args))
        ours.append(timed(records, 1))
    ratios = [
        o["decisions_per_s"] / t["decisions_per_s"] for o, t in zip(ours, theirs, strict=True)
    ]
    return medians(ours), medians(theirs), ratios


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(run[k] for run in runs) for k in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=1.0, help="compress the trace's time")
    parser.add_argument("--cost-model", default="llama2-70b-a800")
    parser.add_argument("--admission", default="predicted")
    parser.add_argument("--ttft-slo", type=float, default=30.0)
    parser.add_argument("--tbt-slo", type=float, default=0.2)
    parser.add_argument(
        "--pool-blocks",
        type=int,
        default=1_000_000,
        help="unrelated blocks stored across the kvstores first (an index of production size)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pin", action="store_true", help="do not pin to one core")
    scan = parser.add_mutually_exclusive_group()
    scan.add_argument(
        "--full-scan", action="store_true", help="evaluate every instance for every decision"
    )
    scan.add_argument(
        "--compare", action="store_true", help="also time the full scan on the same log"
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also time the conductor at git revision REV, in turn with this one (against_*)",
    )
    parser.add_argument(
        "--prune-above",
        type=parse_limits,
        help="evaluate pools of at most PREFILL,DECODE instances whole "
        f"(default: the planners' own, {PrefillPlanner.prune_above},{DecodePlanner.prune_above})",
    )
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=[],
        help="further clusters to measure, PREFILLxDECODE comma-separated (keys get _PxD)",
    )
    args = parser.parse_args()

    if args.prune_above is not None:
        PrefillPlanner.prune_above, DecodePlanner.prune_above = args.prune_above
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        core = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
    with contextlib.ExitStack() as stack:
        args.against_src = None
        if args.against:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="conductor-against-"))
            args.against_src = unpack(args.against, Path(tmp))
        figures = measure(args)
        for prefill, decode in args.shapes:
            shape = argparse.Namespace(**{**vars(args), "prefill": prefill, "decode": decode})
            figures.update({f"{k}_{prefill}x{decode}": v for k, v in measure(shape).items()})
    goals = {
        "decision_latency_p99_ms": ("<", 1.0),
        "decisions_per_s": (">=", 10000.0),
        "replay_events_per_s": (">=", 50000.0),
        # No slower than the revision measured against.
        "decisions_per_s_over_against": (">=", 1.0),
    }
    print(f"\n{'figure':<44} {'value':>12}  goal")
    for name, value in figures.items():
        goal = goals.get(name) or goals.get(name.rsplit("_", 1)[0])
        note = ""
        if goal and isinstance(value, int | float):
            op, target = goal
            ok = value < target if op == "<" else value >= target
            note = f"{op} {target:g}  {'met' if ok else 'NOT met'}"
        print(f"{name:<44} {value:>12}  {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
