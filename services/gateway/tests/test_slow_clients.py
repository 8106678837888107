"""Slow clients, with raw sockets against a real gateway: tricklers and non-readers.

Every outcome holds by construction, not by timing: a trickler never completes its
request (it sends fewer bytes than it announced, or a head without its end), so the
only way its connection can end is the read deadline; a non-reader never reads past
its response's head while the engine streams far more than every buffer between
them holds, so the only way its request can end is the stall deadline. The limits
are small so that the test is quick, and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

import msgspec
import pytest
from gateway_testkit import (
    API_KEY,
    MODEL,
    Cluster,
    GatewayFactory,
    client_for,
    next_event,
    wait_for,
    words_script,
)
from httpx_sse import aconnect_sse

from yb_core import events as ev
from yb_core import protocol
from yb_core.bus import Bus
from yb_core.config import ConfigError, load_config
from yb_gateway.service import GatewayService

# Requests asking for this many tokens get the flood: far more bytes than the
# buffers below hold (8 x 4 KiB kernel and ours, the client's 4 KiB receive buffer).
FLOOD_TOKENS = 200  # inside the test model's 256 positions
FLOOD_CHUNKS = 300
FLOOD_TEXT = "x" * 1024
SMALL_LIMITS: dict[str, Any] = {
    "body_timeout_s": 1.0,
    "stream_stall_timeout_s": 1.0,
    "send_buffer_bytes": 4096,
    "socket_send_buffer_bytes": 4096,
}
WAIT_S = 30.0  # deadline of every wait below: generous, the outcomes do not race it


def flood_or_words(job: protocol.PrefillJob) -> list[protocol.TokenChunk]:
    """The flood for a request with `max_tokens >= FLOOD_TOKENS`, WORDS otherwise."""
    if job.sampling.max_tokens < FLOOD_TOKENS:
        return words_script()(job)
    chunks = [
        protocol.TokenChunk(request_id=job.request_id, seq=i, token_ids=[7], text=FLOOD_TEXT)
        for i in range(FLOOD_CHUNKS)
    ]
    chunks.append(
        protocol.TokenChunk(
            request_id=job.request_id, seq=FLOOD_CHUNKS, finished=True, finish_reason="length"
        )
    )
    return chunks


def chat_body(max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def request_bytes(body: bytes, *, content_length: int | None = None) -> bytes:
    """A POST to the chat endpoint with the API key; `content_length` may lie."""
    length = len(body) if content_length is None else content_length
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        "Host: gateway\r\n"
        f"Authorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    return head.encode() + body


def metric(gw: GatewayService, name: str, **labels: str) -> float:
    return gw.registry.get_sample_value(name, labels) or 0.0


# --- the clients -------------------------------------------------------------------


async def _until_eof(reader: asyncio.StreamReader) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def trickle(port: int, opening: bytes, more: bytes, budget: int) -> bytes:
    """Send `opening`, then `more` a byte at a time, at most `budget` bytes (never
    enough to complete the request), until the gateway answers and closes; what it
    answered. The pace does not matter: the request is never complete."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(opening)

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(budget):
                writer.write(more)
                await writer.drain()
                await asyncio.sleep(0.02)  # pacing only; nothing waits on it

    dripping = asyncio.ensure_future(drip())
    try:
        return await asyncio.wait_for(_until_eof(reader), WAIT_S)
    finally:
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        writer.close()


async def trickle_head(port: int) -> bytes:
    """A request head that never ends: a header value that grows a byte at a time."""
    opening = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-Slow: "
    return await trickle(port, opening, b"a", budget=10_000)


async def trickle_body(port: int) -> bytes:
    """A complete head announcing 4 KiB of body, then body bytes one at a time, never
    more than 4 KiB - 1."""
    return await trickle(port, request_bytes(b"", content_length=4096), b" ", budget=4095)


