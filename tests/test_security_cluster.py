"""Security of the whole cluster as `yb up` runs it (tiny random model, real NATS,
UCX, HTTP): API keys on the gateway, tokens on every metrics endpoint, every
listener on loopback, NATS permissions that let the real flows through, and a
durable log that never holds prompt text or token ids.
"""

from __future__ import annotations

import asyncio
import random
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import psutil
import pytest
from openai import OpenAI

from yb_core import events as ev
from yb_core.bus import Bus, BusUnavailable
from yb_core.netaddr import is_loopback
from yb_dataplane.transport import PeerAddress
from yb_testkit.fixtures import LocalCluster, pid_alive

MODEL = "tiny"
# Distinctive enough that any appearance in the log is a leak, not a coincidence.
SECRET_TEXT = "The vault code is heliotrope-quasar-7731 and the courier leaves at dawn."
TEXT_PROMPT = "Zanzibar marmalade protocol: fold the ledger twice before sunrise."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path_factory.mktemp("secure"), "--model", "tiny-random", "--model-name", MODEL
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def token_prompt(n: int = 160) -> list[int]:
    """A token-id prompt no tokenizer would produce from ordinary text.

    The tiny random model has 275 tokens; ids from 128 up take two or three bytes
    in msgpack, so four of them in a row cannot turn up by chance in the log.
    """
    rng = random.Random(20251122)
    return [rng.randrange(128, 275) for _ in range(n)]


#: How long any wait below may take before the test fails; each ends as soon as its
#: condition holds, so it is generous for a loaded machine, not a speed requirement.
WAIT_S = 120.0
UP_SUBJECTS = "yb.ev.instance.instance_up.>"


def instance_ups(cluster: LocalCluster) -> dict[str, ev.InstanceUp]:
    """The newest `InstanceUp` of every instance `yb up` started, read as the operator
    (`admin`). `/readyz` needs only one prefill and one decode instance, so the
    others' announcements are waited for (not assumed to be in yet)."""
    expected = {name for name in cluster.pids if not name.startswith("nats-server")}

    async def read_once(bus: Bus) -> dict[str, ev.InstanceUp]:
        # One message per instance subject: as many as the stream holds subjects, so
        # the read ends at a known count, not after a quiet spell.
        stream = cluster.nats_config().stream
        info = await bus.jetstream.stream_info(stream, subjects_filter=UP_SUBJECTS)
        subjects = len(info.state.subjects or {})
        reader = await bus.read_ordered(UP_SUBJECTS, last_per_subject=True)
        found: dict[str, ev.InstanceUp] = {}
        try:
            for _ in range(subjects):
                item = await reader.next(timeout_s=WAIT_S)
                assert item is not None, f"fewer than {subjects} announcements"
                if isinstance(item.event, ev.InstanceUp):
                    found[item.event.instance_id] = item.event
        finally:
            await reader.close()
        return found

    async def read() -> dict[str, ev.InstanceUp]:
        bus = await Bus.connect(cluster.nats_config(), "test-admin", timeout_s=WAIT_S)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while not expected <= set(found := await read_once(bus)):
                assert loop.time() < deadline, f"never announced: {expected - set(found)}"
                await asyncio.sleep(0.2)
            return found
        finally:
            await bus.close()

    return asyncio.run(read())


# --- the gateway ----------------------------------------------------------------------


