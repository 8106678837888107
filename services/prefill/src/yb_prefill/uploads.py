"""Storing a request's newly computed full blocks into this host's kvstore.

After the first token is handed to decode, the blocks this instance computed (and
those it pulled from another host, which thereby get a copy on this host, as the
design's replication asks) are put into the kvstore of its own host, one put per
block straight from the engine's pages. That is off the request's critical path: it
runs as a background task while the next request computes. The pages stay
referenced in the engine cache until their put is done, so nothing reuses them
meanwhile. A put the store refuses as a duplicate means the block is there already.

While a job waits for pages (`pages_wanted`), puts not yet posted are skipped as
their turn comes, without a round trip: their pages come back as soon as a put in
flight ends. A put already posted is waited for, never cancelled: the
transport may still be reading its pages, and a page reused meanwhile could be
committed in the store under the block's key with another request's KV in it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from yb_core.telemetry import get_logger
from yb_dataplane.transport import (
    KVSender,
    PeerAddress,
    PeerUnreachable,
    Reason,
    ReservationRefused,
    TransferError,
)
from yb_dataplane.transport.blocks import PutId
from yb_engine.kv_cache import PagedKVCache
from yb_prefill.prefix_cache import PrefixCache

log = get_logger(__name__)


@dataclass(slots=True)
class UploadResult:
    """What one request's uploads did."""

    stored: int = 0
    duplicate: int = 0
    failed: int = 0
    skipped: int = 0
    nbytes: int = 0


class BlockUploader:
    """Puts blocks held in the engine cache into one kvstore (see the module doc)."""

    def __init__(
        self,
        cache: PrefixCache,
        kv: PagedKVCache,
        sender: KVSender,
        *,
        concurrency: int = 4,
        deadline_s: float = 30.0,
    ) -> None:
        self.cache = cache
        self.kv = kv
        self.sender = sender
        self.deadline_s = deadline_s
        self._slots = asyncio.Semaphore(max(1, concurrency))
        #: Set by the engine loop while a job waits for pages: puts not yet posted
        #: are skipped (a cache fill is worth less than a request's first token).
        self.pages_wanted = False
        #: Set each time a put gives its page's reference back.
        self.released = asyncio.Event()

    async def upload(self, store: PeerAddress | None, keys: Sequence[int]) -> UploadResult:
        """Put `keys` (each referenced in the cache by the caller) into `store`.

        Releases each key's reference when its put is done; never raises a transfer
        error (a failed put only means the pool does not get that block).
        """
        result = UploadResult()
        pending = list(keys)
        if store is None:
            result.skipped = len(pending)
            self.cache.release(pending)
            return result
        broken = False

        async def one(key: int) -> None:
            nonlocal broken
            try:
                async with self._slots:
                    if broken or self.pages_wanted:
                        result.skipped += 1
                        return
                    await self._put(store, key)
                    result.stored += 1
                    result.nbytes += self.kv.num_layers * self.kv.page_nbytes
            except ReservationRefused as exc:
                if exc.reason == Reason.DUPLICATE:
                    result.duplicate += 1
                else:
                    result.failed += 1
                    log.info("block_put_refused", key=f"{key:x}", error=str(exc))
            except TransferError as exc:
                result.failed += 1
                if isinstance(exc, PeerUnreachable):
                    broken = True  # do not try the rest against a store that is gone
                log.warning("block_put_failed", key=f"{key:x}", error=str(exc))
            finally:
                self.cache.release([key])
                self.released.set()

        await asyncio.gather(*(one(k) for k in pending))
        return result

    async def _put(self, store: PeerAddress, key: int) -> None:
        page = self.cache.page_of(key)
        layers = self.kv.num_layers
        rid = PutId(key, layers, self.kv.page_nbytes).request_id()
        items = [(layer, self.kv.page_view(layer, page)) for layer in range(layers)]
        await self.sender.send(store, rid, items, deadline_s=self.deadline_s, commit=True)
