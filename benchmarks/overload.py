"""Overload: a burst of ten times the cluster's capacity against a real `yb up`.

    python benchmarks/overload.py --json PATH [--model tiny-random|default]
                                  [--factor 10] [--ttft-slo 4] [--tbt-slo 1]
                                  [--prompt-tokens 256] [--output-tokens 16]
                                  [--bursts 1] [--export-log LOG.jsonl] [--keep DIR]
                                  [--set KEY=VALUE ...]

It starts a cluster (`yb up` in a subprocess; the SLOs the gateway asks of each
request set by `--ttft-slo` and `--tbt-slo`; admission `predicted`; the conductor
told that every engine shares this machine, `compute_sharing=all`), measures what one
request costs, sizes the cluster's capacity from that, sends `factor` times that many
requests at the same instant through the OpenAI API, and reports:

- how each request ended (200, 429, anything else), how fast a refusal came back
  (`answered_s`, from sending to the status line) and whether it carried
  `Retry-After`;
- the accepted requests' TTFT and time between tokens against the SLOs;
- the resident memory of every process of the cluster before, at its peak during,
  and after the burst, and whether any process died.

Capacity is how many requests the cluster can start within the TTFT SLO at once:
`prefill instances x floor(TTFT SLO / TTFT of one request alone)` (at least 1): a
prefill instance computes one prompt at a time, so more than that cannot all meet
the SLO whatever the scheduler does.

`--bursts N` sends N such bursts, each once the last has drained (`--burst-gap`
seconds later), and reports the later ones under `later_bursts`: the first burst
meets a conductor that has only seen requests one at a time, the next one what it
learned from the first. `--set` passes conductor settings (as `yb replay --set`).

`--export-log` writes the cluster's event log (`yb replay --export`) before the
cluster stops, so that where the accepted requests' time went can be read against
what the conductor predicted (printed as a table, one row per accepted request);
`--keep DIR` runs the cluster in DIR and leaves it there (its `yb-up.log` has every
service's log lines).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from figures import emit
from record import flatten

from yb_core.stats import percentile
from yb_testkit.fixtures import LocalCluster, pid_alive
from yb_tools.bench.client import BenchClient, RequestResult
from yb_tools.bench.report import request_tbt
from yb_tools.bench.workloads import Limits, SharedPrefix, shared_prefix_requests
from yb_tools.natsserver import env_without_proxies


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class MemorySampler:
    """Samples every process's RSS on a thread, keeping each one's peak."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.2) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.peak = {name: rss_mb(pid) for name, pid in pids.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_mb(pid))


def pct(values: list[float], q: float) -> float | None:
    """`percentile`, or None for no values (no refusal, no acceptance)."""
    return percentile(values, q) if values else None


def p90_gap(result: RequestResult) -> float | None:
    return request_tbt(result, 90)


def outcome(args: argparse.Namespace, results: list[RequestResult]) -> dict[str, Any]:
    """How one burst's requests ended, against the SLOs."""
    accepted = [r for r in results if r.ok]
    refused = [r for r in results if r.status == 429]
    other = [r for r in results if not r.ok and r.status != 429]
    ttfts = [r.ttft_s for r in accepted if r.ttft_s is not None]
    gaps = [g for r in accepted if (g := p90_gap(r)) is not None]
    within = [
        r
        for r in accepted
        if r.ttft_s is not None
        and r.ttft_s <= args.ttft_slo
        and (p90_gap(r) or 0.0) <= args.tbt_slo
    ]
    answered = [r.answered_s for r in refused if r.answered_s is not None]
    retry_after = [r.retry_after_s for r in refused if r.retry_after_s is not None]
    return {
        "accepted": len(accepted),
        "rejected_429": len(refused),
        "other_errors": len(other),
        "other_error_kinds": sorted({r.error for r in other}),
        "rejected_with_retry_after": len(retry_after),
        "retry_after_min_s": min(retry_after, default=None),
        "retry_after_max_s": max(retry_after, default=None),
        "reject_answer_p50_s": pct(answered, 50),
        "reject_answer_p99_s": pct(answered, 99),
        "reject_answer_max_s": max(answered, default=None),
        "accepted_ttft_p50_s": pct(ttfts, 50),
        "accepted_ttft_p99_s": pct(ttfts, 99),
        "accepted_tbt_p90_p50_s": pct(gaps, 50),
        "accepted_tbt_p90_p99_s": pct(gaps, 99),
        "accepted_within_slo": len(within),
        "accepted_slo_attainment": len(within) / len(accepted) if accepted else None,
    }


