"""`yb bench`: real load against a running gateway, through the OpenAI API with SSE.

    yb bench trace [--trace FILE] [--tokens-per-block 64] [--output-cap 64]
                   [--speedup X] [--max-requests N | --duration S] [common flags]
    yb bench shared-prefix [--groups 4 --prefix-tokens 512 --users 4
                   --question-tokens 32 --output-tokens 32] [--rate R] [common flags]

    common: [--url URL | --data-dir DIR] [--concurrency 8] [--request-timeout 300]
            [--ttft-slo S --tbt-slo S] [--json PATH] [--plot PATH] [--samples PATH]

`trace` replays a Mooncake-format trace (JSON lines: `timestamp` ms, `input_length`,
`output_length`, `hash_ids`) at its own timestamps, each hash id its own
deterministic token block, lengths scaled to this deployment. `shared-prefix` sends
groups of requests that share a long prefix. Both are open loop (requests leave at
their arrival times, at most `--concurrency` in flight), every request has a deadline
and counts as failed past it, and Ctrl-C stops the run and still reports what
finished (a second Ctrl-C quits at once). The gateway and its API key default to
the running `yb up`'s (its data directory's `cluster.json` and key file), else the
configured address and `gateway.api_keys` / `gateway.api_keys_file`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from yb_core.config import YbConfig
from yb_tools.bench.client import BenchClient, RequestResult, ServerError
from yb_tools.bench.report import Figure, Report, Slo, summarize
from yb_tools.bench.runner import LoadRunner
from yb_tools.bench.workloads import (
    Limits,
    RequestSpec,
    SharedPrefix,
    TraceScaling,
    shared_prefix_requests,
    trace_requests,
)
from yb_tools.traces import TraceError, read_trace

# The repository's copy of Mooncake's synthetic trace (an editable install finds it).
REPO_TRACE = Path(__file__).resolve().parents[5] / "benchmarks" / "traces" / "synthetic_trace.jsonl"


def add_parser(sub: Any) -> None:
    """Register `yb bench` and its two workloads."""
    p = sub.add_parser("bench", help="real load against the gateway (OpenAI API, SSE)")
    workloads = p.add_subparsers(dest="workload", required=True)
    common = _common_args()

    t = workloads.add_parser(
        "trace", parents=[common], help="replay a Mooncake-format trace at its timestamps"
    )
    t.add_argument("--trace", help=f"JSON-lines trace (default: {REPO_TRACE.name} of the repo)")
    t.add_argument(
        "--tokens-per-block",
        type=int,
        default=64,
        help="tokens per hash id (the trace's own is 512; default 64, one KV block)",
    )
    t.add_argument("--output-scale", type=float, default=1.0, help="output lengths × X")
    t.add_argument("--output-cap", type=int, default=64, help="at most N output tokens (0: none)")
    t.add_argument("--speedup", type=float, default=1.0, help="arrivals X times faster")
    t.add_argument("--max-requests", type=int, default=0, help="the first N requests (0: all)")
    t.add_argument("--duration", type=float, default=0.0, help="the first S seconds (0: all)")
    t.add_argument("--max-input-tokens", type=int, default=0, help="cut prompts at N tokens")

    s = workloads.add_parser(
        "shared-prefix", parents=[common], help="groups of users sharing a long prefix"
    )
    s.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    s.add_argument("--prefix-tokens", type=int, default=512, help="tokens of each shared prefix")
    s.add_argument("--users", type=int, default=4, help="requests (users) per group")
    s.add_argument("--question-tokens", type=int, default=32, help="each user's own tokens")
    s.add_argument("--output-tokens", type=int, default=32, help="tokens generated per request")
    s.add_argument(
        "--rate", type=float, default=0.0, help="mean requests/s, Poisson (0: all at once)"
    )


def _common_args() -> argparse.ArgumentParser:
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--url", help="gateway URL (default: the running `yb up`'s)")
    c.add_argument("--data-dir", help="data directory of the `yb up` to find the gateway")
    c.add_argument("--model-name", help="model to ask for (default: the one /v1/models lists)")
    c.add_argument("--api-key", help="Bearer key (default: the configured one, else the `yb up`'s)")
    c.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="token ids are drawn below this (default: asked from the gateway)",
    )
    c.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    c.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds a request may take in all; past it, it counts as failed",
    )
    c.add_argument("--ttft-slo", type=float, help="goodput's TTFT SLO (default: gateway's)")
    c.add_argument("--tbt-slo", type=float, help="goodput's TBT SLO (default: gateway's)")
    c.add_argument(
        "--tbt-percentile",
        type=float,
        default=90.0,
        help="a request's TBT is this percentile of its gaps (100: the worst)",
    )
    c.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    c.add_argument("--seed", type=int, default=0, help="seed of the tokens and arrivals")
    c.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    c.add_argument("--plot", metavar="PATH", help="write TTFT/ITL plots as a PNG")
    c.add_argument("--samples", metavar="PATH", help="write every request's result (JSONL)")
    c.add_argument("--note", default="", help="a line recorded with the figures")
    c.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return c


@dataclass
class _Run:
    """What a run produced."""

    results: list[RequestResult]
    elapsed_s: float
    context: dict[str, Figure]
    interrupted: bool


class _Refused(Exception):
    """The run cannot start; the message says why."""


def run(cfg: YbConfig, args: argparse.Namespace) -> int:
    """`yb bench`."""
    slo = Slo(
        ttft_s=args.ttft_slo if args.ttft_slo is not None else cfg.gateway.ttft_slo_s,
        tbt_s=args.tbt_slo if args.tbt_slo is not None else cfg.gateway.tbt_slo_s,
        tbt_percentile=args.tbt_percentile,
    )
    try:
        outcome = asyncio.run(_bench(cfg, args))
    except _Refused as exc:
        print(f"yb bench: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Ctrl-C before the run started, or a second one during it: nothing to report.
        print("yb bench: interrupted", file=sys.stderr)
        return 130
    report = summarize(outcome.results, outcome.elapsed_s, slo, outcome.context)
    print(report.table())
    _write_outputs(args, outcome, report, slo)
    if outcome.interrupted:
        return 130
    return 0 if report.figures["requests_ok"] else 1


def _write_outputs(args: argparse.Namespace, outcome: _Run, report: Report, slo: Slo) -> None:
    if args.json:
        _parent(args.json)
        Path(args.json).write_text(json.dumps(report.figures, indent=2) + "\n")
        print(f"figures: {args.json}")
    if args.samples:
        _parent(args.samples)
        with open(args.samples, "wb") as f:
            for result in outcome.results:
                f.write(msgspec.json.encode(result) + b"\n")
        print(f"samples: {args.samples}")
    if args.plot:
        from yb_tools.bench.plot import write_plot

        _parent(args.plot)
        title = f"yb bench: {report.figures.get('workload', '')}"
        if args.note:
            title += f"  [{args.note}]"
        write_plot(args.plot, outcome.results, report, slo, title)
        print(f"plot: {args.plot}")


def _parent(path: str) -> None:
    Path(path).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)


def gateway_target(cfg: YbConfig, args: argparse.Namespace) -> tuple[str, str]:
    """The gateway's URL and an API key for it.

    URL: `--url`, else the running `yb up`'s (its data directory's `cluster.json`),
    else the configured host and port. Key: `--api-key`, else the configured keys
    (`gateway.api_keys`, `gateway.api_keys_file`), else the key file of that `yb up`
    when the URL is its gateway; "" when there is none (an open gateway).
    """
    from yb_core.config import ConfigError, GatewayConfig
    from yb_tools.cli.launcher import read_cluster_info

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else cfg.resolved_data_dir()
    info = read_cluster_info(data_dir)
    if args.url:
        url = str(args.url).rstrip("/")
    elif info is not None:
        url = info.gateway_url.rstrip("/")
    else:
        url = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    if args.api_key:
        return url, str(args.api_key)
    try:
        keys = cfg.gateway.resolved_api_keys()
        ours = info is not None and url == info.gateway_url.rstrip("/")
        if not keys and info is not None and ours and info.api_key_file:
            keys = GatewayConfig(api_keys_file=info.api_key_file).resolved_api_keys()
    except ConfigError as exc:
        raise _Refused(f"cannot read the API key: {exc}") from exc
    return url, keys[0] if keys else ""


async def _bench(cfg: YbConfig, args: argparse.Namespace) -> _Run:
    url, api_key = gateway_target(cfg, args)
    if args.concurrency < 1:
        raise _Refused("--concurrency must be at least 1")
    if args.request_timeout <= 0:
        raise _Refused("--request-timeout must be positive")
    client = BenchClient(url, concurrency=args.concurrency, api_key=api_key)
    try:
        try:
            info = await client.server_info(args.model_name)
        except ServerError as exc:
            raise _Refused(f"{exc} (is `yb up` running? --url names another gateway)") from exc
        vocab = args.vocab_size or info.vocab_size or await client.probe_vocab_size(info.model)
        if vocab < 1:
            raise _Refused("the gateway does not tell its vocabulary size: pass --vocab-size")
        limits = Limits(vocab_size=vocab, max_model_len=info.max_model_len)
        specs, context = _workload(args, limits)
        context.update(
            {
                "url": url,
                "model": info.model,
                "vocab_size": vocab,
                "max_model_len": info.max_model_len,
                "concurrency": args.concurrency,
                "request_timeout_s": args.request_timeout,
                "temperature": args.temperature,
                "seed": args.seed,
                "cpu_count": os.cpu_count() or 0,
                "note": args.note,
            }
        )
        if not specs:
            raise _Refused("the workload has no request (check --max-requests / --duration)")
        last = specs[-1].arrival_s
        print(
            f"yb bench: {context['workload']}\n"
            f"  {len(specs)} requests over {last:.1f} s to {url} ({info.model}), "
            f"at most {args.concurrency} in flight, {args.request_timeout:g} s deadline",
            file=sys.stderr,
            flush=True,
        )
        return await _drive(client, specs, info.model, args, context)
    finally:
        await client.close()


async def _drive(
    client: BenchClient,
    specs: list[RequestSpec],
    model: str,
    args: argparse.Namespace,
    context: dict[str, Figure],
) -> _Run:
    from tqdm import tqdm

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    counts = {"ok": 0, "failed": 0}

    main_task = asyncio.current_task()

    def on_sigint() -> None:
        # The first Ctrl-C ends the run and keeps what finished; a second one cancels
        # everything at once (still closing every connection on the way out).
        if stop.is_set():
            if main_task is not None:
                main_task.cancel()
            return
        stop.set()
        print("\nyb bench: stopping (Ctrl-C again to abort) ...", file=sys.stderr, flush=True)

    progress = tqdm(
        total=len(specs),
        file=sys.stderr,
        unit="req",
        dynamic_ncols=True,
        disable=args.no_progress,
    )

    def on_result(result: RequestResult) -> None:
        counts["ok" if result.ok else "failed"] += 1
        progress.set_postfix(counts, refresh=False)
        progress.update(1)

    runner = LoadRunner(
        client,
        model=model,
        concurrency=args.concurrency,
        deadline_s=args.request_timeout,
        temperature=args.temperature,
        on_result=on_result,
    )
    installed = _install_sigint(loop, on_sigint)
    try:
        results, elapsed = await runner.run(specs, stop)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
        progress.close()
    return _Run(results, elapsed, context, stop.is_set())


def _install_sigint(loop: asyncio.AbstractEventLoop, handler: Any) -> bool:
    # Signal handlers can only be installed from the main thread (a test may run us
    # elsewhere); without one, Ctrl-C still cancels the run through KeyboardInterrupt.
    try:
        loop.add_signal_handler(signal.SIGINT, handler)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def _workload(
    args: argparse.Namespace, limits: Limits
) -> tuple[list[RequestSpec], dict[str, Figure]]:
    try:
        if args.workload == "trace":
            return _trace_workload(args, limits)
        return _shared_prefix_workload(args, limits)
    except (ValueError, OSError) as exc:  # TraceError is a ValueError
        raise _Refused(str(exc)) from exc


def _trace_workload(
    args: argparse.Namespace, limits: Limits
) -> tuple[list[RequestSpec], dict[str, Figure]]:
    path = Path(args.trace) if args.trace else REPO_TRACE
    if not path.is_file():
        raise TraceError(f"no trace at {path}: pass --trace FILE")
    scaling = TraceScaling(
        block_tokens=args.tokens_per_block,
        output_scale=args.output_scale,
        output_cap=args.output_cap,
        speedup=args.speedup,
        max_requests=args.max_requests,
        duration_s=args.duration,
        max_input_tokens=args.max_input_tokens,
    )
    records = read_trace(path)
    specs = trace_requests(records, scaling, limits, seed=args.seed)
    prompt = _mean([len(s.prompt) for s in specs])
    output = _mean([s.max_tokens for s in specs])
    description = (
        f"trace {path.name}: {len(specs)} of {len(records)} requests, "
        f"{scaling.block_tokens} tokens/hash id, outputs ×{scaling.output_scale:g} "
        f"cap {scaling.output_cap}, ×{scaling.speedup:g} speed; "
        f"mean prompt {prompt:.0f}, mean output {output:.0f} tokens"
    )
    context: dict[str, Figure] = {
        "workload": description,
        "workload_kind": "trace",
        "trace_file": str(path),
        "trace_records": len(records),
        "trace_tokens_per_block": scaling.block_tokens,
        "trace_output_scale": scaling.output_scale,
        "trace_output_cap": scaling.output_cap,
        "trace_speedup": scaling.speedup,
        "trace_max_requests": scaling.max_requests,
        "trace_duration_s": scaling.duration_s,
        "requests_truncated": sum(1 for s in specs if s.truncated),
        "prompt_tokens_mean": prompt,
        "max_tokens_mean": output,
    }
    return specs, context


def _shared_prefix_workload(
    args: argparse.Namespace, limits: Limits
) -> tuple[list[RequestSpec], dict[str, Figure]]:
    workload = SharedPrefix(
        groups=args.groups,
        prefix_tokens=args.prefix_tokens,
        users=args.users,
        question_tokens=args.question_tokens,
        output_tokens=args.output_tokens,
        rate=args.rate,
    )
    specs = shared_prefix_requests(workload, limits, seed=args.seed)
    pace = f"{workload.rate:g} req/s Poisson" if workload.rate else "all at once"
    description = (
        f"shared prefix: {workload.groups} groups × {workload.prefix_tokens} prefix tokens "
        f"× {workload.users} users × {workload.question_tokens} question tokens, "
        f"{workload.output_tokens} output tokens, {pace}"
    )
    context: dict[str, Figure] = {
        "workload": description,
        "workload_kind": "shared-prefix",
        "shared_prefix_groups": workload.groups,
        "shared_prefix_tokens": workload.prefix_tokens,
        "shared_prefix_users": workload.users,
        "shared_prefix_question_tokens": workload.question_tokens,
        "shared_prefix_output_tokens": workload.output_tokens,
        "shared_prefix_rate": workload.rate,
        "requests_truncated": sum(1 for s in specs if s.truncated),
        "prompt_tokens_mean": _mean([len(s.prompt) for s in specs]),
        "max_tokens_mean": float(workload.output_tokens),
    }
    return specs, context


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0
