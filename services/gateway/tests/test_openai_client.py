"""The official `openai` client against the gateway: the compatibility that matters."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from gateway_testkit import API_KEY, MODEL, WORDS, Cluster, GatewayFactory

from yb_core import protocol
from yb_gateway.service import GatewayService
from yb_gateway.structured import render_call


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
    refusals: list[tuple[dict[str, Any], str, str | None]] = [
        ({"functions": [tool["function"]]}, "functions", "unsupported_parameter"),
        ({"extra_body": {"best_of": 2}}, "best_of", "unknown_parameter"),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
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
        await oai.completions.create(model=MODEL, prompt="Once", max_tokens=0)
    assert refused.value.param == "max_tokens" and "echo" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.completions.create(model=MODEL, prompt=[[5, 6], "x"])  # type: ignore[arg-type]
    assert refused.value.param == "prompt" and "mixes" in refused.value.message
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


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tool_call_script(pieces: list[str]) -> Any:
    """An engine that writes `pieces` (one token each, with its logprob) and stops."""

    def script(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
        top = job.sampling.logprobs
        chunks = [
            protocol.TokenChunk(
                request_id=job.request_id,
                seq=i,
                token_ids=[70 + i],
                text=piece,
                logprobs=[]
                if top is None
                else [protocol.TokenLogprob(token_id=70 + i, logprob=-0.25, top=[(70 + i, -0.25)])],
            )
            for i, piece in enumerate(pieces)
        ]
        chunks.append(
            protocol.TokenChunk(
                request_id=job.request_id,
                seq=len(pieces),
                finished=True,
                finish_reason="stop",
                prompt_tokens=len(job.token_ids),
                completion_tokens=len(pieces),
            )
        )
        return chunks

    return script


async def test_openai_client_reads_tool_calls_and_logprobs(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    # Room for the tools in the prompt (the tiny tokenizer spends a token per byte).
    gateway = await gateway_factory(max_model_len=2048)
    oai = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{gateway.port}/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
    )
    text = render_call("get_weather", {"city": "Paris"})
    cluster.engine.script = tool_call_script([text[i : i + 4] for i in range(0, len(text), 4)])
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    whole = await oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], logprobs=True, top_logprobs=1
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == len(
        range(0, len(text), 4)
    )
    # The grammar went to the engine with the sampling parameters.
    job = cluster.engine.jobs[-1]
    assert job.sampling.grammar and job.sampling.logprobs == 1

    stream = await oai.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True, logprobs=True
    )
    names, fragments, finish, streamed_logprobs = [], [], None, 0
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append((call.index, call.id, call.function.name))
            if call.function and call.function.arguments:
                fragments.append(call.function.arguments)
        if chunk.choices[0].logprobs is not None:
            streamed_logprobs += len(chunk.choices[0].logprobs.content or [])
        finish = chunk.choices[0].finish_reason or finish
    assert [(i, name) for i, _, name in names] == [(0, "get_weather")]
    assert names[0][1] is not None and names[0][1].startswith("call_")
    assert len(fragments) > 1 and json.loads("".join(fragments)) == {"city": "Paris"}
    assert finish == "tool_calls" and streamed_logprobs == len(range(0, len(text), 4))

    # The conversation goes on with the call and its result.
    messages += [
        choice.message,
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear"}'},
    ]
    cluster.engine.script = tool_call_script(["Clear", " skies."])
    after = await oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert after.choices[0].message.content == "Clear skies."
    assert after.choices[0].finish_reason == "stop"
