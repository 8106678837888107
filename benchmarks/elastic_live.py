"""Elastic pools, live: `yb up --elastic` under a load step.

    python benchmarks/elastic_live.py --json PATH [--picture docs/images/elastic_live.png]
                                      [--report PATH.html] [--export-log LOG.jsonl]
                                      [--keep DIR] [--low-rate 0.5] [--high-rate 4]
                                      [--low-s 60] [--high-s 75] [--after-s 60]

It starts `yb up --elastic --max-instances 4` with the tiny model, 1 prefill and 1
decode instance, the planner told to plan for a short run (every 5 s of log time, over
a window of 30 s, 10 s ahead, shrinking a pool once it has needed fewer for 30 s; its
margin, `planner_rate_sigmas`, is the default), and the gateway's SLOs at TTFT 2 s and TBT
0.5 s. Then `yb bench`'s client (`yb_tools.bench`, open loop, seeded Poisson arrivals,
prompts of `--prompt-tokens` with no shared prefix, `--output-tokens` each) sends
a load step: `--low-rate` requests/s for `--low-s`, `--high-rate` for `--high-s`, and
`--low-rate` again for `--after-s`. The low phase is long enough for the planner's
first decisions to settle: with nothing in the first half of its window, the first
requests look like a rising trend, and it may add an instance it drains again once
the window has seen `--low-s` of steady load. The high rate is more than one prefill instance
serves within the TTFT SLO as the conductor's cost model prices a prompt (the
built-in model, not one calibrated for the tiny model: the planner plans by it).
Once the load has ended, it waits (at most `--settle-s`) until every instance the
planner drained is down.

Figures (times in seconds, from the log's event times; the step is when the first
request of the high rate was due):
- `first_add_s`: the step to the first `PoolPlanned` with an `add` (or `move`) after
  it; `first_new_up_s`: to the first `InstanceUp` of an engine that was not up
  before; `instances_at_step`: the engines serving at the last decision before the
  step; `instances_peak`: the most engines serving at one decision;
- `ttft_p50_s_<phase>`, `ttft_p90_s_<phase>`, `ttft_within_slo_<phase>` (the share
  within the TTFT SLO), by the phase each request was sent in: `before`, `during`
  (the high rate), `during_grown` (the high rate, sent after the first new instance
  was up), `after`; as the client measured them;
- `requests_sent`, `requests_ok`, `requests_failed` and `failed_kinds`;
- when the load falls: `drains_decided` (drain and move actions after the fall),
  `first_drain_s` (the fall to the first of them), `drained` (the instances, by id),
  `drain_to_down_s_max` and `_mean` (`InstanceDraining` to `InstanceDown`, per
  instance), `drained_all_down` (every drained instance down before the deadline),
  `instances_at_end` (engines serving at the last decision).

`--picture` writes a PNG of the run's timeline (`yb replay --report`'s page, in
headless chromium) with the first decision that added an instance open, for
docs/elastic.md; `--report` keeps the page itself. Every wait has a deadline; the
run takes about four minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from cluster_log import export_log
from figures import emit

from yb_conductor.replay import LogRecord
from yb_core import events as ev
from yb_core.stats import percentile
from yb_testkit.fixtures import LocalCluster
from yb_tools.bench.client import BenchClient, RequestResult
from yb_tools.bench.runner import LoadRunner
from yb_tools.bench.workloads import Limits, RequestSpec, SharedPrefix, shared_prefix_requests

ROOT = Path(__file__).resolve().parents[1]
MAX_INSTANCES = 4
ENGINE_ROLES = ("prefill", "decode")
PHASES = ("before", "during", "during_grown", "after")
#: The planner's settings for a run of minutes (its defaults are for hours).
PLANNER_ENV = {
    "YB_CONDUCTOR__PLANNER_INTERVAL_S": "5",
    "YB_CONDUCTOR__PLANNER_WINDOW_S": "30",
    "YB_CONDUCTOR__PLANNER_LEAD_S": "10",
    "YB_CONDUCTOR__PLANNER_DOWN_AFTER_S": "30",
}


@dataclass(frozen=True, slots=True)
class Step:
    """The load step's shape: rates (requests/s) and how long each phase lasts."""

    low_rate: float
    high_rate: float
    low_s: float
    high_s: float
    after_s: float

    @property
    def rise_s(self) -> float:
        return self.low_s

    @property
    def fall_s(self) -> float:
        return self.low_s + self.high_s

    def arrivals(self, seed: int = 0) -> list[float]:
        """Seeded Poisson arrivals over the three phases (seconds from the start)."""
        rng = random.Random(f"elastic-live/{seed}")
        out: list[float] = []
        for start, length, rate in (
            (0.0, self.low_s, self.low_rate),
            (self.rise_s, self.high_s, self.high_rate),
            (self.fall_s, self.after_s, self.low_rate),
        ):
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= start + length:
                    break
                out.append(t)
        return out


def pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def workload(args: argparse.Namespace, step: Step, limits: Limits) -> list[RequestSpec]:
    """The step's requests: prompts that share no prefix, at the step's arrivals."""
    times = step.arrivals()
    prompts = shared_prefix_requests(
        SharedPrefix(
            groups=len(times),
            prefix_tokens=args.prompt_tokens,
            users=1,
            question_tokens=0,
            output_tokens=args.output_tokens,
        ),
        limits,
        seed=7,
    )
    return [msgspec.structs.replace(s, arrival_s=t) for s, t in zip(prompts, times, strict=True)]


async def load(
    args: argparse.Namespace, cluster: LocalCluster, step: Step
) -> tuple[list[RequestResult], float]:
    """Send the step; the results and the run's start in Unix seconds."""
    client = BenchClient(cluster.url, concurrency=args.concurrency, api_key=cluster.api_key)
    try:
        info = await client.server_info()
        limits = Limits(vocab_size=info.vocab_size or 256, max_model_len=info.max_model_len)
        specs = workload(args, step, limits)
        runner = LoadRunner(
            client, model=info.model, concurrency=args.concurrency, deadline_s=args.deadline
        )
        # The client's clock (perf_counter from the run's start) against the log's.
        started = time.time()
        results, _ = await runner.run(specs)
        return results, started
    finally:
        await client.close()


def drained_and_down(records: list[LogRecord], after: float) -> tuple[set[str], set[str]]:
    """The instances the planner drained (or moved) by decisions after `after`, and
    those of them logged down."""
    drained = {
        a.instance_id
        for r in records
        if isinstance(e := r.event, ev.PoolPlanned) and e.time >= after
        for a in e.actions
        if a.action in ("drain", "move")
    }
    down = {r.event.instance_id for r in records if isinstance(r.event, ev.InstanceDown)}
    return drained, drained & down


