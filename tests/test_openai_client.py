"""The official `openai` client against a whole cluster (`yb up`, tiny random model):
structured outputs, tool calls, `n` and logprobs, through prefill and decode.

The model's weights are random, so the tests ask only what the grammar, the greedy
choice and the counts guarantee: output that parses and validates, calls with valid
arguments, one choice per index, logprobs whose greedy token is the likeliest. Schemas
use enums, booleans and bounded integers, so that even a random model finishes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from yb_testkit.fixtures import LocalCluster
from yb_text.tiny_tokenizer import tiny_tokenizer

MODEL = "tiny"
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]

pytestmark = pytest.mark.timeout(300, func_only=True)


class Weather(BaseModel):
    """What `parse` must return: enums, a boolean and a bounded integer."""

    city: Literal["Paris", "Rome"]
    sunny: bool
    level: int = Field(ge=0, le=9)


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "metric"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("oai"),
        *("--model", "tiny-random", "--model-name", MODEL),
        # Room in decode for several streams at once (one longest sequence, 4,096
        # tokens of the tiny model, is the laptop default).
        env={"YB_DECODE__KV_SEQUENCES": "4"},
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        if cluster.process is not None and cluster.process.poll() is None:
            cluster.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.api_key, max_retries=0)


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Weather, temperature=0, max_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_json_mode_with_logit_bias(client: OpenAI) -> None:
    # The grammar makes `{` the only first token; the bias then makes `}` the greedy next.
    close = tiny_tokenizer().convert_tokens_to_ids("}")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        logit_bias={str(close): 100},
        temperature=0,
        max_tokens=50,
    )
    assert completion.choices[0].message.content == "{}"
    assert completion.choices[0].finish_reason == "stop"


def _call_arguments(arguments: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(arguments)
    assert set(parsed) == {"city", "metric"} and parsed["city"] in ("Paris", "Rome")
    assert isinstance(parsed["metric"], bool)
    return parsed


def test_tool_calls_whole_and_streamed(client: OpenAI) -> None:
    asked: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 200,
    }
    whole = client.chat.completions.create(**asked)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    expected = _call_arguments(calls[0].function.arguments)  # type: ignore[union-attr]

    names, fragments, finish = [], [], None
    for chunk in client.chat.completions.create(**asked, stream=True):
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function is not None and call.function.name:
                names.append(call.function.name)
            if call.function is not None and call.function.arguments:
                fragments.append(call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert len(fragments) > 1  # streamed as generated, not one blob
    assert _call_arguments("".join(fragments)) == expected  # greedy: the same call


def test_n_choices(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, n=3, max_tokens=6, seed=7, temperature=1.0
    )
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    assert completion.usage is not None
    assert completion.usage.completion_tokens <= 3 * 6
    assert completion.usage.completion_tokens >= 3  # every choice generated something

    indices: set[int] = set()
    finished: set[int] = set()
    for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK, n=3, max_tokens=6, seed=7, stream=True
    ):
        for choice in chunk.choices:
            indices.add(choice.index)
            if choice.finish_reason:
                finished.add(choice.index)
    assert indices == finished == {0, 1, 2}


def test_logprobs_whole_and_streamed(client: OpenAI) -> None:
    asked: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "logprobs": True,
        "top_logprobs": 2,
        "temperature": 0,
        "max_tokens": 8,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**asked)
    content = whole.choices[0].logprobs.content if whole.choices[0].logprobs else None
    assert content is not None and len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        # Greedy over the raw distribution: the sampled token is the likeliest.
        assert entry.top_logprobs[0].bytes == entry.bytes
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6

    streamed: list[Any] = []
    for chunk in client.chat.completions.create(**asked, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(e.bytes, round(e.logprob, 4)) for e in streamed] == [
        (e.bytes, round(e.logprob, 4)) for e in content
    ]

    legacy = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        logprobs=2,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    assert logprobs.text_offset == offsets
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs or [], strict=True):
        assert token in top and len(top) <= 3  # the two likeliest and the sampled one


def test_service_tiers_through_the_cluster(client: OpenAI) -> None:
    # The tier named is the one that served, whole and streamed, with the real
    # conductor admitting each by its tier's SLOs and priority; `auto` is `default`.
    tiers: list[tuple[Literal["flex", "priority", "auto"], str]] = [
        ("flex", "flex"),
        ("priority", "priority"),
        ("auto", "default"),
    ]
    for asked, served in tiers:
        whole = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=4,
            service_tier=asked,
        )
        assert whole.service_tier == served and whole.choices[0].finish_reason is not None
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=4,
                service_tier=asked,
                stream=True,
            )
        )
        assert chunks and {c.service_tier for c in chunks} == {served}
