"""What a decode instance has streamed, kept so that lost chunks can be sent again.

Token chunks are core NATS messages, delivered at most once: those published while
the gateway moves to another NATS node (its node died) are lost. The gateway notices
(a gap in `seq`, its reconnect, or a stream gone quiet) and asks with
`protocol.ResendTokens`; `TokenHistory` is what the decode instance answers from.

Chunks are small (a token id and its text, msgpack-encoded), so every chunk of a live
stream is kept, and a finished stream's for `RETENTION_S` more: the gateway asks
within seconds of the loss, the last chunk included. Memory is bounded all the same:
past `MAX_BYTES` the oldest finished streams go first, then the oldest chunks of the
stream that is growing; past `MAX_FINISHED` finished streams, the oldest go. Expiry
runs on every call, so no task is needed to keep it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

#: How long a finished stream stays available for resends.
RETENTION_S: Final = 30.0
#: The accounted size of everything held (encoded chunks plus `CHUNK_OVERHEAD` each).
MAX_BYTES: Final = 32 * 1024 * 1024
#: How many finished streams are held at most.
MAX_FINISHED: Final = 10_000
#: What a held chunk costs beyond its bytes (the bytes object and its deque slot).
CHUNK_OVERHEAD: Final = 48


@dataclass
class KeptStream:
    """One stream's chunks `first_seq` .. `next_seq - 1`, as they were published."""

    subject: str
    first_seq: int = 0
    chunks: deque[bytes] = field(default_factory=deque)
    nbytes: int = 0
    finished_at: float = 0.0  # monotonic; 0 while the stream is live

    @property
    def next_seq(self) -> int:
        """The sequence number the next chunk of the stream gets."""
        return self.first_seq + len(self.chunks)

    @property
    def finished(self) -> bool:
        """True once the stream's last chunk was published."""
        return self.finished_at > 0.0

    def since(self, seq: int) -> list[bytes]:
        """The held chunks from `seq` on (from the oldest held when `seq` is older)."""
        start = max(0, seq - self.first_seq)
        return list(itertools.islice(self.chunks, start, None))


class TokenHistory:
    """The chunks of live streams and of recently finished ones, by request id."""

    def __init__(
        self,
        *,
        retention_s: float = RETENTION_S,
        max_bytes: int = MAX_BYTES,
        max_finished: int = MAX_FINISHED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.max_finished = max_finished
        self._clock = clock
        self._live: dict[str, KeptStream] = {}
        # In the order they finished: the oldest expire first.
        self._finished: OrderedDict[str, KeptStream] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._live) + len(self._finished)

    def record(self, request_id: str, subject: str, seq: int, payload: bytes) -> None:
        """Keep one chunk just published on `subject`.

        Decode numbers a stream's chunks from 0 without holes; a chunk that does not
        follow the held ones starts the history again from it (nothing older can be
        resent then, which the gateway is told by `first_seq`).
        """
        self._expire()
        kept = self._live.get(request_id)
        if kept is None:
            # A finished one of the same id is stale: the request ids are unique, so
            # only a restarted stream reuses one.
            self._drop(self._finished.pop(request_id, None))
            kept = self._live[request_id] = KeptStream(subject, first_seq=seq)
        elif seq != kept.next_seq:
            self._forget_chunks(kept, len(kept.chunks))
            kept.first_seq = seq
        size = len(payload) + CHUNK_OVERHEAD
        kept.chunks.append(payload)
        kept.nbytes += size
        self.nbytes += size
        self._bound(kept)

    def finish(self, request_id: str) -> None:
        """The stream ended: keep it for `retention_s` from now."""
        kept = self._live.pop(request_id, None)
        if kept is None:
            return
        kept.finished_at = max(self._clock(), 1e-9)
        self._finished[request_id] = kept
        self._expire()

    def get(self, request_id: str) -> KeptStream | None:
        """What is held of a stream, live or finished within the retention."""
        self._expire()
        return self._live.get(request_id) or self._finished.get(request_id)

    def _expire(self) -> None:
        horizon = self._clock() - self.retention_s
        while self._finished:
            request_id, kept = next(iter(self._finished.items()))
            if kept.finished_at > horizon and len(self._finished) <= self.max_finished:
                break
            del self._finished[request_id]
            self._drop(kept)

    def _bound(self, growing: KeptStream) -> None:
        # Finished streams are the least likely to be asked for: they go first. Then
        # the growing stream's oldest chunks, which a gateway asking now is least
        # likely to miss (it lost what was sent in the last seconds).
        while self.nbytes > self.max_bytes and self._finished:
            _, kept = self._finished.popitem(last=False)
            self._drop(kept)
        while self.nbytes > self.max_bytes and len(growing.chunks) > 1:
            self._forget_chunks(growing, 1)
            growing.first_seq += 1

    def _forget_chunks(self, kept: KeptStream, count: int) -> None:
        for _ in range(count):
            size = len(kept.chunks.popleft()) + CHUNK_OVERHEAD
            kept.nbytes -= size
            self.nbytes -= size

    def _drop(self, kept: KeptStream | None) -> None:
        if kept is not None:
            self.nbytes -= kept.nbytes
            kept.chunks.clear()
            kept.nbytes = 0
