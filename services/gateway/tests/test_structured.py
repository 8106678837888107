"""Structured outputs, tools and logprobs at the gateway, without a cluster.

The grammars are compiled and run by llguidance against the tiny model's real
tokenizer: what the parser reads is what the grammar lets a model write, and what it
refuses is refused.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest

from yb_core.config import GatewayConfig, ModelConfig
from yb_core.protocol import TokenChunk, TokenLogprob
from yb_gateway.app import decode_body
from yb_gateway.choices import Choices
from yb_gateway.errors import ApiError
from yb_gateway.logprobs import FLOOR, TokenTable, chat_logprobs, completion_logprobs
from yb_gateway.prompt import PromptEncoder, prepare, prepare_all
from yb_gateway.render import ChatFormat, TextFormat
from yb_gateway.schemas import ChatCompletionRequest, CompletionRequest, Usage
from yb_gateway.structured import (
    ToolCallParser,
    conversation,
    output_spec,
    render_call,
)
from yb_text.grammar import check_grammar, new_matcher
from yb_text.tiny_tokenizer import tiny_tokenizer

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NOW: dict[str, Any] = {"type": "function", "function": {"name": "now"}}


def chat_body(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(json.dumps(body).encode(), ChatCompletionRequest)


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar lets a model write exactly `text` (and stop there)."""
    tok = tiny_tokenizer()
    matcher = new_matcher(grammar, tok)
    return bool(
        matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        and matcher.is_accepting()
    )


def test_tool_choices_make_grammars_that_hold_the_output() -> None:
    tok = tiny_tokenizer()
    two = render_call("get_weather", {"city": "Paris"}) + "\n" + render_call("now", {})
    one = render_call("get_weather", {"city": "Rome", "days": 2})
    cases = {
        "auto": {"text": True, "one": True, "two": True},
        "required": {"text": False, "one": True, "two": True},
    }
    for choice, want in cases.items():
        spec = output_spec(chat_body(tools=[WEATHER, NOW], tool_choice=choice))
        check_grammar(spec.grammar, tok)
        assert spec.tools == choice
        got = {"text": accepts(spec.grammar, "It is sunny."), "one": accepts(spec.grammar, one)}
        got["two"] = accepts(spec.grammar, two)
        assert got == want, choice
        # Arguments outside the schema, and keys out of order, are not writable.
        assert not accepts(spec.grammar, render_call("get_weather", {"town": "Paris"}))
        bad_order = '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>'
        assert not accepts(spec.grammar, bad_order)
    single = output_spec(chat_body(tools=[WEATHER, NOW], parallel_tool_calls=False))
    assert accepts(single.grammar, one) and not accepts(single.grammar, two)
    named = output_spec(
        chat_body(
            tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}
        )
    )
    assert accepts(named.grammar, render_call("now", {}))
    assert not accepts(named.grammar, one) and not accepts(named.grammar, "It is sunny.")
    assert output_spec(chat_body(tools=[WEATHER], tool_choice="none")).grammar == ""