def test_the_gateway_needs_the_generated_key(cluster: LocalCluster) -> None:
    key_file = cluster.secrets.api_key_path
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text().strip() == cluster.api_key
    assert str(key_file) in cluster.output()  # `yb up` says where the key is ...
    assert cluster.api_key not in cluster.output()  # ... and never prints the key
    # nats-server's config holds the NATS passwords: only its owner may read it.
    (nats_conf,) = (cluster.data_dir / "nats").glob("*.conf")
    assert stat.S_IMODE(nats_conf.stat().st_mode) == 0o600
    assert cluster.secrets.nats_passwords["gateway"] in nats_conf.read_text()
    # Services get the paths of their secrets, not the secrets.
    for name, pid in cluster.pids.items():
        environ = psutil.Process(pid).environ()
        values = set(environ.values())
        assert cluster.api_key not in values, name
        assert not values & set(cluster.secrets.nats_passwords.values()), name
    url = cluster.url
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    calls: list[tuple[str, str, Any]] = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", completion),
    ]
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        for method, path, body in calls:
            for headers in ({}, {"Authorization": "Bearer yb-wrong"}, {"x-api-key": "yb-wrong"}):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
            r = client.request(method, path, json=body, headers=cluster.headers)
            assert r.status_code == 200, (path, r.text)
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
    # The official client, as the README shows it.
    oai = OpenAI(base_url=f"{url}/v1", api_key=cluster.api_key, max_retries=0, timeout=60)
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_every_metrics_endpoint_needs_the_metrics_token(cluster: LocalCluster) -> None:
    ups = instance_ups(cluster)
    roles = {up.role for up in ups.values()}
    assert roles == {"conductor", "gateway", "prefill", "decode", "kvstore"}, ups
    with httpx.Client(timeout=10, trust_env=False) as client:
        for name, up in ups.items():
            assert up.metrics_address, name
            url = f"http://{up.metrics_address}/metrics"
            assert client.get(url).status_code == 401, name
            # An API key is not the metrics token.
            assert client.get(url, headers=cluster.headers).status_code == 401, name
            scraped = client.get(url, headers=cluster.metrics_headers)
            assert scraped.status_code == 200, name
            assert "# HELP" in scraped.text


