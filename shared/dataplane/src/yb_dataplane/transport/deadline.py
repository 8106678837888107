"""Deadlines: every await in the data plane is bounded by one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from yb_dataplane.transport.errors import TransferTimeout

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point on the monotonic clock. APIs take `deadline_s` (seconds from now)."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline `seconds` from now; a non-positive value is already expired."""
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.at

    async def run(self, awaitable: Awaitable[T], what: str) -> T:
        """Await `awaitable`, raising TransferTimeout (naming `what`) at the deadline.

        On timeout the awaitable is cancelled, as with `asyncio.wait_for`. A TimeoutError
        the awaitable raises by itself (its own, shorter timeout) passes through as is.
        """
        scope = asyncio.timeout_at(self._loop_time())
        try:
            async with scope:
                return await awaitable
        except TimeoutError:
            if scope.expired():
                raise TransferTimeout(f"{what}: deadline passed") from None
            raise

    def _loop_time(self) -> float:
        # asyncio's clock is time.monotonic on every supported platform, but its origin
        # is the loop's own; translate rather than assume.
        loop = asyncio.get_running_loop()
        return loop.time() + (self.at - time.monotonic())
