"""Decode placement: the decode instance whose predicted TBT is lowest.

For each live decode instance three batches are estimated, because the three
admission policies look at different ones:
- `decoding`: what decodes there now (KV committed, not finished), plus this request
  — the load an "early" rejection sees;
- `predicted`: the batch at the moment this request's prefill is expected to end
  (Mooncake §7): requests decoding now that will still be decoding then (a request
  decodes for `t_d`, learned from completions, or less when its `max_tokens` at the
  estimated TBT is shorter), plus requests still in prefill that will have finished
  it by then, plus this one;
- `assigned`: everything sent there and not finished, plus this one (an upper bound).

The placement itself uses the predicted TBT in every admission policy, so that
switching admission changes only who is refused, not where the others go. An
instance without room for the request's KV (prompt plus expected output) is not a
candidate.

Priority: a decode instance short of pages gives them to the higher priorities
first, and a request takes its pages there only once its prefill runs. So the room a
request of priority p finds is the room left by every request assigned there
except those of a lower priority still waiting for (or in) their prefill: those
will wait behind it. With one priority everywhere this is the plain room, and
`priority_order=False` (conductors before engines ordered by priority) ignores it.

Calibrated room (`calibrated_kv`): the conductor accounts a request's KV as whole
blocks of its prompt plus expected output from the moment it is placed. Two things
make that more than the instance will hold when this request's pages are taken:
requests still in a prefill that ends after this one's take their pages after it
(first come, first served), so they are left out; and what an instance reports
using for the requests committed there can be less than accounted (an engine that
reserves tokens, not pages), so the room leaves out what its reports showed the
accounting to overcount (`kv_overcount_blocks`; never below zero).

Pages taken at the prefill's start (`reserved_at_start`): a decode instance reserves
a request's pages when its prefill starts (`ReserveKV`, the prefill's first step) and
refuses there when it has none. A request whose prefill starts at once (nothing
queued ahead of it) finds the room that every started prefill left, whatever its
end, while requests still queued take theirs after it: those are left out. A queued
request starts later, when requests decoding now will have finished and freed
pages, which the accounting does not foresee (a request holds its pages until its
end is logged); it is judged at its prefill's end as above. The instance's reports
are compared with the blocks of the requests committed there and of those whose
prefill started (their pages are reserved and counted in what it uses).

The projected peak (`kv_peak`): the budgets above count every request at its final
length at once, and the requests decoding now as if they never ended. An instance
that has no room by them is still taken when the pages it will hold fit: from when
this request's pages are taken to its expected end, each request counted holds what
it holds now (its prompt, and what it has generated at its expected pace since its
decode started; `ClusterState.held_blocks_now`), grows at that pace (one page per
`block_size` tokens) and frees everything at its expected end (`t_d`, or less by its
`max_tokens`); one past its expected end holds what it has to the end of the window;
this request holds its prompt from when its pages are reserved (with
`reserved_at_start`, its prefill's start, whether it waits in a queue or not), then
grows to its expected output from its prefill's end. The sum rises
between ends and falls at each, so its peak is found in one sweep over the sorted
ends. What the instance reports using beyond the projection of its committed
requests (`kv_unprojected_blocks`) is added. Only an instance that fails the budget
is projected, so the sweep runs only near full, and only for a request whose pages
are taken after some request counted there is expected to end (a request waiting
behind prefills): foreseeing those ends is what the budget lacks. A request whose
pages are taken at once, or before anything ends, is judged by the budget, which
keeps room for requests outliving their expected ends; judged by the projection in a
decode pool kept full (8 prefill and 1 decode instances on `shared-prefix`), it
admitted requests that ended others mid-stream and served fewer.

Tensor parallelism: each instance's TBT is priced at the degree it announced
(`CostModel.at_degree`). In a pool of one degree every idle instance still predicts
the same; a pool that mixes degrees works out every instance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from yb_conductor.candidates import DECODE_PRUNE_ABOVE, still_busy
from yb_conductor.cost_model import CostModel, DegreeCosts
from yb_conductor.state import ClusterState, InstanceState, Placement


@dataclass(slots=True)
class DecodeEstimate:
    """One decode instance, with this request added, at the three horizons."""

    instance: InstanceState
    fits: bool
    decoding_batch: int
    decoding_tbt_s: float
    predicted_batch: int
    predicted_tbt_s: float
    assigned_batch: int
    assigned_tbt_s: float
    at_time: float


@dataclass(slots=True)
class DecodeChoice:
    """Every decode instance's predicted batch and TBT (parallel lists), and the pick
    (`chosen_index` is -1 when no instance has room). `fits`: room by the budgets, or
    by the projected peak where that could change the pick (`kv_peak`)."""

    instances: list[InstanceState]
    fits: list[bool]
    predicted_batches: list[int]
    predicted_tbts: list[float]
    chosen_index: int
    at_time: float
    context: int
    # The positions worked out one by one, in order (None: all): every other one is
    # idle and predicts what the first idle one does.
    evaluated: list[int] | None = None
    # With `evaluated`: the first idle positions, in order, for the explanation's
    # table (`IDLE_KEPT` of them; fewer when there are no more).
    idle: list[int] | None = None


# How many idle decode instances a pruned choice keeps: the explanation's default
# table of decode instances (`explain_decode_top_k` 8) and the one past it.
IDLE_KEPT = 9


class DecodePlanner:
    """Estimates the decode instances for a request and picks the lowest TBT.

    Only the instances with work and the first idle one are worked out (see
    `candidates`); `full_scan` (default `default_full_scan`) works out each, and so
    do pools of at most `prune_above` instances.
    """

    default_full_scan: bool = False
    prune_above: int = DECODE_PRUNE_ABOVE

    def __init__(
        self,
        cost: CostModel,
        *,
        priority_order: bool = False,
        full_scan: bool | None = None,
        calibrated_kv: bool = False,
        reserved_at_start: bool = False,
        kv_peak: bool = False,
    ) -> None:
        self.cost = cost
        self.costs = DegreeCosts(cost)
        self.priority_order = priority_order
        self.calibrated_kv = calibrated_kv
        self.reserved_at_start = reserved_at_start
        self.kv_peak = kv_peak
        self.full_scan = self.default_full_scan if full_scan is None else full_scan

    def choose(
        self,
        state: ClusterState,
        decodes: list[InstanceState],
        *,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        at_time: float,
        priority: int = 0,
        start_time: float | None = None,
    ) -> DecodeChoice:
        """Predict every decode instance's batch at `at_time` (when this request's
        prefill should end) with this request added, and pick the lowest TBT among
        those with KV room for a request of `priority` (ties: the smaller assigned
        batch, then by id)."""
        # One degree in the pool: one model for all; else each instance's own.
        shape = state.shape_of(decodes)
        d = (self.costs.at(*shape) if shape is not None else self.cost).decode
        base, per_seq, per_ctx = d.base_s, d.per_seq_s, d.per_context_token_s
        out_tokens = state.expected_output(max_tokens)
        context = prompt_tokens + out_tokens // 2
        need_blocks = -(-(prompt_tokens + out_tokens) // max(1, block_size))
        t_d = state.learned.decode_time_s
        placements = state.placements
        # Below every priority: nothing is left out of the room (nor when nothing is
        # placed below this request's priority).
        floor = priority if self.priority_order else -math.inf
        waits_behind = floor > state.priorities_placed()[0]
        calibrated = self.calibrated_kv
        peak = self.kv_peak
        # With `reserved_at_start`, a request whose prefill starts now takes its pages
        # now: the room left is what every started prefill has reserved and every
        # queued one has not. A queued request is judged at its prefill's end, as
        # without the setting (see the module's docstring).
        at_start = self.reserved_at_start and start_time is not None and start_time <= state.now
        taken_by = start_time if at_start and start_time is not None else at_time
        # The projected peak runs from when the instance reserves this request's
        # pages: its prefill's start when the engines reserve there.
        reserve_at = taken_by
        if self.reserved_at_start and start_time is not None and start_time < taken_by:
            reserve_at = start_time
        # Only a request whose pages are taken later can find pages freed first.
        projecting = peak and reserve_at > state.now
        n = len(decodes)
        fits = [True] * n
        batches = [1] * n
        # What an idle instance predicts (a batch of one, this request alone).
        idle_tbt = base + per_seq * 1 + per_ctx * context
        tbts = [idle_tbt] * n
        chosen = -1
        chosen_tbt, chosen_requests = math.inf, 0
        order: Iterable[int] = range(n)
        evaluated: list[int] | None = None
        idle: list[int] | None = None
        first_idle = -1
        min_cap = state.min_decode_capacity(decodes)
        if (
            shape is not None
            and not self.full_scan
            and n > self.prune_above
            and (not min_cap or need_blocks <= min_cap)
        ):
            # Every idle instance fits and predicts `idle_tbt` with nothing assigned:
            # only the first of them can be chosen (ties go to the lower id).
            order, idle = self._busy(state, decodes)
            first_idle = idle[0] if idle else -1
            evaluated = sorted([*order, first_idle]) if first_idle >= 0 else list(order)
        for i in order:
            inst = decodes[i]
            if shape is None:
                d = self.costs.of(inst).decode
                base, per_seq, per_ctx = d.base_s, d.per_seq_s, d.per_context_token_s
            cap = inst.kv_capacity_blocks
            held = inst.decode_kv_blocks
            batch, ctx = 1, context
            # The requests whose pages count, for the projected peak: only where the
            # budget may say no (leaving requests out only lowers it).
            kept: list[Placement] | None = None
            if projecting and cap:
                over = inst.kv_overcount_blocks if calibrated else 0.0
                if held - (over if over > 0.0 else 0.0) + need_blocks > cap:
                    kept = []
            for rid in inst.assigned:
                p = placements.get(rid)
                if p is None:
                    continue
                if waits_behind and p.priority < floor and not p.prefill_done:
                    held -= p.kv_blocks  # it will wait for pages behind this one
                elif (
                    calibrated
                    and not p.prefill_done
                    and not (at_start and p.reserved)
                    and (p.prefill_end - p.prefill_s if at_start else p.prefill_end) > taken_by
                ):
                    held -= p.kv_blocks  # its pages are taken after this one's
                elif kept is not None:
                    kept.append(p)
                start = p.decode_started or p.prefill_end
                duration = p.duration_cap if p.duration_cap < t_d else t_d
                if start <= at_time < start + duration:
                    batch += 1
                    ctx += p.context_tokens
            tbt = base + per_seq * batch + per_ctx * ctx
            batches[i] = batch
            tbts[i] = tbt
            taken: float = held
            if calibrated and inst.kv_overcount_blocks > 0.0:
                taken = max(0.0, held - inst.kv_overcount_blocks)
            room = not cap or taken + need_blocks <= cap
            better = tbt < chosen_tbt or (
                tbt == chosen_tbt and inst.decode_requests < chosen_requests
            )
            # Projected only where it can change the pick: an instance that would not
            # be chosen with room keeps the budget's verdict.
            if not room and better and kept is not None:
                own_s = max_tokens * tbt if max_tokens and max_tokens * tbt < t_d else t_d
                room = self._peak_fits(
                    state, inst, kept, start=reserve_at, decode_from=at_time,
                    prompt_tokens=prompt_tokens, need_blocks=need_blocks, duration=own_s,
                    block_size=block_size, cap=cap,
                )  # fmt: skip
            if not room:
                fits[i] = False
            elif better:
                chosen_tbt, chosen_requests = tbt, inst.decode_requests
                chosen = i
        if first_idle >= 0 and (
            idle_tbt < chosen_tbt
            or (
                idle_tbt == chosen_tbt
                and (chosen_requests > 0 or (chosen_requests == 0 and first_idle < chosen))
            )
        ):
            chosen = first_idle
        return DecodeChoice(decodes, fits, batches, tbts, chosen, at_time, context, evaluated, idle)

    @staticmethod
    def _peak_fits(
        state: ClusterState,
        inst: InstanceState,
        kept: list[Placement],
        *,
        start: float,
        decode_from: float,
        prompt_tokens: int,
        need_blocks: int,
        duration: float,
        block_size: int,
        cap: int,
    ) -> bool:
        """Whether the pages `inst` is projected to hold, from `start` (when this
        request's pages are taken) to its expected end (`decode_from + duration`),
        stay within `cap` with this request added (see the module's docstring)."""
        now = state.now
        t_d = state.learned.decode_time_s
        bs = max(1, block_size)
        horizon = decode_from + duration
        # Pages held at `start`, and how fast the sum grows there (pages per second).
        # A request grows from the pages it holds to its budget's (its prompt and
        # expected output), evenly until its expected end.
        prompt_blocks = -(-prompt_tokens // bs)
        level = float(prompt_blocks)
        if inst.kv_unprojected_blocks > 0.0:
            level += inst.kv_unprojected_blocks
        rate = (need_blocks - prompt_blocks) / duration if duration > 0.0 else 0.0
        slope = rate if decode_from <= start else 0.0
        # (time, kind: 0 starts growing / 1 ends, pages at the end, pages/s, grows from)
        events: list[tuple[float, int, float, float, float]] = []
        frees = False
        if decode_from > start:
            events.append((decode_from, 0, 0.0, rate, decode_from))
        for p in kept:
            pages = state.held_blocks_now(p, inst, t_d)
            begin = p.decode_started or p.prefill_end
            took = p.duration_cap if p.duration_cap < t_d else t_d
            end = begin + took
            if end <= now:
                if p.decode_started:  # past its expected end: holds what it has
                    level += pages
                    continue
                begin, end = now, now + took  # its prefill runs late
            if end <= start:
                frees = True
                continue  # it frees its pages before this request takes its own
            grows_from = begin if begin > now else now
            grow = (p.kv_blocks - pages) / (end - grows_from) if p.kv_blocks > pages else 0.0
            if grows_from <= start:
                level += pages + grow * (start - grows_from)
                slope += grow
            else:
                level += pages
                events.append((grows_from, 0, 0.0, grow, grows_from))
            if end < horizon:
                events.append((end, 1, float(pages), grow, grows_from))
        if level > cap or not frees:
            return False
        t = start
        for at, kind, held, grow, grows_from in sorted(events):
            level += slope * (at - t)
            t = at
            if not kind:
                slope += grow
                continue
            if level > cap:
                return False
            level -= held + grow * (at - grows_from if at > grows_from else 0.0)
            if grows_from < at:
                slope -= grow
        return level + slope * (horizon - t) <= cap

    @staticmethod
    def table(state: ClusterState, choice: DecodeChoice, top_k: int) -> list[int]:
        """The positions the explanation lists: every instance in order (`top_k` 0),
        else the chosen one first, then the lowest predicted TBT (ties by id), `top_k`
        in all. Only the evaluated instances and the first idle ones are looked at:
        every idle one predicts the same, so later ones come after them."""
        n = len(choice.instances)
        if top_k <= 0:
            return list(range(n))
        pool: Iterable[int] = range(n)
        if choice.evaluated is not None:
            idle = choice.idle
            if idle is None or IDLE_KEPT <= len(idle) <= top_k:  # too few kept
                busy = state.candidates().decode_busy
                idle = []
                for i, inst in enumerate(choice.instances):
                    if inst.instance_id not in busy:
                        idle.append(i)
                        if len(idle) > top_k:
                            break
            pool = sorted({*choice.evaluated, *idle[: top_k + 1]})
        # Positions in order, then a stable sort by TBT: ties stay in id order (and
        # sorting positions by a key beats sorting (TBT, position) pairs).
        best = sorted(pool, key=choice.predicted_tbts.__getitem__)[: top_k + 1]
        chosen = choice.chosen_index
        order = [chosen] if chosen >= 0 else []
        order.extend(i for i in best if i != chosen)
        return order[:top_k]

    @staticmethod
    def _busy(state: ClusterState, decodes: list[InstanceState]) -> tuple[list[int], list[int]]:
        """Positions in `decodes` of the instances with work, in order, and the first
        `IDLE_KEPT` idle ones' (the first for the pick, the rest for the
        explanation's table; fewer when there are no more)."""
        busy = state.candidates().decode_busy
        found = still_busy(busy, state.instances, state.decode_busy, state.positions(decodes))
        idle: list[int] = []
        for i, inst in enumerate(decodes):
            if inst.instance_id not in busy:
                idle.append(i)
                if len(idle) == IDLE_KEPT:
                    break
        return found, idle

    def estimate(self, choice: DecodeChoice, i: int) -> DecodeEstimate:
        """Instance `i` of a choice at all three horizons."""
        inst = choice.instances[i]
        cost = self.costs.of(inst)
        decoding_batch = inst.decoding_requests + 1
        assigned_batch = inst.decode_requests + 1
        return DecodeEstimate(
            instance=inst,
            fits=choice.fits[i],
            decoding_batch=decoding_batch,
            decoding_tbt_s=cost.tbt_s(
                decoding_batch, inst.decoding_context_tokens + choice.context
            ),
            predicted_batch=choice.predicted_batches[i],
            predicted_tbt_s=choice.predicted_tbts[i],
            assigned_batch=assigned_batch,
            assigned_tbt_s=cost.tbt_s(assigned_batch, inst.decode_context_tokens + choice.context),
            at_time=choice.at_time,
        )

    def drain_time_s(
        self, state: ClusterState, est: DecodeEstimate, limit_s: float, context: int
    ) -> float:
        """Seconds from now until the predicted batch's TBT falls under `limit_s`, as
        its members finish (for a rejection's Retry-After)."""
        t_d = state.learned.decode_time_s
        members: list[tuple[float, int]] = []
        for p in state.assigned_placements(est.instance):
            duration = p.duration_cap if p.duration_cap < t_d else t_d
            start = p.decode_started or p.prefill_end
            members.append((start + duration, p.context_tokens))
        members.sort()
        batch = len(members) + 1
        ctx = sum(c for _, c in members) + context
        cost = self.costs.of(est.instance)
        if cost.tbt_s(batch, ctx) <= limit_s:
            return 0.0
        for end, c in members:
            batch -= 1
            ctx -= c
            if cost.tbt_s(batch, ctx) <= limit_s:
                return max(0.0, end - state.now)
        return t_d  # even alone it would be too slow: waiting helps little
