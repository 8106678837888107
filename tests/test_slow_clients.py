"""Slow HTTP clients against a whole `yb up` cluster: raw sockets, many at once.

Tricklers send a request head or body a byte at a time and never finish it;
non-readers send a streamed completion, read its response head and nothing more,
with a small receive buffer, while decode generates far more than every buffer on the
way holds. Meanwhile a normal client is served. The gateway's limits are small here
(`body_timeout_s`, `stream_stall_timeout_s`, its buffers), so the test is quick.

What holds by construction: a trickler's request is never complete, so it can only
end with the read deadline (408, nothing admitted); a non-reader never reads, so its
stream can only stall. A stalled request must still be decoding when the gateway drops
it (else decode ends it on its own): every request parks in decode after its
`HOLD_TOKENS`th token (failpoint `decode.token`), far more than every buffer on the way
holds, so it is still in decode, holding its pages and batch slot, when the gateway's
cancel reaches it; the cancel ends the hold. "Far more" is about bytes, not tokens:
a token whose text is not complete yet (a byte of a multi-byte character) sends no
frame, and a sampled output of the random model can wander into a run of those. So
the non-readers decode greedily, the tiny model's output is the same on every run
(its logits are spread, no near-ties), and the test first reads that very output to
its end to check it is far larger than the buffers. The checks read the instances'
own accounting (`/metrics`) and the log.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from yb_core import events as ev
from yb_testkit.faults import Scraper, events_of, read_log, samples, wait_until
from yb_testkit.fixtures import LocalCluster

MODEL = "tiny"
DECODE = "decode-0"
MAX_TOKENS = 4000
HOLD_TOKENS = 2000  # a stream parks here: far more than the ~200 frames the buffers hold
# What the gateway's, the kernel's and the client's buffers hold together is ~20 KiB.
FAR_MORE_BYTES = 100 * 1024
STALLED = 8
TRICKLERS = 4  # of each kind: head and body
WAIT_S = 60.0  # every wait's deadline: generous, no outcome races it
# The timeouts are long enough that this test's own clients, which read and send as
# fast as they can, are never dropped for a pause of this process on a busy machine.
LIMITS = {
    "YB_GATEWAY__BODY_TIMEOUT_S": "10",
    "YB_GATEWAY__STREAM_STALL_TIMEOUT_S": "10",
    "YB_GATEWAY__SEND_BUFFER_BYTES": "4096",
    "YB_GATEWAY__SOCKET_SEND_BUFFER_BYTES": "4096",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    data = tmp_path_factory.mktemp("slow-clients")
    failpoints = f"gate={data / 'gates'};timeout=300;decode.token=hold({HOLD_TOKENS})"
    cluster = LocalCluster(
        data,
        *("--model", "tiny-random", "--model-name", MODEL),
        # Decode room for every stalled stream to reach its hold (8 x ~2,000 tokens;
        # the tiny model's longest sequence is 4,096, and one is the laptop default).
        env={**LIMITS, "YB_FAILPOINTS": failpoints, "YB_DECODE__KV_SEQUENCES": "8"},
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def _request(cluster: LocalCluster, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{cluster.port}\r\n"
        f"Authorization: Bearer {cluster.api_key}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    return head.encode() + body


def _read_to_end(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(WAIT_S)
    try:
        while piece := sock.recv(65536):
            data += piece
    except ConnectionResetError:
        pass
    return data


def _trickle(cluster: LocalCluster, opening: bytes, more: bytes, budget: int) -> bytes:
    """Send `opening`, then `more` a byte at a time (at most `budget`, never enough
    to complete the request) until the gateway answers; its whole answer."""
    deadline = time.monotonic() + WAIT_S
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=WAIT_S) as sock:
        sock.sendall(opening)
        for _ in range(budget):
            assert time.monotonic() < deadline, "no answer to a request never completed"
            readable, _, _ = select.select([sock], [], [], 0.02)  # the pace only
            if readable:
                break
            try:
                sock.sendall(more)
            except (BrokenPipeError, ConnectionResetError):
                break
        return _read_to_end(sock)


def trickle_head(cluster: LocalCluster) -> bytes:
    """A request head that never ends: a header value growing a byte at a time."""
    opening = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{cluster.port}\r\nX-Slow: "
    return _trickle(cluster, opening.encode(), b"a", budget=100_000)


def trickle_body(cluster: LocalCluster) -> bytes:
    """A head announcing 4 KiB of body, then at most 4 KiB - 1 of it, a byte at a time."""
    return _trickle(cluster, _request(cluster, b"", content_length=4096), b" ", budget=4095)


def stream_body(max_tokens: int) -> dict[str, Any]:
    """A non-reader's request: greedy, so its output is the same every time."""
    return {
        "model": MODEL,
        "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


class NonReader:
    """A streamed completion whose client reads the response head and nothing more."""

    def __init__(self, cluster: LocalCluster) -> None:
        body = stream_body(MAX_TOKENS)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Set before connecting, so the advertised window is small from the start.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(("127.0.0.1", cluster.port))
        self.sock.sendall(_request(cluster, json.dumps(body).encode()))
        head = b""
        while b"\r\n\r\n" not in head:
            piece = self.sock.recv(1)
            assert piece, f"closed before the response head: {head!r}"
            head += piece
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].split()[1] == "200", head
        fields = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
        self.request_id = fields["x-request-id"]

    def outcome(self) -> str:
        """Read what is left: 'reset' or 'eof' once the gateway dropped the connection,
        'complete' if the whole stream came."""
        try:
            data = b""
            while piece := self.sock.recv(65536):
                data += piece
        except ConnectionResetError:
            return "reset"
        finally:
            self.sock.close()
        return "complete" if b"[DONE]" in data else "eof"


