"""Values a served field cannot carry, and combinations of fields where one would do
nothing, are a 400 naming the field, before anything reaches the bus: never a 500 after
admission, never a silently ignored option."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gateway_testkit import MODEL, Cluster, error_of

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def body_of(endpoint: str, **fields: Any) -> dict[str, Any]:
    """A request that is served as it is, with `fields` added."""
    if endpoint == TEXT:
        return {"model": MODEL, "prompt": "Once", "max_tokens": 8, **fields}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        **fields,
    }


@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", 2**64),
        ("priority", 2**63),
        ("priority", -(2**64)),
        ("top_k", 2**64),
    ],
)
async def test_integers_beyond_64_bits_are_a_400(
    client: httpx.AsyncClient, cluster: Cluster, endpoint: str, field: str, value: int
) -> None:
    # They would fail to encode onto the bus: a 500 once the request was taken.
    error = error_of(await client.post(endpoint, json=body_of(endpoint, **{field: value})), 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert cluster.conductor.admitted == [] and cluster.engine.jobs == []


async def test_64_bit_extremes_are_served(client: httpx.AsyncClient, cluster: Cluster) -> None:
    for fields in (
        {"seed": 2**63 - 1},
        {"seed": -(2**63), "top_k": 2**63 - 1},
    ):
        response = await client.post(CHAT, json=body_of(CHAT, **fields))
        assert response.status_code == 200, response.text
    assert [job.sampling.seed for job in cluster.engine.jobs] == [2**63 - 1, -(2**63)]


@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
@pytest.mark.parametrize(
    "options",
    [{"include_usage": True}, {"continuous_usage_stats": True, "include_usage": True}],
)
async def test_stream_options_without_stream_are_a_400(
    client: httpx.AsyncClient, cluster: Cluster, endpoint: str, options: dict[str, bool]
) -> None:
    # OpenAI's rule: the options shape a stream, and a whole response has none.
    body = body_of(endpoint, stream_options=options)
    error = error_of(await client.post(endpoint, json=body), 400)
    assert error["param"] == "stream_options" and "`stream: true`" in error["message"]
    assert cluster.conductor.admitted == [] and cluster.engine.jobs == []


async def test_stream_options_asking_nothing_pass_without_stream(
    client: httpx.AsyncClient, cluster: Cluster
) -> None:
    for options in (None, {}, {"include_usage": False, "continuous_usage_stats": False}):
        response = await client.post(CHAT, json=body_of(CHAT, stream_options=options))
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("endpoint", [CHAT, TEXT])
async def test_continuous_usage_stats_without_include_usage_is_a_400(
    client: httpx.AsyncClient, cluster: Cluster, endpoint: str
) -> None:
    # vLLM sends no counts then: the client would wait for counts that never come.
    body = body_of(endpoint, stream=True, stream_options={"continuous_usage_stats": True})
    error = error_of(await client.post(endpoint, json=body), 400)
    assert error["param"] == "stream_options.continuous_usage_stats"
    assert "include_usage" in error["message"]
    assert cluster.conductor.admitted == [] and cluster.engine.jobs == []


@pytest.mark.parametrize("role", ["system", "user", "assistant"])
async def test_tool_call_id_on_a_message_not_of_role_tool_is_a_400(
    client: httpx.AsyncClient, cluster: Cluster, role: str
) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": role, "content": "x", "tool_call_id": "call_1"},
    ]
    if role != "user":
        messages.append({"role": "user", "content": "again"})
    error = error_of(await client.post(CHAT, json=body_of(CHAT, messages=messages)), 400)
    assert error["param"] == "messages[1].tool_call_id"
    assert cluster.conductor.admitted == [] and cluster.engine.jobs == []
