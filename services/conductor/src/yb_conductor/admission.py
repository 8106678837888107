"""Overload: when a request is refused, and which requests are refused first.

Three policies, switchable (`ConductorConfig.admission`), as Mooncake §7 compares them:

- `none`: never refuse on load. A request is refused only when nothing can take it
  (no live instance, no decode instance with room for its KV) — the equivalent of
  rejecting at decode admission, after the prefill was paid for;
- `early`: refuse at arrival when the estimated TTFT, or the TBT of the decode batch
  *as it is now* with this request added, exceeds the SLO. Cheap, but it ignores
  the requests already in prefill that will join the batch, which makes load
  oscillate (the paper's Figure 10);
- `predicted`: as `early`, but the TBT is the one predicted for the moment this
  request's prefill ends (see `decode_placement`). With `decode_now_floor`, the
  TBT of the batch decoding now (with this request) is its floor: the prediction
  counts only requests placed already, and those placed while this one waits and
  decodes keep a loaded instance about as loaded as it is.

A TTFT that misses the limit on an instance with nothing queued ahead of the request
(no request there whose prefill has not ended, and no wait estimated:
`admit_unqueued_overrun`) is not refused: no wait caused it, so refusing sheds no
load, and the prefill puts the prompt's prefix in the pool for the requests that
share it. The TBT check still applies.

Priority classes: a request below `priority_ceiling` gets a tighter limit,
`max(shed_floor, 1 - shed_step * (priority_ceiling - priority))` of its SLO, so as
load rises the lowest class is refused first, then the next. Requests at or above
the ceiling get their whole SLO.

A refusal carries a code (the first word of `reason`, counted per code), a sentence
with the figures, and a Retry-After: for TTFT the excess over the limit (the queue
drains in real time), for TBT the time until enough of the batch has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from yb_conductor.decode_placement import DecodeEstimate
from yb_conductor.state import Calibration
from yb_core import events as ev

AdmissionName = Literal["none", "early", "predicted"]
ADMISSIONS: tuple[AdmissionName, ...] = ("none", "early", "predicted")

# Refusal codes: the first word of `RequestRejected.reason`.
NO_PREFILL = "no_prefill"
NO_DECODE = "no_decode"
DECODE_KV_FULL = "decode_kv_full"
TTFT_SLO = "ttft_slo"
TBT_SLO = "tbt_slo"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A refusal: its code, the sentence for the client, and when to retry."""

    code: str
    message: str
    retry_after_s: float

    @property
    def reason(self) -> str:
        """`code: message`, what `RequestRejected.reason` carries."""
        return f"{self.code}: {self.message}"


def _expected(estimate: float, expected: float, digits: int) -> str:
    """What calibration expects of an estimate, as the refusal's sentence names it
    (nothing where it reads as the estimate itself)."""
    shown = f"{expected:.{digits}f}"
    return f" (expected {shown}s)" if shown != f"{estimate:.{digits}f}" else ""


