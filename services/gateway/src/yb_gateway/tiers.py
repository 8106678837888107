"""Service tiers: which tier a request runs in, the one source of its SLOs and priority.

A request names its tier with `service_tier` (OpenAI's field): one of the tiers of
`gateway.service_tiers` (`GatewayConfig.resolved_service_tiers`; `default`, `priority`
and `flex` unless configured otherwise), or `auto`, which means `default` as it does
at OpenAI. The tier gives the request its TTFT and TBT SLOs and its priority, which
go to the conductor in `RequestAdmitted` (with the tier's name) and to the engines in
the `PrefillJob`; the answer reports the tier in its `service_tier`.

The `priority` extension (step 12's per-request integer) is kept as sugar for the
tier of that priority, for the clients written against it: `priority: 1` is the tier
whose priority is 1 (`priority` with the built-in tiers). It never sets a priority of
its own. A free integer would be a second mechanism beside the tiers: any client could
then place itself ahead of the tiers an operator configured, with no SLO that goes
with that place. A priority that no tier has, or that two tiers share, is a 400 that
lists the tiers; sent with a `service_tier`, it must be that tier's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from yb_core import events as ev
from yb_core.config import AUTO_TIER, DEFAULT_TIER, GatewayConfig
from yb_gateway.errors import ApiError, invalid_request


@dataclass(frozen=True, slots=True)
class ServedTier:
    """The tier a request runs in: its name, its SLOs and its priority."""

    name: str
    ttft_slo_s: float
    tbt_slo_s: float
    priority: int

    @property
    def slo(self) -> ev.Slo:
        """The SLOs as the log carries them."""
        return ev.Slo(ttft_s=self.ttft_slo_s, tbt_s=self.tbt_slo_s)


def served_tiers(gateway: GatewayConfig) -> dict[str, ServedTier]:
    """Every tier the gateway serves, by name, in the configuration's order."""
    return {
        name: ServedTier(name, tier.ttft_slo_s, tier.tbt_slo_s, tier.priority)
        for name, tier in gateway.resolved_service_tiers().items()
    }


def default_tier(gateway: GatewayConfig) -> ServedTier:
    """The tier of a request that names none."""
    return served_tiers(gateway)[DEFAULT_TIER]


def resolve_tier(
    service_tier: str | None, priority: int | None, gateway: GatewayConfig
) -> ServedTier:
    """The tier a request with these fields runs in (see the module docstring).

    Raises `ApiError` (400) naming the field at fault and listing the tiers served.
    """
    tiers = served_tiers(gateway)
    if service_tier is not None and service_tier != AUTO_TIER:
        tier = tiers.get(service_tier)
        if tier is None:
            raise invalid_request(
                f"Unknown service_tier {service_tier!r}; this server serves "
                f"{_names(tiers)}, and `{AUTO_TIER}` (= `{DEFAULT_TIER}`).",
                param="service_tier",
            )
        if priority is not None and priority != tier.priority:
            raise _priority_error(
                f"`priority` {priority} is not that of service_tier {tier.name!r} "
                f"({tier.priority}); `priority` only names a tier, so send one of the two",
                tiers,
            )
        return tier
    if priority is None:
        return tiers[DEFAULT_TIER]
    matches = [t for t in tiers.values() if t.priority == priority]
    if len(matches) == 1:
        return matches[0]
    why = "no tier has" if not matches else f"tiers {_names([t.name for t in matches])} share"
    raise _priority_error(
        f"`priority` {priority} names the service tier of that priority, and {why} it",
        tiers,
    )


def _priority_error(message: str, tiers: Mapping[str, ServedTier]) -> ApiError:
    listed = ", ".join(f"`{t.name}` ({t.priority})" for t in tiers.values())
    return invalid_request(
        f"{message}. Tiers (priority): {listed}; send `service_tier` instead.",
        param="priority",
    )


def _names(names: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)
