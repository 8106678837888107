"""What the fault tests share: a cluster to break, its own accounting, its log, a record.

The fault tests break real processes of a `yb up` cluster (SIGKILL, SIGSTOP, a
restart) and then check the outcome through what the cluster itself says: each
instance's `/metrics` (the engines' KV page gauges read the page allocator at every
scrape), the `YB_EVENTS` log read back over NATS, and what a real HTTP client saw.
Every wait has a deadline (`wait_until`), and what each fault did and how long the
recovery took is written as JSON under `$YB_FAULT_NOTES` (default
`/tmp/notes/faults/`) for the closing note's table.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import UnionType
from typing import Any

import httpx
import msgspec

from yb_core import events as ev
from yb_core.bus import Bus, LoggedEvent
from yb_core.config import NatsConfig
from yb_core.failpoints import safe_name
from yb_testkit.fixtures import LocalCluster, pid_alive
from yb_tools.natsserver import die_with_parent

NOTES_DIR = Path(os.environ.get("YB_FAULT_NOTES", "/tmp/notes/faults"))
MODEL = "tiny"


# --- records -------------------------------------------------------------------------


class FaultRecord(msgspec.Struct, kw_only=True):
    """One row of the fault table: what was broken, how, and what happened then."""

    fault: str
    caused_by: str
    client_saw: str
    cleaned_up: str
    checked_by: str
    recovery_s: float
    details: dict[str, Any] = msgspec.field(default_factory=dict)


def record(name: str, row: FaultRecord) -> None:
    """Print the row, write it to `NOTES_DIR/<name>.json`, and rebuild the table of
    every row recorded there so far (`NOTES_DIR/table.md`)."""
    NOTES_DIR.mkdir(parents=True, exist_ok=True)
    data = msgspec.json.encode(row)
    (NOTES_DIR / f"{name}.json").write_bytes(msgspec.json.format(data, indent=2))
    print(f"\n[fault] {name}: {data.decode()}")
    lines = [
        "| fault | caused by | client saw | cleaned up | checked by | recovery (s) |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(NOTES_DIR.glob("*.json")):
        try:
            r = msgspec.json.decode(path.read_bytes(), type=FaultRecord)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        cells = (r.fault, r.caused_by, r.client_saw, r.cleaned_up, r.checked_by)
        text = " | ".join(c.replace("|", "/") for c in cells)
        lines.append(f"| {text} | {r.recovery_s:.2f} |")
    (NOTES_DIR / "table.md").write_text("\n".join(lines) + "\n")


# --- waiting -------------------------------------------------------------------------


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `check` until true; the seconds it took. Fails the test at the deadline.

    Each call gets its own full budget (never what is left of another's). A check
    that cannot reach an instance (`httpx.HTTPError`) counts as not yet true.
    """
    return wait_all({what: check}, timeout_s)


def wait_all(checks: dict[str, Callable[[], bool]], timeout_s: float) -> float:
    """Poll every check, all in the same round, until all hold at once; the seconds
    it took. At the deadline, fails naming the checks that still did not hold.

    (Checking one condition, then another once, races whatever updates the second
    a moment after the first: a gauge set at the engine's next step, an event
    published after the pages were freed.)
    """
    started = time.monotonic()
    while True:
        failing: list[str] = []
        for what, check in checks.items():
            try:
                ok = check()
            except httpx.HTTPError as exc:
                ok = False
                what = f"{what} ({exc!r})"
            if not ok:
                failing.append(what)
        if not failing:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {failing}")
        time.sleep(0.05)


# --- the cluster ---------------------------------------------------------------------


def headers(cluster: LocalCluster) -> dict[str, str]:
    """The HTTP headers a client of the cluster sends (its API key)."""
    return cluster.headers


def signal_instance(cluster: LocalCluster, instance_id: str, sig: signal.Signals) -> int:
    """Send `sig` to one process of the cluster; its pid."""
    pid = cluster.pids[instance_id]
    os.kill(pid, sig)
    return pid


def kill(cluster: LocalCluster, instance_id: str) -> float:
    """SIGKILL one process and wait until it is gone; the monotonic time of the kill."""
    at = time.monotonic()
    pid = signal_instance(cluster, instance_id, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, f"{instance_id} to die")
    return at


