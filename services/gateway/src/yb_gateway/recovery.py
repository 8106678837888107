"""Putting a token stream back together when chunks are lost on the way.

Token chunks are core NATS messages, delivered at most once: while the gateway moves
to another NATS node (its node died) the chunks published meanwhile are dropped. The
decode instance keeps what it streamed (`yb_decode.history`), so a lost chunk is not
lost for good; `StreamRecovery` decides, without any I/O of its own, when the session
asks for it again (`protocol.ResendTokens`) and when to give up:

- chunks are numbered (`seq`): one ahead of the next expected is held, one already
  delivered or held is a duplicate (a resend overlaps what did arrive) and dropped;
- the session asks at once when there is a gap, when the bus reconnected (chunks may
  be gone without a gap showing, the last one included), and when the stream has
  been quiet for `PROBE_S`; while a gap or a reconnect is unresolved it asks again
  every `RETRY_S` (the decode instance may be moving to another node itself: nobody
  answers on its subject until it has);
- it gives up when the decode instance says it no longer holds the missing chunks,
  or when a gap stays unfilled for `GAP_PATIENCE_S`.

The session's own timeouts (first token, between tokens, the request's deadline)
still bound every wait.
"""

from __future__ import annotations

import math
from typing import Final, Literal

from yb_core import protocol

#: How long a stream may be quiet before the decode instance is asked whether chunks
#: were lost: a lost last chunk leaves no gap to see.
PROBE_S: Final = 2.0
#: How soon to ask again while a gap or a reconnect is unresolved.
RETRY_S: Final = 0.5
#: How long a gap may stay unfilled, asking every `RETRY_S`, before the stream ends
#: with `token_stream_gap`. It covers a decode instance that lost its own NATS node
#: and is reconnecting (nats-py's backoff is up to `nats.max_reconnect_wait_s`).
GAP_PATIENCE_S: Final = 10.0
#: The wait for one answer to a resend.
RESEND_TIMEOUT_S: Final = 2.0

#: Why a resend is asked, for the gateway's metrics.
Trigger = Literal["gap", "reconnect", "quiet"]


class StreamRecovery:
    """Order, de-duplication and resend decisions for one request's token stream."""

    def __init__(self, now: float) -> None:
        self.expected = 0  # the seq of the next chunk to deliver
        self._held: dict[int, protocol.TokenChunk] = {}
        self._heard_at = now  # the last chunk from the wire (or the start)
        self._asked_at = -math.inf
        # The bus reconnected and no decode answer came since: chunks may be lost.
        self._suspect = False
        self._trouble_since: float | None = None

    @property
    def gap(self) -> bool:
        """Chunks after a missing one have arrived."""
        return bool(self._held)

    @property
    def first_held(self) -> int:
        """The lowest seq held beyond the gap (-1 without a gap)."""
        return min(self._held) if self._held else -1

    def add(self, chunk: protocol.TokenChunk, now: float) -> bool:
        """Take a chunk from the wire; False when it is a duplicate."""
        self._heard_at = now
        if chunk.seq < self.expected or chunk.seq in self._held:
            return False
        self._held[chunk.seq] = chunk
        self._update(now)
        return True

    def next_ready(self, now: float) -> protocol.TokenChunk | None:
        """The next chunk in order, if it is here."""
        chunk = self._held.pop(self.expected, None)
        if chunk is not None:
            self.expected += 1
            self._update(now)
        return chunk

    def reconnected(self, now: float) -> None:
        """The bus reconnected: ask at once whether anything was lost."""
        self._suspect = True
        self._asked_at = -math.inf
        self._update(now)

    def due(self, now: float) -> Trigger | None:
        """Whether to ask for a resend now, and why."""
        if self._trouble_since is not None:
            if now - self._asked_at >= RETRY_S:
                return "gap" if self._held else "reconnect"
            return None
        if now - self._heard_at >= PROBE_S and now - self._asked_at >= PROBE_S:
            return "quiet"
        return None

    def asking(self, now: float) -> int:
        """A resend is being asked now; the seq to ask from."""
        self._asked_at = now
        return self.expected

    def seconds_to_next(self, now: float, *, asking: bool) -> float:
        """How long until something is due: a resend (unless one is in flight) or
        giving up on a gap."""
        waits = [math.inf]
        if self._trouble_since is not None:
            if self._held:
                waits.append(self._trouble_since + GAP_PATIENCE_S - now)
            if not asking:
                waits.append(self._asked_at + RETRY_S - now)
        elif not asking:
            waits.append(max(self._heard_at, self._asked_at) + PROBE_S - now)
        return max(0.0, min(waits))

    def given_up(self, now: float) -> bool:
        """A gap stayed unfilled for `GAP_PATIENCE_S`."""
        if self._trouble_since is None or now - self._trouble_since < GAP_PATIENCE_S:
            return False
        if self._held:
            return True
        # Only a reconnect that no answer resolved: stop asking so often; the token
        # timeouts and the instance's heartbeat cover a decode that is really gone.
        self._suspect = False
        self._update(now)
        return False

    def answered(self, reply: protocol.TokensResent | None, now: float) -> str:
        """Take the decode instance's answer (None: it did not answer); a reason to end
        the stream, or ''."""
        if reply is None:
            return ""  # asked again every RETRY_S while there is trouble
        missing = self.expected > 0 or bool(self._held)
        match reply.state:
            case "unknown" if missing:
                return "the decode instance no longer holds this stream"
            case "streaming" | "finished" if reply.first_seq > self.expected:
                return (
                    f"the decode instance no longer holds chunks {self.expected} to "
                    f"{reply.first_seq - 1}"
                )
            case _:
                # Whatever was missing has been published again (before this answer
                # left), or nothing was sent yet.
                self._suspect = False
        self._update(now)
        return ""

    def _update(self, now: float) -> None:
        if self._held or self._suspect:
            if self._trouble_since is None:
                self._trouble_since = now
        else:
            self._trouble_since = None
