"""Time to first token with a 3,000-token prefix reused from the other host's kvstore.

    python benchmarks/e2e_reuse.py --json PATH [--rounds 3] [--prefix-tokens 3000]

Through a running cluster, as a client sees it: `yb up` (LocalCluster: 2 prefill
instances on two logical hosts, each with its kvstore, 1 decode, the default model)
and the gateway's streaming `/v1/completions`. Each round takes a fresh random prompt
R (a `--prefix-tokens` prefix and a short question, as token ids) and:

1. sends R to a cluster that has never seen any of it: every token is computed
   (nothing can be reused, exactly the work of reuse disabled): `ttft_recompute_s`;
2. waits until the prefill instance that ran it, X, has stored R's blocks in its
   host's kvstore, then SIGSTOPs X and waits until the conductor declares it dead, so
   that R can only run on the other host;
3. sends R again: the conductor plans the prefix from X's host's kvstore (a transfer
   across hosts), the other prefill instance pulls it over UCX straight into its
   pages and computes only the rest: `ttft_reuse_s`;
4. SIGCONTs X.

The decisions and prefill's `reused_tokens` are read from the event log, so the
table shows what each request really did. Figures are medians over the rounds;
`ttft_speedup = ttft_recompute_s / ttft_reuse_s`. Also recorded: what the cluster
costs in memory over the rounds (`yb_testkit.memory`): each process's peak resident
set and their sum (`peak_rss_mb_<process>`, `peak_rss_mb_total`, the launcher
included), and the highest of the processes' summed proportional set size after each
request, which counts a page they share once (`peak_pss_mb_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from yb_core import events as ev
from yb_core.bus import Bus, EventReader
from yb_testkit.fixtures import LocalCluster
from yb_testkit.memory import PssPeaks, peak_rss_figures
from yb_tools.cli.launcher import read_cluster_info

MODEL = "SmolLM2-135M-Instruct"
HEARTBEAT_TIMEOUT_S = 3.0


@dataclass
class Sample:
    """One timed request and what the log says about it."""

    ttft_s: float
    request_id: str
    prefill: str = ""
    plan: str = ""
    reused_tokens: int = 0
    prompt_tokens: int = 0


class Log:
    """Follows the event log in the background."""

    def __init__(self, bus: Bus, reader: EventReader) -> None:
        self.bus = bus
        self.reader = reader
        self.events: list[ev.AnyEvent] = []
        self.task: asyncio.Task[None] | None = None

    async def follow(self) -> None:
        async for item in self.reader:
            self.events.append(item.event)

    async def wait_for(self, what: str, found: Any, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in reversed(self.events):
                if found(event):
                    return event
            await asyncio.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}")

    def hosts(self) -> dict[str, str]:
        return {e.instance_id: e.host for e in self.events if isinstance(e, ev.InstanceUp)}

    def held(self, instance: str) -> set[int]:
        keys: set[int] = set()
        for e in self.events:
            if not isinstance(e, ev.BlockEvent) or e.instance_id != instance:
                continue
            match e:
                case ev.BlocksCleared():
                    keys.clear()
                case ev.BlockStored():
                    keys.update(e.block_hashes)
                case ev.BlockEvicted():
                    keys.difference_update(e.block_hashes)
                case ev.BlockInventory():
                    keys = set(e.dram) | set(e.ssd) | set(e.engine)
        return keys


async def timed_request(client: httpx.AsyncClient, url: str, tokens: list[int]) -> Sample:
    """Stream a completion; the time until its first token arrives."""
    body = {
        "model": MODEL,
        "prompt": tokens,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    request_id = ""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            request_id = request_id or chunk.get("id", "")
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return Sample(ttft_s=first - started, request_id=request_id, prompt_tokens=len(tokens))


async def describe(log: Log, sample: Sample) -> None:
    """Fill in the decision and prefill's progress from the log."""
    decision = await log.wait_for(
        f"decision {sample.request_id}",
        lambda e: isinstance(e, ev.RequestScheduled) and e.request_id == sample.request_id,
    )
    sample.prefill = decision.prefill_instance
    sample.plan = (
        " + ".join(f"{p.num_blocks}x{p.tier}@{p.source_instance}" for p in decision.reuse) or "-"
    )
    done = await log.wait_for(
        f"prefill_done {sample.request_id}",
        lambda e: (
            isinstance(e, ev.RequestProgress)
            and e.request_id == sample.request_id
            and e.stage == "prefill_done"
        ),
    )
    sample.reused_tokens = done.reused_tokens


