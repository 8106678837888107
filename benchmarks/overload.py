"""Overload: a burst of ten times the cluster's capacity against a real `yb up`.

    python benchmarks/overload.py --json PATH [--model tiny-random|default]
                                  [--factor 10] [--ttft-slo 4] [--tbt-slo 1]
                                  [--prompt-tokens 256] [--output-tokens 16]

It starts a cluster (`yb up` in a subprocess; the SLOs the gateway asks of each
request set by `--ttft-slo` and `--tbt-slo`; admission `predicted`), measures what one
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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared" / "src"))

from yb_shared.bench.client import BenchClient, RequestResult
from yb_shared.bench.report import percentile, request_tbt
from yb_shared.bench.workloads import Limits, SharedPrefix, shared_prefix_requests
from yb_shared.testing import LocalCluster, pid_alive


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

    specs = shared_prefix_requests(
        SharedPrefix(
            groups=count,
            prefix_tokens=args.prompt_tokens,
            users=1,
            question_tokens=8,
            output_tokens=args.output_tokens,
        ),
        limits,
        seed=2,
    )
    client = BenchClient(cluster.url, concurrency=count, api_key=cluster.api_key)
    before = {name: rss_mb(pid) for name, pid in cluster.pids.items()}
    with MemorySampler(cluster.pids) as memory:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.send(spec, model=info.model, deadline_s=args.deadline, t0=started)
                for spec in specs
            )
        )
        burst_s = time.perf_counter() - started
    await asyncio.sleep(2.0)  # let freed memory show
    after = {name: rss_mb(pid) for name, pid in cluster.pids.items()}
    dead = [name for name, pid in cluster.pids.items() if not pid_alive(pid)]
    # The cluster still serves once the burst has passed.
    check = await client.send(alone[0], model=info.model, deadline_s=120, t0=time.perf_counter())
    await client.close()

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
        "burst_wall_s": burst_s,
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
        "ttft_slo_s": args.ttft_slo,
        "tbt_slo_s": args.tbt_slo,
        "memory_mb": by_role,
        "processes_dead": dead,
        "serves_after": check.ok,
    }


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
    args = parser.parse_args(argv)

    env = {
        # Fewer KV pages than the default 1,024: three engines of the default model
        # then fit beside everything else in a small machine's memory.
        "YB_PREFILL__NUM_KV_PAGES": str(args.kv_pages),
        "YB_DECODE__NUM_KV_PAGES": str(args.kv_pages),
        "YB_GATEWAY__TTFT_SLO_S": str(args.ttft_slo),
        "YB_GATEWAY__TBT_SLO_S": str(args.tbt_slo),
        "YB_CONDUCTOR__ADMISSION": "predicted",
    }
    with tempfile.TemporaryDirectory(prefix="yb-overload-") as tmp:
        cluster = LocalCluster(
            Path(tmp),
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
        finally:
            cluster.stop()

    width = max(len(k) for k in figures)
    for key, value in figures.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else json.dumps(value)
        print(f"{key:<{width}}  {shown}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
