"""The official `openai` client against the gateway: the compatibility that matters."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from gateway_testkit import API_KEY, MODEL, WORDS, Cluster

from yb_gateway.service import GatewayService


@pytest.fixture
async def oai(gateway: GatewayService) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
    )


async def test_openai_client_chat_and_completions(
    oai: openai.AsyncOpenAI, cluster: Cluster
) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]

    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "".join(WORDS)
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens == len(WORDS)
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 4

    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == "".join(WORDS)
    assert finish == "stop" and usage is not None and usage.total_tokens > len(WORDS)

    completion = await oai.completions.create(model=MODEL, prompt="Once", max_tokens=8)
    assert completion.choices[0].text == "".join(WORDS)
    text = ""
    async for part in await oai.completions.create(model=MODEL, prompt="Once", stream=True):
        text += part.choices[0].text if part.choices else ""
    assert text == "".join(WORDS)


async def test_openai_client_sees_errors(oai: openai.AsyncOpenAI, cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        await oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"

    cluster.conductor.mode = "reject"
    with pytest.raises(openai.RateLimitError) as limited:
        await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert limited.value.response.headers["retry-after"] == "3"

    cluster.conductor.mode = "schedule"
    cluster.engine.script = lambda job: []  # accepted, then silence
    from yb_core import protocol

    def broken(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
        return [
            protocol.TokenChunk(request_id=job.request_id, seq=0, token_ids=[1], text="a"),
            protocol.TokenChunk(request_id=job.request_id, seq=1, error="decode OOM"),
        ]

    cluster.engine.script = broken
    stream = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
    )
    with pytest.raises(openai.APIError, match="decode OOM"):
        async for _chunk in stream:
            pass


async def test_openai_client_gets_refusals_naming_the_field(
    oai: openai.AsyncOpenAI, cluster: Cluster
) -> None:
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    tool: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refusals: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [tool]}, "tools", "unsupported_parameter"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs", "unsupported_parameter"),
        ({"n": 3}, "n", "unsupported_parameter"),
        ({"extra_body": {"min_tokens": 4}}, "min_tokens", "unknown_parameter"),
    ]
    for kwargs, param, code in refusals:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await oai.chat.completions.create(
                    model=MODEL, messages=messages, stream=stream, **kwargs
                )
            assert (refused.value.param, refused.value.code) == (param, code), kwargs
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.completions.create(model=MODEL, prompt="Once", echo=True)
    assert (refused.value.param, refused.value.code) == ("echo", "unsupported_parameter")
    assert cluster.conductor.admitted == []


async def test_openai_client_neutral_values_and_round_trip(
    oai: openai.AsyncOpenAI, cluster: Cluster
) -> None:
    # What frameworks pass as defaults is served, and an answer goes back as history.
    messages: list[Any] = [{"role": "user", "content": "hello"}]
    first = await oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        n=1,
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        response_format={"type": "text"},
        max_completion_tokens=8,
    )
    messages += [first.choices[0].message, {"role": "user", "content": "more"}]
    second = await oai.chat.completions.create(model=MODEL, messages=messages)
    assert second.choices[0].message.content == "".join(WORDS)
    completion = await oai.completions.create(
        model=MODEL, prompt="Once", n=1, best_of=1, echo=False, presence_penalty=0
    )
    assert completion.choices[0].text == "".join(WORDS)