async def run_rounds(
    cluster: LocalCluster, rounds: int, prefix_tokens: int, question_tokens: int, pss: PssPeaks
) -> tuple[list[Sample], list[Sample]]:
    info = read_cluster_info(cluster.data_dir)
    assert info is not None
    # The operator's NATS user of the data dir: reading the whole log needs it.
    bus = await Bus.connect(cluster.nats_config(), "bench-e2e-reuse")
    reader = await bus.read_ordered()
    log = Log(bus, reader)
    follower = asyncio.get_running_loop().create_task(log.follow())
    recompute: list[Sample] = []
    reuse: list[Sample] = []
    rng = random.Random(20240707)
    try:
        async with httpx.AsyncClient(timeout=300, headers=cluster.headers) as client:
            # Warm-up: both prefill instances, the decode instance and the paths between.
            for _ in range(2):
                await timed_request(
                    client, cluster.url, [rng.randrange(1000, 40000) for _ in range(80)]
                )
            for round_no in range(rounds):
                tokens = [
                    rng.randrange(1000, 40000) for _ in range(prefix_tokens + question_tokens)
                ]
                cold = await timed_request(client, cluster.url, tokens)
                await describe(log, cold)
                recompute.append(cold)
                pss.sample()  # between requests: sampling costs CPU the requests need
                admitted = await log.wait_for(
                    "admission",
                    lambda e, rid=cold.request_id: (
                        isinstance(e, ev.RequestAdmitted) and e.request_id == rid
                    ),
                )
                keys = set(admitted.block_hashes)
                hosts = log.hosts()
                store = next(
                    i
                    for i, h in sorted(hosts.items())
                    if h == hosts[cold.prefill] and i.startswith("kvstore")
                )
                await log.wait_for(
                    f"{store} holding the prompt's {len(keys)} blocks",
                    lambda _e, store=store, keys=keys: keys <= log.held(store),
                )
                pid = cluster.pids[cold.prefill]
                os.kill(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(HEARTBEAT_TIMEOUT_S + 2.5)
                    warm = await timed_request(client, cluster.url, tokens)
                finally:
                    os.kill(pid, signal.SIGCONT)
                await describe(log, warm)
                reuse.append(warm)
                pss.sample()
                print(
                    f"round {round_no + 1}: recompute {cold.ttft_s:.3f}s on {cold.prefill}; "
                    f"reuse {warm.ttft_s:.3f}s on {warm.prefill} ({warm.plan}, "
                    f"{warm.reused_tokens} tokens reused)",
                    flush=True,
                )
                await asyncio.sleep(2.0)  # X reports again and comes back to life
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await reader.close()
        await bus.close()
    return recompute, reuse


def run_with(
    settings: dict[str, str], *, prefix_tokens: int, question_tokens: int, rounds: int = 3
) -> dict[str, float]:
    """This benchmark's figures from a run in a process of its own, the cluster given
    `settings` (`YB_*` variables): what another benchmark compares settings with."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "e2e_reuse.json"
        subprocess.run(
            [
                sys.executable,
                __file__,
                *("--prefix-tokens", str(prefix_tokens)),
                *("--question-tokens", str(question_tokens)),
                *("--rounds", str(rounds), "--json", str(out)),
            ],
            check=True,
            env={**os.environ, **settings},
        )
        figures: dict[str, float] = json.loads(out.read_text())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=3000)
    parser.add_argument("--question-tokens", type=int, default=40)
    parser.add_argument("--data-dir", type=Path, help="cluster data dir (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="yb-e2e-reuse-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        cluster = LocalCluster(
            data_dir,
            env={"YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S)},
        )
        print(f"starting the cluster (data dir {data_dir}) ...", flush=True)
        started = time.monotonic()
        cluster.start(timeout_s=900)
        print(f"cluster ready in {time.monotonic() - started:.0f}s", flush=True)
        try:
            pss = PssPeaks(cluster)
            recompute, reuse = asyncio.run(
                run_rounds(cluster, args.rounds, args.prefix_tokens, args.question_tokens, pss)
            )
            memory = {**peak_rss_figures(cluster), **pss.figures()}
        finally:
            code = cluster.stop()
        if code != 0:
            print(cluster.output()[-3000:])

    t_recompute = statistics.median(s.ttft_s for s in recompute)
    t_reuse = statistics.median(s.ttft_s for s in reuse)
    results: dict[str, float] = {
        "ttft_recompute_s": round(t_recompute, 4),
        "ttft_reuse_s": round(t_reuse, 4),
        "ttft_speedup": round(t_recompute / t_reuse, 2),
        "prompt_tokens": float(recompute[0].prompt_tokens),
        "reused_tokens": float(statistics.median(s.reused_tokens for s in reuse)),
        "rounds": float(len(reuse)),
    }
    results.update(memory)

    print()
    print(f"{'request':<10} {'TTFT s':>8} {'prefill':<10} {'reused':>7}  plan")
    for cold, warm in zip(recompute, reuse, strict=True):
        for label, s in (("recompute", cold), ("reuse", warm)):
            print(f"{label:<10} {s.ttft_s:>8.3f} {s.prefill:<10} {s.reused_tokens:>7}  {s.plan}")
    print(
        f"\nmedian TTFT: recompute {t_recompute:.3f}s, reuse {t_reuse:.3f}s "
        f"-> {t_recompute / t_reuse:.1f}x  ({recompute[0].prompt_tokens}-token prompts)"
    )
    print(
        "peak RSS (MiB): "
        + ", ".join(
            f"{n.removeprefix('peak_rss_mb_')} {m:.0f}"
            for n, m in memory.items()
            if n.startswith("peak_rss_mb_")
        )
    )
    print(f"peak PSS of the whole cluster (MiB): {memory['peak_pss_mb_total']:.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
