"""`yb up --elastic`: the actuator's bookkeeping, its refusals, and its two helpers.

The bookkeeping (`PoolBook`) is driven by hand: ids are never reused, the cap is never
passed, a move starts its instance only once the drained process is gone, an action
is applied once, an add made before the cluster's own engines were up takes one of
them. The supervisor's `add`/`release` run real processes (`sleep`); the watcher
follows a real nats-server. The whole launcher acting on a real planner is
tests/test_elastic_cluster.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.config import NatsConfig
from yb_tools.cli.cluster_watch import (
    Announced,
    ClusterWatcher,
    PlannedAction,
    PoolLogItem,
    WentDown,
)
from yb_tools.cli.elastic import (
    Claimed,
    DrainEngine,
    PoolBook,
    Skipped,
    StartEngine,
    Step,
    Waiting,
    engine_host,
    refusal,
)
from yb_tools.cli.launcher import Topology
from yb_tools.cli.supervision import Supervisor

WAIT_S = 30.0


def _add(role: ev.PoolRole, at: float, index: int = 0) -> PlannedAction:
    return PlannedAction(at, index, ev.PoolAction(action="add", role=role))


def _drain(instance_id: str, at: float, index: int = 0) -> PlannedAction:
    role: ev.PoolRole = "prefill" if instance_id.startswith("prefill") else "decode"
    return PlannedAction(
        at, index, ev.PoolAction(action="drain", role=role, instance_id=instance_id)
    )


def _move(instance_id: str, to: ev.PoolRole, at: float, index: int = 0) -> PlannedAction:
    return PlannedAction(at, index, ev.PoolAction(action="move", role=to, instance_id=instance_id))


def _book(max_instances: int = 3, engines: Mapping[str, ev.PoolRole] | None = None) -> PoolBook:
    """A book whose engines (by default prefill-0 and decode-0) have all announced
    themselves."""
    book = PoolBook(max_instances, engines or {"prefill-0": "prefill", "decode-0": "decode"})
    for instance_id, role in list(book.engines.items()):
        book.announced(Announced(instance_id, role))
    return book


def _came_up(book: PoolBook, instance_id: str) -> list[Step]:
    """The log says `instance_id` (one of the book's engines) came up."""
    return book.announced(Announced(instance_id, book.engines[instance_id]))


def test_added_instances_get_ids_never_used_before() -> None:
    book = _book(4, {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"})
    assert book.apply(_add("decode", 1.0)) == [StartEngine("decode", "decode-1", 1, "add")]
    _came_up(book, "decode-1")
    assert book.apply(_drain("decode-1", 2.0)) == [DrainEngine("decode-1")]
    assert book.gone("decode-1") == []
    # decode-1 is gone: the next decode is decode-2, and prefill counts on from 2.
    assert book.apply(_add("decode", 3.0)) == [StartEngine("decode", "decode-2", 2, "add")]
    assert sorted(book.engines) == ["decode-0", "decode-2", "prefill-0", "prefill-1"]
    book.apply(_drain("prefill-1", 4.0))
    book.gone("prefill-1")
    assert book.apply(_add("prefill", 5.0)) == [StartEngine("prefill", "prefill-2", 2, "add")]


def test_ids_the_log_named_are_never_used_again() -> None:
    """A launcher started again on a log that names instances of an earlier run (or
    of a run before a restart): new ids count on past them, even those gone."""
    book = _book(4)
    book.announced(Announced("prefill-6", "prefill"))
    book.went_down(WentDown("prefill-6"))
    book.went_down(WentDown("decode-3"))  # down before this book was made
    book.announced(Announced("other-9", "decode"))  # not `<role>-<k>`: no effect
    assert book.apply(_add("prefill", 1.0)) == [StartEngine("prefill", "prefill-7", 7, "add")]
    assert book.apply(_add("decode", 1.0, index=1)) == [StartEngine("decode", "decode-4", 4, "add")]


def test_missed_actions_are_counted_then_carried_out_at_catch_up() -> None:
    """What an actuator that was down reads from the log's history: nothing is done
    until the history is read; then what the planner still counts on."""
    # Docker runs these now; decode-0 ran, and was drained and removed.
    book = PoolBook(4, {"prefill-0": "prefill", "prefill-1": "prefill", "decode-1": "decode"})
    for instance_id, role in [("prefill-0", "prefill"), ("decode-0", "decode")]:
        book.announced(Announced(instance_id, role))
    book.announced(Announced("decode-1", "decode"))
    book.missed(_add("prefill", 10.0))  # filled: prefill-1 came up after it
    book.announced(Announced("prefill-1", "prefill"))
    book.missed(_drain("decode-0", 11.0))  # carried out: decode-0 went down
    book.went_down(WentDown("decode-0"))
    book.missed(_move("decode-1", "prefill", 12.0))  # never carried out
    book.missed(_add("decode", 13.0))  # never carried out
    book.missed(_add("decode", 13.0))  # read again: counted once
    assert book.catch_up(now=20.0) == [
        DrainEngine("decode-1", "prefill"),
        StartEngine("decode", "decode-2", 2, "catch-up start"),
    ]
    # The move's instance starts once its drain is over, and nothing more.
    assert book.gone("decode-1") == [StartEngine("prefill", "prefill-2", 2, "move decode-1")]
    assert book.catch_up(now=21.0) == []


def test_a_missed_start_the_planner_forgot_is_not_carried_out() -> None:
    book = _book(4)
    book.missed(_add("decode", 10.0))
    book.missed(_drain("decode-7", 10.0))  # no engine of the book
    assert book.catch_up(now=10.0 + book.start_timeout_s + 1.0) == []


def test_a_start_a_move_will_make_is_not_waited_for_twice() -> None:
    """At the cap, a move and an add of one role: when an instance of that role is
    on its way from elsewhere (restarting), it fills one start, and the move's is
    the one left: the add's wait ends."""
    book = _book(3, {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"})
    assert book.apply(_move("prefill-1", "decode", 1.0)) == [DrainEngine("prefill-1", "decode")]
    (waiting,) = book.apply(_add("decode", 2.0))
    assert isinstance(waiting, Waiting)
    (skipped,) = book.went_down(WentDown("decode-0"))
    assert isinstance(skipped, Skipped) and "no longer waiting" in skipped.reason
    assert book.announced(Announced("decode-0", "decode")) == []
    assert book.gone("prefill-1") == [StartEngine("decode", "decode-1", 1, "move prefill-1")]


def test_a_start_claimed_by_an_engine_that_is_gone_is_made() -> None:
    """An add claimed by an engine on its way (down, being restarted) that never
    comes back (given up on, its container removed): the start is made then."""
    book = _book(3)
    book.went_down(WentDown("decode-0"))
    (claimed,) = book.apply(_add("decode", 1.0))
    assert claimed == Claimed("decode", ("decode-0",), "add")
    assert book.gone("decode-0", refill=True) == [
        StartEngine("decode", "decode-1", 1, "add (decode-0 gone)")
    ]
    # One that is up and goes fills nothing: no start the planner does not expect.
    assert book.gone("prefill-0", refill=True) == []
    # Without `refill` (a process given up on, a start that failed) the start waits
    # for the planner to ask again.
    book = _book(3)
    book.went_down(WentDown("decode-0"))
    book.apply(_add("decode", 1.0))
    assert book.gone("decode-0") == []


def test_an_action_is_applied_once() -> None:
    book = _book()
    first = _add("decode", 7.5, index=0)
    assert book.apply(first) == [StartEngine("decode", "decode-1", 1, "add")]
    assert book.apply(first) == []  # read again (a reconnect, a failover): nothing
    assert book.apply(PlannedAction(7.5, 0, first.action)) == []
    # Another action of the same decision is another action.
    assert book.apply(_drain("decode-1", 7.5, index=1)) == [DrainEngine("decode-1")]
    assert book.apply(_drain("decode-1", 7.5, index=1)) == []


def test_the_cap_is_never_passed_a_start_waits_for_room() -> None:
    book = _book(max_instances=3)
    assert book.apply(_add("prefill", 1.0)) == [StartEngine("prefill", "prefill-1", 1, "add")]
    # Three processes run: the next add waits for room, whatever the planner believes.
    assert book.apply(_add("decode", 2.0)) == [Waiting("decode", "add")]
    assert len(book.engines) == 3
    _came_up(book, "prefill-1")  # fills the prefill add, not the decode one
    assert list(book.waiting) == [Waiting("decode", "add")]
    # A drain frees no room until its process has exited.
    assert book.apply(_drain("prefill-1", 3.0)) == [DrainEngine("prefill-1")]
    assert len(book.engines) == 3
    assert book.gone("prefill-1") == [StartEngine("decode", "decode-1", 1, "add")]
    assert len(book.engines) == 3 and not book.waiting
    # An instance given up on (no process left) frees its slot too.
    assert book.gone("decode-0") == []
    assert book.apply(_add("prefill", 5.0)) == [StartEngine("prefill", "prefill-2", 2, "add")]
    assert len(book.engines) == 3


def test_a_wait_ends_when_an_instance_fills_it_or_the_planner_forgets_it() -> None:
    book = _book(max_instances=2)
    assert book.apply(_add("decode", 1.0)) == [Waiting("decode", "add")]
    # decode-0 crashed and is being restarted: on its way, it will fill the add (the
    # planner counts its return against it), so the wait is over.
    assert book.went_down(WentDown("decode-0")) == [
        Skipped("add decode: no longer waiting: an instance up or on its way fills it")
    ]
    assert _came_up(book, "decode-0") == []
    assert not book.waiting and not book.expected
    # The planner forgets a start after `planner_start_timeout_s`; so does the book.
    assert book.apply(_add("decode", 2.0)) == [Waiting("decode", "add")]
    assert book.apply(_drain("prefill-0", 2.0 + 601.0)) == [
        Skipped("add decode: no longer waiting: an instance up or on its way fills it"),
        DrainEngine("prefill-0"),
    ]
    assert book.gone("prefill-0") == []  # nothing waits any more


def test_a_start_decided_before_an_engine_was_up_is_filled_by_that_engine() -> None:
    # The cluster starts prefill-0, prefill-1 and decode-0; the planner decides before
    # prefill-1 and decode-0 announced themselves, so it does not count them.
    book = PoolBook(5, {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"})
    _came_up(book, "prefill-0")
    assert book.apply(_add("prefill", 1.0, 0)) == [Claimed("prefill", ("prefill-1",), "add")]
    assert book.apply(_add("prefill", 1.0, 1)) == [StartEngine("prefill", "prefill-2", 2, "add")]
    _came_up(book, "decode-0")
    # decode-0 was up before this decision: the planner counted it, this is a new one.
    assert book.apply(_add("decode", 2.0)) == [StartEngine("decode", "decode-1", 1, "add")]
    assert len(book.engines) == 5
    # A crashed engine being restarted is on its way too.
    _came_up(book, "prefill-1")
    _came_up(book, "prefill-2")
    book.went_down(WentDown("prefill-1"))
    assert book.apply(_add("prefill", 3.0)) == [Claimed("prefill", ("prefill-1",), "add")]


def test_a_move_drains_then_starts_in_the_other_role_once_the_process_exited() -> None:
    book = _book(2)
    assert book.apply(_move("decode-0", "prefill", 1.0)) == [DrainEngine("decode-0", "prefill")]
    assert book.engines == {"prefill-0": "prefill", "decode-0": "decode"}  # still there
    # An add meanwhile finds no room: the move's slot is the move's.
    assert book.apply(_add("decode", 2.0)) == [Waiting("decode", "add")]
    assert book.gone("decode-0") == [StartEngine("prefill", "prefill-1", 1, "move decode-0")]
    assert book.engines == {"prefill-0": "prefill", "prefill-1": "prefill"}
    assert list(book.waiting) == [Waiting("decode", "add")]


def test_drains_of_unknown_or_draining_instances_are_skipped() -> None:
    book = _book()
    assert book.apply(_drain("decode-7", 1.0)) == [
        Skipped("drain decode-7: not an engine this actuator runs; skipped")
    ]
    assert book.apply(_drain("decode-0", 2.0)) == [DrainEngine("decode-0")]
    assert book.apply(_move("decode-0", "prefill", 3.0)) == [
        Skipped("move decode-0: draining already; skipped")
    ]
    assert book.gone("decode-0") == []  # a drain, not a move: nothing starts
    assert book.gone("decode-0") == []  # and only once
    with pytest.raises(ValueError):
        PoolBook(1, {"prefill-0": "prefill", "decode-0": "decode"})


def test_added_instances_go_where_the_topology_puts_them() -> None:
    topology = Topology(prefill=1, decode=1, kvstore=2)
    # A prefill beside a kvstore: host-(k mod kvstores).
    assert [engine_host(topology, "prefill", k) for k in range(4)] == [
        "host-0",
        "host-1",
        "host-0",
        "host-1",
    ]
    assert [engine_host(topology, "decode", k) for k in range(3)] == ["host-0", "host-1", "host-0"]
    assert engine_host(Topology(prefill=1, decode=1, kvstore=0), "prefill", 3) == "host-0"


def test_bad_combinations_are_refused() -> None:
    ok = {"engines": 2, "prefill_groups": (), "gpus": None}
    assert refusal(elastic=False, max_instances=None, **ok) is None
    assert refusal(elastic=True, max_instances=3, **ok) is None
    assert refusal(elastic=True, max_instances=None, **ok) == (
        "--elastic needs --max-instances N (the most engine instances at once)"
    )
    assert refusal(elastic=False, max_instances=3, **ok) == "--max-instances needs --elastic"
    assert refusal(elastic=True, max_instances=2, **{**ok, "engines": 3}) == (
        "--max-instances 2 is below the 3 engine instances it starts with (--prefill + --decode)"
    )
    assert refusal(elastic=True, max_instances=1, **{**ok, "engines": 1}) == (
        "--max-instances 1: at least 2 (a prefill and a decode)"
    )
    assert refusal(elastic=True, max_instances=4, **{**ok, "prefill_groups": (2,)}) == (
        "--prefill-groups is not supported with --elastic yet"
    )
    assert refusal(elastic=True, max_instances=4, **{**ok, "gpus": [0]}) == (
        "--gpus is not supported with --elastic yet"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--elastic"], "--elastic needs --max-instances"),
        (["--max-instances", "4"], "--max-instances needs --elastic"),
        (["--elastic", "--max-instances", "2"], "below the 3 engine instances"),
        (["--elastic", "--max-instances", "1", "--prefill", "1", "--decode", "0"], "at least 2"),
        (["--elastic", "--max-instances", "6", "--prefill-groups", "2"], "--prefill-groups is"),
        (["--elastic", "--max-instances", "6", "--gpus", "0"], "--gpus is not supported"),
    ],
)
def test_yb_up_refuses_them_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    from yb_tools.cli import main

    assert main(["up", "--data-dir", str(tmp_path), *args]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "nats").exists()


@dataclass
class _Sleeper:
    """A real process (`sleep`) as a supervisor's member."""

    name: str
    logs: Path
    role: str = "decode"
    log_offset: int = 0
    spawned: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}.log"

    def exit_code(self) -> int | None:
        return self.spawned[-1].poll()

    def respawn(self) -> int:
        self.spawned.append(subprocess.Popen(["sleep", "60"]))
        return self.spawned[-1].pid

    def end(self) -> None:
        self.spawned[-1].terminate()
        self.spawned[-1].wait(timeout=30)

    def stop(self) -> None:
        for proc in self.spawned:
            proc.kill()
            proc.wait(timeout=30)


def test_the_supervisor_restarts_an_added_member_and_leaves_a_released_one(
    tmp_path: Path,
) -> None:
    now = [0.0]
    said: list[str] = []
    kept, added = _Sleeper("decode-0", tmp_path), _Sleeper("decode-1", tmp_path)
    try:
        kept.respawn()
        supervisor = Supervisor(
            [kept], "restart", announced=lambda name: True, say=said.append, clock=lambda: now[0]
        )
        added.respawn()
        supervisor.add(added)
        assert supervisor.tick(ready=True) is None
        # An added member is supervised like any: its exit is restarted.
        added.end()
        assert supervisor.tick(ready=True) is None
        assert said[-1] == "restarting decode-1 in 1s (restart 1)"
        now[0] += 1.0
        supervisor.tick(ready=True)
        assert supervisor.restarts() == {"decode-1": 1}
        assert len(added.spawned) == 2
        # Released (to be drained), its exit is nobody's business: no report, no restart.
        assert supervisor.release("decode-1") is added
        assert supervisor.release("decode-1") is None
        said.clear()
        added.end()
        now[0] += 60.0
        assert supervisor.tick(ready=True) is None
        assert said == [] and len(added.spawned) == 2
        assert supervisor.restarts() == {}
    finally:
        kept.stop()
        added.stop()


def _planned(at: float, *actions: ev.PoolAction) -> ev.PoolPlanned:
    return ev.PoolPlanned(
        time=at, planner_id="conductor-0", forecast=ev.PoolForecast(), pools=[], actions=[*actions]
    )


def _up(instance_id: str, role: ev.Role, at: float) -> ev.InstanceUp:
    return ev.InstanceUp(instance_id=instance_id, role=role, host="host-0", time=at)


async def test_the_watcher_hands_over_the_decisions_made_since_the_launcher_started(
    nats_config: NatsConfig, tmp_path: Path
) -> None:
    since = time.time()
    watcher = ClusterWatcher(nats_config, tmp_path / "targets.json", dict, pool_log_since=since)
    # Started before the log exists (no service has created it yet).
    watcher.start()
    try:
        bus = await Bus.connect(nats_config, "test")
        try:
            await bus.ensure_stream()
            add = ev.PoolAction(action="add", role="decode")
            drain = ev.PoolAction(action="drain", role="prefill", instance_id="prefill-1")
            await bus.publish(_planned(since - 60.0, add))  # an earlier run's
            await bus.publish(_up("decode-0", "decode", since - 60.0))  # an earlier process
            await bus.publish(_up("decode-0", "decode", since + 0.5))
            await bus.publish(_up("gateway-0", "gateway", since + 0.5))  # not an engine
            await bus.publish(_planned(since + 1.0, add, drain))
            await bus.publish(_planned(since + 2.0))  # nothing to do
            await bus.publish(_up("prefill-1", "prefill", since + 3.0))
            await bus.publish(ev.InstanceDown(instance_id="decode-0", time=since + 4.0))
            got: list[PoolLogItem] = []
            deadline = time.monotonic() + WAIT_S
            while len(got) < 5 and time.monotonic() < deadline:
                got += watcher.pool_log()
                await asyncio.sleep(0.05)
        finally:
            await bus.close()
        assert got == [
            Announced("decode-0", "decode"),
            PlannedAction(since + 1.0, 0, add),
            PlannedAction(since + 1.0, 1, drain),
            Announced("prefill-1", "prefill"),
            WentDown("decode-0"),
        ]
        assert watcher.pool_log() == []
    finally:
        await asyncio.to_thread(watcher.stop)
