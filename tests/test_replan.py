"""A stream that survives its engines: re-plans under a running cluster.

One `yb up` cluster (tiny model; 2 prefill, 2 decode, 2 kvstore; the default re-plan
budget of 1), kept up when an instance dies. In file order:

1. the decode instance of a greedy stream is SIGKILLed while the stream is parked after
   its 20th token: the client's SSE stream goes on, without an error, and its text is
   that of an undisturbed run of the same request;
2. the prefill instance of a request is SIGKILLed between chunks of its prompt: the
   same;
3. the log of both replays to the same decisions, the re-plans (attempt 1) included.

What breaks is parked at a failpoint first (`yb_testkit.faults.Gate`), so every
outcome holds by construction, not by the machine's speed; every wait has its own
deadline. The stall (kill to the next token at the client) goes into the fault
table. Budget 0 (today's clean error) is what `tests/test_faults.py` runs under.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_testkit.faults import (
    FaultRecord,
    Gate,
    Held,
    decision_of,
    events_of,
    headers,
    kill,
    long_stream_body,
    read_log,
    record,
    tiny_prompt,
    wait_every_engine_up,
    wait_until,
)
from yb_testkit.fixtures import LocalCluster

HEARTBEAT_S = 4.0
HOLD_TOKENS = 20  # a gated stream parks after this many tokens (failpoint decode.token)
ACT_S = 60.0
VERDICT_S = 30.0

pytestmark = [pytest.mark.timeout(300, func_only=True)]


@pytest.fixture(scope="module")
def replanning(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Gate]]:
    root = tmp_path_factory.mktemp("replan")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "2", "--decode", "2", "--kvstore", "2"),
        "--keep-going",
        env={
            "YB_CONDUCTOR__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_PREFILL__PREFIX_CACHE_PAGES": "0",
            # Room for the 3,000-token prompt twice: the attempt on a killed prefill
            # keeps its decode reservation until the request's deadline.
            "YB_DECODE__KV_SEQUENCES": "2",
            "YB_FAILPOINTS": gate.spec(
                f"decode.token=hold({HOLD_TOKENS})", "prefill.chunk=hold(1)"
            ),
        },
    )
    cluster.start(timeout_s=300)
    try:
        # The tests kill one engine of two and re-plan onto the other.
        wait_every_engine_up(cluster)
        yield cluster, gate
    finally:
        gate.release_everything()
        cluster.stop()


class TimedStream:
    """One streamed completion read on its own thread, each frame with its arrival."""

    def __init__(self, cluster: LocalCluster, body: dict[str, Any]) -> None:
        self.url = f"{cluster.url}/v1/completions"
        self.body = body
        self.headers = headers(cluster)
        self.frames: list[tuple[float, str, str]] = []  # (monotonic, event, data)
        self.failure: BaseException | None = None
        self.status = 0
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url, json=self.body, headers=self.headers, timeout=120
            ) as r:
                self.status = r.status_code
                event = ""
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        self.frames.append((time.monotonic(), event, line[6:]))
                    elif not line:
                        event = ""
        except BaseException as exc:  # what the client saw is the test's evidence
            self.failure = exc
        finally:
            self.done.set()

    def wait_done(self, timeout_s: float) -> None:
        wait_until(self.done.is_set, timeout_s, f"the stream to end ({self.describe()})")

    @property
    def errors(self) -> list[str]:
        return [data for _, event, data in self.frames if event == "error"]

    def pieces(self) -> list[tuple[float, str]]:
        """The text of every frame that has some, with its arrival."""
        out = []
        for at, event, data in self.frames:
            if event or data == "[DONE]":
                continue
            for choice in json.loads(data).get("choices") or []:
                if choice.get("text"):
                    out.append((at, choice["text"]))
        return out

    def text(self) -> str:
        return "".join(piece for _, piece in self.pieces())

    def first_text_after(self, moment: float) -> float:
        """Seconds from `moment` to the first chunk of the completion after it (the
        tiny model's tokens often decode to no text of their own)."""
        return min(at for at, event, data in self.frames if at > moment and not event) - moment

    def uninterrupted(self) -> bool:
        """No error event, nothing broken, `[DONE]` last."""
        return (
            self.failure is None
            and not self.errors
            and bool(self.frames)
            and self.frames[-1][2] == "[DONE]"
        )

    def describe(self) -> str:
        return (
            f"status={self.status} frames={len(self.frames)} errors={self.errors[:2]} "
            f"last={[f[2][:200] for f in self.frames[-2:]]} failure={self.failure!r}"
        )


def _decisions(cluster: LocalCluster, request_id: str) -> list[ev.Decision]:
    return [e for e in events_of(read_log(cluster), ev.Decision) if e.request_id == request_id]


def _replans(cluster: LocalCluster, request_id: str) -> list[ev.RequestReplanned]:
    return [
        e for e in events_of(read_log(cluster), ev.RequestReplanned) if e.request_id == request_id
    ]


def _wait_declared_down(cluster: LocalCluster, instance_id: str) -> None:
    wait_until(
        lambda: any(
            e.instance_id == instance_id for e in events_of(read_log(cluster), ev.InstanceDown)
        ),
        VERDICT_S,
        f"InstanceDown for {instance_id}",
    )


def _kill_mid_request(
    cluster: LocalCluster, gate: Gate, body: dict[str, Any], point: str
) -> tuple[Held, ev.RequestScheduled, float]:
    """SIGKILL the instance that holds a greedy streamed request at failpoint `point`;
    the client must see one uninterrupted stream with the text of an undisturbed run.
    Returns the hold, the first decision and the stall (kill to the next text)."""
    gate.arm(point)
    stream = TimedStream(cluster, body)
    held = gate.wait_held(point, ACT_S)
    first = decision_of(cluster, held.request_id, timeout_s=ACT_S)
    assert isinstance(first, ev.RequestScheduled)
    killed = kill(cluster, held.instance_id)

    stream.wait_done(VERDICT_S + ACT_S)
    assert stream.uninterrupted(), stream.describe()
    stall_s = stream.first_text_after(killed)
    # The undisturbed run once nothing can be placed on the dead instance any more.
    _wait_declared_down(cluster, held.instance_id)
    undisturbed = TimedStream(cluster, body)
    undisturbed.wait_done(ACT_S)
    assert undisturbed.uninterrupted(), undisturbed.describe()
    assert stream.text() == undisturbed.text()
    return held, first, stall_s


def test_decode_death_mid_stream_continues_on_another_decode(
    replanning: tuple[LocalCluster, Gate],
) -> None:
    cluster, gate = replanning
    # Three blocks of 64 and a part: the re-plan must find the prompt's blocks in the
    # pool, where the first prefill stored them.
    body = long_stream_body(tiny_prompt(1, 200), max_tokens=60)
    held, first, stall_s = _kill_mid_request(cluster, gate, body, "decode.token")
    assert first.decode_instance == held.instance_id

    (replan,) = _replans(cluster, held.request_id)
    assert replan.attempt == 1 and replan.failed_instance == held.instance_id
    assert replan.generated_tokens >= HOLD_TOKENS
    assert replan.replans_left == 0
    decisions = _decisions(cluster, held.request_id)
    assert sorted(d.attempt for d in decisions) == [0, 1], decisions
    second = next(d for d in decisions if d.attempt == 1)
    assert isinstance(second, ev.RequestScheduled)
    assert second.decode_instance != held.instance_id
    assert second.reused_blocks >= 200 // 64, second
    record(
        "replan_decode_death",
        FaultRecord(
            fault="decode instance dies mid-stream, re-plan budget 1",
            caused_by=f"SIGKILL {held.instance_id} while a greedy 60-token stream is parked "
            f"after {HOLD_TOKENS} tokens (failpoint decode.token)",
            client_saw=f"one uninterrupted SSE stream, the text of an undisturbed run; "
            f"{stall_s:.2f}s from the kill to the next token",
            cleaned_up=f"the gateway logged RequestReplanned (attempt 1, "
            f"{replan.generated_tokens} tokens streamed); the conductor placed the prompt "
            f"plus those tokens on {second.prefill_instance} / {second.decode_instance}, "
            f"{second.reused_blocks} blocks from the pool",
            checked_by="the client's text against an undisturbed run; RequestReplanned and "
            "the decisions (attempts 0 and 1) in the log",
            recovery_s=round(stall_s, 3),
            details={"heartbeat_timeout_s": HEARTBEAT_S},
        ),
    )


def test_prefill_death_mid_prompt_is_replanned(replanning: tuple[LocalCluster, Gate]) -> None:
    cluster, gate = replanning
    body = long_stream_body(tiny_prompt(2, 3000), max_tokens=8)
    held, first, stall_s = _kill_mid_request(cluster, gate, body, "prefill.chunk")
    assert first.prefill_instance == held.instance_id

    (replan,) = _replans(cluster, held.request_id)
    assert replan.failed_instance == held.instance_id and replan.generated_tokens == 0
    second = next(d for d in _decisions(cluster, held.request_id) if d.attempt == 1)
    assert isinstance(second, ev.RequestScheduled)
    assert second.prefill_instance != held.instance_id
    record(
        "replan_prefill_death",
        FaultRecord(
            fault="prefill instance dies mid-prompt, re-plan budget 1",
            caused_by=f"SIGKILL {held.instance_id} while it is parked between chunks of a "
            "3000-token prompt (failpoint prefill.chunk)",
            client_saw=f"one uninterrupted SSE stream, the text of an undisturbed run; "
            f"{stall_s:.2f}s from the kill to the first token",
            cleaned_up=f"decode's failed transfer (503) made the gateway re-plan (attempt 1, "
            f"{held.instance_id} avoided) onto {second.prefill_instance}, "
            f"{second.reused_blocks} blocks from the pool",
            checked_by="the client's text against an undisturbed run; RequestReplanned and "
            "the attempt-1 decision in the log",
            recovery_s=round(stall_s, 3),
        ),
    )


def test_the_log_of_replans_replays_to_the_same_decisions(
    replanning: tuple[LocalCluster, Gate],
) -> None:
    cluster, _ = replanning
    logged = read_log(cluster)
    assert list(events_of(logged, ev.RequestReplanned)), "the scenarios above logged no re-plan"
    records = [LogRecord(seq=item.seq, event=item.event) for item in logged]
    result = replay(records)
    assert result.divergences == []
    replanned = [d for d in events_of(logged, ev.Decision) if d.attempt > 0]
    assert len(replanned) >= 2
