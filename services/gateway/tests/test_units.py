"""The pure parts: body decoding, readiness folding, decision routing, SSE framing, and
the HTTP application over the narrow view it has of a gateway."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from prometheus_client import CollectorRegistry, Counter

from yb_core import events as ev
from yb_core.config import GatewayConfig, ModelConfig, TelemetryConfig, YbConfig
from yb_core.events import decision_subjects
from yb_core.protocol import SamplingParams, TokenChunk
from yb_gateway.app import create_app, decode_body
from yb_gateway.choices import Choices
from yb_gateway.completions import CompletionsEndpoint
from yb_gateway.decisions import DecisionRouter
from yb_gateway.errors import ApiError
from yb_gateway.metrics import GatewayMetrics
from yb_gateway.prompt import PreparedRequest, PromptEncoder
from yb_gateway.readiness import InstanceTracker
from yb_gateway.render import SSE_DONE, ChatFormat, TextFormat
from yb_gateway.schemas import ChatCompletionRequest, CompletionRequest, Usage
from yb_gateway.tiers import default_tier


def test_decode_body_reports_the_field_path() -> None:
    with pytest.raises(ApiError) as info:
        decode_body(
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', ChatCompletionRequest
        )
    assert info.value.status == 400 and info.value.param == "messages[0].content"
    with pytest.raises(ApiError) as info:
        decode_body(b'{"model": ', CompletionRequest)
    assert info.value.code == "invalid_json"
    request = decode_body(
        b'{"model": "m", "prompt": [1, 2], "frequency_penalty": 0, "stop": "x"}',
        CompletionRequest,
    )
    assert request.prompt == [1, 2] and request.stop == "x"  # a neutral value passes


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b'{"model": "m", "prompt": "x", "foo": 1}', "foo", "unknown_parameter"),
        (
            b'{"model": "m", "prompt": "x", "best_of": 2}',
            "best_of",
            "unsupported_parameter",
        ),
        (
            b'{"model": "m", "prompt": "x", "stream_options": {"x": 1}}',
            "stream_options.x",
            "unknown_parameter",
        ),
        # A name is one step of the path whatever it holds.
        (
            b'{"model": "m", "prompt": "x", "stream_options.include_obfuscation": true}',
            "stream_options.include_obfuscation",
            "unknown_parameter",
        ),
    ],
)
def test_decode_body_names_unknown_and_unsupported_fields(
    raw: bytes, param: str, code: str
) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(raw, CompletionRequest)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        # Anything under a refused field is that field's refusal, with the indices of
        # the messages it lies in.
        (b'{"functions": [{"name": "f"}]}', "functions"),
        (
            b'{"messages": [{"role": "user", "function_call": {"name": "f"}}]}',
            "messages[0].function_call",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "file": {"a": 1}}]}]}',
            "messages[0].content[0].file",
        ),
    ],
)
def test_refused_field_is_named_as_sent(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(raw[:-1] + b', "model": "m", "messages": []}', ChatCompletionRequest)
    assert (info.value.param, info.value.code) == (param, "unsupported_parameter")


def test_tracker_folds_instance_events() -> None:
    tracker = InstanceTracker("m", heartbeat_timeout_s=10.0)
    tracker.apply(ev.InstanceUp(instance_id="p", role="prefill", host="h", model="m", time=100.0))
    tracker.apply(ev.InstanceUp(instance_id="d", role="decode", host="h", model="", time=100.0))
    tracker.apply(ev.InstanceUp(instance_id="x", role="decode", host="h", model="other", time=100))
    tracker.apply(ev.InstanceUp(instance_id="k", role="kvstore", host="h", time=100.0))
    assert tracker.alive("prefill", now=105.0) == ["p"]
    assert tracker.alive("decode", now=105.0) == ["d"]
    assert tracker.alive("decode", now=111.0) == []  # heartbeat timed out
    tracker.apply(ev.LoadReport(instance_id="d", role="decode", time=110.0))
    tracker.apply(ev.LoadReport(instance_id="unknown", role="decode", time=110.0))
    assert tracker.alive("decode", now=111.0) == ["d"]
    tracker.apply(ev.InstanceDown(instance_id="d", time=111.0))
    assert tracker.alive("decode", now=111.0) == []


async def test_router_delivers_by_request_id_and_drops_strangers() -> None:
    router = DecisionRouter()
    future = router.expect("r1")
    rejected = ev.RequestRejected(request_id="r1", gateway_id="g", reason="busy")
    assert not router.deliver(ev.RequestRejected(request_id="r9", gateway_id="g", reason="?"))
    assert router.deliver(rejected)
    assert await asyncio.wait_for(future, 1) is rejected
    assert router.waiting == 0
    assert not router.deliver(rejected)  # a redelivery finds nobody
    router.expect("r2")
    router.forget("r2")
    assert router.waiting == 0


def test_decision_subjects_match_where_decisions_are_published() -> None:
    gateway_id = "gw.1 x"
    pattern = decision_subjects(gateway_id)
    for decision in (
        ev.RequestRejected(request_id="r", gateway_id=gateway_id, reason="-"),
        ev.RequestScheduled(
            request_id="r", gateway_id=gateway_id, prefill_instance="p", decode_instance="d"
        ),
    ):
        subject = ev.subject_for(decision)
        assert subject.startswith(pattern[:-1]), (subject, pattern)


def test_sse_frames_are_openai_shaped() -> None:
    chat = ChatFormat("chatcmpl-1", "m")
    opening = chat.opening(1)
    assert opening.startswith(b"data: {") and opening.endswith(b"}\n\n")
    first = json.loads(opening[len(b"data: ") :])
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
    ]
    closing = json.loads(chat.closing(0, "length")[len(b"data: ") :])
    assert (
        closing["choices"][0]["delta"] == {} and closing["choices"][0]["finish_reason"] == "length"
    )
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    choices = Choices(1, "none")
    choices.add(TokenChunk(request_id="r", seq=0, text="ab", finished=True))
    whole = msgspec.json.decode(TextFormat("cmpl-1", "m").whole(choices.states, "stop", usage))
    assert whole["object"] == "text_completion" and whole["usage"]["total_tokens"] == 5
    assert SSE_DONE == b"data: [DONE]\n\n"


@dataclass
class _View:
    """A gateway as the HTTP application sees it: nothing but `GatewayView`."""

    completions: CompletionsEndpoint
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    started_at: int = 1_700_000_000
    encoder: PromptEncoder | None = None
    report: dict[str, Any] = field(default_factory=dict)

    def readiness(self) -> dict[str, Any]:
        return self.report


async def test_the_app_answers_from_its_view_of_the_gateway() -> None:
    cfg = YbConfig(
        model=ModelConfig(name="tiny"),
        gateway=GatewayConfig(api_keys=["k"]),
        telemetry=TelemetryConfig(metrics_token="t"),
    )
    registry = CollectorRegistry()
    Counter("yb_test_seen", "a series of the view's registry", registry=registry).inc(3)
    view = _View(
        # The endpoints are never called here: no session is ever asked for.
        completions=CompletionsEndpoint(None, cfg, GatewayMetrics(registry)),  # type: ignore[arg-type]
        registry=registry,
        report={"ready": False, "missing": ["event bus (NATS) connection"]},
    )
    async with AsyncTestClient(create_app(cfg, view)) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["missing"] == view.report["missing"]
        view.report = {"ready": True, "missing": []}
        assert (await client.get("/readyz")).status_code == 200
        models = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        card = models.json()["data"][0]
        assert (card["id"], card["created"], card["vocab_size"]) == ("tiny", 1_700_000_000, 0)
        metrics = await client.get("/metrics", headers={"Authorization": "Bearer t"})
        assert "yb_test_seen_total 3.0" in metrics.text
        # The document marks what is not implemented, nested fields too.
        spec = (
            await client.get("/schema/openapi.json", headers={"Authorization": "Bearer k"})
        ).json()
        chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
        body = chat["application/json"]["schema"]
        assert body["additionalProperties"] is False
        assert body["properties"]["functions"]["description"] == (
            "Not implemented by this server: accepts only `[]` or `null`."
        )
        message = body["properties"]["messages"]["items"]["properties"]
        assert "accepts only `null`" in message["function_call"]["description"]
        assert "description" not in message["tool_call_id"]
        assert "description" not in body["properties"]["temperature"]


async def test_a_short_prompt_is_tokenized_on_the_loop_only_while_the_thread_is_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt of at most INLINE_CHARS skips the hop to the tokenizer thread, but
    never while a call runs there (the tokenizer is not safe to share across threads);
    a longer one always goes there. Either way the ids are the same."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from yb_gateway import prompt
    from yb_gateway.logprobs import TokenTable
    from yb_gateway.prompt import INLINE_CHARS
    from yb_text.tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    threads: list[str] = []
    encode = tok.encode
    encode_text = prompt.encode_text

    def recording_encode(*args: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode_text(*args)

    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as executor:
        encoder = PromptEncoder(tok, executor, TokenTable.of(tok))
        monkeypatch.setattr(prompt, "encode_text", recording_encode)
        short, long = "The capital of France is", "word " * (INLINE_CHARS // 4)
        assert await encoder.text(short) == encode(short, add_special_tokens=True)
        assert await encoder.text(long) == encode(long, add_special_tokens=True)
        # The thread busy: a short prompt waits its turn there.
        release = threading.Event()
        busy = executor.submit(release.wait, 30)
        encoder._last = busy
        queued = asyncio.ensure_future(encoder.text(short))
        await asyncio.sleep(0.05)
        assert not queued.done()
        release.set()
        assert await queued == encode(short, add_special_tokens=True)
    assert [name.startswith("tokenizer") for name in threads] == [False, True, True]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_backend_encodes_as_transformers_does(add_special_tokens: bool) -> None:
    """`encode_text` skips transformers' layers only where the Rust backend gives the
    same ids; a backend left truncating (or padding) goes through transformers, which
    resets it."""
    from yb_gateway.prompt import encode_text
    from yb_text.tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    texts = [
        "",
        "The capital of France is",
        "  leading and trailing spaces  ",
        "line\nbreaks\r\nand\ttabs",
        "unicode: caf\u00e9 \u4f60\u597d \U0001f600",
        "special tokens as text: <|im_start|>user\nhi<|im_end|><|endoftext|>",
        "word " * 300,
    ]
    for text in texts:
        expected = tok.encode(text, add_special_tokens=add_special_tokens)
        assert encode_text(tok, text, add_special_tokens) == expected, text
    tok.backend_tokenizer.enable_truncation(3)
    text = texts[1]
    assert encode_text(tok, text, add_special_tokens) == tok.encode(
        text, add_special_tokens=add_special_tokens
    )
    assert len(encode_text(tok, text, add_special_tokens)) > 3
    assert tok.backend_tokenizer.truncation is None


class _StubSession:
    """What `_sse` reads of a `RequestSession`: its chunks, then its end."""

    def __init__(self, chunks: list[TokenChunk]) -> None:
        self._chunks = chunks
        self.ended = False
        self.request_id = "cmpl-1"
        self.finish_reason = "length"
        self.prompt_tokens = 3
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prepared = PreparedRequest(
            token_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=2),
            tier=default_tier(GatewayConfig()),
            stream=True,
            include_usage=True,
        )

    async def chunks(self) -> Any:
        for chunk in self._chunks:
            if chunk.finished:
                self.ended = True  # as `RequestSession.chunks` marks its last chunk
            yield chunk


class _StubSessions:
    released: list[str]

    def __init__(self) -> None:
        self.released = []

    async def release(self, session: Any, reason: str) -> None:
        self.released.append(reason)


async def test_the_last_chunk_leaves_with_the_closing_frames_in_one_write() -> None:
    """Every token but the last goes out on its own as it comes; the last one's frame
    goes out in the same write as the closing frame, the usage and [DONE]."""
    from yb_gateway.metrics import RequestTiming
    from yb_gateway.runner import Exchange

    cfg = YbConfig(model=ModelConfig(name="tiny"))
    sessions = _StubSessions()
    endpoint = CompletionsEndpoint(sessions, cfg, GatewayMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    chunks = [
        TokenChunk(request_id="r", seq=0, token_ids=[1], text="a"),
        TokenChunk(
            request_id="r", seq=1, token_ids=[2], text="b", finished=True, finish_reason="length"
        ),
    ]
    exchange = Exchange(
        [_StubSession(chunks)],  # type: ignore[list-item]
        TextFormat("cmpl-1", "tiny"),
        Choices(1, "none"),
        {},
        RequestTiming(0.0),
    )
    writes = [w async for w in endpoint.runner.sse(exchange)]
    assert len(writes) == 2, writes
    frames = [f for w in writes for f in w.split(b"\n\n") if f]
    texts = [json.loads(f[len(b"data: ") :])["choices"] for f in frames[:-1]]
    assert [c[0]["text"] for c in texts[:2]] == ["a", "b"]
    assert texts[2][0]["finish_reason"] == "length" and texts[3] == []  # closing, usage
    assert writes[1].startswith(frames[1] + b"\n\n") and writes[1].endswith(SSE_DONE)
    assert sessions.released == [""]  # completed: released without a cancel reason
