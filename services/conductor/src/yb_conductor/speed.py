"""Learned speed: what the engines really take, against what the cost model says.

The cost model prices an engine alone on its hardware, at the moment it was
profiled. Two things it cannot know, both of which the log shows:

- its bias on this instance now (a profile taken on a quieter machine, or another
  one): a prefill alone takes `solo` times the cost model's time;
- contention: engines that share compute (CPU engines on one machine, as `yb up`
  runs them; `ConductorConfig.compute_sharing` says which do) slow each other down.
  Each other busy engine of the group adds `per_busy` times the time alone, so a
  prefill beside `k` busy engines takes `cost x solo x (1 + per_busy x k)`.

Both are moving averages of observed prefills, `prefill_started` to `prefill_done`
(one instance's own clock, so no skew between hosts): a prefill during which no
other engine of its group was busy teaches its engine's `solo`; one that ran beside
`k` others on average (sampled at its start and at its end) teaches the group's
`per_busy` (the hardware's, so shared by its engines). Until a contended prefill
has been seen, `per_busy` is the configured prior. A burst arrives before any of
its prefills ends, so what decides it is what earlier traffic taught and the prior;
what it teaches prices the next one.

Per decode instance, the lag from a prefill's end to the first token (decode checks
the commit, joins the request to its batch and streams the token the prefill
computed): a term the TTFT estimate otherwise lacks, and one that grows when the
decode engine is itself slowed down.

"Busy" is the conductor's own accounting, so the model is a pure function of the
log: a prefill engine with requests in flight; a decode engine decoding, or, when
predicting for a prefill that waits behind others, one with requests assigned (the
requests ahead will be decoding while it runs). Kvstores, gateways and the
conductor are not counted; what they cost is in the averages.
"""

from __future__ import annotations

import msgspec

# Observed over estimated time is taken within these bounds: a prefill that waited
# out a fetch timeout must not make an instance look a hundred times slower.
MAX_RATIO = 16.0
# And, alone, within this factor of what was learned so far: one outlier (the first
# request after a start, a neighbour's burst of work) moves `solo` by at most
# `alpha x solo`, while a lasting change still arrives within a few prefills.
MAX_STEP = 2.0
# Below this many other busy engines (averaged over the run) a prefill ran alone.
ALONE_BELOW = 0.5


class InstanceSpeed(msgspec.Struct, kw_only=True, gc=False):
    """What completions taught about one engine (see the module docstring)."""

    solo: float = 1.0
    first_token_s: float = 0.0
    solo_samples: int = 0
    first_token_samples: int = 0


class SharedSpeed(msgspec.Struct, kw_only=True, gc=False):
    """What contended prefills taught about one group of engines sharing compute:
    a property of the hardware they share, so learned once for all of them."""

    per_busy: float
    samples: int = 0


def learn_prefill(
    speed: InstanceSpeed,
    shared: SharedSpeed,
    observed_s: float,
    estimated_s: float,
    others: float,
    *,
    alpha: float,
) -> None:
    """Fold one prefill that took `observed_s` against the cost model's
    `estimated_s`, beside `others` busy engines of its group on average: alone, it
    teaches the engine's `solo`; beside others, the group's `per_busy`."""
    if observed_s <= 0.0 or estimated_s <= 0.0:
        return
    ratio = min(MAX_RATIO, max(1.0 / MAX_RATIO, observed_s / estimated_s))
    if others < ALONE_BELOW:
        ratio = min(speed.solo * MAX_STEP, max(speed.solo / MAX_STEP, ratio))
        speed.solo += alpha * (ratio - speed.solo)
        speed.solo_samples += 1
        return
    # ratio = solo x (1 + per_busy x others), solved for per_busy.
    implied = min(MAX_RATIO, max(0.0, (ratio / speed.solo - 1.0) / others))
    shared.per_busy += alpha * (implied - shared.per_busy)
    shared.samples += 1


def learn_first_token(speed: InstanceSpeed, lag_s: float, *, alpha: float) -> None:
    """Fold one request's lag from its prefill's end to its first token."""
    lag = max(0.0, lag_s)
    speed.first_token_s += alpha * (lag - speed.first_token_s)
    speed.first_token_samples += 1


def slowdown(speed: InstanceSpeed | None, per_busy: float, others: int) -> float:
    """How many times the cost model's time a prefill takes beside `others` busy
    engines of its group, each adding `per_busy` times its time alone."""
    solo = speed.solo if speed is not None else 1.0
    return solo * (1.0 + per_busy * others) if others else solo
