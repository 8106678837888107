"""Failpoints: named places in the engines where a test can park a request.

Fault tests must break something while a request is provably in flight, whatever the
machine's speed (the way TiKV's fail-rs and FoundationDB inject faults). A failpoint
is a named place on a request's path; the configuration arms some of them with an
action, and a request that reaches an armed point performs it. The only action is
`hold`: the request is parked there, asynchronously (the event loop, heartbeats and
other requests go on), until the test releases it, the request is cancelled, or the
hold's own deadline passes (then it proceeds and logs `failpoint_hold_timed_out`).

Configuration: one variable, `YB_FAILPOINTS` (the top-level `failpoints` field of
`YbConfig`), entries separated by `;`::

    YB_FAILPOINTS="gate=/tmp/gates;timeout=120;decode.token=hold(20);prefill.chunk=once:hold(1)"

- `gate=DIR` (required when a point is armed): the directory through which a test
  and the services talk (created if missing).
- `timeout=SECONDS` (default 120): how long one hold waits at most.
- `POINT=hold(N)`: every request that reaches `POINT` holds there.
- `POINT=once:hold(N)`: a request holds only if it claims an arm file,
  `GATE/POINT.arm`, which the test creates; the claim is an atomic rename, so one arm
  file parks exactly one request even when several instances share the gate. This is
  the mode for a cluster shared by several scenarios: nothing else is ever held.
- `POINT=off`: the point is named but not armed.

Parsing is strict: an unknown point, action, option or a bad count is a
`FailpointError` when the configuration is loaded (`YbConfig` validates it), never
ignored. Unset, `Failpoints.count(point)` is a dict lookup that answers None, so the
services pay nothing on their hot paths.

The points (`POINTS`), with what `N` counts:

- `decode.token` (N >= 1): decode, right after it published a request's Nth
  generated token (the first token, sampled by prefill, counts). The request keeps
  its KV pages and its place in the batch; only it stops stepping.
- `decode.prompt` (no N): decode with `piggyback`, once a piggybacked prompt's prefix
  is loaded and the prompt is in the batch, before any chunk of it is computed. It
  keeps its pages; the rest of the batch goes on stepping.
- `prefill.load` (no N): prefill, once decode has reserved the request's pages and
  before it loads the prefix the decision planned to reuse (the plan is fixed:
  break a kvstore it names, then release).
- `prefill.chunk` (N >= 0): prefill, before it computes chunk N of the uncached
  prompt (N chunks are computed and streamed; the decode reservation is held). A
  prompt with N or fewer chunks never reaches it.
- `prefill.commit` (no N): prefill, after the whole prompt is computed and before it
  waits for the last KV pages to be sent and commits the transfer to decode.

How a test sees and steers a hold, in `GATE`:

- `POINT.<request>.reached` is written when the request parks (JSON: point,
  request_id, instance_id, count). Request ids are file-name safe (other characters
  become `_`).
- creating `POINT.<request>.release` releases that request;
- creating `POINT.release` releases every hold at that point, current and later ones
  (the point acts as unarmed while it exists).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from yb_core.telemetry import get_logger

log = get_logger(__name__)

#: Every failpoint: its name -> (whether `hold` takes a count, the least count).
POINTS: dict[str, tuple[bool, int]] = {
    "decode.token": (True, 1),
    "decode.prompt": (False, 0),
    "prefill.load": (False, 0),
    "prefill.chunk": (True, 0),
    "prefill.commit": (False, 0),
}

DEFAULT_TIMEOUT_S = 120.0
#: How often a hold looks at its gate (a stat per poll; holds are rare).
POLL_S = 0.02

HoldOutcome = Literal["released", "cancelled", "timed_out", "not_held"]

_HOLD = re.compile(r"^(once:)?hold(?:\((\d+)\))?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class FailpointError(ValueError):
    """A failpoint configuration that does not parse; the message says what and where."""


@dataclass(frozen=True, slots=True)
class Hold:
    """An armed `hold` at one point: `count` (see `POINTS`), and whether it waits for
    an arm file (`once`)."""

    point: str
    count: int
    once: bool


@dataclass(frozen=True, slots=True)
class FailpointSpec:
    """A parsed `YB_FAILPOINTS`: the armed holds, the gate directory, the deadline."""

    holds: dict[str, Hold]
    gate: Path | None
    timeout_s: float


def parse(text: str) -> FailpointSpec:
    """Parse a `YB_FAILPOINTS` value; raises `FailpointError` on anything unknown."""
    holds: dict[str, Hold] = {}
    gate: Path | None = None
    timeout_s = DEFAULT_TIMEOUT_S
    seen: set[str] = set()
    for raw in text.split(";"):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, value = (s.strip() for s in entry.partition("="))
        if not sep or not key or not value:
            raise FailpointError(f"failpoints: {entry!r} is not NAME=VALUE")
        if key in seen:
            raise FailpointError(f"failpoints: {key!r} is given twice")
        seen.add(key)
        if key == "gate":
            gate = Path(value).expanduser()
        elif key == "timeout":
            try:
                timeout_s = float(value)
            except ValueError:
                raise FailpointError(f"failpoints: timeout={value!r} is not a number") from None
            if not 0 < timeout_s < float("inf"):
                raise FailpointError(f"failpoints: timeout={value!r} must be positive")
        elif key in POINTS:
            hold = _parse_action(key, value)
            if hold is not None:
                holds[key] = hold
        else:
            known = ", ".join(sorted(POINTS))
            raise FailpointError(
                f"failpoints: unknown point or option {key!r} (points: {known}; "
                "options: gate, timeout)"
            )
    if holds and gate is None:
        raise FailpointError("failpoints: a point is armed but no gate=DIR is given")
    return FailpointSpec(holds, gate, timeout_s)


def _parse_action(point: str, value: str) -> Hold | None:
    if value == "off":
        return None
    match = _HOLD.match(value)
    if match is None:
        raise FailpointError(
            f"failpoints: {point}={value!r}: unknown action (hold(N), once:hold(N), off)"
        )
    once, digits = match.groups()
    takes_count, least = POINTS[point]
    if takes_count and digits is None:
        raise FailpointError(f"failpoints: {point} needs a count: hold(N) with N >= {least}")
    if not takes_count and digits is not None:
        raise FailpointError(f"failpoints: {point} takes no count: hold")
    count = int(digits) if digits is not None else 0
    if count < least:
        raise FailpointError(f"failpoints: {point}: the count must be at least {least}")
    return Hold(point, count, once is not None)


def safe_name(request_id: str) -> str:
    """A request id as it appears in gate file names."""
    return _UNSAFE.sub("_", request_id) or "_"


class Failpoints:
    """The failpoints of one process (inert when none is armed).

    `count(point)` says whether a point is armed (and its N) without touching the
    disk; `hold(...)` parks the caller's request there. Holds never raise for the
    gate's sake: a gate that cannot be written is logged and the request proceeds.
    """

    def __init__(self, spec: FailpointSpec | None, instance_id: str) -> None:
        self._holds = dict(spec.holds) if spec is not None else {}
        self._gate = spec.gate if spec is not None else None
        self._timeout_s = spec.timeout_s if spec is not None else DEFAULT_TIMEOUT_S
        self._instance_id = instance_id
        if self._holds and self._gate is not None:
            self._gate.mkdir(parents=True, exist_ok=True)
            log.warning("failpoints_armed", points=sorted(self._holds), gate=str(self._gate))

    @classmethod
    def from_text(cls, text: str, instance_id: str) -> Failpoints:
        """From a `YB_FAILPOINTS` value ('' -> inert)."""
        return cls(parse(text) if text.strip() else None, instance_id)

    def count(self, point: str) -> int | None:
        """The armed hold's N at `point` (0 for points without one); None if unarmed."""
        hold = self._holds.get(point)
        return None if hold is None else hold.count

    async def hold(
        self,
        point: str,
        request_id: str,
        *,
        cancelled: Callable[[], bool] = lambda: False,
        timeout_s: float | None = None,
    ) -> HoldOutcome:
        """Park `request_id` at `point` until released, `cancelled()` is true, or the
        deadline (`timeout` of the configuration) passes; what ended it.

        `not_held`: the point is unarmed, released for everyone, or armed `once` and
        no arm file was there to claim. Cancelling the awaiting task also ends it.
        """
        hold = self._holds.get(point)
        if hold is None or self._gate is None:
            return "not_held"
        gate = self._gate
        name = safe_name(request_id)
        release_all = gate / f"{point}.release"
        release_one = gate / f"{point}.{name}.release"
        reached = gate / f"{point}.{name}.reached"
        if release_all.exists():
            return "not_held"
        if hold.once:
            claim = gate / f".{point}.{name}.claim"
            try:
                # Atomic: of all the requests (and instances) racing for one arm file,
                # exactly one rename succeeds. Claimed under a hidden name: `reached`
                # appears only once its marker is whole (below).
                os.rename(gate / f"{point}.arm", claim)
            except FileNotFoundError:
                return "not_held"
            claim.unlink(missing_ok=True)
        marker = {
            "point": point,
            "request_id": request_id,
            "instance_id": self._instance_id,
            "count": hold.count,
        }
        try:
            # Written under another name and renamed: a reader never sees half of it.
            tmp = gate / f".{point}.{name}.tmp"
            tmp.write_text(json.dumps(marker))
            os.replace(tmp, reached)
        except OSError as exc:
            log.warning("failpoint_gate_unwritable", point=point, error=str(exc))
            return "not_held"
        log.warning("failpoint_hold", point=point, request_id=request_id, count=hold.count)
        limit = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while True:
            if release_one.exists() or release_all.exists():
                outcome: HoldOutcome = "released"
                break
            if cancelled():
                outcome = "cancelled"
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "failpoint_hold_timed_out", point=point, request_id=request_id, after_s=limit
                )
                outcome = "timed_out"
                break
            await asyncio.sleep(POLL_S)
        log.info("failpoint_hold_ended", point=point, request_id=request_id, outcome=outcome)
        return outcome