def gateway_metrics(cluster: LocalCluster) -> dict[str, float]:
    return samples(
        httpx.get(f"{cluster.url}/metrics", headers=cluster.metrics_headers, timeout=10).text
    )


STALL_DROPS = 'yb_gateway_slow_client_drops_total{reason="stream_stall"}'
READ_DROPS = 'yb_gateway_slow_client_drops_total{reason="request_timeout"}'


def test_slow_clients_are_dropped_their_requests_freed_and_others_served(
    cluster: LocalCluster,
) -> None:
    scraper = Scraper(cluster)
    # The construction: the tokens before the hold make far more bytes than the
    # buffers hold (one token short of it, so this one is not held).
    whole = httpx.post(
        f"{cluster.url}/v1/completions",
        json=stream_body(HOLD_TOKENS - 1),
        headers=cluster.headers,
        timeout=WAIT_S,
    )
    assert whole.status_code == 200 and whole.text.endswith("data: [DONE]\n\n"), whole.text[-500:]
    assert len(whole.content) > FAR_MORE_BYTES, len(whole.content)

    with ThreadPoolExecutor(2 * TRICKLERS) as pool:
        tricklers: list[Future[bytes]] = [
            pool.submit(trickle_head, cluster) for _ in range(TRICKLERS)
        ] + [pool.submit(trickle_body, cluster) for _ in range(TRICKLERS)]
        stalled = [NonReader(cluster) for _ in range(STALLED)]
        ids = {s.request_id for s in stalled}

        # A normal client is served while all of them hold their connections.
        normal = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 8, "temperature": 0},
            headers=cluster.headers,
            timeout=WAIT_S,
        )
        assert normal.status_code == 200, normal.text
        assert normal.json()["usage"]["completion_tokens"] == 8
        answers = [f.result(timeout=WAIT_S) for f in tricklers]

    # Every non-reader's connection stalled (and may already have been dropped).
    wait_until(
        lambda: (
            (m := gateway_metrics(cluster))["yb_gateway_stalled_connections"] + m[STALL_DROPS]
            == STALLED
        ),
        WAIT_S,
        "every non-reader to stall",
    )
    # No stalled request can finish in decode meanwhile: each is parked at its
    # HOLD_TOKENS-th token (or still short of it) until the gateway's cancel ends it.
    cancels: dict[str, str] = {}

    def all_cancelled() -> bool:
        log = read_log(cluster)
        cancels.update(
            (e.request_id, e.reason)
            for e in events_of(log, ev.RequestCancelled)
            if e.request_id in ids
        )
        return set(cancels) == ids

    wait_until(all_cancelled, WAIT_S, "the gateway to cancel every stalled request")
    assert all("stream_stall_timeout_s" in reason for reason in cancels.values()), cancels
    assert gateway_metrics(cluster)[STALL_DROPS] == STALLED

    # Decode hears the cancels and frees every page and batch slot they held.
    wait_until(
        lambda: (
            scraper.pages_used(DECODE) == 0 and scraper.value(DECODE, "yb_engine_batch_size") == 0
        ),
        WAIT_S,
        f"{DECODE} to free the stalled requests' pages and slots",
    )
    ends: dict[str, ev.RequestFinished] = {}

    def ended() -> bool:
        # Logged off the request's path (decode's outbox), after the pages are freed.
        ends.clear()
        ends.update(
            (e.request_id, e)
            for e in events_of(read_log(cluster), ev.RequestFinished)
            if e.request_id in ids and e.instance_id == DECODE
        )
        return set(ends) == ids

    wait_until(ended, WAIT_S, f"{DECODE}'s RequestFinished for every stalled request")
    assert {e.outcome for e in ends.values()} == {"cancelled"}
    assert all(e.output_tokens <= HOLD_TOKENS for e in ends.values())

    # The connections are gone; what was buffered for them was dropped.
    assert {s.outcome() for s in stalled} <= {"reset", "eof"}

    # Tricklers: 408, and nothing of theirs was admitted.
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        error: dict[str, Any] = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout"
    final = gateway_metrics(cluster)
    assert final[READ_DROPS] == 2 * TRICKLERS
    assert final["yb_gateway_in_flight_requests"] == 0
    admitted = list(events_of(read_log(cluster), ev.RequestAdmitted))
    assert len(admitted) == STALLED + 2  # and the normal client's, and the greedy one read whole
