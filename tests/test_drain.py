"""Nothing lost on the way down: a decode instance removed from a cluster under load.

One `yb up` cluster (tiny model; 1 prefill, 2 decode, 1 kvstore; `--keep-going`, so
the removed instance stays gone). Streamed greedy completions (`ignore_eos`, so each
runs to `max_tokens`) are sent once on the whole cluster for reference, then again
while one decode instance is told to stop (SIGTERM, what `yb up`'s actuator, `docker
stop` and Kubernetes send). Three of them are parked mid-stream at the failpoint
`decode.token` first, so two are provably on one decode instance (two decode
instances, three requests): that one is removed. Then, in order:

1. SIGTERM: it logs `InstanceDraining`; from then on the conductor places nothing
   there;
2. the first of its two parked streams is let go: it finishes there, at attempt 0;
3. a second SIGTERM ends the drain at once: the other parked stream ends there with
   a 503, its gateway re-plans it onto the other decode instance from the tokens its
   client has, and it goes on.

Every stream is answered 200 and ends with `[DONE]`, with the tokens of the reference
run: `max_tokens` of them, none repeated or skipped. Every wait ends as soon as its
condition holds and has its own deadline; the drain's own deadline (300 s) is never
what ends it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from yb_conductor.replay import LogRecord, replay
from yb_core import events as ev
from yb_testkit.faults import (
    Gate,
    Held,
    SseClient,
    events_of,
    read_log,
    signal_instance,
    tiny_prompt,
    wait_until,
)
from yb_testkit.fixtures import LocalCluster, pid_alive

HOLD_TOKENS = 8  # a gated stream parks after this many tokens (failpoint decode.token)
MAX_TOKENS = 24
STREAMS = 6
ACT_S = 60.0

pytestmark = [pytest.mark.timeout(300, func_only=True), pytest.mark.slow]


@pytest.fixture(scope="module")
def draining(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Gate]]:
    root = tmp_path_factory.mktemp("drain")
    gate = Gate(root / "gate")
    cluster = LocalCluster(
        root / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "1", "--decode", "2", "--kvstore", "1"),
        "--keep-going",
        env={
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_KVSTORE__LOAD_REPORT_INTERVAL_S": "0.5",
            # Only the second signal ends the drain, never its deadline.
            "YB_DECODE__DRAIN_TIMEOUT_S": "300",
            "YB_FAILPOINTS": gate.spec(f"decode.token=hold({HOLD_TOKENS})"),
        },
    )
    cluster.start(timeout_s=300)
    try:
        yield cluster, gate
    finally:
        gate.release_everything()
        cluster.stop()


def body(seed: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": tiny_prompt(seed, 40),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # One entry per generated token: the stream's tokens, in order.
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }


def tokens_of(stream: SseClient) -> tuple[list[str], int]:
    """The stream's tokens (from its logprobs) and its usage's completion tokens."""
    tokens: list[str] = []
    usage = -1
    for data in stream.frames:
        if data == "[DONE]" or data in stream.errors:
            continue
        frame = json.loads(data)
        for choice in frame.get("choices") or []:
            tokens += (choice.get("logprobs") or {}).get("tokens") or []
        if frame.get("usage"):
            usage = frame["usage"]["completion_tokens"]
    return tokens, usage


def finish(streams: list[SseClient]) -> list[list[str]]:
    """Wait for every stream; each must have completed with `MAX_TOKENS` tokens."""
    out = []
    for stream in streams:
        stream.wait_done(ACT_S)
        assert stream.completed, stream.describe()
        tokens, usage = tokens_of(stream)
        assert len(tokens) == usage == MAX_TOKENS, (len(tokens), usage, stream.describe())
        out.append(tokens)
    return out


def status_of(cluster: LocalCluster, instance_id: str) -> str:
    """The STATE column of `yb status` for one instance."""
    out = subprocess.run(
        [sys.executable, "-m", "yb_tools.cli", "status", "--data-dir", str(cluster.data_dir)],
        capture_output=True,
        text=True,
        timeout=ACT_S,
        check=True,
    ).stdout
    (line,) = [x for x in out.splitlines() if x.startswith(f"{instance_id} ")]
    return line.split()[3]


def logged(cluster: LocalCluster, kind: type[Any], instance_id: str) -> list[Any]:
    return [e for e in events_of(read_log(cluster), kind) if e.instance_id == instance_id]


def test_a_decode_instance_removed_under_load_loses_nothing(
    draining: tuple[LocalCluster, Gate],
) -> None:
    cluster, gate = draining
    reference = finish([SseClient(cluster, body(seed)) for seed in range(STREAMS)])

    # Three parked mid-stream, one at a time (one arm parks one request): two decode
    # instances, so one of them holds two of them. That one is removed.
    parked: list[tuple[Held, SseClient]] = []
    for seed in range(3):
        gate.arm("decode.token")
        stream = SseClient(cluster, body(seed))
        parked.append((gate.wait_held("decode.token", ACT_S), stream))
    places = [held.instance_id for held, _ in parked]
    removed = max(set(places), key=places.count)
    (first, a), (second, _) = [(h, s) for h, s in parked if h.instance_id == removed][:2]
    # The rest of the load, placed anywhere (the removed instance included).
    load = [(seed, stream) for seed, (_, stream) in enumerate(parked)]
    load += [(seed, SseClient(cluster, body(seed))) for seed in range(len(parked), STREAMS)]
    for held, _ in parked:
        if held.instance_id != removed:
            gate.release(held)

    pid = signal_instance(cluster, removed, signal.SIGTERM)
    wait_until(
        lambda: bool(logged(cluster, ev.InstanceDraining, removed)), ACT_S, "InstanceDraining"
    )
    gate.release(first)
    a.wait_done(ACT_S)
    assert a.completed, a.describe()
    # `b` is parked still: the instance drains on, and a second signal ends that.
    assert pid_alive(pid) and not logged(cluster, ev.InstanceDown, removed)
    assert status_of(cluster, removed) == "draining"
    signal_instance(cluster, removed, signal.SIGTERM)
    wait_until(lambda: not pid_alive(pid), ACT_S, f"{removed} to exit")

    assert finish([stream for _, stream in load]) == [reference[seed] for seed, _ in load]

    log = read_log(cluster)
    mark = next(
        item.seq
        for item in log
        if isinstance(item.event, ev.InstanceDraining) and item.event.instance_id == removed
    )
    # Nothing the conductor decided once it knew went to the removed instance.
    for decision in events_of(log, ev.RequestScheduled):
        if decision.admitted_seq > mark:
            assert removed not in (decision.decode_instance, decision.prefill_instance), decision
    # `a` finished where it was; `b` was re-planned from the tokens its client had.
    ends = {(e.request_id, e.attempt): e for e in events_of(log, ev.RequestFinished)}
    assert ends[(first.request_id, 0)].outcome == "completed"
    assert ends[(first.request_id, 0)].instance_id == removed
    assert not [e for e in events_of(log, ev.RequestReplanned) if e.request_id == first.request_id]
    (replan,) = [
        e for e in events_of(log, ev.RequestReplanned) if e.request_id == second.request_id
    ]
    assert replan.failed_instance == removed and replan.generated_tokens == HOLD_TOKENS
    assert ends[(second.request_id, 1)].outcome == "completed"
    assert ends[(second.request_id, 1)].instance_id != removed
    # And the log, the drain included, replays to the same decisions.
    result = replay([LogRecord(seq=item.seq, event=item.event) for item in log])
    assert result.divergences == []
