"""The conductor's settings as they travel: in the log, and as `--set key=value`.

A conductor publishes its settings and cost model (`ConductorConfigured`) when it
becomes active, and the fold adopts them where they stand in the log. They travel as
JSON, with the behaviour version the conductor decided by (`compat`), because the
log outlives the software that wrote it: fields this version does not know (a newer
writer's) are dropped, and a missing field takes the value that reproduces the
recording conductor (`compat.absent_means`) or else its default. A record that is
not JSON, or whose values do not convert, is an error (`RecordedSettingsError`): a
conductor deciding with other settings than recorded would not replay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from yb_conductor import __version__
from yb_conductor.compat import BEHAVIOUR_VERSION, absent_means
from yb_conductor.cost_model import CostModel, CostModelError, load_cost_model
from yb_core import events as ev
from yb_core.config import ConductorConfig

_FIELDS = frozenset(f.name for f in msgspec.structs.fields(ConductorConfig))


class SettingsError(ValueError):
    """A `--set` that names no setting or does not convert."""


def with_overrides(cfg: ConductorConfig, overrides: Mapping[str, Any]) -> ConductorConfig:
    """`cfg` with some fields replaced; string values are converted ("0.5", "false")."""
    if not overrides:
        return cfg
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        known = ", ".join(sorted(_FIELDS))
        raise SettingsError(f"unknown conductor setting(s) {', '.join(unknown)}; known: {known}")
    raw = msgspec.to_builtins(cfg)
    for key, value in overrides.items():
        raw[key] = _parse_value(value)
    try:
        return msgspec.convert(raw, ConductorConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"invalid setting: {exc}") from exc


def _parse_value(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    lowered = value.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    return value


def parse_assignments(items: list[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` -> `{"a": "1", "b": "x"}`."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--set wants key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


class RecordedSettingsError(ValueError):
    """Settings or a cost model recorded in the log (or a snapshot) that cannot be
    read: not JSON, or a value that does not convert. The message names the record
    (`origin`) and the problem."""


def configured_event(
    cfg: ConductorConfig, cost: CostModel, instance_id: str, time: float = 0.0
) -> ev.ConductorConfigured:
    """The event that records these settings in the log."""
    return ev.ConductorConfigured(
        time=time,
        instance_id=instance_id,
        settings_json=msgspec.json.encode(cfg).decode(),
        cost_model_json=msgspec.json.encode(cost).decode(),
        software=f"yuebing-conductor {__version__}",
        behaviour_version=BEHAVIOUR_VERSION,
    )


def describe_record(event: ev.ConductorConfigured, seq: int = 0) -> str:
    """Where a `ConductorConfigured` stands, for error messages."""
    where = f"at stream sequence {seq} " if seq else ""
    return (
        f"ConductorConfigured {where}(conductor {event.instance_id!r}, "
        f"time {event.time:.3f}, behaviour version {event.behaviour_version})"
    )


def recorded_settings(
    settings_json: str, behaviour_version: int = 0, *, origin: str = "recorded settings"
) -> ConductorConfig:
    """Settings as recorded (in the log or a snapshot) by a conductor of behaviour
    version `behaviour_version`: unknown fields dropped (written by newer software),
    a missing one as that conductor had it (`compat.absent_means`), else its default.
    `RecordedSettingsError`, naming `origin`, when the text is not a JSON object or
    a value does not convert."""
    try:
        raw = msgspec.json.decode(settings_json.encode())
    except msgspec.DecodeError as exc:
        raise RecordedSettingsError(f"{origin}: settings are not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise RecordedSettingsError(f"{origin}: settings are a JSON {kind}, not an object")
    known = {k: v for k, v in raw.items() if k in _FIELDS}
    for key, value in absent_means(behaviour_version).items():
        known.setdefault(key, value)
    try:
        return msgspec.convert(known, ConductorConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise RecordedSettingsError(f"{origin}: unreadable setting: {exc}") from exc


def recorded_cost_model(cost_model_json: str, *, origin: str) -> CostModel:
    """A cost model as recorded; `RecordedSettingsError`, naming `origin`, when it is
    not JSON or does not convert."""
    try:
        return msgspec.json.decode(cost_model_json.encode(), type=CostModel)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordedSettingsError(f"{origin}: unreadable cost model: {exc}") from exc


def from_event(
    event: ev.ConductorConfigured, fallback_cost: CostModel | None = None, *, seq: int = 0
) -> tuple[ConductorConfig, CostModel]:
    """The settings and cost model an event recorded (see the module docstring).

    An event without a cost model (written before they were recorded) prices with
    `fallback_cost`, else with the model its settings name. `RecordedSettingsError`,
    naming the event (at stream sequence `seq`), when either cannot be read, or the
    named model is not readable here.
    """
    origin = describe_record(event, seq)
    cfg = recorded_settings(event.settings_json, event.behaviour_version, origin=origin)
    if event.cost_model_json:
        return cfg, recorded_cost_model(event.cost_model_json, origin=origin)
    if fallback_cost is not None:
        return cfg, fallback_cost
    try:
        return cfg, load_cost_model(cfg.cost_model)
    except CostModelError as exc:
        raise RecordedSettingsError(f"{origin}: {exc}") from exc