async def burst(args: argparse.Namespace, cluster: LocalCluster) -> dict[str, Any]:
    probe = BenchClient(cluster.url, concurrency=4, api_key=cluster.api_key)
    info = await probe.server_info()
    limits = Limits(vocab_size=info.vocab_size or 256, max_model_len=info.max_model_len)
    t0 = time.perf_counter()
    # One request at a time, for the cost of one (the first also warms the engines).
    alone = shared_prefix_requests(
        SharedPrefix(
            groups=4,
            prefix_tokens=args.prompt_tokens,
            users=1,
            question_tokens=8,
            output_tokens=args.output_tokens,
        ),
        limits,
        seed=1,
    )
    solo: list[RequestResult] = []
    for spec in alone:
        solo.append(await probe.send(spec, model=info.model, deadline_s=120, t0=t0))
    await probe.close()
    bad = [r for r in solo if not r.ok]
    if bad:
        raise SystemExit(f"a request alone failed: {bad[0].error}: {bad[0].message}")
    ttft_alone = statistics.median(r.ttft_s or 0.0 for r in solo[1:])
    capacity = args.prefill * max(1, int(args.ttft_slo // max(ttft_alone, 1e-3)))
    count = args.factor * capacity

    client = BenchClient(cluster.url, concurrency=count, api_key=cluster.api_key)
    before = {name: rss_mb(pid) for name, pid in cluster.pids.items()}
    bursts: list[dict[str, Any]] = []
    with MemorySampler(cluster.pids) as memory:
        for i in range(max(1, args.bursts)):
            if i:
                # The next wave comes once the last has drained: what the conductor
                # learned from it prices this one.
                await asyncio.sleep(args.burst_gap)
            specs = shared_prefix_requests(
                SharedPrefix(
                    groups=count,
                    prefix_tokens=args.prompt_tokens,
                    users=1,
                    question_tokens=8,
                    output_tokens=args.output_tokens,
                ),
                limits,
                seed=2 + i,
            )
            started = time.perf_counter()
            results = await asyncio.gather(
                *(
                    client.send(spec, model=info.model, deadline_s=args.deadline, t0=started)
                    for spec in specs
                )
            )
            figures = {"burst_wall_s": time.perf_counter() - started}
            figures.update(outcome(args, list(results)))
            bursts.append(figures)
    await asyncio.sleep(2.0)  # let freed memory show
    after = {name: rss_mb(pid) for name, pid in cluster.pids.items()}
    dead = [name for name, pid in cluster.pids.items() if not pid_alive(pid)]
    # The cluster still serves once the burst has passed.
    check = await client.send(alone[0], model=info.model, deadline_s=120, t0=time.perf_counter())
    await client.close()

    by_role: dict[str, dict[str, float]] = {}
    for name in cluster.pids:
        role = name.rsplit("-", 1)[0]
        entry = by_role.setdefault(role, {"before": 0.0, "peak": 0.0, "after": 0.0})
        entry["before"] += before[name]
        entry["peak"] += memory.peak[name]
        entry["after"] += after[name]
    return {
        "model": info.model,
        "ttft_alone_s": ttft_alone,
        "capacity_requests": capacity,
        "burst_requests": count,
        **bursts[0],
        "ttft_slo_s": args.ttft_slo,
        "tbt_slo_s": args.tbt_slo,
        "memory_mb": by_role,
        "processes_dead": dead,
        "serves_after": check.ok,
        "later_bursts": bursts[1:],
    }


def export_log(cluster: LocalCluster, path: Path) -> None:
    """The running cluster's event log to `path`, as `yb replay --export` writes it."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "yb_tools.cli",
            "replay",
            "--data-dir",
            str(cluster.data_dir),
            "--export",
            str(path),
        ],
        env=env_without_proxies(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    print((done.stdout or done.stderr).strip(), file=sys.stderr)


def timeline(path: Path) -> list[dict[str, Any]]:
    """Per accepted request of an exported log: what the conductor predicted against
    what happened, in seconds from its admission (the time its decision carries).

    `wait` is admission to `prefill_started` (the predicted part is `est_queue`),
    `prefill` is `prefill_started` to `prefill_done` (predicted `est_prefill`; it
    includes the reservation on decode and the hand-over), `commit` is admission to
    `kv_committed`, `ttft` the first token as decode measured it.
    """
    from yb_conductor.replay import read_log
    from yb_core import events as ev

    admitted: dict[str, float] = {}
    rows: dict[str, dict[str, Any]] = {}
    for record in read_log(path):
        e = record.event
        match e:
            case ev.RequestAdmitted():
                admitted[e.request_id] = e.time
            case ev.RequestScheduled():
                t0 = admitted.get(e.request_id, e.time)
                rows[e.request_id] = {
                    "request_id": e.request_id,
                    "at": t0,
                    "prefill_instance": e.prefill_instance,
                    "est_queue": e.estimates.queue_s,
                    "est_prefill": e.estimates.transfer_s + e.estimates.prefill_s,
                    "est_ttft": e.estimates.ttft_s,
                }
            case ev.RequestProgress() if e.request_id in rows:
                row = rows[e.request_id]
                row[e.stage] = e.time - row["at"]
            case ev.RequestFinished() if e.request_id in rows and e.ttft_s:
                rows[e.request_id]["ttft"] = e.ttft_s
    out = []
    for row in sorted(rows.values(), key=lambda r: r["at"]):
        started, done = row.get("prefill_started"), row.get("prefill_done")
        row["wait"] = started
        row["prefill"] = done - started if started is not None and done is not None else None
        row["commit"] = row.get("kv_committed")
        out.append(row)
    return out


def print_timeline(rows: list[dict[str, Any]]) -> None:
    """The timeline as a table on stderr."""
    first = rows[0]["at"] if rows else 0.0
    cols = ("est_queue", "wait", "est_prefill", "prefill", "commit", "est_ttft", "ttft")
    print(f"{'at':>7} {'prefill':<10} " + " ".join(f"{c:>11}" for c in cols), file=sys.stderr)
    for r in rows:
        cells = " ".join(
            f"{r[c]:>11.3f}" if isinstance(r.get(c), float) else f"{'-':>11}" for c in cols
        )
        print(f"{r['at'] - first:>7.3f} {r['prefill_instance']:<10} {cells}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--model", default="tiny-random", help="tiny-random, default or a dir")
    parser.add_argument("--factor", type=int, default=10)
    parser.add_argument("--ttft-slo", type=float, default=4.0)
    parser.add_argument("--tbt-slo", type=float, default=1.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--kv-pages", type=int, default=256, help="KV pages per engine")
    parser.add_argument("--bursts", type=int, default=1, help="bursts, one after another")
    parser.add_argument("--burst-gap", type=float, default=5.0, help="seconds between bursts")
    parser.add_argument("--export-log", type=Path, help="write the event log here (.jsonl)")
    parser.add_argument("--keep", type=Path, help="run the cluster in this dir and keep it")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a conductor setting (repeatable), e.g. admission=early",
    )
    args = parser.parse_args(argv)

    env = {
        # Fewer KV pages than the default 1,024: three engines of the default model
        # then fit beside everything else in a small machine's memory.
        "YB_PREFILL__NUM_KV_PAGES": str(args.kv_pages),
        "YB_DECODE__NUM_KV_PAGES": str(args.kv_pages),
        "YB_GATEWAY__TTFT_SLO_S": str(args.ttft_slo),
        "YB_GATEWAY__TBT_SLO_S": str(args.tbt_slo),
        "YB_CONDUCTOR__ADMISSION": "predicted",
        # `yb up` runs every engine on this machine: they share its cores.
        "YB_CONDUCTOR__COMPUTE_SHARING": "all",
    }
    for item in args.settings:
        key, _, value = item.partition("=")
        env[f"YB_CONDUCTOR__{key.strip().upper()}"] = value.strip()
    with contextlib.ExitStack() as stack:
        if args.keep:
            data_dir = args.keep
        else:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="yb-overload-")))
        cluster = LocalCluster(
            data_dir,
            "--model",
            args.model,
            "--prefill",
            str(args.prefill),
            "--decode",
            str(args.decode),
            env=env,
        )
        cluster.start()
        try:
            figures = asyncio.run(burst(args, cluster))
            if args.export_log:
                export_log(cluster, args.export_log)
                print_timeline(timeline(args.export_log))
        finally:
            cluster.stop()

    # One flat object, as every benchmark writes: `memory_mb_<role>_<before|peak|after>`,
    # `later_bursts_<n>_<figure>` for the (n+1)-th burst.
    figures = flatten(figures)
    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
