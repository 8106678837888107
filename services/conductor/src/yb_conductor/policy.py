"""Placement policies: given the folded state and an admitted request, decide.

A policy is a pure function of its inputs: no clock, no I/O, ties broken by instance
id, and no randomness (when a policy wants some, it must draw it from a generator
seeded from the request). That is what lets a replay recompute every decision.

- `mooncake`: KVCache-centric (prefill by Algorithm 1 and better, see
  `prefill_placement`; decode by predicted TBT; refusals by `admission`);
- the baselines `yb sim` compares it with (`least-loaded`, `random`, `round-robin`,
  `local-prefix`, `sglang-cache-aware`, `dynamo-kv`), one module each under
  `baselines`.

`placement_policy` builds the one the settings name (`conductor.policy`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from yb_conductor.admission import (
    DECODE_KV_FULL,
    NO_DECODE,
    NO_PREFILL,
    AdmissionPolicy,
    Verdict,
)
from yb_conductor.baselines import BASELINES
from yb_conductor.batch_admission import BatchAdmission
from yb_conductor.cost_model import CostModel, load_cost_model
from yb_conductor.decode_placement import DecodeChoice, DecodeEstimate, DecodePlanner
from yb_conductor.piggyback import PiggybackEstimate, plan_steps
from yb_conductor.policy_base import Decided, Policy, PolicyFactory, reject
from yb_conductor.prefill_placement import (
    LOCAL,
    TRANSFER,
    Estimate,
    Option,
    PoolView,
    PrefillChoice,
    PrefillPlanner,
)
from yb_conductor.state import Calibration, ClusterState, InstanceState
from yb_core import events as ev
from yb_core.config import ConductorConfig

# The branch (and candidate option) of a prompt prefilled inside a decode batch.
PIGGYBACK = "piggyback"

__all__ = [
    "PLACEMENT_POLICIES",
    "Decided",
    "MooncakePolicy",
    "Policy",
    "placement_policy",
    "reject",
]


# What completed requests taught of the (TTFT, TBT) estimates (`calibrated_admission`).
Calibrations = tuple[Calibration, Calibration]


@dataclass(frozen=True, slots=True)
class _Estimated:
    """A request's estimates on the instances chosen for it (`MooncakePolicy._estimate`).

    `ttft_s` is the TTFT admission judges (`estimates.ttft_s`), `lag` the decode
    instance's learned first-token lag in it, `queued` whether work waits ahead of
    it where it would be prefilled. `piggy`: prefilling it inside the decode batch,
    when that can be planned; `on_decode` when it wins, against `prefill_ttft_s` on
    the prefill pool.
    """

    estimates: ev.Estimates
    ttft_s: float
    lag: float
    queued: bool
    piggy: PiggybackEstimate | None = None
    on_decode: bool = False
    prefill_ttft_s: float = 0.0


class MooncakePolicy:
    """KVCache-centric placement with SLO-aware, prediction-based admission."""

    name = "mooncake"

    def __init__(
        self,
        cfg: ConductorConfig | None = None,
        cost: CostModel | None = None,
        *,
        priority_order: bool | None = None,
    ) -> None:
        cfg = cfg or ConductorConfig()
        self.cfg = cfg
        self.cost = cost or load_cost_model(cfg.cost_model)
        # Whether engines run their queues by priority (see `prefill_placement`): the
        # setting unless told otherwise (a log recorded before it is read as off).
        if priority_order is None:
            priority_order = cfg.priority_order
        self.priority_order = priority_order
        self.prefill = PrefillPlanner(
            self.cost,
            balancing_threshold=cfg.kvcache_balancing_threshold,
            weigh_transfer=cfg.weigh_transfer,
            priority_order=priority_order,
            stickiness=cfg.prefix_stickiness,
            eviction_regret=cfg.eviction_regret,
            pending_prefixes=cfg.pending_prefixes,
            load_overlap=cfg.prefix_load_overlap,
        )
        self.decode = DecodePlanner(
            self.cost,
            priority_order=priority_order,
            calibrated_kv=cfg.calibrated_admission,
            reserved_at_start=cfg.kv_reserved_at_start,
            kv_peak=cfg.decode_kv_peak,
        )
        self.admission = AdmissionPolicy(
            cfg.admission,
            shed_step=cfg.shed_step,
            shed_floor=cfg.shed_floor,
            priority_ceiling=cfg.priority_ceiling,
            max_retry_after_s=cfg.max_retry_after_s,
            admit_unqueued_overrun=cfg.admit_unqueued_overrun,
            decode_now_floor=cfg.decode_now_floor,
        )
        # Batch lines: only into capacity interactive traffic leaves idle.
        self.batch = BatchAdmission(cfg)

    def decide(self, state: ClusterState, request: ev.RequestAdmitted, seq: int) -> Decided:
        """Place the request, or refuse it with the figures that led there.

        In steps: the live pools (`_live_pools`), the prefill instance
        (`_choose_prefill`) and the decode instance (`_choose_decode`) with the
        candidate tables they leave (`_explanation`), the estimates, against
        prefilling inside the decode batch (`_estimate`), admission (`_admission`;
        for a batch line, whether it fits into idle capacity: `batch_admission`),
        and the decision (`_piggybacked` or `_on_prefill`).
        """
        pools = self._live_pools(state, request, seq)
        if isinstance(pools, Decided):
            return pools
        prefills, decodes = pools
        view, choice = self._choose_prefill(state, request, prefills)
        batch = self.batch.applies(request)
        repicked = False
        if batch:
            picked = self.batch.repick(choice)
            choice, repicked = picked, picked is not choice
        chosen = choice.chosen
        dchoice = self._choose_decode(state, request, decodes, chosen)
        explain = self._explanation(state, request, view, choice, dchoice)
        if dchoice.chosen_index < 0:
            verdict = Verdict(
                DECODE_KV_FULL, f"no decode instance has KV room for {request.prompt_tokens}", 1.0
            )
            explain.branch, explain.reason = "reject", verdict.reason
            return Decided(reject(request, seq, self.name, verdict, explain=explain), [])
        decode = self.decode.estimate(dchoice, dchoice.chosen_index)
        est = self._estimate(state, request, view, chosen, decode, explain)
        predictions = self._predictions(request, decode)
        calibration = (
            (state.learned.ttft, state.learned.tbt) if self.cfg.calibrated_admission else None
        )

        def drain_s(limit: float) -> float:
            return self.decode.drain_time_s(state, decode, limit, dchoice.context)

        if batch:
            verdict_or_none = self.batch.check(state, request, chosen, decode, drain_s)
        else:
            verdict_or_none = self._admission(request, est, decode, drain_s, calibration)
        if verdict_or_none is not None:
            explain.branch, explain.reason = "reject", verdict_or_none.reason
            return Decided(
                reject(request, seq, self.name, verdict_or_none, est.estimates, explain),
                predictions,
            )
        if est.piggy is not None and est.on_decode:
            return self._piggybacked(
                state, request, seq, view, decode, est.piggy, est.estimates, explain, predictions,
                f"against {est.prefill_ttft_s:.3f}s on {chosen.instance.instance_id}",
            )  # fmt: skip
        decision = self._on_prefill(
            state, request, seq, view, chosen, choice.chosen_copy_s, decode, est, explain,
            calibration,
        )  # fmt: skip
        if batch and decision.explain is not None:
            decision.explain.reason += self.batch.note(state, request, chosen, decode, repicked)
        return Decided(decision, predictions)

    def _live_pools(
        self, state: ClusterState, request: ev.RequestAdmitted, seq: int
    ) -> tuple[list[InstanceState], list[InstanceState]] | Decided:
        """The live prefill and decode instances that can take the request (whose
        pages hold its block size, `ClusterState.live`), or its refusal when a pool
        has none."""
        prefills = state.live("prefill", request.model, request.block_size)
        decodes = state.live("decode", request.model, request.block_size)
        if not prefills:
            reason = _none_live(state, "prefill", request)
            return Decided(reject(request, seq, self.name, Verdict(NO_PREFILL, reason, 1.0)), [])
        if not decodes:
            reason = _none_live(state, "decode", request)
            return Decided(reject(request, seq, self.name, Verdict(NO_DECODE, reason, 1.0)), [])
        return prefills, decodes

    def _choose_prefill(
        self, state: ClusterState, request: ev.RequestAdmitted, prefills: list[InstanceState]
    ) -> tuple[PoolView, PrefillChoice]:
        """What the pool holds of the request's prefix, and every prefill instance's
        best option with the pick (`prefill_placement`)."""
        view = self.prefill.view(state, request)
        return view, self.prefill.options(state, request, view, prefills)

    def _choose_decode(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        decodes: list[InstanceState],
        chosen: Option,
    ) -> DecodeChoice:
        """The decode instance by its TBT predicted for when the chosen prefill ends
        (`decode_placement`); its pages are taken from the prefill's start on."""
        return self.decode.choose(
            state,
            decodes,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_size=max(1, request.block_size),
            at_time=state.now + chosen.ttft_s,
            priority=request.priority,
            start_time=state.now + chosen.queue_s,
        )

    def _explanation(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        view: PoolView,
        choice: PrefillChoice,
        dchoice: DecodeChoice,
    ) -> ev.Explanation:
        """The decision's explanation so far: the SLO limits and both candidate
        tables (`explain_top_k`, `explain_decode_top_k` rows); the branch and the
        reason are filled in by the step that settles the decision."""
        ttft_limit, tbt_limit = self.admission.limits(request)
        return ev.Explanation(
            admission=self.admission.name,
            best_blocks=view.best_any_blocks,
            best_source=view.best_any_source,
            ttft_limit_s=ttft_limit,
            tbt_limit_s=tbt_limit,
            candidates=self.prefill.candidates(
                choice, view.best_any_blocks, self.cfg.explain_top_k
            ),
            decode_candidates=[
                ev.DecodeCandidate(
                    instance_id=dchoice.instances[i].instance_id,
                    batch=dchoice.instances[i].decoding_requests + 1,
                    predicted_batch=dchoice.predicted_batches[i],
                    tbt_s=dchoice.predicted_tbts[i],
                )
                for i in self.decode.table(state, dchoice, self.cfg.explain_decode_top_k)
            ],
        )

    def _estimate(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        view: PoolView,
        chosen: Option,
        decode: DecodeEstimate,
        explain: ev.Explanation,
    ) -> _Estimated:
        """The request's estimates on the chosen instances, or prefilled inside the
        decode instance's batch when that has the lower TTFT (its row joins the
        candidate table, first when it wins)."""
        # The first token follows the prefill's end by the decode instance's learned
        # lag (0 without `learn_speed`); the decode batch is predicted at the end.
        lag = state.first_token_lag_s(decode.instance.instance_id)
        ttft = chosen.ttft_s + lag if lag else chosen.ttft_s
        estimates = ev.Estimates(
            queue_s=chosen.queue_s,
            transfer_s=chosen.transfer_s,
            prefill_s=chosen.prefill_s,
            ttft_s=ttft,
            tbt_s=decode.predicted_tbt_s,
            decode_batch=decode.predicted_batch,
        )
        # Anything queued ahead on the instance that would prefill it (by the log,
        # not only by the estimate): a refusal would then shed load.
        queued = bool(chosen.instance.prefill_queue) or chosen.queue_s > 0.0
        piggy = None
        # A batch line is not piggybacked: it would take step time from the streams.
        if (
            decode.instance.piggyback
            and not request.prompt_logprobs
            and not self.batch.applies(request)
        ):
            piggy = self._piggyback(state, request, view, decode.instance, explain.tbt_limit_s)
        if piggy is None:
            return _Estimated(estimates, ttft, lag, queued)
        on_decode = piggy.ttft_s < ttft
        row = self._piggyback_row(decode.instance, view, piggy)
        explain.candidates.insert(0 if on_decode else min(1, len(explain.candidates)), row)
        if not on_decode:
            return _Estimated(estimates, ttft, lag, queued, piggy)
        estimates = msgspec.structs.replace(
            estimates,
            queue_s=piggy.wait_s,
            transfer_s=piggy.load_s,
            prefill_s=piggy.prefill_s,
            ttft_s=piggy.ttft_s,
        )
        queued = bool(decode.instance.prefill_queue) or piggy.wait_s > 0.0
        return _Estimated(estimates, piggy.ttft_s, lag, queued, piggy, True, ttft)

    def _predictions(
        self, request: ev.RequestAdmitted, decode: DecodeEstimate
    ) -> list[ev.LoadPrediction]:
        """Under `predicted` admission, the decode load predicted for the end of the
        request's prefill, logged beside the decision."""
        if self.admission.name != "predicted":
            return []
        return [
            ev.LoadPrediction(
                time=request.time,
                instance_id=decode.instance.instance_id,
                at_time=decode.at_time,
                predicted_batch=decode.predicted_batch,
                predicted_tbt_s=decode.predicted_tbt_s,
                request_id=request.request_id,
                current_batch=decode.decoding_batch - 1,
            )
        ]

    def _admission(
        self,
        request: ev.RequestAdmitted,
        est: _Estimated,
        decode: DecodeEstimate,
        drain_s: Callable[[float], float],
        calibration: Calibrations | None,
    ) -> Verdict | None:
        """Why the request is refused on these estimates (`admission`), or None; with
        `calibrated_admission`, judged by what outcomes taught of the estimates.
        `drain_s(limit)`: how long until the decode batch's TBT falls under `limit`."""
        return self.admission.check(
            request,
            est.ttft_s,
            decode,
            drain_s,
            calibration=calibration,
            queued=est.queued,
        )

    def _on_prefill(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        seq: int,
        view: PoolView,
        chosen: Option,
        copy_s: float,
        decode: DecodeEstimate,
        est: _Estimated,
        explain: ev.Explanation,
        calibration: Calibrations | None,
    ) -> ev.RequestScheduled:
        """The decision that the chosen prefill instance computes the prompt (reusing
        what its option plans) and the chosen decode instance decodes it; `copy_s` is
        what copying the prefix there costs (with `prefix_stickiness`)."""
        reuse = self.prefill.reuse_plan(state, view, chosen)
        explain.branch = chosen.est.option
        # Only with stickiness, so that older logs explain as they always did.
        sticky = self.prefill.stickiness > 0.0
        explain.reason = self._why(
            chosen, decode, view, est.lag, "TTFT" if sticky else "lowest TTFT"
        )
        explain.reason += self.admission.overrun_note(request, est.ttft_s, est.queued, calibration)
        if sticky:
            explain.reason += (
                f"; chosen for the lowest TTFT + copy cost (copy {copy_s:.3f}s, "
                f"prefix_stickiness {self.prefill.stickiness:g})"
            )
        decision = self._scheduled(
            request, seq, chosen.instance, decode.instance, reuse, est.estimates, explain
        )
        decision.prefill_stages = list(chosen.instance.stages)
        return decision

    def _scheduled(
        self,
        request: ev.RequestAdmitted,
        seq: int,
        prefill: InstanceState,
        decode: InstanceState,
        reuse: list[ev.ReusePlan],
        estimates: ev.Estimates,
        explain: ev.Explanation,
    ) -> ev.RequestScheduled:
        """The placement decision: `prefill` computes the prompt (reusing `reuse`),
        `decode` decodes it."""
        reused = sum(r.num_blocks for r in reuse)
        return ev.RequestScheduled(
            time=request.time,
            request_id=request.request_id,
            gateway_id=request.gateway_id,
            prefill_instance=prefill.instance_id,
            decode_instance=decode.instance_id,
            reused_blocks=reused,
            reuse=reuse,
            estimates=estimates,
            policy=self.name,
            admitted_seq=seq,
            prompt_tokens=request.prompt_tokens,
            computed_tokens=request.prompt_tokens - reused * max(1, request.block_size),
            explain=explain,
        )

    def _piggyback(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        view: PoolView,
        inst: InstanceState,
        limit_s: float,
    ) -> PiggybackEstimate | None:
        """The request prefilled inside decode instance `inst`'s batch (see
        `piggyback`): reusing the best prefix in the pool or computing it all,
        whichever is faster; None when its steps cannot keep within `limit_s`."""
        bs = max(1, request.block_size)
        prompt = request.prompt_tokens
        cost = self.prefill.costs.of(inst)  # the decode instance's degree and lanes
        batch, context = inst.decoding_requests, inst.decoding_context_tokens
        now = state.now
        wait = inst.busy_until - now if inst.busy_until > now else 0.0
        if batch:
            wait += cost.tbt_s(batch, context) * 0.5
        best = view.best
        options = [(0, 0.0)]
        if best is not None and best.blocks:
            remote = best.instance.host != inst.host
            options.append((best.blocks, self.prefill.load_s(cost, best, best.blocks, bs, remote)))
        found: PiggybackEstimate | None = None
        for blocks, load in options:
            steps = plan_steps(
                cost, batch=batch, context=context, new_tokens=prompt - blocks * bs,
                cached_tokens=blocks * bs, limit_s=limit_s, block_size=bs,
            )  # fmt: skip
            if steps is None:
                continue
            est = PiggybackEstimate(wait, load, steps, blocks)
            if found is None or est.ttft_s < found.ttft_s:
                found = est
        return found

    @staticmethod
    def _piggyback_row(
        inst: InstanceState, view: PoolView, piggy: PiggybackEstimate
    ) -> ev.Candidate:
        """The piggyback option as a row of the candidate table."""
        source = view.best.instance.instance_id if piggy.reuse_blocks and view.best else ""
        return ev.Candidate(
            instance_id=inst.instance_id,
            option=PIGGYBACK,
            best_blocks=view.best_any_blocks,
            reuse_blocks=piggy.reuse_blocks,
            source=source,
            queue_s=piggy.wait_s,
            transfer_s=piggy.load_s,
            prefill_s=piggy.prefill_s,
            ttft_s=piggy.ttft_s,
        )

    def _piggybacked(
        self,
        state: ClusterState,
        request: ev.RequestAdmitted,
        seq: int,
        view: PoolView,
        decode: DecodeEstimate,
        piggy: PiggybackEstimate,
        estimates: ev.Estimates,
        explain: ev.Explanation,
        predictions: list[ev.LoadPrediction],
        against: str,
    ) -> Decided:
        """The decision that the decode instance prefills the request in its batch."""
        inst = decode.instance
        reuse: list[ev.ReusePlan] = []
        if piggy.reuse_blocks and view.best is not None:
            plan = Estimate(TRANSFER, 0, piggy.reuse_blocks, piggy.load_s, 0.0, remote=view.best)
            reuse = self.prefill.reuse_plan(state, view, Option(inst, 0.0, plan, 0.0))
        largest = max(chunk for chunk, _ in piggy.steps)
        explain.branch = PIGGYBACK
        explain.reason = (
            f"{inst.instance_id} prefills it inside its batch of {inst.decoding_requests}: "
            f"{len(piggy.steps)} step(s) of at most {largest} tokens within the TBT limit "
            f"{explain.tbt_limit_s:.4f}s, reusing {piggy.reuse_blocks} blocks; TTFT "
            f"{piggy.ttft_s:.3f}s = wait {piggy.wait_s:.3f} + load {piggy.load_s:.3f} + "
            f"steps {piggy.prefill_s:.3f}, {against}"
        )
        decision = self._scheduled(request, seq, inst, inst, reuse, estimates, explain)
        decision.piggyback = True
        return Decided(decision, predictions)

    @staticmethod
    def _why(
        chosen: Option,
        decode: DecodeEstimate,
        view: PoolView,
        lag: float = 0.0,
        ttft_label: str = "lowest TTFT",
    ) -> str:
        est = chosen.est
        inst = chosen.instance.instance_id
        pending = est.engine is not None and est.engine.pending
        if est.option == LOCAL:
            what = f"reuses its local prefix of {est.reuse_blocks} blocks"
            if pending and est.engine is not None:
                what += (
                    f" ({est.engine.blocks} of them being computed there by a prefill "
                    "ahead of it: pending_prefixes)"
                )
        elif est.option == TRANSFER:
            src = est.remote.instance.instance_id if est.remote else "?"
            what = (
                f"pulls blocks {est.local_blocks}..{est.reuse_blocks} from {src} "
                f"(local prefix {est.local_blocks}"
                f"{', being computed there by a prefill ahead of it' if pending else ''})"
            )
        elif view.best_any_blocks:
            what = f"recomputes: faster than loading any of the {view.best_any_blocks} cached"
        else:
            what = "recomputes: no prefix cached anywhere"
        stages = chosen.instance.stages
        if stages:
            inst = f"{inst} (prefill group over {len(stages)} stages: {', '.join(stages)})"
        if chosen.factor != 1.0 or lag:
            # Only with learned speed, so that older logs explain as they always did.
            ttft = (
                f"{ttft_label} {chosen.ttft_s + lag:.3f}s = queue {chosen.queue_s:.3f} "
                f"+ transfer {chosen.transfer_s:.3f} + prefill {chosen.prefill_s:.3f} "
                f"(x{chosen.factor:.2f} the cost model) + first token {lag:.3f}"
            )
        else:
            ttft = (
                f"{ttft_label} {chosen.ttft_s:.3f}s = queue {chosen.queue_s:.3f} "
                f"+ transfer {chosen.transfer_s:.3f} + prefill {chosen.prefill_s:.3f}"
            )
        return (
            f"{inst} {what}; {ttft}; decode "
            f"{decode.instance.instance_id}: predicted TBT {decode.predicted_tbt_s:.4f}s "
            f"at batch {decode.predicted_batch}"
        )


PLACEMENT_POLICIES: dict[str, PolicyFactory] = {
    MooncakePolicy.name: MooncakePolicy,
    **BASELINES,
}


def placement_policy(
    cfg: ConductorConfig | str | None = None, cost: CostModel | None = None
) -> Policy:
    """The configured placement policy (or one by name); a clear error for an unknown one."""
    if isinstance(cfg, str):
        cfg = ConductorConfig(policy=cfg)
    cfg = cfg or ConductorConfig()
    try:
        factory = PLACEMENT_POLICIES[cfg.policy]
    except KeyError:
        known = ", ".join(sorted(PLACEMENT_POLICIES))
        raise ValueError(f"unknown policy {cfg.policy!r}; known: {known}") from None
    return factory(cfg, cost)


def _none_live(state: ClusterState, role: ev.Role, request: ev.RequestAdmitted) -> str:
    """Why no instance of `role` can take `request`: none is live, or the live ones
    all have pages of another size."""
    if state.live(role, request.model):
        return f"no live {role} instance with {request.block_size}-token pages"
    return f"no live {role} instance"
