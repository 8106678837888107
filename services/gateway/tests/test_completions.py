"""Serving requests end to end: gateway <-> real NATS <-> conductor and engine peers."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
from gateway_testkit import (
    METRICS_AUTH,
    MODEL,
    PREFILL_ID,
    WORDS,
    Cluster,
    GatewayFactory,
    client_for,
    make_config,
    next_event,
    poll_status,
    start_gateway,
)
from httpx_sse import aconnect_sse

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_core.hashing import block_hashes
from yb_core.model_files import identity_of
from yb_core.telemetry import trace_id_hex
from yb_gateway.schemas import ChatMessage
from yb_gateway.service import GatewayService

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to the world"}]}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16}


async def test_streaming_chat(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "top_k": 20,
        "seed": 7,
        "stop": "\n\n",
        "max_tokens": 32,
        # The extension names the tier of that priority: `priority`, with its SLOs.
        "priority": 1,
    }
    events = []
    async with aconnect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        async for sse in source.aiter_sse():
            events.append(sse.data)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "".join(WORDS)
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["stop"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == len(WORDS)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}

    # What reached the cluster: the admission carries hashes of the chat-templated
    # prompt; the job carries its tokens, the sampling settings and the decision.
    admitted = cluster.conductor.admitted[-1]
    (job,) = cluster.engine.jobs
    assert gateway.encoder is not None
    expected_ids = await gateway.encoder.chat(msgspec.convert(CHAT["messages"], list[ChatMessage]))
    assert job.token_ids == expected_ids
    assert usage["prompt_tokens"] == len(expected_ids)
    hashes = block_hashes(
        expected_ids, 4, identity_of(gateway.cfg.model, gateway.cfg.model_cache_dir())
    )
    assert admitted.block_hashes == job.block_hashes == hashes
    assert admitted.prompt_tokens == len(expected_ids) and admitted.max_tokens == 32
    assert admitted.priority == 1 and admitted.gateway_id == gateway.instance_id
    assert admitted.service_tier == "priority" and job.priority == 1
    assert all(c["service_tier"] == "priority" for c in chunks)
    assert admitted.model == MODEL and admitted.deadline > admitted.time
    assert job.decision.prefill_instance == PREFILL_ID
    assert job.sampling.temperature == 0.5 and job.sampling.top_k == 20
    assert job.sampling.seed == 7 and job.sampling.stop == ["\n\n"]
    assert "traceparent" in job.trace_headers
    assert gateway.in_flight == 0 and gateway.decisions.waiting == 0


async def test_non_streaming_completion_with_usage(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"].startswith("cmpl-")
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [
        {"index": 0, "text": "".join(WORDS), "finish_reason": "stop", "logprobs": None}
    ]
    prompt_tokens = len(cluster.engine.jobs[0].token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(WORDS),
        "total_tokens": prompt_tokens + len(WORDS),
        "prompt_tokens_details": {"cached_tokens": 4},
    }


async def test_completion_from_token_ids_and_streaming_text(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "stream": True, "max_tokens": 4}
    async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
        data = [sse.data async for sse in source.aiter_sse()]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(WORDS)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert cluster.engine.jobs[0].token_ids == [5, 6, 7, 8, 9]
    assert cluster.engine.jobs[0].sampling.max_tokens == 4
    assert not cluster.engine.jobs[0].sampling.ignore_eos


async def test_ignore_eos_reaches_the_engines(client: httpx.AsyncClient, cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert cluster.engine.jobs[0].sampling.ignore_eos


async def test_the_served_context_is_capped_at_the_models_own_limit(
    nats_config: NatsConfig, cluster: Cluster
) -> None:
    del cluster
    # The tiny model attends to 4096 positions; a configured 8192 is not served.
    cfg = make_config(nats_config)
    cfg.model.max_model_len = 8192
    gw = await start_gateway(cfg)
    try:
        async with client_for(gw) as client:
            (card,) = (await client.get("/v1/models")).json()["data"]
            body = {"model": MODEL, "prompt": [5] * 4096, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body)
    finally:
        await gw.stop()
    assert card["max_model_len"] == 4096
    assert gw.encoder is not None and card["vocab_size"] == gw.encoder.vocab_size > 0
    assert response.status_code == 400
    assert "4096" in response.json()["error"]["message"]


async def test_non_streaming_chat(client: httpx.AsyncClient, cluster: Cluster) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    response = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "max_completion_tokens": 9},
        headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "".join(WORDS)}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert cluster.engine.jobs[0].sampling.max_tokens == 9
    # The client's trace continues through the gateway to the engines.
    assert trace_id_hex(cluster.engine.jobs[0].trace_headers) == trace_id


async def test_n_choices_end_when_the_last_one_finishes(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    """The engine streams the choices' chunks interleaved in one numbering; the answer
    waits for every choice, whole or streamed, and counts the tokens of all of them."""
    response = await client.post("/v1/completions", json={**COMPLETION, "n": 15})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == list(range(15))
    assert {c["text"] for c in body["choices"]} == {"".join(WORDS)}
    assert body["usage"]["completion_tokens"] == 15 * len(WORDS)
    assert cluster.engine.jobs[-1].sampling.n == 15

    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    texts = ["", "", ""]
    async with aconnect_sse(client, "POST", "/v1/chat/completions", json=body) as source:
        async for sse in source.aiter_sse():
            if sse.data == "[DONE]":
                break
            chunk = json.loads(sse.data)
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
            usage = chunk.get("usage")
    assert texts == ["".join(WORDS)] * 3
    assert usage is not None and usage["completion_tokens"] == 3 * len(WORDS)


async def test_models_health_and_metrics(client: httpx.AsyncClient, cluster: Cluster) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).is_success
    await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    text = (await client.get("/metrics", headers=METRICS_AUTH)).text
    assert 'yb_gateway_requests_total{status="200"} 1.0' in text
    assert 'yb_gateway_requests_total{status="404"} 1.0' in text
    assert 'yb_gateway_ttft_seconds_count{tier="default"} 1.0' in text
    assert "yb_gateway_inter_token_seconds_count" in text
    assert "yb_gateway_in_flight_requests 0.0" in text
    assert (await client.get("/schema/openapi.json")).json()["paths"]["/v1/chat/completions"]


async def test_readyz_follows_engine_instances(
    gateway: GatewayService, client: httpx.AsyncClient, bus: Bus
) -> None:
    response = await client.get("/readyz")
    assert response.status_code == 503
    report = response.json()
    assert report["bus"] == "connected" and report["tokenizer"] == "loaded"
    assert any("prefill" in m for m in report["missing"])
    assert any("decode" in m for m in report["missing"])

    await bus.publish(ev.InstanceUp(instance_id="p1", role="prefill", host="h", model=MODEL))
    await bus.publish(ev.InstanceUp(instance_id="d1", role="decode", host="h", model=MODEL))
    reader = await bus.read_ordered("yb.ev.instance.>")
    await next_event(reader, ev.InstanceUp)
    await reader.close()

    ready = (await poll_status(client, "/readyz", 200)).json()
    assert ready["prefill_instances"] == ["p1"] and ready["decode_instances"] == ["d1"]

    await bus.publish(ev.InstanceDown(instance_id="d1", reason="stopped"))
    assert (await poll_status(client, "/readyz", 503)).json()["decode_instances"] == []

    # An instance whose heartbeat is older than the timeout is dead, announced or not.
    await bus.publish(
        ev.InstanceUp(instance_id="d2", role="decode", host="h", model=MODEL, time=1000.0)
    )
    await bus.publish(ev.InstanceUp(instance_id="d3", role="decode", host="h", model="other"))
    # A live instance announced after them: once the gateway counts it, it has read
    # the two before, and counted neither.
    await bus.publish(ev.InstanceUp(instance_id="d4", role="decode", host="h", model=MODEL))
    assert (await poll_status(client, "/readyz", 200)).json()["decode_instances"] == ["d4"]


async def test_gateway_announces_itself_and_retires(
    gateway_factory: GatewayFactory, bus: Bus
) -> None:
    reader = await bus.read_ordered("yb.ev.instance.>", new_only=True)
    gw = await gateway_factory()
    up = await next_event(reader, ev.InstanceUp)
    assert (up.instance_id, up.role, up.model) == (gw.instance_id, "gateway", MODEL)
    assert up.metrics_address.endswith(f":{gw.port}")
    await gw.stop()
    down = await next_event(reader, ev.InstanceDown)
    assert down.instance_id == gw.instance_id
    await reader.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_continuous_usage_stats_put_counts_on_every_chunk(
    client: httpx.AsyncClient, cluster: Cluster, path: str
) -> None:
    # vLLM's extension, which guidellm sends: with include_usage, every chunk carries
    # the counts so far (without it, a 400: test_input_checks).
    request = {"messages": CHAT["messages"]} if "chat" in path else {"prompt": "Hello"}
    body = {
        "model": MODEL,
        **request,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with aconnect_sse(client, "POST", path, json=body) as source:
        assert source.response.status_code == 200
        events = [sse.data async for sse in source.aiter_sse()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    with_text = [
        c
        for c in chunks
        if c["choices"]
        and (c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text"))
    ]
    assert len(with_text) == len(WORDS)
    counts = [c["usage"]["completion_tokens"] for c in with_text]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == len(WORDS)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(WORDS)
    prompt_tokens = final["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in with_text)
