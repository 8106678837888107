"""Snapshots: the whole fold at one stream sequence, so a restart replays only the tail.

Like an event-sourced follower, the state is stored together with the position it
reflects (`last_seq`); a conductor restored from it reads the log from
`last_seq + 1` and ends in exactly the state a conductor that read everything has —
the property tests check that snapshot + tail == whole log, decision for decision.

Everything that decides is in the snapshot, in its order: instances, placements and
every queue (dict order is FIFO order), the block index (per slot, so slots come back
the same, with each slot's keys in the order it holds them), block trackers, what
completions taught, the decisions not yet seen in the log, the de-duplication memory,
the quality counters, the planner's windows and open actions, and the settings and
cost model in force, with the behaviour
version they were written by (read as `compat` says; a snapshot whose settings or
cost model do not read is unusable, never restored with defaults). msgpack carries it;
the index's bitmasks are not stored (they can exceed 64 bits) but rebuilt from the
per-slot key lists.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from yb_conductor.block_index import BlockIndex
from yb_conductor.compat import BEHAVIOUR_VERSION
from yb_conductor.conductor import Conductor
from yb_conductor.hotness import HotPrefixes
from yb_conductor.planner import Planner
from yb_conductor.quality import DecisionQuality
from yb_conductor.retention import Retention
from yb_conductor.settings import RecordedSettingsError, recorded_cost_model, recorded_settings
from yb_conductor.speed import InstanceSpeed, SharedSpeed
from yb_conductor.state import (
    BlockTracker,
    InstanceState,
    Learned,
    PendingAdmission,
    Placement,
)
from yb_core import events as ev

SNAPSHOT_VERSION: Final = 1


class SnapshotError(ValueError):
    """A snapshot this conductor cannot restore (corrupt, or from a newer version)."""


class Snapshot(msgspec.Struct, kw_only=True):
    """The conductor's fold at `last_seq`."""

    version: int = SNAPSHOT_VERSION
    last_seq: int
    settings_json: str
    cost_model_json: str
    now: float
    instances: list[InstanceState]
    placements: list[Placement]
    admissions: dict[str, PendingAdmission]
    index: list[tuple[str, list[int], list[int], list[int]]]
    trackers: dict[str, BlockTracker]
    resync_wanted: list[str]
    learned: Learned
    expired_placements: int
    deadlines: list[tuple[float, str]]
    next_expiry: float
    unrecorded: list[ev.Decision]
    decided: list[tuple[str, float]]
    quality: DecisionQuality
    hot: HotPrefixes = msgspec.field(default_factory=HotPrefixes)
    companions: list[
        ev.LoadPrediction | ev.ReplicationPlanned | ev.RetentionPlanned | ev.PoolPlanned
    ] = msgspec.field(default_factory=list)
    admission_info: dict[str, PendingAdmission] = msgspec.field(default_factory=dict)
    declared_dead: dict[str, str] = msgspec.field(default_factory=dict)
    cancel_wanted: dict[str, str] = msgspec.field(default_factory=dict)
    # Cancels held back for a gateway's re-plan: restored, they still wait their grace.
    cancel_not_before: dict[str, float] = msgspec.field(default_factory=dict)
    speeds: dict[str, InstanceSpeed] = msgspec.field(default_factory=dict)
    shared_speeds: dict[str, SharedSpeed] = msgspec.field(default_factory=dict)
    # Eviction regret: the evicted blocks still remembered (oldest first) and the counts.
    evicted_unheld: list[int] = msgspec.field(default_factory=list)
    evicted_blocks: int = 0
    evicted_wanted: int = 0
    retention: Retention = msgspec.field(default_factory=Retention)
    # The pools' planner: its windows and open actions, and the conductor it names.
    planner: Planner = msgspec.field(default_factory=Planner)
    planner_id: str = "conductor"
    # The behaviour version `settings_json` was written by (0: before versions).
    behaviour_version: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


class _Version(msgspec.Struct):
    version: int = SNAPSHOT_VERSION