class AdmissionPolicy:
    """Decides refusals on load, per the configured policy and priority classes."""

    def __init__(
        self,
        name: AdmissionName = "predicted",
        *,
        shed_step: float = 0.1,
        shed_floor: float = 0.5,
        priority_ceiling: int = 0,
        max_retry_after_s: float = 30.0,
        admit_unqueued_overrun: bool = False,
        decode_now_floor: bool = False,
    ) -> None:
        if name not in ADMISSIONS:
            raise ValueError(f"unknown admission policy {name!r}; known: {', '.join(ADMISSIONS)}")
        self.name = name
        self.shed_step = shed_step
        self.shed_floor = shed_floor
        self.priority_ceiling = priority_ceiling
        self.max_retry_after_s = max_retry_after_s
        self.admit_unqueued_overrun = admit_unqueued_overrun
        self.decode_now_floor = decode_now_floor

    def factor(self, priority: int) -> float:
        """The share of its SLO a request of this priority may use."""
        if priority >= self.priority_ceiling:
            return 1.0
        return max(self.shed_floor, 1.0 - self.shed_step * (self.priority_ceiling - priority))

    def limits(self, request: ev.RequestAdmitted) -> tuple[float, float]:
        """(TTFT limit, TBT limit) in seconds for this request."""
        f = self.factor(request.priority)
        return request.slo.ttft_s * f, request.slo.tbt_s * f

    def check(
        self,
        request: ev.RequestAdmitted,
        ttft_s: float,
        decode: DecodeEstimate,
        drain_s: Callable[[float], float],
        calibration: tuple[Calibration, Calibration] | None = None,
        queued: bool = True,
    ) -> Verdict | None:
        """A refusal, or None to admit. `drain_s(limit)` says how long until the
        decode batch's TBT falls under `limit` (only asked when refusing on TBT).
        `calibration`: what outcomes taught of the (TTFT, TBT) estimates (calibrated
        admission): a request is refused only when what its estimate is expected to
        turn out misses the SLO. `queued`: whether anything is queued ahead of the
        request on its prefill instance (`admit_unqueued_overrun`)."""
        if self.name == "none":
            return None
        ttft_limit, tbt_limit = self.limits(request)
        expected_ttft = calibration[0].expected(ttft_s) if calibration else ttft_s
        if expected_ttft > ttft_limit and not self.overrun_admitted(queued):
            return Verdict(
                TTFT_SLO,
                f"estimated TTFT {ttft_s:.3f}s{_expected(ttft_s, expected_ttft, 3)} "
                f"exceeds {ttft_limit:.3f}s{self._shed_note(request)}",
                self._retry(expected_ttft - ttft_limit),
            )
        if self.name == "early":
            tbt, batch, horizon = decode.decoding_tbt_s, decode.decoding_batch, "now"
        else:
            tbt, batch, horizon = decode.predicted_tbt_s, decode.predicted_batch, "at prefill end"
            if self.decode_now_floor and decode.decoding_tbt_s > tbt:
                horizon = f"now (above the {batch} at prefill end)"
                tbt, batch = decode.decoding_tbt_s, decode.decoding_batch
        expected_tbt = calibration[1].expected(tbt) if calibration else tbt
        if expected_tbt > tbt_limit:
            return Verdict(
                TBT_SLO,
                f"TBT {tbt:.4f}s{_expected(tbt, expected_tbt, 4)} with batch {batch} "
                f"{horizon} on {decode.instance.instance_id} exceeds {tbt_limit:.4f}s"
                f"{self._shed_note(request)}",
                self._retry(drain_s(tbt_limit)),
            )
        return None

    def overrun_admitted(self, queued: bool) -> bool:
        """Whether a TTFT over the limit is admitted (`queued`: with anything queued
        ahead of it)."""
        return self.admit_unqueued_overrun and not queued

    def overrun_note(
        self,
        request: ev.RequestAdmitted,
        ttft_s: float,
        queued: bool,
        calibration: tuple[Calibration, Calibration] | None = None,
    ) -> str:
        """For an admitted request: what the decision's reason adds when its TTFT was
        admitted over the limit (`admit_unqueued_overrun`), else ""."""
        if self.name == "none" or not self.overrun_admitted(queued):
            return ""
        ttft_limit = self.limits(request)[0]
        expected_ttft = calibration[0].expected(ttft_s) if calibration else ttft_s
        if expected_ttft <= ttft_limit:
            return ""
        return (
            f"; admitted over its TTFT limit {ttft_limit:.3f}s (estimated {ttft_s:.3f}s"
            f"{_expected(ttft_s, expected_ttft, 3)}): nothing is queued ahead of it, so "
            "a refusal would shed no load (admit_unqueued_overrun)"
        )

    def _shed_note(self, request: ev.RequestAdmitted) -> str:
        f = self.factor(request.priority)
        return f" (priority {request.priority}: {f:.0%} of SLO)" if f < 1.0 else ""

    def _retry(self, seconds: float) -> float:
        return float(min(self.max_retry_after_s, max(1.0, round(seconds, 3))))
