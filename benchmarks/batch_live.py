"""The Batch API live: a batch of chat lines beside interactive load, through `yb up`.

    python benchmarks/batch_live.py --json PATH [--model default] [--lines 500]
                                    [--requests 60] [--rate 0.5] [--no-after]
                                    [--batch-deadline 900] [--keep DIR]

It starts one cluster (`yb up`, `--model`, its default shape), with the gateway's SLOs
at TTFT `--ttft-slo` and TBT `--tbt-slo` (the conductor holds a batch line back unless
it fits in what interactive traffic leaves idle, its decode TBT within a share of
that SLO: `yb_conductor.batch_admission`), and measures in three phases:

- `alone`: `yb bench`'s client (`yb_tools.bench`: open loop, streamed, timed as the
  tokens arrive) sends `--requests` interactive requests, seeded Poisson arrivals at
  `--rate` requests/s, prompts of `--prompt-tokens` with no shared prefix,
  `--output-tokens` each, nothing else running;
- `with_batch`: the official `openai` client uploads a JSONL of `--lines` chat lines
  (`files.create(purpose="batch")`, short distinct questions, `--batch-max-tokens`
  each) and creates the batch (`batches.create`, `/v1/chat/completions`, `24h`);
  then the same interactive load (the same arrivals, prompts of their own so no
  prefix is reused across phases) runs beside it. The batch is polled
  (`batches.retrieve`) every `--poll-s` until it is `completed` (or another
  terminal status, or `--batch-deadline` seconds after its creation), and its
  output and error files are read back;
- `after` (unless `--no-after`): the same load alone once more, for the drift of
  the machine over the run.

Figures (times in seconds):
- by phase (`alone`, `with_batch`, `after`): `ttft_p50_s_`, `ttft_p90_s_` of the
  completed interactive requests as the client measured them, `tbt_p90_s_` (the
  90th percentile of every gap between streamed tokens), `goodput_` (the share of
  the requests sent that completed within both SLOs, TBT judged at each request's
  90th percentile gap), `requests_ok_`, `requests_failed_`, `failed_kinds_`, and
  `load_average_1m_` (the machine's when the phase started: it may be shared);
  `ttft_p90_ratio` is `with_batch` over `alone`;
- the batch: `batch_status`, `batch_completion_s` (from `batches.create` to the
  first poll that saw `completed`), `batch_lines_per_s`, `batch_counts_*` (its
  `request_counts`), `batch_completed_during_load` (lines done when the last
  interactive request of `with_batch` ended) and `batch_outlived_load` (whether
  the batch was still running then: the whole interactive phase ran beside it);
- every line answered once: `output_lines`, `output_custom_ids` (distinct),
  `output_duplicates`, `output_not_200`, `missing_custom_ids` (lines in neither
  file), `error_lines` and `error_codes`, `answered_exactly_once` (every line in the
  output file exactly once with a 200 and no error, and no error file line);
  `batch_completion_tokens_mean`;
- from the cluster's event log (`yb replay --export`): `batch_admissions` (a line's
  every try), `batch_held` (refused `batch_held`, tried again later), of them
  `batch_held_during_load`, `batch_other_rejections`, `batch_runs` (scheduled
  tries; more than the lines when a line ran twice), `batch_runs_during_load`,
  `interactive_rejected`.

Every wait has a deadline and the cluster is always stopped. The defaults (500
lines, 60 requests a phase at 0.5/s) take about ten minutes on a 2-core machine
with the default model; `--lines 50 --requests 20` is a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from cluster_log import export_log
from figures import emit
from openai import AsyncOpenAI
from openai.types import Batch

from yb_conductor.replay import LogRecord
from yb_core import events as ev
from yb_core.stats import percentile
from yb_testkit.fixtures import LocalCluster
from yb_tools.bench.client import BenchClient, RequestResult
from yb_tools.bench.report import Slo, meets_slo
from yb_tools.bench.runner import LoadRunner
from yb_tools.bench.workloads import Limits, RequestSpec, SharedPrefix, shared_prefix_requests

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
TOPICS = (
    "the sea",
    "a mountain",
    "bread",
    "a river",
    "the moon",
    "a library",
    "winter",
    "a bicycle",
    "a garden",
    "the wind",
)


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of interactive load: its results, its window in Unix seconds, and
    the machine's 1-minute load average when it started (the machine may be shared)."""

    results: list[RequestResult]
    start: float
    end: float
    load_average_1m: float


