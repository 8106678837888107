"""Service tiers (issue 40, item 3) through a real gateway on a real bus, with the
official `openai` client: `service_tier` picks the tier, the tier is the one source of
the request's SLOs and priority (in the log's `RequestAdmitted` and the engines'
job), the answer reports it, and the gateway's metrics count by it."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from gateway_testkit import (
    API_KEY,
    METRICS_AUTH,
    MODEL,
    WORDS,
    Cluster,
    GatewayFactory,
    client_for,
    error_of,
)

from yb_core.config import FLEX_TTFT_FACTOR, ServiceTier
from yb_gateway.batches import BATCH_RUN
from yb_gateway.render import ChatFormat
from yb_gateway.runner import RunResult, decode_body
from yb_gateway.schemas import ChatCompletionRequest
from yb_gateway.service import GatewayService

ASK: list[Any] = [{"role": "user", "content": "hello"}]


def client(gateway: GatewayService) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
    )


@pytest.fixture
async def oai(gateway: GatewayService) -> openai.AsyncOpenAI:
    return client(gateway)


async def test_the_tier_asked_for_serves_the_request_and_the_answer_says_so(
    oai: openai.AsyncOpenAI, gateway: GatewayService, cluster: Cluster
) -> None:
    gcfg = gateway.cfg.gateway
    ttft, tbt = gcfg.ttft_slo_s, gcfg.tbt_slo_s
    # tier asked for -> (tier reported, its priority, its TTFT SLO, its TBT SLO)
    expected = {
        "flex": ("flex", -1, ttft * FLEX_TTFT_FACTOR, tbt),
        "priority": ("priority", 1, ttft, tbt),
        "auto": ("default", 0, ttft, tbt),
        None: ("default", 0, ttft, tbt),
    }
    for asked, (name, priority, ttft_slo, tbt_slo) in expected.items():
        tier: Any = asked if asked is not None else openai.omit
        whole = await oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, service_tier=tier
        )
        assert whole.service_tier == name and whole.choices[0].message.content == "".join(WORDS)
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=8,
            service_tier=tier,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        # Every chunk, the role's first and the usage's last among them.
        assert len(chunks) > len(WORDS) and {c.service_tier for c in chunks} == {name}
        # Both requests, as the log carries them and as the prefill engine got them.
        for admitted in cluster.conductor.admitted[-2:]:
            assert admitted.service_tier == name, asked
            assert admitted.priority == priority
            assert (admitted.slo.ttft_s, admitted.slo.tbt_s) == (ttft_slo, tbt_slo)
        assert [job.priority for job in cluster.engine.jobs[-2:]] == [priority] * 2

    # `/v1/completions` takes it too (the `openai` client passes it as an extra).
    completion = await oai.completions.create(
        model=MODEL, prompt="Once", max_tokens=8, extra_body={"service_tier": "flex"}
    )
    assert getattr(completion, "service_tier", None) == "flex"
    text = await oai.completions.create(
        model=MODEL, prompt="Once", stream=True, extra_body={"service_tier": "priority"}
    )
    assert {getattr(part, "service_tier", None) async for part in text} == {"priority"}
    assert [a.service_tier for a in cluster.conductor.admitted[-2:]] == ["flex", "priority"]


async def test_an_unknown_tier_is_a_400_naming_the_tiers(
    oai: openai.AsyncOpenAI, cluster: Cluster
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            await oai.chat.completions.create(
                model=MODEL, messages=ASK, service_tier="scale", stream=stream
            )
        assert refused.value.param == "service_tier"
        message = refused.value.message
        assert "'scale'" in message
        assert all(f"`{t}`" in message for t in ("default", "priority", "flex", "auto"))
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.completions.create(
            model=MODEL, prompt="Once", extra_body={"service_tier": "gold"}
        )
    assert refused.value.param == "service_tier"
    assert cluster.conductor.admitted == []  # refused before anything reached the bus


async def test_the_priority_extension_names_a_tier(
    gateway: GatewayService, cluster: Cluster
) -> None:
    async with client_for(gateway) as http:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4}
        served = await http.post("/v1/chat/completions", json={**body, "priority": -1})
        assert served.status_code == 200 and served.json()["service_tier"] == "flex"
        admitted = cluster.conductor.admitted[-1]
        assert (admitted.service_tier, admitted.priority) == ("flex", -1)
        # A priority no tier has: 400, listing the tiers and their priorities.
        error = error_of(await http.post("/v1/chat/completions", json={**body, "priority": 3}), 400)
        assert error["param"] == "priority"
        assert "`default` (0), `priority` (1), `flex` (-1)" in error["message"]
        # Sent with a tier, it must be that tier's.
        both = {**body, "priority": 1, "service_tier": "flex"}
        error = error_of(await http.post("/v1/chat/completions", json=both), 400)
        assert error["param"] == "priority" and "'flex' (-1)" in error["message"]
        agreeing = {**body, "priority": 1, "service_tier": "priority"}
        assert (await http.post("/v1/chat/completions", json=agreeing)).status_code == 200
    assert len(cluster.conductor.admitted) == 2


async def test_metrics_count_by_tier(gateway: GatewayService, cluster: Cluster) -> None:
    async with client_for(gateway) as http:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
        for tier in ("flex", "flex", "priority"):
            response = await http.post("/v1/completions", json={**body, "service_tier": tier})
            assert response.status_code == 200, response.text
        cluster.conductor.mode = "reject"
        refused = await http.post("/v1/completions", json={**body, "service_tier": "flex"})
        assert refused.status_code == 429
        text = (await http.get("/metrics", headers=METRICS_AUTH)).text
    assert 'yb_gateway_ttft_seconds_count{tier="flex"} 2.0' in text
    assert 'yb_gateway_ttft_seconds_count{tier="priority"} 1.0' in text
    assert 'yb_gateway_ttft_seconds_count{tier="default"} 0.0' in text
    assert 'yb_gateway_goodput_requests_total{tier="flex"} 2.0' in text
    assert 'yb_gateway_refused_requests_total{code="request_rejected",tier="flex"} 1.0' in text
    assert 'yb_gateway_refused_requests_total{code="request_rejected",tier="default"} 0.0' in text


async def test_configured_tiers_replace_the_built_in_ones(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    gold = ServiceTier(ttft_slo_s=5.0, priority=2)  # its TBT SLO left to the gateway's
    gateway = await gateway_factory(
        ttft_slo_s=20.0,
        tbt_slo_s=0.5,
        service_tiers={"default": ServiceTier(), "gold": gold},
    )
    oai = client(gateway)
    answer = await oai.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"service_tier": "gold"}
    )
    assert getattr(answer, "service_tier", None) == "gold"
    admitted = cluster.conductor.admitted[-1]
    assert (admitted.service_tier, admitted.priority) == ("gold", 2)
    assert (admitted.slo.ttft_s, admitted.slo.tbt_s) == (5.0, 0.5)
    plain = await oai.chat.completions.create(model=MODEL, messages=ASK)
    assert plain.service_tier == "default"
    assert cluster.conductor.admitted[-1].slo.ttft_s == 20.0
    # Tiers the configuration does not list are not served.
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.chat.completions.create(model=MODEL, messages=ASK, service_tier="flex")
    assert "`default`, `gold`" in refused.value.message
    async with client_for(gateway) as http:
        text = (await http.get("/metrics", headers=METRICS_AUTH)).text
    assert 'yb_gateway_goodput_requests_total{tier="gold"}' in text
    assert 'tier="flex"' not in text


async def test_a_batch_line_runs_in_the_tier_its_body_names(
    gateway: GatewayService, cluster: Cluster
) -> None:
    # The batch worker's path for a line (`RequestRunner.run` with `BATCH_RUN`).
    runner = gateway.completions.runner

    async def line(tier: str) -> RunResult:
        raw = {"model": MODEL, "messages": ASK, "max_tokens": 4, "service_tier": tier}
        body = decode_body(json.dumps(raw).encode(), ChatCompletionRequest)
        fmt = ChatFormat(f"chatcmpl-batch-{tier}", MODEL)
        return await runner.run(body, fmt, "chat.completions", options=BATCH_RUN)

    result = await line("flex")
    assert result.status == 200 and json.loads(result.body)["service_tier"] == "flex"
    assert cluster.conductor.admitted[-1].service_tier == "flex"
    refused = await line("gold")  # the line's answer: the error file holds it
    assert refused.status == 400
    assert json.loads(refused.body)["error"]["param"] == "service_tier"
