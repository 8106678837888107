"""Routes token chunks to the sessions streaming them.

The gateway subscribes once to every token subject addressed to it
(`protocol.token_subjects`), when it connects and before it admits any request,
rather than once per request: a subscription per request costs a SUB and an UNSUB
that the server applies to its subject index, and a task and a queue in nats-py, for
every request. A session routes its stream's subject here before its job leaves (so
no chunk for it can arrive unrouted) and forgets it when that stream ends; chunks
for a subject nobody streams (an earlier attempt's, a request that ended) are
dropped, as they were by the subscription that no longer existed.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.msg import Msg


class TokenRoutes:
    """Token subject -> what takes its chunks' payloads."""

    def __init__(self) -> None:
        self._routes: dict[str, Callable[[bytes], None]] = {}

    def route(self, subject: str, take: Callable[[bytes], None]) -> None:
        """Hand every chunk on `subject` to `take` from now on (before the job leaves)."""
        self._routes[subject] = take

    def forget(self, subject: str) -> None:
        """Drop the chunks on `subject` from now on."""
        self._routes.pop(subject, None)

    def __len__(self) -> int:
        return len(self._routes)

    async def deliver(self, msg: Msg) -> None:
        """The subscription's callback: the chunk to its stream, if one is routed."""
        take = self._routes.get(msg.subject)
        if take is not None:
            take(msg.data)