def settle(cluster: LocalCluster, log_path: Path, fall: float, deadline_s: float) -> None:
    """Wait until a drain was decided after the fall and every drained instance is down
    (or the deadline passes)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        drained, down = drained_and_down(export_log(cluster, log_path), fall)
        if drained and drained == down:
            return
        time.sleep(3.0)
    print(f"settle: not every drain was down within {deadline_s:g}s", file=sys.stderr)


def analyse(
    args: argparse.Namespace,
    step: Step,
    results: list[RequestResult],
    started: float,
    records: list[LogRecord],
) -> dict[str, Any]:
    """The figures of one run, from the client's results and the cluster's log."""
    rise, fall = started + step.rise_s, started + step.fall_s
    events = [r.event for r in records]
    plans = [e for e in events if isinstance(e, ev.PoolPlanned)]
    ups = [e for e in events if isinstance(e, ev.InstanceUp) and e.role in ENGINE_ROLES]
    initial = {e.instance_id for e in ups if e.time < started}
    grows = (p for p in plans if p.time >= rise and p.actions)
    grow = next((p for p in grows if any(a.action in ("add", "move") for a in p.actions)), None)
    new_up = next((e for e in ups if e.time >= rise and e.instance_id not in initial), None)

    def serving(p: ev.PoolPlanned) -> int:
        return sum(pool.current for pool in p.pools)

    drains = [
        (p, a) for p in plans if p.time >= fall for a in p.actions if a.action in ("drain", "move")
    ]
    draining = {
        e.instance_id: e.time
        for e in events
        if isinstance(e, ev.InstanceDraining) and e.time >= started
    }
    downs: dict[str, float] = {}
    for e in events:
        if isinstance(e, ev.InstanceDown) and e.instance_id in draining:
            downs.setdefault(e.instance_id, e.time)
    drained = sorted({a.instance_id for _, a in drains})
    to_down = [downs[i] - draining[i] for i in drained if i in draining and i in downs]

    grown_at = (new_up.time - started) if new_up is not None else None
    phases: dict[str, list[RequestResult]] = {name: [] for name in PHASES}
    for r in results:
        if r.sent_s is None:
            continue
        if r.sent_s < step.rise_s:
            phases["before"].append(r)
        elif r.sent_s < step.fall_s:
            phases["during"].append(r)
            if grown_at is not None and r.sent_s >= grown_at:
                phases["during_grown"].append(r)
        else:
            phases["after"].append(r)
    figures: dict[str, Any] = {
        "model": args.model,
        "max_instances": MAX_INSTANCES,
        "low_rate": step.low_rate,
        "high_rate": step.high_rate,
        "high_s": step.high_s,
        "ttft_slo_s": args.ttft_slo,
        "first_add_s": grow.time - rise if grow is not None else None,
        "first_add_role": grow.actions[0].role if grow is not None else "",
        "first_new_up_s": new_up.time - rise if new_up is not None else None,
        "first_new_instance": new_up.instance_id if new_up is not None else "",
        "instances_at_step": next((serving(p) for p in reversed(plans) if p.time < rise), 0),
        "instances_peak": max((serving(p) for p in plans if p.time >= started), default=0),
    }
    for name in PHASES:
        ttfts = [r.ttft_s for r in phases[name] if r.ok and r.ttft_s is not None]
        figures[f"requests_{name}"] = len(phases[name])
        figures[f"ttft_p50_s_{name}"] = pct(ttfts, 50)
        figures[f"ttft_p90_s_{name}"] = pct(ttfts, 90)
        within = sum(1 for t in ttfts if t <= args.ttft_slo)
        figures[f"ttft_within_slo_{name}"] = within / len(ttfts) if ttfts else None
    failed = [r for r in results if not r.ok]
    figures.update(
        {
            "requests_sent": sum(1 for r in results if r.sent_s is not None),
            "requests_ok": sum(1 for r in results if r.ok),
            "requests_failed": len(failed),
            "failed_kinds": ",".join(sorted({r.error for r in failed})),
            "drains_decided": len(drains),
            "first_drain_s": drains[0][0].time - fall if drains else None,
            "drained": ",".join(drained),
            "drain_to_down_s_max": max(to_down, default=None),
            "drain_to_down_s_mean": statistics.fmean(to_down) if to_down else None,
            "drained_all_down": bool(drained) and len(to_down) == len(drained),
            "instances_at_end": serving(plans[-1]) if plans else 0,
        }
    )
    return figures


def print_plans(records: list[LogRecord], started: float) -> None:
    """Every planner decision with an action, on stderr."""
    for r in records:
        e = r.event
        if isinstance(e, ev.PoolPlanned) and e.actions and e.time >= started:
            print(f"{e.time - started:7.1f}s  {e.reason}", file=sys.stderr)


async def screenshot(page_path: Path, plan: int) -> bytes:
    """A PNG of the page with planner decision `plan` open (-1: none)."""
    from yb_testkit.browser import Browser

    async with Browser.launch() as browser:
        # As high as the lanes, the panel and the legend of a run of 4 engines.
        page = await browser.new_page(width=1400, height=480)
        await page.navigate(page_path.as_uri())
        await page.wait_for("window.__ybTimelineReady", timeout_s=30)
        if plan >= 0:
            await page.evaluate(f"window.ybTimeline.selectPlan({plan})")
        await page.evaluate("new Promise(r => requestAnimationFrame(() => r(true)))")
        return await page.screenshot()


def picture(records: list[LogRecord], rise: float, png: Path | None, html: Path | None) -> None:
    """The run's timeline page (`html`) and a PNG of it (`png`) with the first decision
    that added an instance after the step (`rise`, event time) open."""
    from yb_testkit.browser import find_chromium
    from yb_tools.timeline.page import write_page
    from yb_tools.timeline.report import build_report

    timeline = build_report(records, title="yb up --elastic: a load step", source="live log")
    with tempfile.TemporaryDirectory(prefix="yb-elastic-page-") as tmp:
        page_path = write_page(timeline, html or Path(tmp) / "timeline.html")
        if png is None:
            return
        if find_chromium() is None:
            print("no chromium on PATH: no picture", file=sys.stderr)
            return
        plans = timeline.plans
        after = rise - timeline.meta.t0
        adds = [
            k
            for k, p in enumerate(plans)
            if p.time >= after and any(a.action == "add" for a in p.actions)
        ]
        shot = asyncio.run(screenshot(page_path, adds[0] if adds else -1))
    png.parent.mkdir(parents=True, exist_ok=True)
    png.write_bytes(shot)
    print(f"picture: {png}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="tiny-random", help="tiny-random, default or a dir")
    parser.add_argument("--low-rate", type=float, default=0.5, help="requests/s")
    parser.add_argument("--high-rate", type=float, default=4.0, help="requests/s")
    parser.add_argument("--low-s", type=float, default=60.0)
    parser.add_argument("--high-s", type=float, default=75.0)
    parser.add_argument("--after-s", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--tbt-slo", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=64, help="in flight at most")
    parser.add_argument("--deadline", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--settle-s", type=float, default=60.0, help="wait for drains after")
    parser.add_argument(
        "--picture", type=Path, default=ROOT / "docs" / "images" / "elastic_live.png"
    )
    parser.add_argument("--no-picture", action="store_true")
    parser.add_argument("--report", type=Path, help="keep the timeline page here (.html)")
    parser.add_argument("--export-log", type=Path, help="keep the event log here (.jsonl)")
    parser.add_argument("--keep", type=Path, help="run the cluster in this dir and keep it")
    args = parser.parse_args(argv)
    step = Step(args.low_rate, args.high_rate, args.low_s, args.high_s, args.after_s)

    env = {
        **PLANNER_ENV,
        "YB_GATEWAY__TTFT_SLO_S": str(args.ttft_slo),
        "YB_GATEWAY__TBT_SLO_S": str(args.tbt_slo),
    }
    wall = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="yb-elastic-live-")))
        data_dir = args.keep or tmp / "cluster"
        log_path = args.export_log or tmp / "log.jsonl"
        cluster = LocalCluster(
            data_dir,
            *("--model", args.model, "--model-name", "tiny"),
            *("--prefill", "1", "--decode", "1", "--kvstore", "1"),
            *("--elastic", "--max-instances", str(MAX_INSTANCES)),
            env=env,
        )
        cluster.start(timeout_s=240)
        try:
            results, started = asyncio.run(load(args, cluster, step))
            settle(cluster, log_path, started + step.fall_s, args.settle_s)
            records = export_log(cluster, log_path)
        finally:
            cluster.stop()
    figures = analyse(args, step, results, started, records)
    figures["run_wall_s"] = time.monotonic() - wall
    print_plans(records, started)
    if args.report or not args.no_picture:
        png = None if args.no_picture else args.picture
        picture(records, started + step.rise_s, png, args.report)
    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