async def idle(port: int) -> bytes:
    """A connection that sends nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(_until_eof(reader), WAIT_S)
    finally:
        writer.close()


class NonReader:
    """A streamed request whose client reads the response head and nothing more.

    Its receive buffer is small (set before connecting, so the window is small from
    the start) and it never calls `recv` again until `outcome()`.
    """

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self.sock = sock
        self.head = head
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        self.request_id = {k.lower(): v for k, v in headers.items()}["x-request-id"]

    @classmethod
    async def open(cls, port: int, max_tokens: int = FLOOD_TOKENS) -> NonReader:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, request_bytes(json.dumps(chat_body(max_tokens)).encode()))
        head = b""
        while b"\r\n\r\n" not in head:
            piece = await asyncio.wait_for(loop.sock_recv(sock, 1), WAIT_S)
            assert piece, f"closed before the response head: {head!r}"
            head += piece
        return cls(sock, head)

    async def outcome(self) -> str:
        """Read what is left: 'reset' or 'eof' (the gateway dropped the connection),
        or 'complete' (the whole stream came, [DONE] last)."""
        loop = asyncio.get_running_loop()
        data = b""
        try:
            while piece := await asyncio.wait_for(loop.sock_recv(self.sock, 65536), WAIT_S):
                data += piece
        except ConnectionResetError:
            return "reset"
        finally:
            self.sock.close()
        return "complete" if data.rstrip().endswith(b"0") and b"[DONE]" in data else "eof"


async def normal_stream(gw: GatewayService) -> str:
    """A well-behaved streamed chat completion; its text."""
    async with (
        client_for(gw) as client,
        aconnect_sse(client, "POST", "/v1/chat/completions", json=chat_body(16)) as source,
    ):
        assert source.response.status_code == 200
        datas = [sse.data async for sse in source.aiter_sse()]
    assert datas[-1] == "[DONE]"
    return "".join(
        json.loads(d)["choices"][0]["delta"].get("content") or "" for d in datas[:-1] if d
    )


# --- the tests ---------------------------------------------------------------------


async def test_tricklers_get_408_and_nothing_is_admitted(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    gw = await gateway_factory(**SMALL_LIMITS)
    port = gw.port
    slow = [trickle_head(port) for _ in range(6)] + [trickle_body(port) for _ in range(6)]
    pending = asyncio.gather(*slow, *(idle(port) for _ in range(3)))
    # Served while a dozen tricklers hold their connections.
    assert await normal_stream(gw) == "Hello, world!"
    answers = await pending

    for answer in answers[:12]:
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        error = msgspec.json.decode(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout"
        assert "body_timeout_s=1s" in error["message"]
    assert [a for a in answers[12:]] == [b""] * 3  # idle: closed without an answer
    assert metric(gw, "yb_gateway_slow_client_drops_total", reason="request_timeout") == 12
    # Only the normal request reached the log.
    assert len(cluster.conductor.admitted) == 1
    await wait_for(lambda: gw.in_flight == 0, WAIT_S, "no request in flight")


async def test_non_readers_are_cancelled_everywhere_and_others_served(
    gateway_factory: GatewayFactory, cluster: Cluster, bus: Bus
) -> None:
    gw = await gateway_factory(**SMALL_LIMITS)
    cluster.engine.script = flood_or_words
    cancelled = await bus.read_ordered("yb.ev.req.request_cancelled", new_only=True)
    stalled = await asyncio.gather(*(NonReader.open(gw.port) for _ in range(12)))
    assert {s.status for s in stalled} == {200}
    assert await normal_stream(gw) == "Hello, world!"

    # Each stalled request is cancelled on the bus, with the reason.
    ids = {s.request_id for s in stalled}
    reasons: dict[str, str] = {}
    while set(reasons) != ids:
        event = await next_event(cancelled, ev.RequestCancelled, timeout_s=WAIT_S)
        reasons[event.request_id] = event.reason
    await cancelled.close()
    assert all("client dropped" in r and "stream_stall_timeout_s" in r for r in reasons.values())
    assert metric(gw, "yb_gateway_slow_client_drops_total", reason="stream_stall") == 12
    assert metric(gw, "yb_gateway_requests_total", status="499") == 12
    await wait_for(lambda: gw.in_flight == 0, WAIT_S, "no request in flight")
    assert metric(gw, "yb_gateway_stalled_connections") == 0
    # And the connections are gone: what was buffered for them was dropped.
    outcomes = await asyncio.gather(*(s.outcome() for s in stalled))
    assert set(outcomes) <= {"reset", "eof"}, outcomes


async def test_a_client_that_catches_up_keeps_its_stream(
    gateway_factory: GatewayFactory, cluster: Cluster
) -> None:
    # The stall deadline is long: the client stops reading until the gateway says
    # its writes wait for it, then reads everything; being slow is not being stalled.
    gw = await gateway_factory(**{**SMALL_LIMITS, "stream_stall_timeout_s": 600.0})
    cluster.engine.script = flood_or_words
    reader = await NonReader.open(gw.port)
    await wait_for(
        lambda: metric(gw, "yb_gateway_stalled_connections") == 1, WAIT_S, "the stall to show"
    )
    assert await reader.outcome() == "complete"
    await wait_for(lambda: gw.in_flight == 0, WAIT_S, "the request to end")
    assert metric(gw, "yb_gateway_stalled_connections") == 0
    assert metric(gw, "yb_gateway_slow_client_drops_total", reason="stream_stall") == 0
    assert metric(gw, "yb_gateway_requests_total", status="200") == 1


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("BODY_TIMEOUT_S", "0"),
        ("STREAM_STALL_TIMEOUT_S", "-1"),
        ("SEND_BUFFER_BYTES", "10"),
        ("SOCKET_SEND_BUFFER_BYTES", "-1"),
    ],
)
def test_slow_client_limits_are_validated(setting: str, value: str) -> None:
    with pytest.raises(ConfigError, match=setting.lower()):
        load_config(env={f"YB_GATEWAY__{setting}": value})