class Command(msgspec.Struct, frozen=True):
    """How a process was started: enough to start it again as a supervisor would."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def command_of(pid: int) -> Command:
    """Read a running process's command, environment and directory (from /proc).

    Read it before killing the process; `restart` then starts it again, and the new
    process is the caller's to stop.
    """
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    raw_env = Path(f"/proc/{pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw_env if b"=" in item)
    return Command([a.decode() for a in argv], env, os.readlink(f"/proc/{pid}/cwd"))


def restart(command: Command, log_path: Path) -> subprocess.Popen[bytes]:
    """Start a process again from its `Command`, appending to its log."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            command.argv,
            env=command.env,
            cwd=command.cwd,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, keyed `name` or `name{labels}`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class Scraper:
    """Reads instances' `/metrics` (their own accounting, not their logs)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster
        self._addresses: dict[str, str] = {}
        self._headers = cluster.metrics_headers

    def address(self, instance_id: str) -> str:
        """host:port of the instance's metrics endpoint, from its startup log line."""
        if instance_id not in self._addresses:
            for line in self._cluster.instance_log(instance_id).splitlines():
                if '"metrics_listening"' in line:
                    entry = json.loads(line)
                    self._addresses[instance_id] = f"{entry['host']}:{entry['port']}"
        assert instance_id in self._addresses, f"{instance_id} logged no metrics address"
        return self._addresses[instance_id]

    def metrics(self, instance_id: str) -> dict[str, float]:
        """Every sample, keyed `name` or `name{labels}` as Prometheus prints them."""
        r = httpx.get(
            f"http://{self.address(instance_id)}/metrics", headers=self._headers, timeout=5
        )
        r.raise_for_status()
        return samples(r.text)

    def value(self, instance_id: str, key: str) -> float:
        """One sample (0 when absent: a labelled series not created yet)."""
        return self.metrics(instance_id).get(key, 0.0)

    def pages_used(self, instance_id: str) -> float:
        """KV pages the engine's allocator has handed out and not got back."""
        return self.value(instance_id, "yb_engine_kv_pages_used")

    def held_for_requests(self, instance_id: str) -> float:
        """Pages an engine holds beyond its prefix cache: 0 when nothing is in flight."""
        m = self.metrics(instance_id)
        return m.get("yb_engine_kv_pages_used", 0.0) - m.get("yb_prefill_engine_cache_blocks", 0.0)


# --- the log -------------------------------------------------------------------------


def read_log(cluster: LocalCluster) -> list[LoggedEvent]:
    """Every event of the cluster's `YB_EVENTS` up to now, in order."""
    return read_events(cluster.nats_config())


def read_events(cfg: NatsConfig) -> list[LoggedEvent]:
    """Every event of `YB_EVENTS` up to now, in order (the scheduling log as stored)."""

    async def run() -> list[LoggedEvent]:
        bus = await Bus.connect(cfg, "fault-test-reader", timeout_s=10)
        try:
            last = await bus.last_sequence()
            reader = await bus.read_ordered()
            out: list[LoggedEvent] = []
            seq = 0
            try:
                while seq < last:
                    item = await reader.next(timeout_s=10)
                    assert item is not None, f"the log stopped short of sequence {last}"
                    out.append(item)
                    seq = item.seq
            finally:
                await reader.close()
            return out
        finally:
            await bus.close()

    return asyncio.run(run())


def events_of(log: list[LoggedEvent], kind: type[Any] | UnionType) -> Iterator[Any]:
    """The events of one type, in log order."""
    return (item.event for item in log if isinstance(item.event, kind))


def wait_every_engine_up(cluster: LocalCluster, timeout_s: float = 120.0) -> None:
    """Wait until every prefill, decode and kvstore instance of `cluster` has announced
    itself (`InstanceUp`). `start()` returns once one engine of each role serves: a
    test that kills one of two and expects its work to move to the other needs both."""
    engines = {i for i in cluster.pids if i.startswith(("prefill-", "decode-", "kvstore-"))}

    def all_up() -> bool:
        up = {e.instance_id for e in events_of(read_log(cluster), ev.InstanceUp)}
        return engines <= up

    wait_until(all_up, timeout_s, f"every engine to announce itself ({', '.join(sorted(engines))})")


