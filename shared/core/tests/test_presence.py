"""A process that starts under the id of one that died without a goodbye says so.

A supervisor (`yb up`) restarts a dead process within a second or two, long before the
conductor's heartbeat timeout would declare it dead. The new process's first
announcement therefore ends the previous one's presence first (`InstanceDown`,
"restarted: ..."), so that everyone who follows the log re-plans what it held at once;
and only then, when the log's last word on the id is an announcement of another epoch.
Against a real nats-server.
"""

from __future__ import annotations

from yb_core import events as ev
from yb_core.bus import Bus
from yb_core.instance import PROCESS_EPOCH, Presence

WAIT_S = 30.0


def _announcement(epoch: int = 0) -> ev.InstanceUp:
    return ev.InstanceUp(instance_id="decode-0", role="decode", host="host-0", epoch=epoch)


def _report() -> ev.LoadReport:
    return ev.LoadReport(instance_id="decode-0", role="decode")


async def _previous_process(bus: Bus, epoch: int, goodbye: bool = False) -> None:
    """What an earlier process under the same id left in the log."""
    await bus.publish(_announcement(epoch))
    if goodbye:
        await bus.publish(ev.InstanceDown(instance_id="decode-0", reason="stopped"))
    # Long ago, in a real cluster: the instance stream holds it by now.
    await bus.sync_instances(WAIT_S)


async def _instance_events(bus: Bus) -> list[ev.AnyEvent]:
    """Every announcement and verdict on decode-0 in the log, in order."""
    reader = await bus.read_ordered("yb.ev.instance.*.decode-0")
    try:
        last = await bus.last_sequence()
        events: list[ev.AnyEvent] = []
        while (item := await reader.next(timeout_s=WAIT_S)) is not None:
            events.append(item.event)
            if item.seq >= last:
                break
        return events
    finally:
        await reader.close()


def _summary(events: list[ev.AnyEvent]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for event in events:
        match event:
            case ev.InstanceUp():
                out.append(("up", event.epoch))
            case ev.InstanceDown():
                out.append(("down", event.reason))
    return out


async def test_a_restart_ends_the_previous_process_before_announcing(bus: Bus) -> None:
    await _previous_process(bus, epoch=1)
    await Presence(bus, _announcement(epoch=2), _report, 1.0).announce()
    summary = _summary(await _instance_events(bus))
    assert summary == [
        ("up", 1),
        ("down", "restarted: the previous process (epoch 1) ended without a goodbye"),
        ("up", 2),
    ]


async def test_nothing_is_said_after_a_goodbye_or_a_verdict(bus: Bus) -> None:
    await _previous_process(bus, epoch=1, goodbye=True)
    await Presence(bus, _announcement(epoch=2), _report, 1.0).announce()
    assert _summary(await _instance_events(bus)) == [("up", 1), ("down", "stopped"), ("up", 2)]


async def test_a_first_start_or_the_same_process_says_nothing(bus: Bus) -> None:
    presence = Presence(bus, _announcement(), _report, 1.0)
    assert presence.announcement.epoch == PROCESS_EPOCH  # an epoch of this process
    await presence.announce()
    await bus.sync_instances(WAIT_S)
    # The same process announcing itself again on another connection (a gateway
    # that reconnected builds a new presence): not a restart.
    await Presence(bus, _announcement(), _report, 1.0).announce()
    await presence.announce()
    assert _summary(await _instance_events(bus)) == [("up", PROCESS_EPOCH)] * 3