def test_response_formats() -> None:
    obj = output_spec(chat_body(response_format={"type": "json_object"}))
    assert accepts(obj.grammar, '{"a": [1, 2]}') and not accepts(obj.grammar, "[1]")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for strict in (True, False):
        fmt: dict[str, Any] = {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": schema},
        }
        fmt["json_schema"]["strict"] = strict
        spec = output_spec(chat_body(response_format=fmt))
        assert accepts(spec.grammar, '{"name": "Ada", "age": 36}')
        assert not accepts(spec.grammar, '{"name": "Ada"}')
    assert output_spec(chat_body(response_format={"type": "text"})).grammar == ""


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ],
)
def test_bad_tool_and_format_requests_are_400s(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        output_spec(chat_body(**fields))
    assert (info.value.status, info.value.param) == (400, param)


def test_parser_streams_names_then_argument_fragments() -> None:
    text = (
        render_call("get_weather", {"city": 'Pa"ris {x}', "days": [1, {"a": 2}]})
        + "\n"
        + render_call("now", {})
    )
    for step in (1, 3, len(text)):
        parser = ToolCallParser("auto")
        deltas = []
        content = ""
        for i in range(0, len(text), step):
            parsed = parser.feed(text[i : i + step])
            deltas += parsed.tool_calls
            content += parsed.content
        assert content == ""
        firsts = [d for d in deltas if d.id is not None]
        assert [(d.index, d.type, d.function.name, d.function.arguments) for d in firsts] == [
            (0, "function", "get_weather", ""),
            (1, "function", "now", ""),
        ]
        for index, call in enumerate(parser.tool_calls()):
            fragments = [d.function.arguments for d in deltas if d.index == index and d.id is None]
            assert "".join(fragments) == call.function.arguments  # type: ignore[arg-type]
            assert call.id.startswith("call_") and firsts[index].id == call.id
            if step == 1 and index == 0:
                assert len(fragments) > 3  # streamed, not one blob
        assert json.loads(parser.tool_calls()[0].function.arguments) == {
            "city": 'Pa"ris {x}',
            "days": [1, {"a": 2}],
        }


def test_parser_passes_text_through_in_auto_mode() -> None:
    parser = ToolCallParser("auto")
    assert parser.feed("<t").content == ""  # could still open a call
    assert parser.feed("ea> time").content == "<tea> time"
    assert parser.tool_calls() == []


def test_tool_history_is_rendered_for_a_template_without_tools() -> None:
    body = chat_body(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    rendered = conversation(
        body.messages, body.tools or [], template_tools=False, text_of=lambda i, m: m.content or ""
    )
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == render_call("get_weather", {"city": "Paris"})
    assert rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    with_template = conversation(
        body.messages, body.tools or [], template_tools=True, text_of=lambda i, m: m.content or ""
    )
    assert with_template[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert with_template[2]["tool_call_id"] == "call_1"
    body.messages[2].tool_call_id = None
    with pytest.raises(ApiError) as info:
        conversation(body.messages, [], template_tools=False, text_of=lambda i, m: "")
    assert info.value.param == "messages[2].tool_call_id"


def test_logprobs_render_token_text_and_bytes() -> None:
    tok = tiny_tokenizer()
    table = TokenTable.of(tok)
    ids = tok.encode("é the", add_special_tokens=False)  # "é" is two byte tokens
    entries = [TokenLogprob(token_id=t, logprob=-0.5, top=[(t, -0.5), (5, -1.5)]) for t in ids]
    entries.append(TokenLogprob(token_id=ids[0], logprob=float("-inf")))
    chat = chat_logprobs(table, entries, top=1)
    assert chat.content is not None
    assert b"".join(bytes(c.bytes or []) for c in chat.content[:-1]) == "é the".encode()
    assert [len(c.top_logprobs) for c in chat.content] == [1] * len(ids) + [0]
    assert chat.content[-1].logprob == FLOOR
    legacy, end = completion_logprobs(table, entries[:-1], top=1, offset=10)
    assert legacy.text_offset[0] == 10 and end == 10 + sum(len(t) for t in legacy.tokens)
    assert legacy.top_logprobs[0] == {table.text(ids[0]): -0.5}  # the sampled one is top 1
    assert set(legacy.top_logprobs[0] or {}) <= {table.text(ids[0]), table.text(5)}


def _chunk(index: int, seq: int, text: str, **kw: Any) -> TokenChunk:
    return TokenChunk(request_id="r", seq=seq, index=index, token_ids=[65], text=text, **kw)


def test_choices_render_by_index_with_tool_calls_and_usage() -> None:
    table = TokenTable.of(tiny_tokenizer())
    fmt = ChatFormat("chatcmpl-1", "m")
    fmt.prepared(0, table, None)
    choices = Choices(2, "auto")
    call = render_call("now", {})
    lp = [TokenLogprob(token_id=65, logprob=-0.1)]
    frames = []
    for chunk in (
        _chunk(1, 0, "Hi", logprobs=lp),
        _chunk(0, 1, call[:15], logprobs=lp),
        _chunk(0, 2, call[15:], logprobs=lp, finished=True, finish_reason="stop"),
        _chunk(1, 3, "!", logprobs=lp, finished=True, finish_reason="length"),
    ):
        update = choices.add(chunk)
        frames.append(msgspec.json.decode(fmt.delta(update)[len(b"data: ") :]))
    assert [f["choices"][0]["index"] for f in frames] == [1, 0, 0, 1]
    assert frames[0]["choices"][0]["delta"] == {"content": "Hi"}
    assert frames[0]["choices"][0]["logprobs"]["content"][0]["token"] == table.text(65)
    assert "tool_calls" not in frames[1]["choices"][0]["delta"]  # the name is not whole yet
    first_call = frames[2]["choices"][0]["delta"]["tool_calls"][0]
    assert first_call["function"] == {"name": "now", "arguments": ""}
    usage = Usage(prompt_tokens=3, completion_tokens=choices.completion_tokens, total_tokens=7)
    whole = msgspec.json.decode(fmt.whole(choices.states, "stop", usage))
    zero, one = whole["choices"]
    assert zero["message"]["content"] is None and zero["finish_reason"] == "tool_calls"
    assert zero["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    assert one["message"] == {"role": "assistant", "content": "Hi!"}
    assert one["finish_reason"] == "length" and len(one["logprobs"]["content"]) == 2
    assert choices.completion_tokens == 4


def test_text_format_echoes_the_prompt() -> None:
    fmt = TextFormat("cmpl-1", "m")
    fmt.prepared(None, TokenTable([b"a"]), "Once", 2)
    choices = Choices(2, "none")
    choices.add(_chunk(0, 0, " upon", finished=True))
    choices.add(_chunk(1, 1, " a", finished=True))
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    whole = msgspec.json.decode(fmt.whole(choices.states, "stop", usage))
    assert [c["text"] for c in whole["choices"]] == ["Once upon", "Once a"]
    opening = fmt.opening(2) or b""
    assert opening.count(b'"text":"Once"') == 2


def test_decoding_limits_of_the_new_fields() -> None:
    base = b'{"model": "m", "prompt": "x", '
    for field, param in (
        (b'"n": 17}', "n"),
        (b'"logprobs": 6}', "logprobs"),
        (b'"presence_penalty": 2.5}', "presence_penalty"),
        (b'"logit_bias": {"1": 101}}', "logit_bias"),
        (b'"stop": ["a", "b", "c", "d", "e"]}', "stop"),
    ):
        with pytest.raises(ApiError) as info:
            decode_body(base + field, CompletionRequest)
        assert (info.value.status, info.value.param) == (400, param), field
    with pytest.raises(ApiError) as info:
        chat_body(top_logprobs=21)
    assert info.value.param == "top_logprobs"


@pytest.fixture
async def encoder() -> AsyncIterator[PromptEncoder]:
    with ThreadPoolExecutor(1) as executor:
        tok = tiny_tokenizer()
        yield PromptEncoder(tok, executor, TokenTable.of(tok))


MODEL = ModelConfig(source="tiny-random", name="m", block_size=4, max_model_len=2048)


async def test_prepare_maps_fields_to_sampling(encoder: PromptEncoder) -> None:
    chat = chat_body(
        n=3,
        presence_penalty=0.5,
        frequency_penalty=-1,
        logit_bias={"65": -100, "7": 2.5},
        logprobs=True,
        top_logprobs=4,
        tools=[WEATHER],
        stop=["a", "b", "c", "d"],
    )
    prepared = await prepare(chat, encoder, MODEL, GatewayConfig())
    sampling = prepared.sampling
    assert (sampling.n, sampling.presence_penalty, sampling.frequency_penalty) == (3, 0.5, -1.0)
    assert sampling.logit_bias == {65: -100.0, 7: 2.5} and sampling.logprobs == 4
    assert sampling.grammar and prepared.output.tools == "auto" and prepared.n == 3
    # The tools reach the prompt (the tiny template ignores `tools`: a system message).
    prompt = tiny_tokenizer().decode(prepared.token_ids)
    assert prompt.startswith("<|im_start|>system\n") and "get_weather" in prompt
    text = decode_body(
        b'{"model": "m", "prompt": [65, 66], "echo": true, "logprobs": null}', CompletionRequest
    )
    prepared = await prepare(text, encoder, MODEL, GatewayConfig())
    assert prepared.echo == tiny_tokenizer().decode([65, 66]) and prepared.echo
    assert prepared.sampling.logprobs is None
    plain = await prepare(chat_body(), encoder, MODEL, GatewayConfig())
    assert (plain.sampling.n, plain.sampling.grammar, plain.sampling.logprobs) == (1, "", None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"275": 1}}, "logit_bias"),  # past the tiny vocabulary
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # generates nothing, echoes nothing
        ({"prompt": [], "echo": True}, "prompt"),
        ({"prompt": [[5], [6, "x"]]}, "prompt[1][1]"),
        ({"prompt": [[5], [300]]}, "prompt[1]"),  # past the tiny vocabulary
        ({"prompt": ["x", ""]}, "prompt[1]"),
    ],
)
async def test_prepare_refuses_what_cannot_be_served(
    encoder: PromptEncoder, body: dict[str, Any], param: str
) -> None:
    async def run() -> None:
        if "prompt" in body:  # the decoder may refuse it already
            text = json.dumps({"model": "m", **body}).encode()
            await prepare_all(decode_body(text, CompletionRequest), encoder, MODEL, GatewayConfig())
        else:
            await prepare(chat_body(**body), encoder, MODEL, GatewayConfig())

    with pytest.raises(ApiError) as info:
        await run()
    assert (info.value.status, info.value.param) == (400, param)
    if param == "response_format":
        assert "nope" in info.value.message  # llguidance's own words