def decisions_per_admission(log: list[LoggedEvent]) -> dict[str, list[str]]:
    """Every admitted request id, and every re-plan of one (`<id>#<attempt>`) -> the
    kinds of the decisions logged for it."""

    def key(request_id: str, attempt: int) -> str:
        return f"{request_id}#{attempt}" if attempt else request_id

    decisions: dict[str, list[str]] = {e.request_id: [] for e in events_of(log, ev.RequestAdmitted)}
    for replan in events_of(log, ev.RequestReplanned):
        decisions[key(replan.request_id, replan.attempt)] = []
    for e in events_of(log, ev.RequestScheduled | ev.RequestRejected):
        decisions.setdefault(key(e.request_id, e.attempt), []).append(type(e).__name__)
    return decisions


def decision_of(cluster: LocalCluster, request_id: str, timeout_s: float = 15) -> ev.AnyEvent:
    """The conductor's recorded decision for a request (waiting for it to be logged)."""
    found: list[ev.AnyEvent] = []

    def logged() -> bool:
        found[:] = [
            e
            for e in events_of(read_log(cluster), ev.RequestScheduled | ev.RequestRejected)
            if e.request_id == request_id
        ]
        return bool(found)

    wait_until(logged, timeout_s, f"the decision for {request_id}")
    return found[0]


def finished_events(cluster: LocalCluster, request_id: str) -> list[ev.AnyEvent]:
    """What the log says ended a request: its `RequestFinished` and `RequestCancelled`."""
    return [
        e
        for e in events_of(read_log(cluster), ev.RequestFinished | ev.RequestCancelled)
        if e.request_id == request_id
    ]


# --- clients -------------------------------------------------------------------------