@dataclass(slots=True)
class BatchRun:
    """What the batch did, as the `openai` client saw it."""

    batch: Batch
    created: float  # monotonic, just after `batches.create` answered
    done_s: float | None = None  # create to the first poll that saw a terminal status
    counts_at_load_end: int = 0
    running_at_load_end: bool = False
    output: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


def pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seeded Poisson arrivals (seconds from the phase's start), the first at 0."""
    rng = random.Random(f"batch-live/{seed}")
    out, t = [], 0.0
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def interactive(args: argparse.Namespace, limits: Limits, phase: int) -> list[RequestSpec]:
    """One phase's requests: the same arrivals every phase, prompts of its own."""
    times = arrivals(args.requests, args.rate)
    prompts = shared_prefix_requests(
        SharedPrefix(
            groups=args.requests,
            prefix_tokens=args.prompt_tokens,
            users=1,
            question_tokens=0,
            output_tokens=args.output_tokens,
        ),
        limits,
        seed=100 + phase,
    )
    return [msgspec.structs.replace(s, arrival_s=t) for s, t in zip(prompts, times, strict=True)]


def batch_file(args: argparse.Namespace, model: str) -> bytes:
    """The batch's JSONL: `--lines` short chat questions, each its own custom_id."""
    lines = []
    for i in range(args.lines):
        ask = f"Write one sentence about {TOPICS[i % len(TOPICS)]}, number {i}."
        body = {
            "model": model,
            "messages": [{"role": "user", "content": ask}],
            "max_tokens": args.batch_max_tokens,
            "temperature": 0,
        }
        line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions"}
        lines.append(json.dumps({**line, "body": body}))
    return "\n".join(lines).encode()


async def run_load(
    args: argparse.Namespace, cluster: LocalCluster, specs: list[RequestSpec], model: str
) -> Phase:
    """Send one phase of interactive load."""
    client = BenchClient(cluster.url, concurrency=args.concurrency, api_key=cluster.api_key)
    try:
        runner = LoadRunner(
            client, model=model, concurrency=args.concurrency, deadline_s=args.deadline
        )
        load = os.getloadavg()[0]
        started = time.time()
        results, _ = await runner.run(specs)
        return Phase(results, started, time.time(), load)
    finally:
        await client.close()


async def poll(openai: AsyncOpenAI, run: BatchRun, every_s: float, deadline: float) -> None:
    """Follow the batch until it is done or the deadline (monotonic) passes."""
    while time.monotonic() < deadline:
        run.batch = await openai.batches.retrieve(run.batch.id)
        if run.batch.status in TERMINAL:
            run.done_s = time.monotonic() - run.created
            return
        await asyncio.sleep(every_s)
    print(
        f"batch {run.batch.id} still {run.batch.status} at its deadline: cancelled",
        file=sys.stderr,
    )
    with contextlib.suppress(Exception):
        run.batch = await openai.batches.cancel(run.batch.id)


async def jsonl(openai: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    content = await openai.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


async def measure(
    args: argparse.Namespace, cluster: LocalCluster
) -> tuple[dict[str, Phase], BatchRun, str]:
    """The three phases; each phase's results and window, the batch, the model."""
    probe = BenchClient(cluster.url, concurrency=1, api_key=cluster.api_key)
    try:
        info = await probe.server_info()
    finally:
        await probe.close()
    limits = Limits(vocab_size=info.vocab_size or 256, max_model_len=info.max_model_len)
    phases: dict[str, Phase] = {}
    openai = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, max_retries=2)
    try:
        # Two requests first: the engines' first forward passes are not the load's.
        await run_load(args, cluster, interactive(args, limits, 9)[:2], info.model)
        phases["alone"] = await run_load(args, cluster, interactive(args, limits, 0), info.model)

        upload = await openai.files.create(
            file=("batch_live.jsonl", batch_file(args, info.model)), purpose="batch"
        )
        batch = await openai.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        run = BatchRun(batch=batch, created=time.monotonic())
        deadline = run.created + args.batch_deadline
        follow = asyncio.create_task(poll(openai, run, args.poll_s, deadline))
        try:
            phases["with_batch"] = await run_load(
                args, cluster, interactive(args, limits, 1), info.model
            )
            now = await openai.batches.retrieve(batch.id)
            counts = now.request_counts
            run.counts_at_load_end = counts.completed + counts.failed if counts else 0
            run.running_at_load_end = now.status not in TERMINAL
            # `poll` has its own deadline; this one only guards against a hung request.
            await asyncio.wait({follow}, timeout=max(1.0, deadline - time.monotonic() + 30))
            if follow.done():
                follow.result()  # its exception, if any
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
        run.output = await jsonl(openai, run.batch.output_file_id)
        run.errors = await jsonl(openai, run.batch.error_file_id)

        if not args.no_after:
            phases["after"] = await run_load(
                args, cluster, interactive(args, limits, 2), info.model
            )
    finally:
        await openai.close()
    return phases, run, info.model


def phase_figures(args: argparse.Namespace, name: str, phase: Phase) -> dict[str, Any]:
    """One phase's interactive figures, keyed `<figure>_<name>`."""
    slo = Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo)
    results = phase.results
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps()]
    sent = [r for r in results if r.sent_s is not None]
    failed = [r for r in results if not r.ok]
    return {
        f"ttft_p50_s_{name}": pct(ttfts, 50),
        f"ttft_p90_s_{name}": pct(ttfts, 90),
        f"tbt_p90_s_{name}": pct(gaps, 90),
        f"goodput_{name}": sum(meets_slo(r, slo) for r in sent) / len(sent) if sent else None,
        f"requests_ok_{name}": len(ok),
        f"requests_failed_{name}": len(failed),
        f"failed_kinds_{name}": ",".join(sorted({r.error for r in failed})),
        f"load_average_1m_{name}": phase.load_average_1m,
    }


