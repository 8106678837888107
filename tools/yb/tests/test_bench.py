"""`yb bench` without a cluster: token blocks, workloads, SSE parsing and the report."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from yb_core.config import load_config
from yb_core.stats import percentile
from yb_tools.bench.client import CANCELLED, RequestResult, _sse_events
from yb_tools.bench.report import Slo, meets_slo, summarize
from yb_tools.bench.tokens import TokenBlocks, token_block
from yb_tools.bench.workloads import (
    Limits,
    SharedPrefix,
    TraceScaling,
    scaled_input_length,
    shared_prefix_requests,
    trace_requests,
)
from yb_tools.cli import bench
from yb_tools.cli.launcher import ClusterInfo
from yb_tools.traces import TraceRecord, read_trace

REPO_TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "traces" / "synthetic_trace.jsonl"

# --- token blocks ----------------------------------------------------------------------


def test_equal_ids_give_equal_tokens_and_different_ids_differ() -> None:
    a = token_block("trace", 7, 64, 49152)
    assert a == token_block("trace", 7, 64, 49152)
    assert a != token_block("trace", 8, 64, 49152)
    assert a != token_block("prefix", 7, 64, 49152)  # namespaces never collide
    assert a != token_block("trace", 7, 64, 49152, seed=1)
    assert len(a) == 64
    assert len(set(a)) > 50  # pseudo-random, not a constant run


def test_tokens_are_pinned_across_runs_and_machines() -> None:
    # Golden values: a change in the derivation would silently change every benchmark
    # prompt (and its cache behaviour), so it must show here.
    assert token_block("trace", 0, 8, 49152) == [
        16694,
        46908,
        4777,
        19131,
        753,
        35461,
        43837,
        48560,
    ]
    code = "from yb_tools.bench.tokens import token_block; print(token_block('q', 3, 5, 1000))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    assert outputs == {f"{token_block('q', 3, 5, 1000)}\n"}


@pytest.mark.parametrize("vocab", [1, 2, 7, 290, 49152, 2**31 - 1])
def test_tokens_stay_inside_the_vocabulary(vocab: int) -> None:
    ids = token_block("v", 1, 5000, vocab)
    assert all(0 <= t < vocab for t in ids)
    if vocab <= 290:
        assert set(ids) == set(range(vocab))  # every id is reachable


def test_a_shorter_block_is_a_prefix_of_the_longer_one() -> None:
    assert token_block("t", 3, 100, 1000)[:37] == token_block("t", 3, 37, 1000)
    assert token_block("t", 3, 0, 1000) == []
    with pytest.raises(ValueError):
        token_block("t", 3, -1, 1000)
    with pytest.raises(ValueError):
        token_block("t", 3, 4, 0)


def test_chained_blocks_share_exactly_the_shared_ids() -> None:
    blocks = TokenBlocks("trace", 49152)
    a = blocks.chain([1, 2, 3], 16, 48)
    b = blocks.chain([1, 2, 9], 16, 48)
    assert a[:32] == b[:32]
    assert a[32:] != b[32:]
    assert blocks.chain([1, 2, 3], 16, 40) == a[:40]  # a partial last block
    assert a[16:32] == token_block("trace", 2, 16, 49152)  # position does not matter


# --- the trace workload ----------------------------------------------------------------


def _records() -> list[TraceRecord]:
    return [
        TraceRecord(timestamp=1000, input_length=1500, output_length=300, hash_ids=[0, 1, 2]),
        TraceRecord(timestamp=3000, input_length=1024, output_length=10, hash_ids=[0, 1]),
        TraceRecord(timestamp=5000, input_length=100, output_length=1, hash_ids=[5]),
        TraceRecord(timestamp=9000, input_length=700, output_length=40, hash_ids=[]),
    ]


def test_scaled_input_length_keeps_the_block_structure() -> None:
    rec = TraceRecord(timestamp=0, input_length=1500, output_length=1, hash_ids=[0, 1, 2])
    assert scaled_input_length(rec, 512) == 1500
    assert scaled_input_length(rec, 64) == round(1500 / 8)
    # Rounding never drops the last named block nor spills past it.
    rec = TraceRecord(timestamp=0, input_length=1025, output_length=1, hash_ids=[0, 1, 2])
    assert scaled_input_length(rec, 4) == 9
    rec = TraceRecord(timestamp=0, input_length=512, output_length=1, hash_ids=[0])
    assert scaled_input_length(rec, 1) == 1


def test_trace_scaling_of_lengths_and_arrivals() -> None:
    scaling = TraceScaling(block_tokens=64, output_scale=0.5, output_cap=64, speedup=2.0)
    specs = trace_requests(_records(), scaling, Limits(vocab_size=1000))
    assert [s.index for s in specs] == [0, 1, 2, 3]
    # Relative to the first request, then twice as fast.
    assert [s.arrival_s for s in specs] == [0.0, 1.0, 2.0, 4.0]
    assert [len(s.prompt) for s in specs] == [188, 128, 13, 88]
    assert [s.max_tokens for s in specs] == [64, 5, 1, 20]
    # Shared hash ids are shared tokens, whole blocks of them.
    assert specs[0].prompt[:128] == specs[1].prompt
    assert specs[0].group == specs[1].group == 0
    assert specs[2].prompt[:13] != specs[0].prompt[:13]
    assert all(0 <= t < 1000 for s in specs for t in s.prompt)
    assert not any(s.truncated for s in specs)


def test_trace_request_count_duration_and_context_limits() -> None:
    limits = Limits(vocab_size=1000)
    assert len(trace_requests(_records(), TraceScaling(max_requests=2), limits)) == 2
    assert len(trace_requests(_records(), TraceScaling(duration_s=4.0), limits)) == 3
    assert len(trace_requests(_records(), TraceScaling(duration_s=4.0, speedup=2), limits)) == 4
    # The prompt gives way to the output when the context is short; its prefix stays.
    full = trace_requests(_records(), TraceScaling(block_tokens=512), limits)
    cut = trace_requests(
        _records(), TraceScaling(block_tokens=512), Limits(vocab_size=1000, max_model_len=1000)
    )
    assert len(cut[0].prompt) + cut[0].max_tokens == 1000
    assert cut[0].prompt == full[0].prompt[: len(cut[0].prompt)]
    assert cut[0].truncated and not cut[2].truncated
    capped = trace_requests(_records(), TraceScaling(max_input_tokens=50), limits)
    assert max(len(s.prompt) for s in capped) == 50
    with pytest.raises(ValueError):
        TraceScaling(speedup=0)


def test_the_repository_trace_reads_and_scales() -> None:
    records = read_trace(REPO_TRACE)
    assert len(records) == 3993
    assert records[0].hash_ids[:3] == [0, 1, 2]
    specs = trace_requests(records, TraceScaling(max_requests=100), Limits(49152, 8192))
    assert len(specs) == 100
    assert all(len(s.prompt) + s.max_tokens <= 8192 for s in specs)
    assert all(s.max_tokens <= 64 for s in specs)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)


# --- the shared-prefix workload --------------------------------------------------------


def test_shared_prefix_shape() -> None:
    workload = SharedPrefix(
        groups=3, prefix_tokens=100, users=4, question_tokens=10, output_tokens=7
    )
    specs = shared_prefix_requests(workload, Limits(vocab_size=500))
    assert len(specs) == 12
    assert all(len(s.prompt) == 110 and s.max_tokens == 7 for s in specs)
    # Round by round: user 0 of every group first, so the first round warms the cache.
    assert [s.group for s in specs] == [0, 1, 2] * 4
    for group in range(3):
        mine = [s.prompt for s in specs if s.group == group]
        assert len({tuple(p[:100]) for p in mine}) == 1
        assert len({tuple(p[100:]) for p in mine}) == 4
    assert len({tuple(s.prompt[:100]) for s in specs}) == 3
    assert all(s.arrival_s == 0.0 for s in specs)
    assert all(0 <= t < 500 for s in specs for t in s.prompt)


def test_shared_prefix_arrivals_at_a_rate_are_seeded_poisson() -> None:
    workload = SharedPrefix(groups=10, users=40, prefix_tokens=8, question_tokens=2, rate=4.0)
    specs = shared_prefix_requests(workload, Limits(vocab_size=100))
    again = shared_prefix_requests(workload, Limits(vocab_size=100))
    other = shared_prefix_requests(workload, Limits(vocab_size=100), seed=1)
    times = [s.arrival_s for s in specs]
    assert times == [s.arrival_s for s in again]
    assert times != [s.arrival_s for s in other]
    assert times[0] == 0.0 and times == sorted(times)
    # 399 exponential gaps of mean 0.25 s: the total is within a few percent of 100 s.
    assert 85 < times[-1] < 115


def test_shared_prefix_fits_the_context() -> None:
    workload = SharedPrefix(groups=1, users=2, prefix_tokens=500, question_tokens=50)
    specs = shared_prefix_requests(workload, Limits(vocab_size=100, max_model_len=300))
    assert all(len(s.prompt) + s.max_tokens == 300 and s.truncated for s in specs)
    with pytest.raises(ValueError):
        SharedPrefix(groups=0)


# --- the SSE reader --------------------------------------------------------------------


async def _lines(text: str) -> AsyncIterator[str]:
    for line in text.split("\n"):
        yield line


async def test_sse_events_frames_names_and_done() -> None:
    body = (
        'data: {"a": 1}\n\n'
        ": a comment\n"
        'event: error\ndata: {"error": {"message": "x"}}\n\n'
        "data: one\ndata: two\n\n"
        "data: [DONE]\n\n"
    )
    got = [e async for e in _sse_events(_lines(body))]
    assert got == [
        ("message", '{"a": 1}'),
        ("error", '{"error": {"message": "x"}}'),
        ("message", "one\ntwo"),
        ("message", "[DONE]"),
    ]


# --- statistics and the report ---------------------------------------------------------


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [0.3, 1.0, 0.1, 7.5, 2.2, 2.2, 0.0]
    assert math.isclose(percentile(values, q), float(np.percentile(values, q)))
    assert percentile([4.0], q) == 4.0
    with pytest.raises(ValueError):
        percentile([], q)


def _ok(
    index: int, ttft: float, times: list[float], prompt: int, cached: int, out: int
) -> RequestResult:
    return RequestResult(
        index=index,
        sent_s=float(index),
        ttft_s=ttft,
        e2e_s=times[-1] + 0.01 if times else ttft,
        token_times=times,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        usage_reported=True,
    )


def _samples() -> list[RequestResult]:
    return [
        _ok(0, 0.5, [0.5, 0.6, 0.7, 0.8], prompt=100, cached=0, out=4),
        _ok(1, 1.5, [1.5, 1.7, 1.9, 2.1], prompt=100, cached=64, out=4),
        # Meets TTFT but one gap of 3 s: its p90 gap breaks a 2 s TBT SLO.
        _ok(2, 0.2, [0.2, 0.3, 3.3], prompt=200, cached=128, out=3),
        RequestResult(index=3, sent_s=3.0, error="http_429", status=429, message="overloaded"),
        RequestResult(index=4, sent_s=4.0, error="http_429", status=429, message="overloaded"),
        RequestResult(index=5, sent_s=5.0, error="timeout", message="late"),
        RequestResult(index=6, sent_s=None, error=CANCELLED),
    ]


def test_report_figures_from_known_samples() -> None:
    report = summarize(_samples(), 10.0, Slo(ttft_s=1.0, tbt_s=2.0), {"workload": "w"})
    f = report.figures
    assert f["workload"] == "w"
    assert (f["requests_planned"], f["requests_sent"], f["requests_ok"]) == (7, 6, 3)
    assert (f["requests_failed"], f["requests_cancelled"]) == (3, 1)
    assert math.isclose(f["ttft_mean_s"], (0.5 + 1.5 + 0.2) / 3)  # type: ignore[arg-type]
    assert math.isclose(f["ttft_p50_s"], 0.5)  # type: ignore[arg-type]
    gaps = [0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.1, 3.0]
    assert math.isclose(f["itl_mean_s"], sum(gaps) / len(gaps))  # type: ignore[arg-type]
    assert math.isclose(f["itl_p99_s"], float(np.percentile(gaps, 99)))  # type: ignore[arg-type]
    assert math.isclose(f["tpot_p50_s"], (2.11 - 1.5) / 3)  # type: ignore[arg-type]
    # Only request 0 meets both SLOs: 1 ran past the TTFT SLO, 2 past the TBT SLO.
    assert f["requests_meeting_slo"] == 1
    assert math.isclose(f["goodput_rps"], 0.1)  # type: ignore[arg-type]
    assert math.isclose(f["slo_attainment"], 1 / 6)  # type: ignore[arg-type]
    assert (f["errors_total"], f["errors_http_429"], f["errors_timeout"]) == (3, 2, 1)
    assert f["errors_http_503"] == 0
    assert (f["prompt_tokens"], f["cached_tokens"]) == (400, 192)
    assert math.isclose(f["cache_hit_ratio"], 0.48)  # type: ignore[arg-type]
    assert f["requests_with_cache_hit"] == 2
    assert (f["requests_cache_hit"], f["requests_cache_miss"]) == (2, 1)
    assert math.isclose(f["ttft_cache_hit_mean_s"], (1.5 + 0.2) / 2)  # type: ignore[arg-type]
    assert f["ttft_cache_miss_p50_s"] == 0.5
    assert f["output_tokens"] == 11
    assert math.isclose(f["output_tokens_per_s"], 1.1)  # type: ignore[arg-type]
    assert math.isclose(f["request_throughput_rps"], 0.3)  # type: ignore[arg-type]
    # Flat: every value a JSON scalar.
    assert all(not isinstance(v, dict | list) for v in f.values())
    json.dumps(f)
    assert report.error_examples == {"http_429": "overloaded", "timeout": "late"}


def test_worst_gap_slo_and_single_token_requests() -> None:
    r = _ok(0, 0.5, [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 4.0], 10, 0, 11)
    assert meets_slo(r, Slo(ttft_s=1.0, tbt_s=2.0, tbt_percentile=50))
    assert not meets_slo(r, Slo(ttft_s=1.0, tbt_s=2.0, tbt_percentile=100))
    single = _ok(1, 0.5, [0.5], 10, 0, 1)  # no gap to judge
    assert meets_slo(single, Slo(ttft_s=1.0, tbt_s=0.001))


def test_report_of_a_run_where_nothing_completed() -> None:
    results = [RequestResult(index=0, sent_s=0.0, error="connect", message="refused")]
    report = summarize(results, 1.0, Slo(1.0, 1.0))
    f = report.figures
    assert f["ttft_p99_s"] is None and f["goodput_rps"] == 0.0
    assert f["errors_connect"] == 1
    table = report.table()
    assert "connect: refused" in table
    assert "time to first token" in table


def test_table_shows_the_figures() -> None:
    table = summarize(_samples(), 10.0, Slo(ttft_s=1.0, tbt_s=2.0), {"workload": "w"}).table()
    assert "3 ok, 3 failed, 1 cancelled, of 7" in table
    assert "http_429: 2" in table and "timeout: 1" in table
    assert "192 of 400 prompt tokens cached (48.0%)" in table
    assert "goodput    0.100 req/s" in table
    assert "TTFT p50   850 ms with a cache hit (2 requests), 500 ms without (1)" in table


# --- where the gateway is ---------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="yb")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    return parser.parse_args(["bench", *argv])


def test_gateway_and_key_come_from_the_running_yb_up(tmp_path: Path) -> None:
    key_file = tmp_path / "secrets" / "api_key"
    key_file.parent.mkdir()
    key_file.write_text("sk-local\n")
    info = ClusterInfo(
        nats_url="nats://127.0.0.1:1",
        nats_monitor_url="http://127.0.0.1:2",
        gateway_url="http://127.0.0.1:9999",
        pid=1,
        started_at=0.0,
        api_key_file=str(key_file),
    )
    (tmp_path / "cluster.json").write_bytes(msgspec.json.encode(info))
    cfg = load_config(None, env={})
    here = ("shared-prefix", "--data-dir", str(tmp_path))
    assert bench.gateway_target(cfg, _args(*here)) == ("http://127.0.0.1:9999", "sk-local")
    # Another gateway does not get this cluster's key; an explicit key always wins.
    other = (*here, "--url", "http://10.1.2.3:8000/")
    assert bench.gateway_target(cfg, _args(*other)) == ("http://10.1.2.3:8000", "")
    assert bench.gateway_target(cfg, _args(*other, "--api-key", "k")) == (
        "http://10.1.2.3:8000",
        "k",
    )
    # No `yb up` there: the configured address.
    empty = tmp_path / "none"
    assert bench.gateway_target(cfg, _args("trace", "--data-dir", str(empty))) == (
        f"http://{cfg.gateway.host}:{cfg.gateway.port}",
        "",
    )