def complete(cluster: LocalCluster, prompt: list[int], max_tokens: int = 6) -> dict[str, Any]:
    """A greedy, non-streamed completion that must succeed; the response body."""
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers=headers(cluster),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def tiny_prompt(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def long_stream_body(prompt: list[int], max_tokens: int = 3000) -> dict[str, Any]:
    """A streamed completion that cannot end early: `ignore_eos`, no stop strings, a
    large `max_tokens`. (How long it runs is the decode gate's business, not this.)"""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


# --- failpoint gates -----------------------------------------------------------------


class Held(msgspec.Struct, frozen=True):
    """A request parked at a failpoint, as its marker file says."""

    point: str
    request_id: str
    instance_id: str
    count: int


class Gate:
    """The test's side of `yb_core.failpoints` (points armed `once:`).

    `arm(point)` lets exactly one request park at `point`; `wait_held(point)` waits
    for that request's marker (so the test acts while it is provably in flight);
    `release(held)` lets it go on. `release_everything()` ends every hold this gate
    started and disarms, so a failed scenario leaves nothing parked.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seen: set[str] = set()

    def spec(self, *points: str, timeout_s: float = 120) -> str:
        """The `YB_FAILPOINTS` value arming `points` (`name=hold(N)` or `name=hold`)."""
        armed = ";".join(p.replace("=", "=once:", 1) for p in points)
        return f"gate={self.dir};timeout={timeout_s:g};{armed}"

    def arm(self, point: str) -> None:
        """The next request to reach `point` parks there (one request only)."""
        self._seen |= {p.name for p in self.dir.glob(f"{point}.*.reached")}
        (self.dir / f"{point}.arm").touch()

    def wait_held(self, point: str, timeout_s: float) -> Held:
        """Until the armed request has parked at `point`; who and where."""
        found: list[Path] = []

        def reached() -> bool:
            found[:] = [p for p in self.dir.glob(f"{point}.*.reached") if p.name not in self._seen]
            return bool(found)

        wait_until(reached, timeout_s, f"a request to park at failpoint {point}")
        (path,) = found
        self._seen.add(path.name)
        return msgspec.json.decode(path.read_bytes(), type=Held)

    def release(self, held: Held) -> None:
        """Let a parked request go on."""
        name = safe_name(held.request_id)
        (self.dir / f"{held.point}.{name}.release").touch()

    def release_everything(self) -> None:
        """Disarm every point and release every request that ever parked here."""
        for arm in self.dir.glob("*.arm"):
            arm.unlink(missing_ok=True)
        for marker in self.dir.glob("*.reached"):
            (self.dir / (marker.name.removesuffix(".reached") + ".release")).touch()

    def armed(self) -> list[str]:
        """Arm files not yet claimed by a request."""
        return sorted(p.name for p in self.dir.glob("*.arm"))


def assert_completed(*clients: SseClient) -> None:
    """Each stream was answered 200 and ended with `[DONE]`, without an error."""
    for client in clients:
        assert client.completed, client.describe()


class SseClient:
    """One streamed completion read on its own thread, as a client sees it.

    `frames` are the SSE frames' data in order (`[DONE]` included), `errors` the data
    of `event: error` frames. (A client that hangs up at a chosen moment is a
    `RawStream`.)
    """

    def __init__(self, cluster: LocalCluster, body: dict[str, Any], timeout_s: float = 120):
        self.url = f"{cluster.url}/v1/completions"
        self.body = body
        self.headers = headers(cluster)
        self.timeout_s = timeout_s
        self.status = 0
        self.request_id = ""
        self.frames: list[str] = []
        self.errors: list[str] = []
        self.text_frames = 0
        self.failure: BaseException | None = None
        self.ended_at = 0.0
        self.started = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url, json=self.body, headers=self.headers, timeout=self.timeout_s
            ) as r:
                self.status = r.status_code
                self.request_id = r.headers.get("x-request-id", "")
                self.started.set()
                event = ""
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                        self.frames.append(data)
                        if event == "error":
                            self.errors.append(data)
                        elif data != "[DONE]" and _has_text(data):
                            self.text_frames += 1
                    elif not line:
                        event = ""
        except BaseException as exc:  # what the client saw is the test's evidence
            self.failure = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()

    def wait_text(self, frames: int, timeout_s: float) -> None:
        """Until `frames` frames with text have arrived."""
        wait_until(lambda: self.text_frames >= frames or self.done.is_set(), timeout_s, "tokens")
        assert self.text_frames >= frames, self.describe()

    def wait_done(self, timeout_s: float) -> float:
        """Until the stream has ended; the seconds waited."""
        return wait_until(self.done.is_set, timeout_s, f"the stream to end ({self.describe()})")

    @property
    def completed(self) -> bool:
        """Answered 200 and ended with `[DONE]`, without an error event or a break."""
        return (
            self.status == 200
            and self.failure is None
            and not self.errors
            and bool(self.frames)
            and self.frames[-1] == "[DONE]"
        )

    @property
    def ended_cleanly_with_error(self) -> bool:
        """An OpenAI error event, then `[DONE]`, and nothing broken in between."""
        return (
            self.failure is None
            and bool(self.errors)
            and bool(self.frames)
            and self.frames[-1] == "[DONE]"
        )

    def text(self) -> str:
        """The completion's text so far: every text frame's, in order."""
        pieces: list[str] = []
        for data in self.frames:
            if data != "[DONE]" and data not in self.errors:
                for choice in json.loads(data).get("choices") or []:
                    pieces.append(choice.get("text") or "")
        return "".join(pieces)

    def error_message(self) -> str:
        """The message of the first error event ('' if none)."""
        if not self.errors:
            return ""
        message: str = json.loads(self.errors[0])["error"]["message"]
        return message

    def describe(self) -> str:
        """A short account for assertion messages."""
        return (
            f"status={self.status} text_frames={self.text_frames} errors={self.errors[:2]} "
            f"last={self.frames[-2:]} failure={self.failure!r}"
        )


def _has_text(data: str) -> bool:
    try:
        choices = json.loads(data).get("choices") or []
    except json.JSONDecodeError:
        return False
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)


class RawStream:
    """A streamed completion over a raw socket: the response head read, the body left
    unread. `close()` is the client going away, at a moment the test chose (no frame
    needs to arrive for it, unlike a client that hangs up "at the next frame")."""

    def __init__(self, cluster: LocalCluster, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        host, port = cluster.url.removeprefix("http://").split(":")
        head = [
            "POST /v1/completions HTTP/1.1",
            f"Host: {host}:{port}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            *(f"{k}: {v}" for k, v in headers(cluster).items()),
            "",
            "",
        ]
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        try:
            self.sock.sendall("\r\n".join(head).encode() + payload)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = self.sock.recv(4096)
                assert chunk, "the gateway closed the connection before answering"
                received += chunk
            status_line, *lines = received.split(b"\r\n\r\n")[0].decode().split("\r\n")
            assert " 200 " in f"{status_line} ", status_line
            ids = [
                value.strip()
                for name, _, value in (line.partition(":") for line in lines)
                if name.strip().lower() == "x-request-id"
            ]
            assert ids, f"no X-Request-Id in {lines}"
            self.request_id = ids[0]
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        """Hang up (unread data makes the kernel reset the connection: the gateway
        hears of it at once)."""
        self.sock.close()
