"""`yb up --elastic`: the launcher carries out the real planner's decisions.

One `yb up --elastic --max-instances 4` cluster (tiny model) starts with 1 prefill and
2 decode instances. The planner, planning every 2 s of log time, must keep at least 3
prefill and 1 decode instances, and 3 + 1 is its whole budget: whatever the load, its
targets are 3 and 1 (over the budget the pools share it, each kept at its minimum).
So, by construction, it adds a prefill instance, which `yb up` starts as `prefill-1`,
and it drains a decode instance, or moves it to prefill (a decode pool held at 2 by
hysteresis gives way to the prefill pool's need); the third prefill instance,
`prefill-2`, starts in the slot the decode instance left. No decode instance is ever
added, so one always serves. Streamed requests run from the start until the add is
seen: every one is answered 200 and ends with `[DONE]`.

What is checked is what the log and the processes say: the `PoolPlanned` with the
add, the `InstanceUp` of the instance `yb up` says it started for it (a new id,
`prefill-1`; the second prefill instance, started seconds later, may announce itself
first); the decision to drain (or move) an instance, its `InstanceDraining` and
`InstanceDown`, and its process gone; the pools at their targets at the end; `yb up`
saying what it did; never more than 4 engine processes in cluster.json.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from yb_core import events as ev
from yb_core.bus import LoggedEvent
from yb_testkit.faults import SseClient, events_of, long_stream_body, read_log, tiny_prompt
from yb_testkit.fixtures import LocalCluster, pid_alive

MAX_INSTANCES = 4
#: Each wait's own deadline: an instance of the tiny model starts in seconds.
ACT_S = 60.0
ENGINE_PREFIXES = ("prefill-", "decode-")
#: `yb up`'s line for a process it started for an add: the new instance's id.
ADD_STARTED = re.compile(r"\[yb\] planner: add (?:prefill|decode) -> started (\S+) \(")

pytestmark = [pytest.mark.timeout(300, func_only=True), pytest.mark.slow]


@pytest.fixture
def elastic(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        tmp_path / "cluster",
        *("--model", "tiny-random", "--model-name", "tiny"),
        *("--prefill", "1", "--decode", "2", "--kvstore", "1"),
        *("--elastic", "--max-instances", str(MAX_INSTANCES)),
        env={
            "YB_CONDUCTOR__PLANNER_INTERVAL_S": "2",
            "YB_CONDUCTOR__PLANNER_WINDOW_S": "10",
            "YB_CONDUCTOR__PLANNER_LEAD_S": "0",
            "YB_CONDUCTOR__PLANNER_DOWN_AFTER_S": "6",
            # Minimums that fill the budget: the targets do not depend on the load.
            "YB_CONDUCTOR__PLANNER_MIN_PREFILL": "3",
            "YB_CONDUCTOR__PLANNER_MIN_DECODE": "1",
            # Load reports keep the log (the planner's clock) moving while idle.
            "YB_PREFILL__LOAD_REPORT_INTERVAL_S": "0.5",
            "YB_DECODE__LOAD_REPORT_INTERVAL_S": "0.5",
        },
    )
    cluster.start(timeout_s=240)
    try:
        yield cluster
    finally:
        cluster.stop()


class Load:
    """Streamed completions, `workers` at a time, until `stop()`."""

    def __init__(self, cluster: LocalCluster, workers: int = 2) -> None:
        self.cluster = cluster
        self.clients: list[SseClient] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            body = long_stream_body(tiny_prompt(1000 * worker + n, 40), max_tokens=16)
            client = SseClient(self.cluster, body, timeout_s=90)
            self.clients.append(client)
            client.done.wait(120)
            n += 1

    def stop(self) -> list[SseClient]:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)
        return self.clients


def _engines(cluster: LocalCluster) -> set[str]:
    """The engine processes `yb up` runs now (cluster.json), checked against the cap;
    every pid seen is kept in `cluster.pids`."""
    pids = cluster.info().pids
    cluster.pids = {**cluster.pids, **pids}
    engines = {name for name in pids if name.startswith(ENGINE_PREFIXES)}
    assert len(engines) <= MAX_INSTANCES, engines
    return engines


def _wait(
    check: Callable[[list[LoggedEvent]], bool], what: str, cluster: LocalCluster
) -> list[LoggedEvent]:
    """Poll the log (twice a second: each read is the whole log) until `check(log)`."""
    deadline = time.monotonic() + ACT_S
    while True:
        _engines(cluster)
        log = read_log(cluster)
        if check(log):
            return log
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {ACT_S:g}s waiting for {what}\n{cluster.output()}"
            )
        time.sleep(0.5)


def _actions(log: list[LoggedEvent], kind: str) -> list[tuple[ev.PoolPlanned, ev.PoolAction]]:
    return [(d, a) for d in events_of(log, ev.PoolPlanned) for a in d.actions if a.action == kind]


def _up_after(log: list[LoggedEvent], role: str, known: set[str], after: float) -> list[str]:
    return [
        e.instance_id
        for e in events_of(log, ev.InstanceUp)
        if e.role == role and e.instance_id not in known and e.time >= after
    ]


def test_the_launcher_adds_and_drains_as_the_planner_decides(elastic: LocalCluster) -> None:
    cluster = elastic
    initial = _engines(cluster)
    assert initial == {"prefill-0", "decode-0", "decode-1"}
    load = Load(cluster)
    try:
        # The add: decided by the planner, carried out by `yb up` (its line names the
        # process it started), announced by that new id. The first process started is
        # the add's, not the first to come up: the second prefill instance, started
        # seconds later, may announce itself first.
        def first_started(log: list[LoggedEvent]) -> str | None:
            """The id of the first process `yb up` started for an add, once it is up."""
            ids = ADD_STARTED.findall(cluster.output())
            ups = {e.instance_id for e in events_of(log, ev.InstanceUp)}
            return ids[0] if ids and ids[0] in ups else None

        log = _wait(
            lambda log: bool(_actions(log, "add")) and first_started(log) is not None,
            "an add and the new instance's InstanceUp",
            cluster,
        )
        decision, action = _actions(log, "add")[0]
        assert action.role == "prefill"  # the minimum of 3 asked for it
        assert decision.max_instances == MAX_INSTANCES
        new = first_started(log)
        assert new == "prefill-1"
        assert _up_after(log, "prefill", initial, decision.time).count(new) == 1
        assert "[yb] planner: add prefill -> started prefill-1 (host-0" in cluster.output()
    finally:
        clients = load.stop()

    # The drain: at the latest once the load has left the planner's window.
    def drained_ids(log: list[LoggedEvent]) -> set[str]:
        """Drained (or moved) as decided: logged draining and down, out of cluster.json,
        its process (whose pid the test saw) gone."""
        planned = {a.instance_id for _, a in _actions(log, "drain") + _actions(log, "move")}
        draining = {e.instance_id for e in events_of(log, ev.InstanceDraining)}
        down = {e.instance_id for e in events_of(log, ev.InstanceDown)}
        gone = planned & draining & down - _engines(cluster)
        return {i for i in gone if i in cluster.pids and not pid_alive(cluster.pids[i])}

    log = _wait(lambda log: bool(drained_ids(log)), "a drain carried out", cluster)
    output = cluster.output()
    for victim in drained_ids(log):
        assert victim.startswith("decode-")
        assert f"[yb] planner: {victim} drained: exited with code 0" in output

    # The pools at their targets: the third prefill instance took the freed slot.
    def at_targets(log: list[LoggedEvent]) -> bool:
        engines = _engines(cluster)
        ups = {e.instance_id for e in events_of(log, ev.InstanceUp)}
        return (
            "prefill-2" in ups
            and engines
            == {"prefill-0", "prefill-1", "prefill-2"} | (engines & {"decode-0", "decode-1"})
            and len(engines) == MAX_INSTANCES
        )

    _wait(at_targets, "3 prefill and 1 decode instances", cluster)
    assert "started prefill-2" in cluster.output()

    assert clients, "no request was sent"
    for client in clients:
        assert client.completed, client.describe()
