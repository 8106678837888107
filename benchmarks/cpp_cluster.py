"""CPP through a running cluster: a long prompt's TTFT on a prefill group against one
whole-model prefill instance, as a client sees it.

    python benchmarks/cpp_cluster.py --json PATH [--tokens 4096] [--stages 2]
        [--rounds 2] [--chunk-size 512]

`yb up` (LocalCluster, the default model) with one whole-model prefill instance
(`prefill-0`) and one prefill group of `--stages` stages (`--prefill-groups N`), one
decode instance and one kvstore; every prefill process has `--chunk-size`-token chunks
and one torch thread (as `yb up` gives each engine). Each round sends two fresh random
prompts of `--tokens` tokens (as token ids, `max_tokens` 1, streamed), one to each
path, alternating which goes first, and times each from sending it to its first token
(`ttft_single_s`, `ttft_group_s`: medians over the rounds;
`speedup = ttft_single_s / ttft_group_s`). The path is arranged by construction: the
other path's process (the whole-model instance, or the group's last stage) is
SIGSTOPped until the conductor declares it dead, so the conductor can plan only on the
one measured, and SIGCONTed after (it announces itself again). A stopped process takes
no CPU, so each path has the machine's cores, beside the idle rest of the cluster. The
decision of every request is read from the event log: the table shows where it ran.

This is the service path end to end: the gateway, the conductor's decision, the
lead's `StageJob`s, the chunks' hidden states between the stages over UCX, every
stage's pages streamed to decode, the commit and the hand-over
(`services/prefill/README.md`). `benchmarks/cpp.py` measures the engine's stages
alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from e2e_reuse import Log, Sample, timed_request
from figures import emit

from yb_core import events as ev
from yb_core.bus import Bus
from yb_testkit.fixtures import LocalCluster

HEARTBEAT_TIMEOUT_S = 3.0
WHOLE = "prefill-0"


async def logged_after(
    log: Log, since: int, what: str, kind: type[ev.InstanceUp | ev.InstanceDown], instance: str
) -> None:
    """Until an event of `kind` about `instance` is logged past `log.events[since]`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(isinstance(e, kind) and e.instance_id == instance for e in log.events[since:]):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


async def stopped(log: Log, cluster: LocalCluster, instance: str) -> None:
    """SIGSTOP `instance` and wait until the conductor declared it dead."""
    since = len(log.events)
    os.kill(cluster.pids[instance], signal.SIGSTOP)
    await logged_after(log, since, f"{instance} declared down", ev.InstanceDown, instance)


async def resumed(log: Log, cluster: LocalCluster, instance: str) -> None:
    """SIGCONT `instance` and wait until it announced itself again."""
    since = len(log.events)
    os.kill(cluster.pids[instance], signal.SIGCONT)
    await logged_after(log, since, f"{instance} announced again", ev.InstanceUp, instance)


async def timed_on(
    log: Log,
    cluster: LocalCluster,
    client: httpx.AsyncClient,
    tokens: list[int],
    stop: str,
) -> tuple[Sample, ev.RequestScheduled]:
    """One request with `stop` stopped: its sample and its decision."""
    await stopped(log, cluster, stop)
    try:
        sample = await timed_request(client, cluster.url, tokens)
    finally:
        await resumed(log, cluster, stop)
    decision = await log.wait_for(
        f"decision {sample.request_id}",
        lambda e: isinstance(e, ev.RequestScheduled) and e.request_id == sample.request_id,
    )
    assert isinstance(decision, ev.RequestScheduled)
    return sample, decision


async def run(
    cluster: LocalCluster, tokens: int, stages: int, rounds: int
) -> tuple[list[float], list[float], list[str]]:
    bus = await Bus.connect(cluster.nats_config(), "bench-cpp-cluster")
    reader = await bus.read_ordered()
    log = Log(bus, reader)
    follower = asyncio.get_running_loop().create_task(log.follow())
    last_stage = f"prefill-g0-{stages - 1}"
    rng = random.Random(20261127)
    single: list[float] = []
    group: list[float] = []
    rows: list[str] = []
    try:
        async with httpx.AsyncClient(timeout=600, headers=cluster.headers) as client:
            # Warm-up: each path once with a short prompt.
            for stop in (last_stage, WHOLE):
                await timed_on(
                    log, cluster, client, [rng.randrange(1000, 40000) for _ in range(300)], stop
                )
            for round_no in range(rounds):
                order = [(last_stage, single), (WHOLE, group)]
                if round_no % 2:
                    order.reverse()
                for stop, into in order:
                    prompt = [rng.randrange(1000, 40000) for _ in range(tokens)]
                    sample, decision = await timed_on(log, cluster, client, prompt, stop)
                    where = " -> ".join(decision.prefill_stages) or decision.prefill_instance
                    expected_group = stop == WHOLE
                    if bool(decision.prefill_stages) != expected_group:
                        raise RuntimeError(f"{sample.request_id} ran on {where}, not as arranged")
                    into.append(sample.ttft_s)
                    rows.append(f"round {round_no + 1}: {sample.ttft_s:8.3f} s  on {where}")
                    print(rows[-1], flush=True)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await reader.close()
        await bus.close()
    return single, group, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=512)
    args = parser.parse_args(argv)
    if args.stages < 2 or args.rounds < 1 or args.tokens < 2 or args.chunk_size < 1:
        parser.error("--stages >= 2, --rounds >= 1, --tokens >= 2, --chunk-size >= 1")
    with tempfile.TemporaryDirectory(prefix="yb-cpp-cluster-") as tmp:
        cluster = LocalCluster(
            Path(tmp),
            *("--prefill", "1", "--prefill-groups", str(args.stages)),
            *("--decode", "1", "--kvstore", "1"),
            env={
                "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
                "YB_PREFILL__CHUNK_SIZE": str(args.chunk_size),
                # A long prompt's predicted TTFT is no reason to refuse it here.
                "YB_GATEWAY__TTFT_SLO_S": "3600",
            },
        )
        started = time.monotonic()
        cluster.start(timeout_s=900)
        print(f"cluster ready in {time.monotonic() - started:.0f}s", flush=True)
        try:
            single, group, _ = asyncio.run(run(cluster, args.tokens, args.stages, args.rounds))
        finally:
            cluster.stop()
    median = statistics.median
    figures: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "prompt_tokens": args.tokens,
        "stages": args.stages,
        "chunk_size": args.chunk_size,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        f"ttft_single_{args.tokens}_s": median(single),
        f"ttft_group{args.stages}_{args.tokens}_s": median(group),
        f"group{args.stages}_speedup_{args.tokens}": median(single) / median(group),
        "load_average_1m": os.getloadavg()[0],
    }
    emit(figures, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