# --- listeners ------------------------------------------------------------------------


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP/UDP socket process `pid` listens on."""
    sockets = psutil.Process(pid).net_connections(kind="inet")
    return sorted(
        (c.laddr.ip, c.laddr.port)
        for c in sockets
        if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)  # 2: SOCK_DGRAM
    )


def ucx_addresses(cluster: LocalCluster) -> dict[str, PeerAddress]:
    """The UCX receiver address each engine and kvstore announced."""
    return {
        name: PeerAddress.parse(up.ucx_address)
        for name, up in instance_ups(cluster).items()
        if up.ucx_address
    }


def test_every_listener_is_on_loopback(cluster: LocalCluster) -> None:
    ucx = ucx_addresses(cluster)
    assert set(ucx) == {"prefill-0", "prefill-1", "decode-0", "kvstore-0", "kvstore-1"}
    assert {address.host for address in ucx.values()} == {"127.0.0.1"}
    checked = 0
    exposed = []
    for name, pid in cluster.pids.items():
        for address, port in listeners(pid):
            checked += 1
            if not is_loopback(address):
                exposed.append((name, address, port))
    assert exposed == []
    # The scan really saw the cluster's sockets: nats-server (client + monitor), the
    # gateway, the metrics of 6 services, and UCX's TCP transport, which listens
    # (on loopback) in each of the 5 processes that use UCX.
    for name in ucx:
        assert len(listeners(cluster.pids[name])) >= 2, (name, listeners(cluster.pids[name]))
    assert checked >= 14, checked


def test_a_forged_hello_is_ignored_and_harms_nothing(cluster: LocalCluster) -> None:
    # A hello names the worker address to connect back to, and UCX aborts the
    # process on a malformed one: a receiver answers only the cluster's own workers.
    decode = ucx_addresses(cluster)["decode-0"]
    pid = cluster.pids["decode-0"]

    def decode_log() -> str:
        return (cluster.data_dir / "logs" / "decode-0.log").read_text(errors="replace")

    async def forge() -> None:
        from yb_dataplane.transport import ucx_env
        from yb_dataplane.transport.handshake import frame_array
        from yb_dataplane.transport.wire import Hello, encode_frame

        ucx = ucx_env.acquire()
        try:
            endpoint = await ucx.create_endpoint_from_worker_address(
                ucx_env.address_from(decode.worker), endpoint_error_handling=True
            )
            junks = (b"\x01" * 40, decode.worker[:-8] + b"\xff" * 8, b"\x00")
            for junk in junks:
                hello = Hello(1, junk, 12345, "forger")
                await endpoint.send(
                    frame_array(encode_frame(hello)), tag=decode.hello_tag, force_tag=True
                )
            # The receiver waits a while for the forger to be announced, then ignores
            # each hello and says so: wait for all of them to be handled.
            deadline = asyncio.get_running_loop().time() + WAIT_S
            while decode_log().count("ignored a hello from 'forger'") < len(junks):
                assert asyncio.get_running_loop().time() < deadline, "hellos not handled"
                await asyncio.sleep(0.1)
            endpoint.abort()
        finally:
            ucx_env.release()

    asyncio.run(forge())
    assert pid_alive(pid)
    assert decode_log().count("ignored a hello from 'forger'") == 3
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=120) as client:
        body = {"model": MODEL, "prompt": "still serving", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert pid_alive(pid)


# --- NATS -----------------------------------------------------------------------------


def test_real_traffic_meets_no_permission_violation(cluster: LocalCluster) -> None:
    # Traffic of every kind: streamed and not, chat and completion, shared prefixes
    # (blocks stored, indexed and fetched from the other host's kvstore).
    system = "You are a careful assistant. " * 30
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=120) as client:
        for i in range(4):
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {i}"},
                ],
                "max_tokens": 3,
                "stream": i % 2 == 0,
            }
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    logs = cluster.data_dir / "logs"
    nats_log = (logs / "nats-server.log").read_text(errors="replace")
    assert "Violation" not in nats_log, [
        line for line in nats_log.splitlines() if "Violation" in line
    ]
    for path in logs.glob("*.log"):
        text = path.read_text(errors="replace")
        assert "nats_permission_denied" not in text, path.name
    # Nothing reaches the server without credentials.
    anonymous = msgspec.structs.replace(cluster.nats_config(), user="", password="")
    with pytest.raises(BusUnavailable, match="authorization violation"):
        asyncio.run(Bus.connect(anonymous, "anonymous", timeout_s=10))


def test_operator_tools_use_the_data_dirs_admin_credentials(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    def yb(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "yb_tools.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    status = yb("status", "--data-dir", str(cluster.data_dir))
    assert status.returncode == 0, status.stderr
    assert "gateway-0" in status.stdout and "decode-0" in status.stdout
    exported = tmp_path / "log.jsonl"
    replay = yb("replay", "--data-dir", str(cluster.data_dir), "--export", str(exported))
    assert replay.returncode == 0, replay.stderr
    assert exported.stat().st_size > 0
    # Pointed at the same NATS from a data dir without credentials: refused, and said so.
    nats_url = cluster.nats_config().url
    refused = yb("status", "--nats", nats_url, "--data-dir", str(tmp_path / "empty"))
    assert refused.returncode == 1
    assert "authorization violation" in refused.stderr


# --- the durable log --------------------------------------------------------------------


def _windows(tokens: list[int], width: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + width]) for i in range(len(tokens) - width + 1)]


class LeakDetector:
    """Finds prompt text or runs of prompt token ids in raw log messages, in any
    encoding a careless publisher would use: msgpack (the log's), JSON, raw arrays."""

    def __init__(self, texts: list[str], token_lists: list[list[int]], width: int = 4) -> None:
        # Texts too plain to tell apart from JSON or padding (a generated "      ")
        # would only raise false alarms.
        self.texts = [t for t in texts if len(t) >= 6 and len(set(t.strip())) >= 4]
        self.windows = {w for tokens in token_lists for w in _windows(tokens, width)}
        self.width = width
        self.needles: list[tuple[str, bytes]] = []
        for text in self.texts:
            for piece in {text, text[: len(text) // 2], text[len(text) // 2 :]}:
                if len(piece) >= 6:
                    self.needles.append((f"text {piece[:20]!r}", piece.encode()))
        for window in sorted(self.windows)[:5000]:
            label = f"tokens {window}"
            self.needles.append((label, b"".join(msgspec.msgpack.encode(t) for t in window)))
            self.needles.append((label, ", ".join(map(str, window)).encode()))
            self.needles.append((label, ",".join(map(str, window)).encode()))
            for dtype in ("<i4", "<i8", ">i4"):
                self.needles.append((label, np.array(window, dtype=dtype).tobytes()))

    def findings(self, data: bytes, headers: dict[str, str]) -> list[str]:
        """What of the prompts `data` (a raw message) and its headers reveal."""
        found = [label for label, needle in self.needles if needle in data]
        header_text = " ".join(f"{k}={v}" for k, v in headers.items())
        found += [f"header {t[:20]!r}" for t in self.texts if t in header_text]
        try:
            decoded = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            decoded = None
        found += self._walk(decoded)
        return found

    def _walk(self, node: Any) -> list[str]:
        found: list[str] = []
        if isinstance(node, str):
            found += [f"string {t[:20]!r}" for t in self.texts if t in node or node == t]
        elif isinstance(node, dict):
            for key, value in node.items():
                found += self._walk(key) + self._walk(value)
        elif isinstance(node, list):
            ints = [v for v in node if isinstance(v, int) and not isinstance(v, bool)]
            if len(ints) >= self.width and any(
                w in self.windows for w in _windows(ints, self.width)
            ):
                found.append(f"int list of {len(ints)}")
            for value in node:
                found += self._walk(value)
        return found


def read_raw_log(cluster: LocalCluster) -> list[tuple[int, str, bytes, dict[str, str]]]:
    """Every message of the event stream, undecoded: (seq, subject, data, headers)."""

    async def read() -> list[tuple[int, str, bytes, dict[str, str]]]:
        bus = await Bus.connect(cluster.nats_config(), "test-admin", timeout_s=WAIT_S)
        try:
            last = await bus.last_sequence()
            sub = await bus.jetstream.subscribe(
                "yb.ev.>", stream="YB_EVENTS", ordered_consumer=True
            )
            out = []
            while not out or out[-1][0] < last:
                msg = await sub.next_msg(timeout=WAIT_S)
                out.append(
                    (
                        int(msg.metadata.sequence.stream),
                        msg.subject,
                        bytes(msg.data),
                        dict(msg.headers or {}),
                    )
                )
            await sub.unsubscribe()
            return out
        finally:
            await bus.close()

    return asyncio.run(read())


def test_the_durable_log_holds_no_prompt_text_or_token_ids(cluster: LocalCluster) -> None:
    tokens = token_prompt()
    request_ids: list[str] = []
    outputs: list[str] = []
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=120) as client:
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_TEXT}]}),
            ("/v1/completions", {"prompt": tokens}),
            ("/v1/completions", {"prompt": TEXT_PROMPT}),
            ("/v1/completions", {"prompt": tokens}),  # again: served from the pool
        ]
        for path, body in bodies:
            r = client.post(path, json={"model": MODEL, "max_tokens": 8, **body})
            assert r.status_code == 200, r.text
            reply = r.json()
            request_ids.append(reply["id"])
            choice = reply["choices"][0]
            outputs.append(choice["message"]["content"] if "message" in choice else choice["text"])
        # A streamed one too: the token path differs.
        stream = {"model": MODEL, "prompt": SECRET_TEXT, "max_tokens": 8, "stream": True}
        with client.stream("POST", "/v1/completions", json=stream) as r:
            assert r.status_code == 200
            assert "[DONE]" in "".join(r.iter_lines())

    detector = LeakDetector([SECRET_TEXT, TEXT_PROMPT, *outputs], [tokens])
    # The detector is not blind: a careless event with the prompt in it is caught.
    careless = msgspec.msgpack.encode({"request_id": "r", "prompt": SECRET_TEXT, "ids": tokens})
    assert len(detector.findings(careless, {})) >= 2
    assert detector.findings(np.array(tokens, dtype="<i4").tobytes(), {})

    log = read_raw_log(cluster)
    assert len(log) > 20
    subjects = {subject for _, subject, _, _ in log}
    assert "yb.ev.req.request_admitted" in subjects
    everything = b"".join(data for _, _, data, _ in log)
    for request_id in request_ids:  # the requests really went through the log
        assert request_id.encode() in everything, request_id
    leaks = {
        (seq, subject): found
        for seq, subject, data, headers in log
        if (found := detector.findings(data, headers))
    }
    assert leaks == {}
