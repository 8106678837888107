"""One active conductor at a time: a leased key in a JetStream KV bucket.

The bucket's `ttl` is the lease: the holder rewrites the key every `ttl / 3` with a
compare-and-set on the revision it last wrote (`update(last=...)`); a holder that
stops (crash, partition, a pause longer than the ttl) stops renewing, the server
expires the entry, and the next `create` — which only succeeds on an absent key —
makes a standby the holder. A holder whose renewal fails knows at once that it lost
the lease and stops publishing.

Two conductors can both believe they are active for at most one renewal period
(the old one's next renewal fails). That window is harmless by construction: both
fold the same log with the same code, so they publish the same decisions, and every
publish carries the decision's `Nats-Msg-Id` (`request_scheduled:<request id>`),
which JetStream de-duplicates: a request still gets exactly one decision.
"""

from __future__ import annotations

import contextlib

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from yb_core.telemetry import get_logger

log = get_logger(__name__)

LEASE_KEY = "active"


class Lease:
    """The conductor lease held (or wanted) by one conductor instance."""

    def __init__(
        self, js: JetStreamContext, bucket: str, holder: str, ttl_s: float, replicas: int = 1
    ) -> None:
        self._js = js
        self.bucket = bucket
        self.holder = holder
        self.ttl_s = ttl_s
        # As many copies as the event stream: on a three-node NATS cluster the lease
        # must survive the loss of a node too.
        self.replicas = replicas
        self._kv: KeyValue | None = None
        self._revision = 0

    @property
    def held(self) -> bool:
        """Whether this instance believes it holds the lease."""
        return self._revision > 0

    async def open(self) -> None:
        """Create (or bind to) the lease bucket."""
        try:
            self._kv = await self._js.create_key_value(
                bucket=self.bucket, ttl=self.ttl_s, history=1, replicas=self.replicas
            )
        except nats.js.errors.BadRequestError:
            # Exists with other settings (another ttl): use it as it is.
            self._kv = await self._js.key_value(self.bucket)

    async def acquire(self) -> bool:
        """Take the lease if nobody holds it; True when held afterwards."""
        assert self._kv is not None
        if self.held:
            return await self.renew()
        try:
            self._revision = await self._kv.create(LEASE_KEY, self.holder.encode())
            log.info("lease_acquired", bucket=self.bucket, revision=self._revision)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("lease_acquire_failed", error=repr(exc))
            return False
        # Someone holds it; if that someone is us (a restart within the ttl), resume.
        # A failed read (a timeout during a leader election) is "not ours now".
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError):
            entry = await self._kv.get(LEASE_KEY)
            if entry.value == self.holder.encode() and entry.revision:
                self._revision = entry.revision
                return await self.renew()
        return False

    async def renew(self) -> bool:
        """Extend the lease; False (and no longer held) if someone else has it now."""
        assert self._kv is not None
        if not self.held:
            return False
        try:
            self._revision = await self._kv.update(
                LEASE_KEY, self.holder.encode(), last=self._revision
            )
            return True
        except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("lease_lost", error=repr(exc))
            self._revision = 0
            return False

    async def release(self) -> None:
        """Give the lease up (a clean stop), so a standby takes over at once."""
        if self._kv is None or not self.held:
            return
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, OSError):
            await self._kv.delete(LEASE_KEY, last=self._revision)
        self._revision = 0
