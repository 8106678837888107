"""Which engines are alive, folded from the instance events of the log.

`/readyz` answers 200 only when a request could actually be served: the bus is up,
the tokenizer is loaded, and at least one prefill and one decode instance of the
served model are alive. Liveness is judged from the log alone, like the conductor
does: `InstanceUp` adds an instance, `InstanceDown` removes it, and one whose last
`InstanceUp`/`LoadReport` is older than the heartbeat timeout counts as dead, so a
crashed engine that never said goodbye stops making the gateway ready.
"""

from __future__ import annotations

from dataclasses import dataclass

from yb_core import events as ev
from yb_core.bus import EventReader

INSTANCE_SUBJECTS = "yb.ev.instance.>"
ENGINE_ROLES: tuple[ev.Role, ...] = ("prefill", "decode")


@dataclass(slots=True)
class _Instance:
    role: ev.Role
    last_seen: float


class InstanceTracker:
    """Live engine instances of one model, as of the events applied so far.

    `apply` is a pure fold (no clock, no I/O) so it is tested by feeding events;
    `alive` takes the current time from the caller.
    """

    def __init__(self, model: str, heartbeat_timeout_s: float) -> None:
        self.model = model
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._instances: dict[str, _Instance] = {}
        self.events_applied = 0

    def apply(self, event: ev.AnyEvent) -> None:
        """Fold one instance event; other events are ignored."""
        match event:
            case ev.InstanceUp(role=role, model=model) if role in ENGINE_ROLES:
                # An instance that does not say which model it serves is trusted: an
                # older publisher may not fill the field.
                if model and model != self.model:
                    self._instances.pop(event.instance_id, None)
                else:
                    self._instances[event.instance_id] = _Instance(role, event.time)
            case ev.InstanceDown():
                self._instances.pop(event.instance_id, None)
            case ev.LoadReport():
                # Reports refresh known instances only: a report alone does not say
                # which model the instance serves.
                known = self._instances.get(event.instance_id)
                if known is not None:
                    known.last_seen = max(known.last_seen, event.time)
            case _:
                return
        self.events_applied += 1

    def alive(self, role: ev.Role, now: float) -> list[str]:
        """Ids of the instances of `role` heard from within the heartbeat timeout."""
        horizon = now - self.heartbeat_timeout_s
        return sorted(
            iid
            for iid, inst in self._instances.items()
            if inst.role == role and inst.last_seen >= horizon
        )

    async def follow(self, reader: EventReader) -> None:
        """Apply every instance event from the reader until it ends (bus closed)."""
        async for logged in reader:
            self.apply(logged.event)