def take(c: Conductor) -> Snapshot:
    """The conductor's state as a snapshot (shares nothing mutable with it)."""
    s = c.state
    snap = Snapshot(
        last_seq=c.last_seq,
        settings_json=msgspec.json.encode(c.cfg).decode(),
        cost_model_json=msgspec.json.encode(c.policy.cost).decode(),
        now=s.now,
        instances=list(s.instances.values()),
        placements=list(s.placements.values()),
        admissions=s.admissions,
        index=s.index.export(),
        trackers=s.block_trackers,
        resync_wanted=list(s.resync_wanted),
        learned=s.learned,
        expired_placements=s.expired_placements,
        deadlines=list(s._deadlines),
        next_expiry=s._next_expiry,
        unrecorded=list(c.unrecorded.values()),
        decided=list(c.decided.items()),
        quality=c.quality,
        hot=c.hot,
        companions=list(c.unrecorded_companions.values()),
        admission_info=c.admission_info,
        declared_dead=s.declared_dead,
        cancel_wanted=s.cancel_wanted,
        cancel_not_before=s.cancel_not_before,
        speeds=s.speeds,
        shared_speeds=s.shared_speeds,
        evicted_unheld=list(s.evicted_unheld),
        evicted_blocks=s.evicted_blocks,
        evicted_wanted=s.evicted_wanted,
        retention=c.retention,
        planner=c.planner,
        planner_id=c.planner_id,
        behaviour_version=BEHAVIOUR_VERSION,
    )
    # Round-trip through bytes: the snapshot must not alias the live state.
    return _decoder.decode(_encoder.encode(snap))


def encode(snap: Snapshot) -> bytes:
    """A snapshot as bytes (msgpack)."""
    return _encoder.encode(snap)


def decode(data: bytes) -> Snapshot:
    """Bytes back to a snapshot; `SnapshotError` if unusable."""
    try:
        version = msgspec.msgpack.decode(data, type=_Version).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"unreadable snapshot: {exc}") from exc
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {version}; this conductor reads {SNAPSHOT_VERSION}")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"unreadable snapshot: {exc}") from exc


def restore(snap: Snapshot, *, follow_recorded: bool = True) -> Conductor:
    """A conductor in exactly the state the snapshot recorded; `SnapshotError` when
    its settings or cost model cannot be read."""
    origin = f"snapshot at stream sequence {snap.last_seq}"
    try:
        cfg = recorded_settings(snap.settings_json, snap.behaviour_version, origin=origin)
        cost = recorded_cost_model(snap.cost_model_json, origin=origin)
    except RecordedSettingsError as exc:
        raise SnapshotError(str(exc)) from exc
    c = Conductor(cfg=cfg, cost=cost, follow_recorded=follow_recorded)
    s = c.state
    s.now = snap.now
    s.instances = {i.instance_id: i for i in snap.instances}
    s.placements = {p.request_id: p for p in snap.placements}
    for p in snap.placements:
        if p.pending_keys:
            s.add_pending(p)
    s.admissions = dict(snap.admissions)
    s.index = BlockIndex.restore(snap.index)
    s.block_trackers = dict(snap.trackers)
    s.resync_wanted = dict.fromkeys(snap.resync_wanted)
    s.declared_dead = dict(snap.declared_dead)
    s.cancel_wanted = dict(snap.cancel_wanted)
    s.cancel_not_before = dict(snap.cancel_not_before)
    s.learned = snap.learned
    s.speeds = dict(snap.speeds)
    s.shared_speeds = dict(snap.shared_speeds)
    s.evicted_unheld = dict.fromkeys(snap.evicted_unheld)
    s.evicted_blocks = snap.evicted_blocks
    s.evicted_wanted = snap.evicted_wanted
    s.expired_placements = snap.expired_placements
    s._deadlines = list(snap.deadlines)
    s._next_expiry = snap.next_expiry if not math.isnan(snap.next_expiry) else math.inf
    c.last_seq = snap.last_seq
    c.unrecorded = {d.request_id: d for d in snap.unrecorded}
    c.decided = dict(snap.decided)
    c.quality = snap.quality
    c.hot = snap.hot
    c.retention = snap.retention
    c.planner = snap.planner
    c.planner_id = snap.planner_id
    c.unrecorded_companions = {ev.message_id_for(o): o for o in snap.companions}
    c.admission_info = dict(snap.admission_info)
    return c
