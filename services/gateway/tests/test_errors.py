"""Every refusal is an OpenAI error body with the right status, and never a hang."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gateway_testkit import (
    METRICS_AUTH,
    MODEL,
    PREFILL_ID,
    WORDS,
    Cluster,
    GatewayFactory,
    client_for,
    error_of,
    next_event,
)

from yb_core import events as ev
from yb_core.bus import Bus
from yb_gateway.schemas import MAX_CHOICES
from yb_gateway.service import GatewayService

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_malformed_json(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "max_tokens": "10"}, "max_tokens"),
        ({**CHAT, "messages": "hi"}, "messages"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({**CHAT, "temperature": 3.0}, "temperature"),
        ({"messages": CHAT["messages"]}, None),  # `model` missing
        ({**CHAT, "messages": []}, "messages"),
    ],
)
async def test_wrong_or_missing_fields(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    error = error_of(await client.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is None:
        assert "model" in error["message"]


async def test_unknown_model(client: httpx.AsyncClient) -> None:
    error = error_of(
        await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404
    )
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


async def test_prompt_too_long_names_the_limit(client: httpx.AsyncClient) -> None:
    # max_model_len is 256 in the test config.
    error = error_of(
        await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": list(range(250)), "max_tokens": 10}
        ),
        400,
    )
    assert error["code"] == "context_length_exceeded"
    assert "max_model_len=256" in error["message"]


async def test_max_tokens_over_server_limit_names_the_limit(client: httpx.AsyncClient) -> None:
    error = error_of(
        await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10_000}), 400
    )
    assert error["param"] == "max_tokens" and "max_max_tokens=512" in error["message"]


async def test_at_most_max_choices(client: httpx.AsyncClient) -> None:
    error = error_of(
        await client.post("/v1/chat/completions", json={**CHAT, "n": MAX_CHOICES + 1}), 400
    )
    assert error["param"] == "n" and f"<= {MAX_CHOICES}" in error["message"]


async def test_token_ids_outside_vocabulary(client: httpx.AsyncClient) -> None:
    error = error_of(
        await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**6]}), 400
    )
    assert error["param"] == "prompt"


async def test_body_too_large(client: httpx.AsyncClient) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}  # limit: 64 KiB
    error = error_of(await client.post("/v1/chat/completions", json=big), 413)
    assert "65536" in error["message"]


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    error_of(await client.get("/v1/nothing"), 404)
    error_of(await client.get("/v1/chat/completions"), 405)


async def test_rejection_is_429_with_retry_after(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    cluster.conductor.mode = "reject"
    cluster.conductor.retry_after_s = 2.2
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    error = error_of(response, 429)
    assert response.headers["retry-after"] == "3"
    assert "predicted TBT over SLO" in error["message"]
    assert cluster.engine.jobs == []


async def test_no_decision_is_503_at_the_decision_timeout(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    gw = await gateway_factory(decision_timeout_s=0.5)
    cluster.conductor.mode = "silent"
    cancelled = await bus.read_ordered("yb.ev.req.request_cancelled", new_only=True)
    async with client_for(gw) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    error = error_of(response, 503)
    assert error["code"] == "decision_timeout"
    assert "decision_timeout_s=0.5s" in error["message"]
    # The admission is withdrawn, so a late decision does not hold an engine.
    event = await next_event(cancelled, ev.RequestCancelled)
    assert event.request_id == response.headers["x-request-id"]
    await cancelled.close()
    assert gw.in_flight == 0 and gw.decisions.waiting == 0


async def test_job_refused_is_503_and_recorded_as_failed(
    client: httpx.AsyncClient, cluster: Cluster, bus: Bus
) -> None:
    finished = await bus.read_ordered("yb.ev.req.request_finished", new_only=True)
    cluster.engine.reply = "refuse"
    response = await client.post("/v1/chat/completions", json=CHAT)
    error = error_of(response, 503)
    assert error["code"] == "job_refused" and "no KV pages" in error["message"]
    event = await next_event(finished, ev.RequestFinished)
    assert event.outcome == "failed" and event.request_id == response.headers["x-request-id"]
    await finished.close()


async def test_a_job_refused_by_a_draining_engine_is_re_planned_not_failed(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    # Decided before the engine's drain reached the conductor, refused on arrival:
    # nothing streams yet, so the gateway re-plans it around that engine.
    cluster.engine.reply = "refuse_once"
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "".join(WORDS)
    [replan] = cluster.conductor.replanned
    assert replan.attempt == 1 and replan.failed_instance == PREFILL_ID
    assert "shutting down" in replan.reason
    assert [job.attempt for job in cluster.engine.jobs] == [0, 1]


async def test_prefill_silent_is_503_at_the_job_timeout(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    gw = await gateway_factory(job_timeout_s=1.0)
    events = await bus.read_ordered("yb.ev.req.>", new_only=True)
    cluster.engine.reply = "silent"
    async with client_for(gw) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    error = error_of(response, 503)
    # The hand-off's own deadline ended it (job_timeout_s), not a later one.
    assert error["code"] == "no_engine" and "did not take the job" in error["message"]
    # Failed for the conductor, and cancelled in case the job reached an engine late.
    assert (await next_event(events, ev.RequestFinished)).outcome == "failed"
    await next_event(events, ev.RequestCancelled)
    await events.close()


async def test_engine_error_chunk_is_its_status(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    from yb_core import protocol

    def failing(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
        return [
            protocol.TokenChunk(request_id=job.request_id, seq=0, token_ids=[1], text="a"),
            protocol.TokenChunk(
                request_id=job.request_id, seq=1, error="KV transfer failed", error_status=507
            ),
        ]

    cluster.engine.script = failing
    error = error_of(await client.post("/v1/chat/completions", json=CHAT), 507)
    assert error["message"] == "KV transfer failed"


async def test_first_token_timeout_is_504(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    gw = await gateway_factory(first_token_timeout_s=0.3)
    cluster.engine.script = lambda job: []
    async with client_for(gw) as client:
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert error_of(response, 504)["code"] == "first_token_timeout"


async def test_unexpected_exception_is_a_logged_500(
    gateway: GatewayService, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom(*_args: Any) -> list[int]:
        raise RuntimeError("tokenizer exploded")

    assert gateway.encoder is not None
    monkeypatch.setattr(gateway.encoder, "chat", boom)
    error = error_of(await client.post("/v1/chat/completions", json=CHAT), 500)
    assert error["type"] == "server_error" and "chatcmpl-" in error["message"]
    assert "exploded" not in error["message"]  # internals stay in the log
    metrics = (await client.get("/metrics", headers=METRICS_AUTH)).text
    assert 'yb_gateway_requests_total{status="500"} 1.0' in metrics
    assert "yb_gateway_in_flight_requests 0.0" in metrics
