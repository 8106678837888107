"""Every field of a request is served or refused, never ignored (issue 17, item 2).

Over real HTTP: each field that OpenAI (or vLLM) defines but the gateway does not
implement, sent with a value that asks for something, is a 400 naming it
(`unsupported_parameter`); each field nobody defines is a 400 naming it
(`unknown_parameter`); on both endpoints, streamed or not, and before anything reaches
the bus. The neutral values that clients send as defaults still pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_testkit import MODEL, WORDS, Cluster, error_of

from yb_gateway.schemas import REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
KINDS = {CHAT: ChatCompletionRequest, TEXT: CompletionRequest}

# A value of each refused field that asks for what the gateway does not do.
_ASKING_COMMON: dict[str, Any] = {
    "repetition_penalty": 1.1,
    "stream_options.include_obfuscation": True,
}
ASKING: dict[str, dict[str, Any]] = {
    CHAT: {
        **_ASKING_COMMON,
        "functions": [{"name": "f", "parameters": {}}],
        "function_call": "auto",
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low",
        "verbosity": "low",
        "web_search_options": {},
        "store": True,
        "metadata": {"k": "v"},
        "moderation": {"model": "omni-moderation-latest"},
        "prompt_cache_key": "k",
        "prompt_cache_options": {"mode": "implicit"},
        "prompt_cache_retention": "24h",
        "safety_identifier": "user-1",
        "messages.function_call": {"name": "f", "arguments": "{}"},
        "messages.refusal": "no",
        "messages.audio": {"id": "a1"},
        "messages.content.image_url": {"url": "http://example.com/cat.png"},
        "messages.content.input_audio": {"data": "", "format": "wav"},
        "messages.content.file": {"file_id": "file-1"},
        "messages.content.refusal": "no",
        "messages.content.prompt_cache_breakpoint": {"mode": "explicit"},
    },
    TEXT: {
        **_ASKING_COMMON,
        "best_of": 2,
        "suffix": "the end",
    },
}

# The neutral values of each refused field, all sent at once: they must pass.
_NEUTRAL_COMMON: dict[str, Any] = {
    "repetition_penalty": 1,
    "stream_options.include_obfuscation": False,
}
NEUTRAL: dict[str, dict[str, Any]] = {
    CHAT: {
        **_NEUTRAL_COMMON,
        "functions": None,
        "function_call": "none",
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "reasoning_effort": None,
        "verbosity": None,
        "web_search_options": None,
        "store": False,
        "metadata": {},
        "moderation": None,
        "prompt_cache_key": None,
        "prompt_cache_options": None,
        "prompt_cache_retention": None,
        "safety_identifier": None,
        "messages.function_call": None,
        "messages.refusal": None,
        "messages.audio": None,
        "messages.content.image_url": None,
        "messages.content.input_audio": None,
        "messages.content.file": None,
        "messages.content.refusal": None,
        "messages.content.prompt_cache_breakpoint": None,
    },
    TEXT: {**_NEUTRAL_COMMON, "best_of": 1, "suffix": None},
}

# Fields nobody defines for the endpoint (as their full path, indices included),
# among them vLLM extensions the gateway does not know and OpenAI fields of the other
# endpoint.
UNKNOWN: dict[str, list[str]] = {
    CHAT: [
        "foo",
        "min_tokens",
        "guided_json",
        "suffix",
        "prompt",
        "messages[1].foo",
        "messages[0].content[0].foo",
        "stream_options.foo",
    ],
    TEXT: ["foo", "min_tokens", "max_completion_tokens", "top_logprobs", "stream_options.foo"],
}


def base_body(endpoint: str) -> dict[str, Any]:
    """A request that is served as it is; fields are placed into it by `place`."""
    if endpoint == TEXT:
        return {"model": MODEL, "prompt": "Once", "max_tokens": 8}
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 8,
    }


def place(body: dict[str, Any], path: str, value: Any) -> str:
    """Put `value` at `path` (a refused field's key) in `body`; the param that names it."""
    name = path.rpartition(".")[2]
    if path.startswith("stream_options."):
        body.setdefault("stream_options", {})[name] = value
        return path
    if path.startswith("messages.content."):
        body["messages"][0]["content"][0][name] = value
        return f"messages[0].content[0].{name}"
    if path.startswith("messages."):
        body["messages"][1][name] = value
        return f"messages[1].{name}"
    body[path] = value
    return path


def place_unknown(body: dict[str, Any], param: str) -> None:
    """Put an unknown field at `param` (a path with indices) in `body`."""
    *parents, name = param.split(".")
    node: Any = body
    for step in parents:
        key, _, rest = step.partition("[")
        node = node.setdefault(key, {})
        for index in rest.rstrip("]").split("]["):
            if index:
                node = node[int(index)]
    node[name] = 1


def test_every_refused_field_has_its_cases() -> None:
    for endpoint, kind in KINDS.items():
        assert set(ASKING[endpoint]) == set(REFUSED_FIELDS[kind]), endpoint
        assert set(NEUTRAL[endpoint]) == set(REFUSED_FIELDS[kind]), endpoint


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
async def test_each_unsupported_field_is_a_400_naming_it(
    client: httpx.AsyncClient, cluster: Cluster, endpoint: str, stream: bool
) -> None:
    kind = KINDS[endpoint]
    wrong = []
    for path, value in ASKING[endpoint].items():
        body = base_body(endpoint)
        body["stream"] = stream
        param = place(body, path, value)
        error = error_of(await client.post(endpoint, json=body), 400)
        rule = REFUSED_FIELDS[kind][path]
        got = (error["type"], error["param"], error["code"])
        if got != ("invalid_request_error", param, "unsupported_parameter"):
            wrong.append((path, got))
        elif f"`{param}`" not in error["message"] or rule.accepts not in error["message"]:
            wrong.append((path, error["message"]))
    assert wrong == []
    # Refused before admission: nothing reached the conductor or an engine.
    assert cluster.conductor.admitted == [] and cluster.engine.jobs == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
async def test_each_unknown_field_is_a_400_naming_it(
    client: httpx.AsyncClient, cluster: Cluster, endpoint: str, stream: bool
) -> None:
    wrong = []
    for param in UNKNOWN[endpoint]:
        body = base_body(endpoint)
        body["stream"] = stream
        place_unknown(body, param)
        error = error_of(await client.post(endpoint, json=body), 400)
        got = (error["type"], error["param"], error["code"])
        if got != ("invalid_request_error", param, "unknown_parameter"):
            wrong.append((param, got))
        elif f"Unknown parameter: `{param}`" not in error["message"]:
            wrong.append((param, error["message"]))
    assert wrong == []
    assert cluster.conductor.admitted == [] and cluster.engine.jobs == []


async def test_neutral_values_are_served(client: httpx.AsyncClient, cluster: Cluster) -> None:
    for endpoint in (CHAT, TEXT):
        for stream in (False, True):
            body = base_body(endpoint)
            body["stream"] = stream
            for path, value in NEUTRAL[endpoint].items():
                place(body, path, value)
            # `stream_options` asks for something only where there is a stream.
            body["stream_options"]["include_usage"] = stream
            response = await client.post(endpoint, json=body)
            assert response.status_code == 200, (endpoint, stream, response.text)
            if stream:
                assert response.text.endswith("data: [DONE]\n\n")
                assert '"usage":{"prompt_tokens"' in response.text
            else:
                choice = response.json()["choices"][0]
                text = choice["message"]["content"] if endpoint == CHAT else choice["text"]
                assert text == "".join(WORDS)
    assert len(cluster.conductor.admitted) == 4


async def test_supported_fields_are_served(client: httpx.AsyncClient, cluster: Cluster) -> None:
    every = {
        "max_tokens": 8,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 7,
        "stop": ["\n\n"],
        "stream_options": {"include_usage": True},
        "user": "u-1",
        "priority": -1,
        "service_tier": "flex",
        "ignore_eos": True,
    }
    chat = base_body(CHAT)
    chat["messages"][1]["name"] = "bot"
    chat = {**chat, **every, "max_completion_tokens": 8, "stream": True}
    text = {"model": MODEL, "prompt": [1, 2, 3], **every, "stream": True}
    for endpoint, body in ((CHAT, chat), (TEXT, text)):
        response = await client.post(endpoint, json=body)
        assert response.status_code == 200, response.text
        assert response.text.endswith("data: [DONE]\n\n")
    sampling = [job.sampling for job in cluster.engine.jobs]
    assert [(s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) for s in sampling] == [
        (0.0, 0.9, 5, 7, ["\n\n"], True)
    ] * 2
    assert [(e.priority, e.service_tier) for e in cluster.conductor.admitted] == [(-1, "flex")] * 2


def test_readme_lists_every_field() -> None:
    """The README's tables name each field, served or refused, of both endpoints."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for kind, refused in REFUSED_FIELDS.items():
        shown = [
            key.replace("messages.content.", "messages[].content[].").replace(
                "messages.", "messages[]."
            )
            for key in refused
        ]
        shown += [name for name in kind.__struct_fields__ if name not in refused]
        missing = [name for name in shown if f"`{name}`" not in readme]
        assert missing == [], kind.__name__
