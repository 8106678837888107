"""`yb bench` against a real cluster (`yb up` with the tiny random model).

The front end runs in-process (the same `add_parser` + `run` the `yb` command
calls), so these tests cover argument parsing, the HTTP/SSE client, the runner, the
report and its files end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from yb_core.config import load_config
from yb_testkit.fixtures import LocalCluster
from yb_tools.bench.client import CANCELLED, BenchClient, RequestResult
from yb_tools.bench.runner import LoadRunner
from yb_tools.bench.workloads import (
    Limits,
    RequestSpec,
    TraceScaling,
    trace_requests,
)
from yb_tools.cli import bench
from yb_tools.traces import read_trace

# Figures a consumer of `--json` relies on; after a clean run none may be null.
REQUIRED = [
    "workload",
    "model",
    "url",
    "vocab_size",
    "requests_planned",
    "requests_sent",
    "requests_ok",
    "requests_failed",
    "requests_cancelled",
    "duration_s",
    "request_throughput_rps",
    *(f"{m}_{s}_s" for m in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")),
    "output_tokens",
    "output_tokens_per_s",
    "prompt_tokens",
    "cached_tokens",
    "cache_hit_ratio",
    "goodput_rps",
    "slo_attainment",
    "ttft_slo_s",
    "tbt_slo_s",
    "errors_total",
    "errors_http_429",
    "errors_timeout",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = LocalCluster(
        tmp_path_factory.mktemp("bench"),
        *("--model", "tiny-random", "--model-name", "tiny"),
        # The trace's requests overlap: room for four 1,000-token prompts at once.
        env={"YB_DECODE__KV_SEQUENCES": "2"},
    )
    running.start(timeout_s=300)
    try:
        yield running
    finally:
        running.stop()


def _bench(cluster: LocalCluster, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="yb")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    # The data directory alone: the bench finds the gateway and its API key there.
    args = parser.parse_args(["bench", *argv, "--data-dir", str(cluster.data_dir), "--no-progress"])
    return bench.run(load_config(None, env={}), args)


def _figures(path: Path) -> dict[str, Any]:
    figures: dict[str, Any] = json.loads(path.read_text())
    return figures


def test_shared_prefix_run_writes_complete_figures_and_hits_the_cache(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code = _bench(
        cluster,
        "shared-prefix",
        *("--groups", "2", "--prefix-tokens", "256", "--users", "4"),
        *("--question-tokens", "8", "--output-tokens", "4", "--concurrency", "1"),
        *("--json", str(out / "f.json"), "--plot", str(out / "p.png")),
        *("--samples", str(out / "s.jsonl")),
    )
    assert code == 0, cluster.output()
    f = _figures(out / "f.json")
    missing = [k for k in REQUIRED if f.get(k) is None]
    assert missing == []
    assert all(not isinstance(v, dict | list) for v in f.values())
    assert (f["requests_planned"], f["requests_ok"], f["errors_total"]) == (8, 8, 0)
    assert f["prompt_tokens"] == 8 * 264
    assert f["output_tokens"] >= 8
    # The vocabulary was learnt from the gateway: the tiny model's, not a default.
    assert 0 < f["vocab_size"] < 1000
    # Users after the first of a group find the group's 4 prefix blocks cached.
    assert f["cached_tokens"] > 0, f
    assert f["requests_with_cache_hit"] >= 1
    assert (out / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = [json.loads(line) for line in (out / "s.jsonl").read_text().splitlines()]
    assert [s["index"] for s in samples] == list(range(8))
    assert all(s["request_id"].startswith("cmpl-") for s in samples)


def test_trace_replay_sends_the_scaled_prompts(cluster: LocalCluster, tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    code = _bench(
        cluster,
        "trace",
        *("--max-requests", "6", "--tokens-per-block", "16", "--output-cap", "4"),
        *("--speedup", "20", "--json", str(path)),
    )
    assert code == 0, cluster.output()
    f = _figures(path)
    assert f["workload_kind"] == "trace"
    assert f["url"] == cluster.url
    assert (f["requests_ok"], f["errors_total"]) == (6, 0)
    # What the gateway counted is exactly what the workload built.
    specs = trace_requests(
        read_trace(bench.REPO_TRACE),
        TraceScaling(block_tokens=16, output_cap=4, speedup=20, max_requests=6),
        Limits(f["vocab_size"], f["max_model_len"]),
    )
    assert f["prompt_tokens"] == sum(len(s.prompt) for s in specs)
    assert 6 <= f["output_tokens"] <= 24


def test_a_request_past_its_deadline_counts_as_failed(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    path = tmp_path / "f.json"
    code = _bench(
        cluster,
        "shared-prefix",
        *("--groups", "1", "--users", "3", "--prefix-tokens", "64", "--output-tokens", "200"),
        *("--request-timeout", "0.001", "--json", str(path)),
    )
    assert code == 1  # nothing completed
    f = _figures(path)
    assert (f["requests_ok"], f["errors_timeout"], f["errors_total"]) == (0, 3, 3)
    assert f["ttft_p50_s"] is None


def test_refused_requests_are_counted_by_status(cluster: LocalCluster, tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    # Token ids beyond the tiny vocabulary: the gateway answers 400 to every request.
    code = _bench(
        cluster,
        "shared-prefix",
        *("--groups", "2", "--users", "2", "--vocab-size", "100000", "--json", str(path)),
    )
    assert code == 1
    f = _figures(path)
    assert (f["errors_http_400"], f["errors_total"], f["requests_ok"]) == (4, 4, 0)


async def test_stopping_cancels_what_is_in_flight_everywhere(cluster: LocalCluster) -> None:
    client = BenchClient(cluster.url, concurrency=2, api_key=cluster.api_key)
    info = await client.server_info()
    vocab = await client.probe_vocab_size(info.model)
    stop = asyncio.Event()
    seen: list[RequestResult] = []

    def on_result(result: RequestResult) -> None:
        seen.append(result)
        stop.set()  # what Ctrl-C does

    from yb_tools.bench.tokens import token_block

    # A one-token request that ends first, then long ones that are cut short.
    specs = [
        RequestSpec(index=0, arrival_s=0.0, prompt=token_block("s", 0, 8, vocab), max_tokens=1)
    ]
    specs += [
        RequestSpec(index=i, arrival_s=0.0, prompt=token_block("s", i, 64, vocab), max_tokens=2000)
        for i in range(1, 10)
    ]
    runner = LoadRunner(
        client, model=info.model, concurrency=2, deadline_s=120, on_result=on_result
    )
    try:
        results, _ = await runner.run(specs, stop)
    finally:
        await client.close()
    assert len(results) == 10
    assert all(r.ok or r.error == CANCELLED for r in results), [r.error for r in results]
    assert sum(r.error == CANCELLED for r in results) >= 8
    assert runner.in_flight == 0
    # The gateway saw the clients go and holds nothing afterwards.
    # Generous deadlines: the wait ends as soon as the gauge reads 0.
    deadline = time.monotonic() + 120
    in_flight = -1.0
    async with httpx.AsyncClient(
        base_url=cluster.url, timeout=60, headers=cluster.metrics_headers
    ) as http:
        while time.monotonic() < deadline:
            metrics = (await http.get("/metrics")).text
            in_flight = sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("yb_gateway_in_flight_requests")
            )
            if in_flight == 0:
                break
            await asyncio.sleep(0.2)
    assert in_flight == 0
