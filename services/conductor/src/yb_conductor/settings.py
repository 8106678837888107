"""The conductor's settings as they travel: in the log, and as `--set key=value`.

A conductor publishes its settings and cost model (`ConductorConfigured`) when it
becomes active, and the fold adopts them where they stand in the log. They travel as
JSON and are read leniently — fields this version does not know are dropped,
missing ones take defaults — because the log outlives the software that wrote it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from yb_conductor import __version__
from yb_conductor.cost_model import CostModel, CostModelError, load_cost_model
from yb_core import events as ev
from yb_core.config import ConductorConfig

_FIELDS = frozenset(f.name for f in msgspec.structs.fields(ConductorConfig))
# Settings added after logs were first recorded. Absent from an older record, they
# take the value that reproduces how that conductor decided, not today's default.
_ABSENT_MEANS: dict[str, Any] = {
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
}


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
    )


def recorded_settings(settings_json: str) -> ConductorConfig:
    """Settings as recorded (in the log or a snapshot), read leniently: unknown
    fields dropped, missing ones as the recording conductor had them."""
    try:
        raw = msgspec.json.decode(settings_json.encode())
    except msgspec.DecodeError:
        raw = {}
    known = {k: v for k, v in (raw.items() if isinstance(raw, dict) else ()) if k in _FIELDS}
    for key, value in _ABSENT_MEANS.items():
        known.setdefault(key, value)
    try:
        return msgspec.convert(known, ConductorConfig, strict=False)
    except msgspec.ValidationError:
        return ConductorConfig(**_ABSENT_MEANS)


def from_event(
    event: ev.ConductorConfigured, fallback_cost: CostModel | None = None
) -> tuple[ConductorConfig, CostModel]:
    """The settings and cost model an event recorded (lenient; see module doc)."""
    cfg = recorded_settings(event.settings_json)
    cost = fallback_cost
    if event.cost_model_json:
        try:
            cost = msgspec.json.decode(event.cost_model_json.encode(), type=CostModel)
        except (msgspec.DecodeError, msgspec.ValidationError):
            cost = fallback_cost
    if cost is None:
        try:
            cost = load_cost_model(cfg.cost_model)
        except CostModelError:
            cost = load_cost_model("")
    return cfg, cost
