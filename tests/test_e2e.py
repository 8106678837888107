"""The whole cluster through `yb up`, as a user runs it: real NATS, UCX, model, HTTP.

One cluster with the tiny random model checks the API surface and the plumbing; one
with the default model checks the answer (Paris) and that the prompt's KV travelled
over UCX, not NATS. Both stop with Ctrl-C and must leave no process behind.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from yb_testkit.fixtures import LocalCluster, pid_alive
from yb_testkit.reference import single_process_answer
from yb_tools.cli.launcher import read_cluster_info

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _stop_and_check_no_orphans(cluster: LocalCluster) -> None:
    pids = dict(cluster.pids)
    assert pids, "cluster.json listed no processes"
    code = cluster.stop()
    assert code == 0, cluster.output()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids.values()):
        time.sleep(0.2)
    assert [n for n, p in pids.items() if pid_alive(p)] == []
    assert read_cluster_info(cluster.data_dir) is None


# The tiny cluster's start-up (the module fixture, with its own deadline) does not
# count against a test's timeout.
pytestmark = pytest.mark.timeout(300, func_only=True)


@pytest.fixture(scope="module")
def tiny_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("tiny"), "--model", "tiny-random", "--model-name", "tiny"
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        if cluster.process is not None and cluster.process.poll() is None:
            cluster.stop()


def test_tiny_cluster_serves_the_openai_api(tiny_cluster: LocalCluster) -> None:
    url = tiny_cluster.url
    auth = tiny_cluster.headers
    models = httpx.get(f"{url}/v1/models", timeout=10, headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]

    body = {"model": "tiny", "messages": PARIS, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=60, headers=auth
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    r = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0},
        headers=auth,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_tiny_cluster_bad_input_is_refused_cleanly(tiny_cluster: LocalCluster) -> None:
    url = tiny_cluster.url
    auth = tiny_cluster.headers
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json", **auth},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=10,
        json={"model": "nope", "messages": PARIS},
        headers=auth,
    )
    assert r.status_code == 404
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=10,
        json={"model": "tiny", "prompt": "word " * 20000, "max_tokens": 4},
        headers=auth,
    )
    assert r.status_code == 400
    # The tiny model attends to 4096 positions: the gateway serves that, not the
    # configured 8192.
    assert "4096" in r.json()["error"]["message"]


def test_tiny_cluster_decisions_are_events_and_status_shows_instances(
    tiny_cluster: LocalCluster,
) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "yb_tools.cli", "status", "--data-dir", str(tiny_cluster.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for name in (
        "conductor-0",
        "gateway-0",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "kvstore-0",
        "kvstore-1",
    ):
        assert name in out, out
    decode_log = tiny_cluster.instance_log("decode-0")
    assert "kv_transfer_failed" not in decode_log


def test_tiny_cluster_one_trace_runs_from_gateway_to_decode(tiny_cluster: LocalCluster) -> None:
    # A client's W3C traceparent is continued by the gateway; the context then rides
    # in NATS headers to prefill and on to decode, which log the trace id they joined.
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(
        f"{tiny_cluster.url}/v1/completions",
        json={"model": "tiny", "prompt": "trace me", "max_tokens": 2, "temperature": 0},
        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", **tiny_cluster.headers},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    request_id = r.json()["id"]

    def logged_trace(instance_prefix: str, event: str) -> set[str]:
        found = set()
        for name in ("prefill-0", "prefill-1", "decode-0"):
            if not name.startswith(instance_prefix):
                continue
            for line in tiny_cluster.instance_log(name).splitlines():
                if f'"{event}"' in line and request_id in line:
                    found.add(json.loads(line)["trace_id"])
        return found

    # The answer can reach the client before an instance's log line reaches its
    # file: look until both are there, with a deadline.
    deadline = time.monotonic() + 30
    while True:
        found = (
            logged_trace("prefill", "prefill_started"),
            logged_trace("decode", "decode_started"),
        )
        if found == ({trace_id}, {trace_id}) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert found == ({trace_id}, {trace_id}), found


def test_tiny_cluster_stops_cleanly_on_ctrl_c(tiny_cluster: LocalCluster) -> None:
    _stop_and_check_no_orphans(tiny_cluster)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # its cluster starts inside it (up to 900 s, the model)
def test_default_model_answers_paris_with_kv_over_ucx(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "default")
    cluster.start(timeout_s=900)
    try:
        info = read_cluster_info(cluster.data_dir)
        assert info is not None
        nats_before = json.load(urllib.request.urlopen(f"{info.nats_monitor_url}/varz"))

        client = OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, timeout=300)
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=PARIS,
            temperature=0,
            max_tokens=48,
            stream=True,
        )
        first = None
        text = ""
        pieces = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter()
                text += chunk.choices[0].delta.content
                pieces += 1
        ended = time.perf_counter()
        assert "Paris" in text, text
        assert first is not None
        # Disaggregation changes nothing: the same greedy tokens as one process running
        # prefill and decode on the same runner.
        assert text == single_process_answer(PARIS, 48), text
        print(
            f"\nParis prompt: TTFT {first - started:.3f}s, "
            f"decode {pieces / max(ended - first, 1e-9):.1f} tokens/s, text {text!r}"
        )

        # The prompt's KV reached decode over UCX; NATS carried far less than the KV.
        nats_after = json.load(urllib.request.urlopen(f"{info.nats_monitor_url}/varz"))
        nats_bytes = nats_after["in_bytes"] - nats_before["in_bytes"]
        decode_metrics = httpx.get(
            f"http://{_metrics_address(cluster, 'decode-0')}/metrics",
            timeout=5,
            headers=cluster.metrics_headers,
        ).text
        ucx_bytes = _metric(decode_metrics, "yb_decode_kv_bytes_received_total")
        assert ucx_bytes > 0
        assert nats_bytes < ucx_bytes / 4, (nats_bytes, ucx_bytes)
    finally:
        code = cluster.stop()
    assert code == 0, cluster.output()


def _metrics_address(cluster: LocalCluster, instance_id: str) -> str:
    for line in cluster.instance_log(instance_id).splitlines():
        if '"metrics_listening"' in line:
            record = json.loads(line)
            return f"{record['host']}:{record['port']}"
    raise AssertionError(f"{instance_id} logged no metrics address")
