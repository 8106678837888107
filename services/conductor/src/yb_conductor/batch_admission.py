"""Batch lines use only the capacity that interactive traffic leaves idle.

A batch line (`RequestAdmitted.batch`, a line of the Batch API) is due by its
`batch_deadline`, hours away, and has no TTFT or TBT objective of its own. What it
must not do is slow interactive requests. A prefill engine holds a line's prefill
between two layers while work of a higher priority waits (`PrefillJob.preemptible`,
priced by `batch_preemption`), and a decode engine gives a decoding line's batch slot
to a waiting request of a higher priority, but neither makes way for work of the
line's own priority (the `flex` tier), and a decoding line shares each step of the
batch it is in. So a line is admitted only where the conductor's own predictions show
room, on the instances the policy chose for it (`ConductorConfig.batch_*`):

- **prefill**: its predicted queue wait there is at most `batch_max_queue_s`. When
  the policy's pick (say an instance holding its prefix) has a queue, the evaluated
  instance with the lowest TTFT among those within the threshold is taken instead
  (`repick`), so a busy holder does not hold a line back while others are idle;
- **decode**: the TBT with it, predicted for the end of its prefill and of the batch
  decoding now, whichever is larger, stays within `batch_tbt_share` of the TBT SLO
  it carries (its tier's, the objective of the interactive requests it shares the
  batch with);
- **decode KV**: after its pages (its prompt and expected output) the instance
  keeps `batch_kv_reserve` of its pages free for interactive prompts.

Otherwise it is refused with the code `batch_held`, a sentence naming the instance
and the figure, and a Retry-After (the queue's excess over the threshold, or the
time the decode batch takes to fall under the limit); the gateway's batch worker
tries it again until its deadline. A batch line is never piggybacked into a decode
batch (that takes step time from the streams there). Its TTFT and TBT are not
judged against an SLO: the rule above replaces the admission check.

A re-planned batch line (its engine failed while it ran) is decided as an
interactive request of its tier: it is running already, and holding it back would
be a pre-emption.

Interactive requests never reach this module, so they are decided as before; a log
recorded before batch lines were marked has none, and replays as recorded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from yb_conductor.admission import Verdict
from yb_conductor.decode_placement import DecodeEstimate
from yb_conductor.prefill_placement import Option, PrefillChoice
from yb_conductor.state import ClusterState
from yb_core import events as ev
from yb_core.config import ConductorConfig

#: The refusal code of a batch line held back (the first word of the reason).
BATCH_HELD = "batch_held"


class BatchAdmission:
    """Decides whether a batch line fits into idle capacity (see the module docstring)."""

    def __init__(self, cfg: ConductorConfig) -> None:
        self.enabled = cfg.batch_idle_only
        self.max_queue_s = cfg.batch_max_queue_s
        self.tbt_share = cfg.batch_tbt_share
        self.kv_reserve = cfg.batch_kv_reserve
        self.max_retry_after_s = cfg.max_retry_after_s

    def applies(self, request: ev.RequestAdmitted) -> bool:
        """Whether `request` is decided by this rule: a batch line, with the rule on."""
        return self.enabled and request.batch

    def repick(self, choice: PrefillChoice) -> PrefillChoice:
        """The prefill choice for a batch line: the policy's pick when its queue is
        within the threshold, else the evaluated instance with the lowest TTFT among
        those within it (the first on ties), else the pick (refused by `check`)."""
        limit = self.max_queue_s
        if choice.queues[choice.chosen_index] <= limit:
            return choice
        best = -1
        for i, queue in enumerate(choice.queues):
            if queue <= limit and (best < 0 or choice.ttfts[i] < choice.ttfts[best]):
                best = i
        if best < 0:
            return choice
        # A longer explanation table evaluates every instance: the same rule picks there.
        full = choice.full
        return dataclasses.replace(
            choice,
            chosen_index=best,
            chosen_copy_s=0.0,
            full=(lambda: self.repick(full())) if full is not None else None,
        )

    def tbt_limit_s(self, request: ev.RequestAdmitted) -> float:
        """The decode TBT a batch line may bring a batch to."""
        return request.slo.tbt_s * self.tbt_share

    def check(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        chosen: Option,
        decode: DecodeEstimate,
        drain_s: Callable[[float], float],
    ) -> Verdict | None:
        """Why the batch line is held back on these instances, or None to admit it.
        `drain_s(limit)` says how long until the decode batch's TBT falls under
        `limit` (asked only when holding back on TBT)."""
        due = self._due(request)
        queue = chosen.queue_s
        prefill = chosen.instance.instance_id
        if queue > self.max_queue_s:
            return Verdict(
                BATCH_HELD,
                f"held back, load on {prefill} (queue {queue:.3f}s over "
                f"batch_max_queue_s {self.max_queue_s:g}s){due}",
                self._retry(queue - self.max_queue_s),
            )
        inst = decode.instance
        tbt, batch, horizon = decode.predicted_tbt_s, decode.predicted_batch, "at prefill end"
        if decode.decoding_tbt_s > tbt:
            tbt, batch, horizon = decode.decoding_tbt_s, decode.decoding_batch, "now"
        limit = self.tbt_limit_s(request)
        if tbt > limit:
            return Verdict(
                BATCH_HELD,
                f"held back, load on {inst.instance_id} (TBT {tbt:.4f}s with batch {batch} "
                f"{horizon} over {self.tbt_share:.0%} of the TBT SLO {request.slo.tbt_s:g}s, "
                f"batch_tbt_share){due}",
                self._retry(drain_s(limit)),
            )
        cap = inst.kv_capacity_blocks
        if cap:
            left = cap - inst.decode_kv_blocks - self.need_blocks(state, request)
            if left < self.kv_reserve * cap:
                return Verdict(
                    BATCH_HELD,
                    f"held back, KV on {inst.instance_id} ({max(0, left)} of {cap} blocks "
                    f"left with it, under batch_kv_reserve {self.kv_reserve:.0%}){due}",
                    self._retry(1.0),
                )
        return None

    def note(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        chosen: Option,
        decode: DecodeEstimate,
        repicked: bool = False,
    ) -> str:
        """What an admitted batch line's reason adds: the idle capacity it was found
        (`repicked`: on another prefill instance than the policy's pick, which had a
        queue)."""
        tbt = max(decode.predicted_tbt_s, decode.decoding_tbt_s)
        kv = ""
        cap = decode.instance.kv_capacity_blocks
        if cap:
            left = cap - decode.instance.decode_kv_blocks - self.need_blocks(state, request)
            kv = f", {left} of {cap} KV blocks left"
        other = " (the pick by TTFT had a queue)" if repicked else ""
        return (
            f"; batch line into idle capacity: queue {chosen.queue_s:.3f}s{other}, "
            f"TBT {tbt:.4f}s "
            f"within {self.tbt_limit_s(request):.4f}s{kv}{self._due(request)}"
        )

    @staticmethod
    def need_blocks(state: ClusterState, request: ev.RequestAdmitted) -> int:
        """The decode pages a request takes: its prompt and expected output."""
        out = state.expected_output(request.max_tokens)
        return -(-(request.prompt_tokens + out) // max(1, request.block_size))

    @staticmethod
    def _due(request: ev.RequestAdmitted) -> str:
        if not request.batch_deadline:
            return ""
        return f"; due in {max(0.0, request.batch_deadline - request.time):.0f}s"

    def _retry(self, seconds: float) -> float:
        return float(min(self.max_retry_after_s, max(1.0, round(seconds, 3))))