def batch_figures(args: argparse.Namespace, run: BatchRun) -> dict[str, Any]:
    """The batch's outcome, and whether every line was answered exactly once."""
    batch = run.batch
    counts = batch.request_counts
    expected = {f"line-{i}" for i in range(args.lines)}
    ids = Counter(line.get("custom_id") for line in run.output)
    not_200 = [
        line
        for line in run.output
        if line.get("error") is not None or (line.get("response") or {}).get("status_code") != 200
    ]
    codes = Counter(((e.get("error") or {}).get("code") or "?") for e in run.errors)
    errored = {e.get("custom_id") for e in run.errors}
    tokens = [
        usage["completion_tokens"]
        for line in run.output
        if (usage := ((line.get("response") or {}).get("body") or {}).get("usage"))
    ]
    done = batch.status == "completed" and run.done_s is not None
    return {
        "batch_status": batch.status,
        "batch_completion_s": run.done_s if done else None,
        "batch_lines_per_s": args.lines / run.done_s if done and run.done_s else None,
        "batch_counts_total": counts.total if counts else 0,
        "batch_counts_completed": counts.completed if counts else 0,
        "batch_counts_failed": counts.failed if counts else 0,
        "batch_completed_during_load": run.counts_at_load_end,
        "batch_outlived_load": run.running_at_load_end,
        "output_lines": len(run.output),
        "output_custom_ids": len(ids),
        "output_duplicates": sum(n - 1 for n in ids.values()),
        "output_not_200": len(not_200),
        "missing_custom_ids": len(expected - set(ids) - errored),
        "error_lines": len(run.errors),
        "error_codes": ",".join(f"{c}:{n}" for c, n in sorted(codes.items())),
        "answered_exactly_once": set(ids) == expected
        and all(n == 1 for n in ids.values())
        and not not_200
        and not run.errors,
        "batch_completion_tokens_mean": statistics.fmean(tokens) if tokens else None,
    }


