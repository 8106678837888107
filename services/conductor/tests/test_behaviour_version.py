"""Recorded settings and the behaviour version: a current conductor records its
version; a record without one (an old log) reads missing settings as that conductor
had them, a current one as today's defaults; a record that cannot be read is an
error naming the event, never a silent default; the state reads the one settings
object the conductor holds."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from yb_conductor import compat, snapshot
from yb_conductor.compat import BEHAVIOUR_VERSION, SWITCHES, absent_means
from yb_conductor.conductor import Conductor
from yb_conductor.cost_model import DEFAULT
from yb_conductor.replay import LogRecord, replay
from yb_conductor.settings import (
    RecordedSettingsError,
    configured_event,
    from_event,
    recorded_settings,
)
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig

# What a record made before behaviour versions means by each setting it lacks: how
# the conductors that wrote such logs decided. Spelled out here, not read from
# `compat`, so that a change to an old value (which would break old logs) fails.
BEFORE_VERSIONS: dict[str, Any] = {
    "learn_speed": False,
    "priority_order": False,
    "prefix_stickiness": 0.0,
    "calibrated_admission": False,
    "eviction_regret": False,
    "explain_decode_top_k": 0,
    "admit_unqueued_overrun": False,
    "kv_reserved_at_start": False,
    "prefix_load_overlap": False,
    "learn_from_cut_short": True,
    "pending_prefixes": False,
    "decode_now_floor": False,
    "retention": False,
    "decode_kv_peak": False,
    "pending_by_priority": False,
    "batch_preemption": False,
    "planner_rate_sigmas": 0.0,
    "planner_balanced_share": False,
    "planner_decode_trend": False,
    "retention_by_class": False,
}


def _configured(settings_json: str, **fields: Any) -> ev.ConductorConfigured:
    return ev.ConductorConfigured(
        time=12.5, instance_id="conductor-7", settings_json=settings_json, **fields
    )


def test_a_current_conductor_records_its_behaviour_version(crafted: Any) -> None:
    event = configured_event(ConductorConfig(), DEFAULT, "c")
    assert event.behaviour_version == BEHAVIOUR_VERSION >= 1
    decoded = ev.decode_event(ev.encode_event(event))
    assert isinstance(decoded, ev.ConductorConfigured)
    assert decoded.behaviour_version == BEHAVIOUR_VERSION
    # So does its snapshot, and the version round-trips through bytes.
    taken = snapshot.decode(snapshot.encode(snapshot.take(crafted().c)))
    assert taken.behaviour_version == BEHAVIOUR_VERSION


def test_a_record_without_a_version_decodes_as_version_0() -> None:
    # An event as an older conductor encoded it: no field at all.
    raw = msgspec.json.encode(
        {"type": "conductor_configured", "instance_id": "c", "settings_json": "{}"}
    )
    event = msgspec.json.decode(raw, type=ev.AnyEvent)
    assert isinstance(event, ev.ConductorConfigured)
    assert event.behaviour_version == compat.UNVERSIONED == 0


def test_every_switch_is_a_setting_and_old_logs_keep_their_values() -> None:
    fields = {f.name: f for f in msgspec.structs.fields(ConductorConfig)}
    assert absent_means(0) == BEFORE_VERSIONS
    # Version 1 logs: engines never paused a batch line, and no pending prefix
    # counted while a lower priority was placed.
    planner_v2 = {
        "planner_rate_sigmas": 0.0,
        "planner_balanced_share": False,
        "planner_decode_trend": False,
    }
    retention_v3 = {"retention_by_class": False}
    assert absent_means(1) == {
        "pending_by_priority": False,
        "batch_preemption": False,
        **planner_v2,
        **retention_v3,
    }
    # Version 2 logs: the planner sized with a fixed utilisation, shared the budget
    # in proportion, and held the decode pool's occupancy of the moment.
    assert absent_means(2) == {**planner_v2, **retention_v3}
    # Version 3 logs: retention predicted without a block's class.
    assert absent_means(3) == retention_v3
    assert absent_means(4) == {}
    for switch in SWITCHES:
        assert switch.name in fields, switch.name
        assert type(switch.old) is type(fields[switch.name].default), switch.name
        assert 1 <= switch.retired_at <= BEHAVIOUR_VERSION, switch.name
        assert switch.keeps, switch.name
    assert len({s.name for s in SWITCHES}) == len(SWITCHES)


def test_a_version_0_record_fills_the_old_values() -> None:
    cfg = recorded_settings('{"policy": "mooncake"}', 0)
    for name, old in BEFORE_VERSIONS.items():
        assert getattr(cfg, name) == old, name
    # What the record does carry is taken as recorded.
    assert recorded_settings('{"learn_speed": true}', 0).learn_speed is True
    # The fold adopts the same when it meets such a record.
    conductor = Conductor()
    conductor.apply(1, _configured('{"admission": "early"}'))
    assert conductor.cfg.admission == "early"
    assert conductor.state.cfg is conductor.cfg
    assert not conductor.state.cfg.learn_speed and not conductor.state.cfg.priority_order


def test_a_current_record_missing_a_setting_takes_todays_default() -> None:
    assert recorded_settings("{}", BEHAVIOUR_VERSION) == ConductorConfig()
    cfg, _ = from_event(_configured('{"seed": 3}', behaviour_version=BEHAVIOUR_VERSION))
    assert cfg == ConductorConfig(seed=3)
    # A switch reads its old value only below the version that retired it.
    for switch in SWITCHES:
        before = recorded_settings("{}", switch.retired_at - 1)
        at = recorded_settings("{}", switch.retired_at)
        assert getattr(before, switch.name) == switch.old
        assert getattr(at, switch.name) == getattr(ConductorConfig(), switch.name)


def test_settings_a_newer_conductor_knows_are_dropped() -> None:
    # Forward compatibility: a field this version does not know is no corruption.
    newer = '{"admission": "early", "a_setting_from_the_future": 1}'
    cfg = recorded_settings(newer, BEHAVIOUR_VERSION + 1)
    assert cfg == ConductorConfig(admission="early")


@pytest.mark.parametrize(
    ("settings_json", "cost_model_json", "problem"),
    [
        ("not json", "", "settings are not JSON"),
        ("[1, 2]", "", "settings are a JSON list, not an object"),
        ('{"learn_speed": "maybe"}', "", "unreadable setting"),
        ('{"admission": "sometimes"}', "", "unreadable setting"),
        ('{"prefix_stickiness": -1}', "", "unreadable setting"),
        ("{}", "{not a cost model", "unreadable cost model"),
        ("{}", '{"kv_bytes_per_token": "many"}', "unreadable cost model"),
        ('{"cost_model": "/no/such/profile.json"}', "", "not a file"),
    ],
)
def test_unreadable_recorded_settings_are_an_error_naming_the_event(
    settings_json: str, cost_model_json: str, problem: str
) -> None:
    event = _configured(settings_json, cost_model_json=cost_model_json)
    with pytest.raises(RecordedSettingsError) as err:
        from_event(event, seq=41)
    message = str(err.value)
    assert "ConductorConfigured at stream sequence 41" in message
    assert "'conductor-7'" in message and "time 12.500" in message
    assert problem in message
    # The fold stops there, and so does a replay: no decision under other settings.
    records = [LogRecord(seq=41, event=event)]
    with pytest.raises(RecordedSettingsError, match="stream sequence 41"):
        replay(records)


def test_a_snapshot_with_unreadable_settings_is_unusable(crafted: Any) -> None:
    snap = snapshot.take(crafted().c)
    broken = msgspec.structs.replace(snap, settings_json='{"seed": "x"}')
    with pytest.raises(snapshot.SnapshotError, match="snapshot at stream sequence"):
        snapshot.restore(broken)
    broken = msgspec.structs.replace(snap, cost_model_json="")
    with pytest.raises(snapshot.SnapshotError, match="unreadable cost model"):
        snapshot.restore(broken)


def test_the_state_reads_the_one_settings_object(crafted: Any) -> None:
    assert ClusterState().cfg == ConductorConfig()
    c = crafted(decode_time_alpha=0.0)
    c.hosts(1)
    conductor: Conductor = c.c
    assert conductor.state.cfg is conductor.cfg
    learned = conductor.state.learned
    before = learned.output_tokens
    c.admit("a")
    c.finish("a", "d-0", output_tokens=7)
    assert learned.output_tokens == before  # weight 0: completions teach nothing
    # A reconfiguration swaps the object the state reads: now one completion is all.
    eager = msgspec.structs.replace(conductor.cfg, decode_time_alpha=1.0)
    conductor.configure(eager, DEFAULT)
    assert conductor.state.cfg is eager is conductor.cfg
    c.admit("b")
    c.finish("b", "d-0", output_tokens=42)
    assert learned.output_tokens == 42
