"""The conductor as a pure function of the ordered log: `apply(seq, event) -> outputs`.

For an admission it decides on the spot, from the state folded so far, and accounts
the decision's load at once, so the next admission sees it. When the recorded
decision comes by later in the log, it is checked against the one computed here: in
a live conductor they are the same object; in a replay a difference is a divergence,
and the recorded decision wins (the log is the truth), so the state stays the one the
live conductor had. A what-if run (`follow_recorded=False`) does the opposite: it
ignores the recorded decisions and lives with its own.

A request gets exactly one decision per attempt: a repeated admission (a retried
publish that slipped past JetStream's duplicate window) is answered with nothing. A
re-plan (`RequestReplanned`, attempt k) releases the request's old placement and is
decided like an admission of the request as it stands (its prompt plus the tokens
already streamed, avoiding the engine that failed); the decision carries `attempt`
k. Decisions are matched to their recorded copies by request id and attempt; a late
copy of an earlier attempt's decision changes nothing.

Settings are part of the log too: at a `ConductorConfigured` event the fold adopts
the settings and cost model it records (a what-if run layers its overrides on top),
so a replay needs nothing but the log. A record it cannot read stops the fold
(`settings.RecordedSettingsError`, naming the event): deciding on with other
settings than recorded would make decisions no replay reproduces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from yb_conductor.cost_model import CostModel, load_cost_model
from yb_conductor.hotness import HotPrefixes
from yb_conductor.planner import Planner
from yb_conductor.policy import Policy, placement_policy
from yb_conductor.prefill_placement import PrefillPlanner
from yb_conductor.quality import DecisionQuality
from yb_conductor.retention import Retention
from yb_conductor.settings import from_event, with_overrides
from yb_conductor.state import ClusterState, Outcome, PendingAdmission
from yb_core import events as ev
from yb_core.config import ConductorConfig

Companion = ev.LoadPrediction | ev.ReplicationPlanned | ev.RetentionPlanned | ev.PoolPlanned
Output = ev.Decision | Companion

# Companions computed here and not yet seen in the log, at most (oldest dropped).
_MAX_COMPANIONS = 10_000


@dataclass(frozen=True, slots=True)
class Divergence:
    """A recorded output that this conductor would have made differently.

    `request_id` names the request (for a replication plan, its message id);
    `recomputed` is None when this conductor made no such output.
    """

    seq: int
    request_id: str
    recorded: Output
    recomputed: Output | None


def _own(cfg: ConductorConfig, cost: CostModel | None) -> CostModel:
    """A copy of the cost model for one conductor: the engines' announcements adjust
    its KV size (`Conductor._price_kv`), which must not change a model other
    conductors in the process share (the built-in ones are module constants)."""
    return msgspec.structs.replace(cost or load_cost_model(cfg.cost_model))


class Conductor:
    """Folds events and makes decisions; owns no I/O.

    `policy` defaults to the one `cfg` names; `cfg` is also what the state reads
    (`ClusterState.cfg`, one object: `configure` swaps it). `follow_recorded=False`
    makes a what-if conductor (recorded decisions ignored); `overrides` are settings laid
    over every configuration the log records; `adopt_logged_config=False` ignores
    those records altogether (tests of one fixed policy); `ignore_explain` compares
    recorded and recomputed decisions without their explanations (an explanation
    recomputed with a longer candidate table is still the same decision).
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        cfg: ConductorConfig | None = None,
        cost: CostModel | None = None,
        follow_recorded: bool = True,
        adopt_logged_config: bool = True,
        overrides: Mapping[str, Any] | None = None,
        ignore_explain: bool = False,
    ) -> None:
        self.overrides = dict(overrides or {})
        cfg = with_overrides(cfg or ConductorConfig(), self.overrides)
        # A setting that names another cost model (a what-if) prices with that model,
        # not with the one the log recorded; read once, so a bad file fails here.
        self._cost_override = (
            load_cost_model(cfg.cost_model) if "cost_model" in self.overrides else None
        )
        self.policy = policy if policy is not None else placement_policy(cfg, _own(cfg, cost))
        self._announced_kv_bytes = 0
        self._announced_layers = 0
        self.follow_recorded = follow_recorded
        self.adopt_logged_config = adopt_logged_config
        self.ignore_explain = ignore_explain
        self.state = ClusterState(cfg)
        self.last_seq = 0
        # Decisions computed here whose recorded copy has not been seen yet.
        self.unrecorded: dict[str, ev.Decision] = {}
        # What their admissions said, to re-place a recorded decision that differs.
        self.admission_info: dict[str, PendingAdmission] = {}
        # Load predictions and replication plans likewise, by message id.
        self.unrecorded_companions: dict[str, Companion] = {}
        self.divergences: list[Divergence] = []
        # Request id -> decision time, for de-duplication (pruned by event time).
        self.decided: dict[str, float] = {}
        self.quality = DecisionQuality()
        self.hot = HotPrefixes()
        self.retention = Retention()
        # The pools' planner (`planner`), on the same fold; its decisions name the
        # conductor that published the settings in force (`ConductorConfigured`).
        self.planner = Planner()
        self.planner_id = "conductor"
        # Completions not yet collected by the service's metrics (bounded).
        self.outcomes: list[Outcome] = []

    @property
    def cfg(self) -> ConductorConfig:
        """The settings in force (the state's: one object)."""
        return self.state.cfg

    def apply(self, seq: int, event: ev.AnyEvent) -> list[Output]:
        """Fold the event at stream sequence `seq`; return what it calls for.

        Events at or below the last applied sequence are redeliveries and ignored.
        Raises `RecordedSettingsError` at a `ConductorConfigured` it cannot read.
        """
        if seq and seq <= self.last_seq:
            return []
        if seq:
            self.last_seq = seq
        planner = self.planner
        planner.observe(event)  # first: an admission's placement reports to it
        out = self._fold(seq, event)
        if planner.due(self.cfg, self.state.now):
            cost = getattr(self.policy, "cost", None) or _own(self.cfg, self._cost_override)
            decision = planner.plan(self.cfg, self.state, cost, self.planner_id)
            self.unrecorded_companions[ev.message_id_for(decision)] = decision
            out = [*out, decision]
        return out

    def _fold(self, seq: int, event: ev.AnyEvent) -> list[Output]:
        match event:
            case ev.RequestAdmitted():
                return self._admit(seq, event)
            case ev.RequestReplanned():
                return self._replan(seq, event)
            case ev.RequestScheduled() | ev.RequestRejected():
                if self.follow_recorded:
                    self._recorded(seq, event)
                return []
            case ev.LoadPrediction() | ev.ReplicationPlanned() | ev.RetentionPlanned():
                if self.follow_recorded:
                    self._recorded_companion(seq, event)
                return []
            case ev.PoolPlanned():
                if self.follow_recorded:
                    mine = self._recorded_companion(seq, event)
                    if mine != event:
                        self.planner.adopt(
                            event, mine if isinstance(mine, ev.PoolPlanned) else None
                        )
                return []
            case ev.ConductorConfigured():
                self.planner_id = event.instance_id
                if self.adopt_logged_config:
                    cfg, cost = from_event(event, seq=seq)
                    self.configure(with_overrides(cfg, self.overrides), self._cost_override or cost)
                return []
            case ev.RequestFinished():
                self.state.apply(event)
                if self.state.outcomes:
                    for outcome in self.state.outcomes:
                        self.quality.record_outcome(outcome)
                    if len(self.outcomes) < 10_000:
                        self.outcomes.extend(self.state.outcomes)
                    self.state.outcomes.clear()
                return []
            case ev.InstanceUp(kv_spec=spec) if spec is not None:
                self.state.apply(event)
                layers = event.num_layers or spec.num_layers
                self._price_kv(spec.bytes_per_token_layer * layers, layers)
                return []
            case _:
                self.state.apply(event)
                return []

    def _price_kv(self, bytes_per_token: int, layers: int) -> None:
        """Price KV transfers at what the engines announce one token's KV to be (a
        model with latent attention keeps a fraction of what per-head K/V would): the
        cost model's figure is the profile's, which may be of another model. A load
        the prefill computes on as it lands overlaps layer by layer, over the model's
        `layers`."""
        self._announced_kv_bytes = bytes_per_token
        self._announced_layers = layers
        cost = getattr(self.policy, "cost", None)
        if cost is not None:
            cost.kv_bytes_per_token = bytes_per_token
        planner = getattr(self.policy, "prefill", None)
        if isinstance(planner, PrefillPlanner):
            planner.overlap_layers = layers

    def configure(self, cfg: ConductorConfig, cost: CostModel | None = None) -> None:
        """Decide with these settings from now on. The state and its history stay
        and read the new settings: what was learned stays, and a learning turned off
        is no longer applied; `decode_time_s` seeded the learned decode time once."""
        self.policy = placement_policy(cfg, _own(cfg, cost))
        if self._announced_kv_bytes:  # what the engines said outlives a reconfiguration
            self._price_kv(self._announced_kv_bytes, self._announced_layers)
        self.state.cfg = cfg

    def _admit(self, seq: int, event: ev.RequestAdmitted) -> list[Output]:
        state = self.state
        state.apply(event)
        rid = event.request_id
        if rid in self.decided or rid in state.placements:
            # Decided already (a retried admission): nothing new to account.
            if rid not in self.unrecorded and rid not in state.placements:
                state.admissions.pop(rid, None)
            return []
        return self._decide(seq, event, 0)

    def _replan(self, seq: int, event: ev.RequestReplanned) -> list[Output]:
        if attempt_key(event.request_id, event.attempt) in self.decided:
            return []  # a repeated re-plan: decided already
        self.state.apply(event)
        with self.state.avoiding(event.failed_instance):
            return self._decide(seq, event.as_admission(), event.attempt)

    def _decide(self, seq: int, event: ev.RequestAdmitted, attempt: int) -> list[Output]:
        state = self.state
        rid = event.request_id
        info = state.admissions.get(rid)
        if event.prompt_logprobs:
            # Only a whole-model prefill computes a prompt's logprobs, from its first
            # token: no group (their stages hold parts of the model), no reuse.
            with state.avoiding(*state.group_leads()):
                decided = self.policy.decide(
                    state, msgspec.structs.replace(event, block_hashes=[]), seq
                )
        else:
            decided = self.policy.decide(state, event, seq)
        decision = decided.decision
        if attempt:
            decision = msgspec.structs.replace(decision, attempt=attempt)
        if isinstance(decision, ev.RequestScheduled):
            state.place(decision)
            if not attempt:
                reused = max((r.first_block + r.num_blocks for r in decision.reuse), default=0)
                self.planner.placed(rid, min(event.prompt_tokens, reused * event.block_size))
        else:
            state.admissions.pop(rid, None)
        self._remember(attempt_key(rid, attempt), decision.time)
        self.unrecorded[rid] = decision
        if info is not None:
            self.admission_info[rid] = info
        self.quality.record(decision)
        extra: list[Companion] = list(decided.predictions)
        replica = self.hot.observe(self.cfg, state, event, decision)
        if replica is not None:
            extra.append(replica)
        extra.extend(self.retention.observe(self.cfg, state, event, decision))
        companions = self.unrecorded_companions
        for out in extra:
            companions[ev.message_id_for(out)] = out
        while len(companions) > _MAX_COMPANIONS:
            del companions[next(iter(companions))]
        return [decision, *extra]

    def _remember(self, key: str, at: float) -> None:
        decided = self.decided
        decided[key] = at
        # Oldest first (insertion order): forget what is past any retry's reach.
        horizon = self.state.now - self.cfg.request_timeout_s
        while decided:
            first = next(iter(decided))
            if decided[first] >= horizon:
                break
            del decided[first]
            rid, attempt = split_attempt_key(first)
            mine = self.unrecorded.get(rid)
            if mine is not None and mine.attempt == attempt:
                del self.unrecorded[rid]
                self.admission_info.pop(rid, None)

    def _recorded_companion(self, seq: int, recorded: Companion) -> Companion | None:
        """Match a recorded companion with the one made here (returned; None if none)."""
        key = ev.message_id_for(recorded)
        mine = self.unrecorded_companions.pop(key, None)
        if mine is not None and mine != recorded:
            rid = getattr(recorded, "request_id", "") or key
            self.divergences.append(Divergence(seq, rid, recorded, mine))
        return mine

    def _recorded(self, seq: int, recorded: ev.Decision) -> None:
        rid = recorded.request_id
        mine = self.unrecorded.get(rid)
        if mine is not None and mine.attempt > recorded.attempt:
            return  # a late copy of an earlier attempt's decision: superseded
        if mine is not None and mine.attempt < recorded.attempt:
            mine = None  # ours is for an attempt the log has moved past
        else:
            self.unrecorded.pop(rid, None)
        info = self.admission_info.pop(rid, None)
        if self._same(mine, recorded):
            return
        if mine is None:
            key = attempt_key(rid, recorded.attempt)
            if key in self.decided:
                return  # a second copy of a decision already seen: no new load
            # Decided before our log began (a truncated log): adopt it.
            self._remember(key, recorded.time)
        else:
            self.divergences.append(Divergence(seq, rid, recorded, mine))
        # The log is the truth: replace our accounting with the recorded decision's,
        # placed with what its admission said.
        if isinstance(mine, ev.RequestScheduled):
            self.state.unplace(rid)
        if info is not None:
            self.state.admissions[rid] = info
        self.state.apply(recorded)

    def _same(self, mine: ev.Decision | None, recorded: ev.Decision) -> bool:
        if mine == recorded:
            return True
        if not self.ignore_explain or mine is None:
            return False
        return msgspec.structs.replace(mine, explain=None) == msgspec.structs.replace(
            recorded, explain=None
        )


# Separates a request id from its attempt in `Conductor.decided`'s keys (request ids
# are gateway-made and never hold control characters).
_ATTEMPT_SEPARATOR = "\x1f"


def attempt_key(request_id: str, attempt: int) -> str:
    """The key that de-duplicates the decision on one attempt of a request: its id
    for the first plan (as before re-plans existed), id and attempt after."""
    return request_id if not attempt else f"{request_id}{_ATTEMPT_SEPARATOR}{attempt}"


def split_attempt_key(key: str) -> tuple[str, int]:
    """`attempt_key` undone: the request id and the attempt."""
    rid, _, attempt = key.partition(_ATTEMPT_SEPARATOR)
    return rid, int(attempt) if attempt else 0
