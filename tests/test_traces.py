"""One request is one trace: a real `yb up` exports its spans over OTLP to a real
receiver, and the spans of every service link up under the gateway's request span.

The cluster runs with a ten-minute batch delay, so nothing is exported while it
runs: every span that arrives was flushed when its process stopped (Ctrl-C), which
is also the check that a short run loses none.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from yb_testkit.fixtures import LocalCluster
from yb_testkit.otlp import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.timeout(600)

#: Each span of a request's trace, and the span it must hang under.
PARENTS = {
    "gateway tokenize": "gateway chat.completions",
    "gateway admission": "gateway chat.completions",
    "gateway hand-off": "gateway chat.completions",
    # The admission's context travels in the event log with `RequestAdmitted`.
    "conductor decide": "gateway admission",
    # The job's context travels in the job's NATS headers.
    "prefill": "gateway hand-off",
    "prefill queue wait": "prefill",
    "prefill reserve decode": "prefill",
    "prefill prefix load": "prefill",
    "prefill compute": "prefill",
    "kv transfer": "prefill",
    "prefill hand-over": "prefill",
    "decode reserve": "prefill reserve decode",
    "decode": "prefill hand-over",
    "decode first token": "decode",
    "decode stream": "decode",
}
SERVICES = {"yuebing-gateway", "yuebing-conductor", "yuebing-prefill", "yuebing-decode"}


def _trace_of(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    """The spans that share a trace with the gateway span of `request_id`."""
    roots = [
        s
        for s in spans
        if s.service == "yuebing-gateway" and s.attributes.get("yb.request_id") == request_id
    ]
    if not roots:
        return []
    return [s for s in spans if s.trace_id == roots[0].trace_id]


def test_a_chat_completion_is_one_trace_across_four_services(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        cluster = LocalCluster(
            tmp_path / "traced",
            "--model",
            "tiny-random",
            "--model-name",
            "tiny",
            env={
                "YB_TELEMETRY__OTLP_ENDPOINT": receiver.http_endpoint,
                "OTEL_BSP_SCHEDULE_DELAY": "600000",
            },
        )
        cluster.start(timeout_s=300)
        try:
            r = httpx.post(
                f"{cluster.url}/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "trace me"}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                headers=cluster.headers,
                timeout=60,
            )
        finally:
            code = cluster.stop()
        assert r.status_code == 200, r.text
        assert code == 0, cluster.output()
        answer = r.json()
        request_id = answer["id"]
        spans = receiver.wait_for(
            lambda got: {s.name for s in _trace_of(got, request_id)} >= set(PARENTS),
            timeout_s=60,
            what=f"every span of request {request_id}",
        )

    trace = _trace_of(spans, request_id)
    assert receiver.rejected == []
    assert {s.service for s in trace} >= SERVICES
    # One of each: a replay or a standby's catch-up would add a second decision.
    assert Counter(s.name for s in trace) == Counter(
        {name: 1 for name in [*PARENTS, "gateway chat.completions"]}
    ), sorted(str(s) for s in trace)

    by_id = {s.span_id: s for s in trace}
    by_name = {s.name: s for s in trace}
    root = by_name["gateway chat.completions"]
    assert root.parent_span_id == ""  # the client sent no traceparent
    for span in trace:
        if span is root:
            continue
        parent = by_id.get(span.parent_span_id)
        assert parent is not None, f"{span}: its parent is not in the trace"
        assert parent.name == PARENTS[span.name], f"{span} hangs under {parent}"

    decide = by_name["conductor decide"].attributes
    assert decide["yb.request_id"] == request_id
    assert decide["yb.decision"] == "scheduled"
    assert decide["yb.prefill_instance"] == by_name["prefill"].instance
    assert decide["yb.decode_instance"] == by_name["decode"].instance
    assert decide["yb.estimate.ttft_s"] > 0
    transfer = by_name["kv transfer"]
    assert transfer.attributes["yb.pages_sent"] > 0
    assert [name for name, _ in transfer.events] and {name for name, _ in transfer.events} == {
        "kv_segment_sent"
    }
    decode = by_name["decode"].attributes
    assert decode["yb.completion_tokens"] == answer["usage"]["completion_tokens"] == 4
    assert root.attributes["yb.completion_tokens"] == 4
