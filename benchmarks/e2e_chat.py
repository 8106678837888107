"""Time to first token and decode speed of one chat request through the whole cluster.

Starts the cluster with `yb up` (or uses `--url` of a running one), sends the greedy
"What is the capital of France?" chat request `--runs` times over SSE, one at a time,
and reports TTFT and decode tokens/s for the first (cold) request and the median of
the rest (warm).

When it starts the cluster itself it also reports what `yb up` costs in memory
(`yb_testkit.memory`): the peak resident memory (VmHWM) of every process of the
cluster, the launcher included, read just before it stops (`peak_rss_mb_<process>`,
and `peak_rss_mb_total`, their sum), the highest of the processes' summed
proportional set size after each request, which counts a page they share once
(`peak_pss_mb_total`), and the KV pages each engine sized for itself
(`kv_pages_<instance>`, from its `kv_cache_sized` log line).

    python benchmarks/e2e_chat.py --json out.json [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from yb_testkit.fixtures import LocalCluster
from yb_testkit.memory import PssPeaks, peak_rss_figures

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def one_request(
    url: str, model: str, max_tokens: int, headers: dict[str, str]
) -> tuple[float, float, int, str]:
    """(ttft_s, decode tokens/s, tokens, text) of one streamed greedy request."""
    body = {
        "model": model,
        "messages": PROMPT,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = 0.0
    text = ""
    tokens = 0
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=300, headers=headers
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content") or ""
                if piece and not first:
                    first = time.perf_counter()
                text += piece
    ended = time.perf_counter()
    decode_s = ended - first
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    return first - started, rate, tokens, text


def cluster_memory(cluster: LocalCluster) -> dict[str, float]:
    """`peak_rss_mb_*` of every process of a running `yb up` and their sum, and
    `kv_pages_*` of every engine."""
    figures = peak_rss_figures(cluster)
    for name in cluster.pids:
        if not name.startswith(("prefill", "decode")):
            continue
        for line in cluster.instance_log(name).splitlines():
            if '"kv_cache_sized"' in line:
                figures[f"kv_pages_{name.replace('-', '_')}"] = json.loads(line)["pages"]
    return figures


def main() -> int:
    """Run the benchmark and print/write its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway (default: start `yb up`)")
    parser.add_argument(
        "--api-key",
        help="the gateway's API key, with --url (default: the configured key, else the "
        "one `yb up` keeps in the data directory)",
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    cluster = None
    url = args.url
    api_key = args.api_key or ""
    if url and not api_key:
        from yb_core.config import load_config
        from yb_core.credentials import client_api_key

        api_key = client_api_key(load_config())
    if not url:
        cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="yb-bench-")))
        started = time.perf_counter()
        cluster.start()
        print(f"cluster ready in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        url = cluster.url
        api_key = cluster.api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    memory: dict[str, float] = {}
    pss = PssPeaks(cluster) if cluster is not None else None
    try:
        results = []
        for _ in range(args.runs):
            results.append(one_request(url, args.model, args.max_tokens, headers))
            if pss is not None:
                pss.sample()  # between requests: sampling costs CPU the requests need
        if cluster is not None and pss is not None:
            memory = {**cluster_memory(cluster), **pss.figures()}
    finally:
        if cluster is not None:
            cluster.stop()
    cold, warm = results[0], results[1:] or results
    figures = {
        "ttft_cold_s": round(cold[0], 4),
        "ttft_warm_median_s": round(statistics.median(r[0] for r in warm), 4),
        "decode_tokens_per_s_median": round(statistics.median(r[1] for r in warm), 2),
        "completion_tokens": cold[2],
        "answer_names_paris": all("Paris" in r[3] for r in results),
        **memory,
    }
    print(f"{'run':>4} {'ttft_s':>8} {'decode_tok/s':>13} {'tokens':>7}  text")
    for i, (ttft, rate, tokens, text) in enumerate(results):
        print(f"{i:>4} {ttft:>8.3f} {rate:>13.1f} {tokens:>7}  {text!r}")
    for key, value in figures.items():
        print(f"{key:<28} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