def log_figures(records: list[LogRecord], batch_id: str, load: Phase) -> dict[str, Any]:
    """How the conductor decided the batch's lines, from the cluster's log (`load`:
    the interactive phase that ran beside the batch)."""
    prefix = f"chatcmpl-{batch_id}-"
    start, end = load.start, load.end
    admitted = held = held_load = other = runs = runs_load = rejected = 0
    for r in records:
        e = r.event
        if isinstance(e, ev.RequestAdmitted) and e.request_id.startswith(prefix):
            admitted += 1
        elif isinstance(e, ev.RequestRejected):
            if not e.request_id.startswith(prefix):
                rejected += 1
            elif e.reason.startswith("batch_held"):
                held += 1
                held_load += start <= e.time <= end
            else:
                other += 1
        elif isinstance(e, ev.RequestScheduled) and e.request_id.startswith(prefix):
            runs += 1
            runs_load += start <= e.time <= end
    return {
        "batch_admissions": admitted,
        "batch_held": held,
        "batch_held_during_load": held_load,
        "batch_other_rejections": other,
        "batch_runs": runs,
        "batch_runs_during_load": runs_load,
        "interactive_rejected": rejected,
    }


def table(figures: dict[str, Any], phases: list[str]) -> str:
    """The interactive phases side by side, in markdown."""

    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return "–" if value is None or value == "" else str(value)

    rows = [
        *("ttft_p50_s", "ttft_p90_s", "tbt_p90_s", "goodput"),
        *("requests_ok", "requests_failed", "load_average_1m"),
    ]
    out = ["| figure | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for row in rows:
        out.append(f"| {row} | " + " | ".join(show(figures[f"{row}_{p}"]) for p in phases) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="default", help="default, tiny-random or a dir")
    parser.add_argument("--lines", type=int, default=500, help="lines in the batch")
    parser.add_argument("--batch-max-tokens", type=int, default=16, help="per batch line")
    parser.add_argument("--requests", type=int, default=60, help="interactive, per phase")
    parser.add_argument("--rate", type=float, default=0.5, help="interactive requests/s")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--tbt-slo", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=64, help="in flight at most")
    parser.add_argument("--deadline", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--batch-deadline", type=float, default=900.0, help="seconds")
    parser.add_argument("--poll-s", type=float, default=0.5, help="batches.retrieve every")
    parser.add_argument("--no-after", action="store_true", help="skip the phase `after`")
    parser.add_argument("--export-log", type=Path, help="keep the event log here (.jsonl)")
    parser.add_argument("--keep", type=Path, help="run the cluster in this dir and keep it")
    args = parser.parse_args(argv)

    env = {"YB_GATEWAY__TTFT_SLO_S": str(args.ttft_slo), "YB_GATEWAY__TBT_SLO_S": str(args.tbt_slo)}
    wall = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="yb-batch-live-")))
        data_dir = args.keep or tmp / "cluster"
        log_path = args.export_log or tmp / "log.jsonl"
        cluster = LocalCluster(data_dir, "--model", args.model, env=env)
        try:
            cluster.start(timeout_s=300)
            phases, run, model = asyncio.run(measure(args, cluster))
            records = export_log(cluster, log_path)
        finally:
            cluster.stop()
    figures: dict[str, Any] = {
        "model": model,
        "lines": args.lines,
        "batch_max_tokens": args.batch_max_tokens,
        "requests_per_phase": args.requests,
        "rate": args.rate,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "ttft_slo_s": args.ttft_slo,
        "tbt_slo_s": args.tbt_slo,
    }
    for name, phase in phases.items():
        figures.update(phase_figures(args, name, phase))
    alone, beside = figures["ttft_p90_s_alone"], figures["ttft_p90_s_with_batch"]
    figures["ttft_p90_ratio"] = beside / alone if alone and beside is not None else None
    figures.update(batch_figures(args, run))
    figures.update(log_figures(records, run.batch.id, phases["with_batch"]))
    figures["run_wall_s"] = time.monotonic() - wall
    print(table(figures, list(phases)) + "\n")
    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
