"""`/v1/completions` as evaluation harnesses use it: OpenAI's four prompt forms, several
prompts in one request, and `echo` with `logprobs` (the prompt's own logprobs), over
real HTTP, a real bus and the played engine (`gateway_testkit`).

What the prompt's logprobs are worth (equal to the model's) is held by the services'
tests and `tests/test_lm_eval.py`; here: their shape, order and completeness, as the
gateway renders what the engine sends.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from gateway_testkit import (
    MODEL,
    WORDS,
    Cluster,
    error_of,
    words_script,
)
from httpx_sse import aconnect_sse

from yb_gateway import prompt as prompt_module
from yb_gateway.service import GatewayService

TEXT = "/v1/completions"
ANSWER = "".join(WORDS)


async def _encoded(gateway: GatewayService, prompt: str) -> list[int]:
    assert gateway.encoder is not None
    return await gateway.encoder.text(prompt)


@pytest.mark.parametrize(
    "prompt",
    [
        "Once upon",
        ["Once upon", "a time", "there"],
        [5, 6, 7, 8],
        [[5, 6, 7, 8], [9, 10], [11]],
    ],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
async def test_each_prompt_form_gives_n_choices_per_prompt_in_order(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster, prompt: Any
) -> None:
    response = await client.post(TEXT, json={"model": MODEL, "prompt": prompt, "n": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    several = isinstance(prompt, list) and not isinstance(prompt[0], int)
    prompts = prompt if several else [prompt]
    assert [c["index"] for c in body["choices"]] == list(range(2 * len(prompts)))
    assert all(c["text"] == ANSWER for c in body["choices"])
    # One request in the cluster per prompt, each with its own tokens, in order.
    jobs = {job.request_id: job for job in cluster.engine.jobs}
    assert len(jobs) == len(prompts)
    rid = response.headers["x-request-id"]
    expected = [p if isinstance(p, list) else await _encoded(gateway, p) for p in prompts]
    by_prompt = [jobs[rid if not i else f"{rid}-p{i}"] for i in range(len(prompts))]
    assert [job.token_ids for job in by_prompt] == expected
    assert all(job.sampling.n == 2 for job in by_prompt)
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(ids) for ids in expected)
    assert usage["completion_tokens"] == 2 * len(prompts) * len(WORDS)
    assert gateway.in_flight == 0


async def test_several_prompts_stream_with_prompt_major_indices(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    body = {
        "model": MODEL,
        "prompt": [[5, 6, 7], [8, 9]],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    async with aconnect_sse(client, "POST", TEXT, json=body) as source:
        assert source.response.status_code == 200
        async for sse in source.aiter_sse():
            if sse.data == "[DONE]":
                break
            chunk = json.loads(sse.data)
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
    assert texts == dict.fromkeys(range(4), ANSWER)
    assert finishes == dict.fromkeys(range(4), "stop")
    assert usage is not None and usage["prompt_tokens"] == 5
    assert usage["completion_tokens"] == 4 * len(WORDS)
    assert gateway.in_flight == 0


@pytest.mark.parametrize(
    ("prompt", "param", "words"),
    [
        ([], "prompt", "empty list"),
        ([5, "x"], "prompt", "mixes"),
        ([[5], 6], "prompt", "mixes"),
        (["x", [5]], "prompt", "mixes"),
        ([[5], []], "prompt[1]", "empty"),
        (["x", ""], "prompt[1]", "empty"),
        ([[5], [6, 100000]], "prompt[1]", "vocabulary"),
        ([1.5], "prompt[0]", "Expected"),
        ([[5], [6, "x"]], "prompt[1][1]", "Expected"),
        (["x"] * (prompt_module.MAX_PROMPTS + 1), "prompt", "at most"),
        ([[5] * 300], "prompt[0]", "context length"),
    ],
)
async def test_bad_prompts_are_refused_naming_the_param(
    client: httpx.AsyncClient, cluster: Cluster, prompt: Any, param: str, words: str
) -> None:
    for stream in (False, True):
        body = {"model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": 4}
        error = error_of(await client.post(TEXT, json=body), 400)
        assert error["param"] == param and words in error["message"], error
    assert cluster.conductor.admitted == []


def _prompt_part(gateway: GatewayService, token_ids: list[int], top: int) -> dict[str, Any]:
    """What the gateway should render for `token_ids`' own logprobs, from what the
    played engine sends (`prompt_logprob_entries`)."""
    assert gateway.encoder is not None
    table = gateway.encoder.tokens
    texts = [table.text(t) for t in token_ids]
    tops: list[dict[str, float] | None] = [None]
    for i, text in enumerate(texts[1:], start=1):
        alternatives = {table.text(1): -0.05, text: -i / 10} if top >= 2 else {}
        if top == 1:
            alternatives = {table.text(1): -0.05}
        alternatives.setdefault(text, -i / 10)
        tops.append(alternatives)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [None] + [-i / 10 for i in range(1, len(texts))],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


async def test_echo_with_logprobs_returns_the_prompts_own_logprobs(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14], [15]]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0}
    response = await client.post(TEXT, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert gateway.encoder is not None
    for index, choice in enumerate(answer["choices"]):
        assert choice["index"] == index
        assert choice["text"] == await gateway.encoder.decode(prompts[index])
        # `max_tokens: 0`: the prompt and nothing else.
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"] == _prompt_part(gateway, prompts[index], 2)
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == 11
    jobs = cluster.engine.jobs
    assert all(j.sampling.prompt_logprobs == 2 and j.sampling.logprobs == 2 for j in jobs)
    # The cluster generates one token (which the answer leaves out).
    assert all(j.sampling.max_tokens == 1 for j in jobs)
    assert {e.max_tokens for e in cluster.conductor.admitted} == {1}


async def test_echo_with_logprobs_goes_on_with_the_generated_tokens(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    # As lm-evaluation-harness asks: the context and continuation as token ids, one
    # token generated, `logprobs: 1`; the continuation's logprobs are read from
    # `token_logprobs[ctxlen:-1]`.
    prompt = [5, 6, 7, 8]
    body = {"model": MODEL, "prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1}
    choice = (await client.post(TEXT, json=body)).json()["choices"][0]
    logprobs = choice["logprobs"]
    part = _prompt_part(gateway, prompt, 1)
    n = len(prompt)
    assert logprobs["token_logprobs"][:n] == part["token_logprobs"]
    assert logprobs["top_logprobs"][:n] == part["top_logprobs"]
    assert logprobs["tokens"][:n] == part["tokens"]
    # Then the generated tokens (the played engine writes WORDS whatever max_tokens).
    assert len(logprobs["tokens"]) == n + len(WORDS) == len(logprobs["text_offset"])
    assert gateway.encoder is not None
    echo = await gateway.encoder.decode(prompt)
    assert choice["text"] == echo + ANSWER
    assert logprobs["text_offset"][n] == len(echo)  # offsets run through the whole text


async def test_echo_with_logprobs_streams_each_prompt_opening_with_its_logprobs(
    gateway: GatewayService, client: httpx.AsyncClient, cluster: Cluster
) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "n": 2,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 3,
        "stream": True,
    }
    frames: list[dict[str, Any]] = []
    async with aconnect_sse(client, "POST", TEXT, json=body) as source:
        assert source.response.status_code == 200
        async for sse in source.aiter_sse():
            if sse.data == "[DONE]":
                break
            frames.extend(json.loads(sse.data)["choices"])
    assert gateway.encoder is not None
    for index in range(4):
        mine = [f for f in frames if f["index"] == index]
        prompt = prompts[index // 2]
        # The first frame of each choice echoes its prompt with the prompt's logprobs.
        assert mine[0]["text"] == await gateway.encoder.decode(prompt)
        assert mine[0]["logprobs"] == _prompt_part(gateway, prompt, 2)
        assert "".join(f["text"] for f in mine[1:]) == ANSWER
        assert all(len(f["logprobs"]["tokens"]) == 1 for f in mine[1:] if f["text"])
        assert mine[-1]["finish_reason"] == "stop"


async def test_a_prompt_of_one_token_has_one_null_logprob(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    for stream in (False, True):
        body = {
            "model": MODEL,
            "prompt": [7],
            "echo": True,
            "logprobs": 0,
            "max_tokens": 0,
            "stream": stream,
        }
        response = await client.post(TEXT, json=body)
        assert response.status_code == 200, response.text
        if stream:
            first = json.loads(response.text.split("\n\n")[0].removeprefix("data: "))
            logprobs = first["choices"][0]["logprobs"]
        else:
            logprobs = response.json()["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"] == [None] and logprobs["top_logprobs"] == [None]


async def test_missing_prompt_logprobs_are_an_error_never_silence(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    # An engine that ignores the ask (an older prefill, say): the answer is a 502,
    # not a completion without the logprobs the client asked for.
    cluster.engine.script = words_script(prompt_logprobs=False)
    body = {"model": MODEL, "prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 1}
    error = error_of(await client.post(TEXT, json=body), 502)
    assert error["code"] == "prompt_logprobs_missing"
    async with aconnect_sse(client, "POST", TEXT, json={**body, "stream": True}) as source:
        events = [sse async for sse in source.aiter_sse()]
    assert events[-2].event == "error" and "prompt_logprobs_missing" in events[-2].data
    assert events[-1].data == "[DONE]"


async def test_prompt_logprobs_are_bounded_by_what_one_message_carries(
    client: httpx.AsyncClient, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prompt's logprobs travel from prefill to decode in one message: a prompt
    # whose logprobs would not fit is refused before anything reaches the cluster.
    per_token = prompt_module.PROMPT_LOGPROB_BYTES + 5 * prompt_module.PROMPT_LOGPROB_TOP_BYTES
    monkeypatch.setattr(prompt_module, "MAX_PROMPT_LOGPROBS_BYTES", 10 * per_token)
    body = {"model": MODEL, "prompt": [5] * 11, "echo": True, "logprobs": 5, "max_tokens": 1}
    error = error_of(await client.post(TEXT, json=body), 400)
    assert error["param"] == "logprobs" and "at most 10 prompt tokens" in error["message"]
    ok = await client.post(TEXT, json={**body, "prompt": [5] * 10})
    assert ok.status_code == 200, ok.text
    assert len(cluster.engine.jobs) == 1
