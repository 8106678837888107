"""Storing a request's newly computed full blocks into its host's kvstore.

An engine that computed a prompt puts its full blocks into the kvstore of its own
host, one put per block straight from the engine's pages (`BlockUploader`): the
blocks it computed, and those it pulled from another host's kvstore, which thereby
get a copy on this host, as the design's replication asks; the blocks it read from
this host's kvstore are there already (`blocks_to_store`). The prefill engine does
so after each prefill (`yb_prefill`), and a decode engine after each prompt it
prefilled inside its batch (`yb_decode.piggyback`). The kvstore logs each block it
stores (`BlockStored`), which is how the conductor learns the pool holds it.

That is off the request's critical path: it runs as a background task of the
caller's after the first token. The caller holds each block's page until its put is
done (`HeldBlocks`), so nothing reuses the page meanwhile. A put the store refuses as
a duplicate means the block is there already; a failed put means only that the pool
does not get that block: it is logged and counted, never raised.

While the caller wants pages back (`pages_wanted`), puts not yet posted are skipped
as their turn comes, without a round trip: their pages come back as soon as a put in
flight ends. A put already posted is waited for, never cancelled: the transport may
still be reading its pages, and a page reused meanwhile could be committed in the
store under the block's key with another request's KV in it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from yb_core.telemetry import get_logger
from yb_dataplane.prefix_fetch import PagedBuffers
from yb_dataplane.transport import (
    KVSender,
    PeerAddress,
    PeerUnreachable,
    Reason,
    ReservationRefused,
    TransferError,
)
from yb_dataplane.transport.blocks import PutId

log = get_logger(__name__)

#: The outcomes an upload counts, in `UploadResult`'s field names.
OUTCOMES = ("stored", "duplicate", "failed", "skipped")


@dataclass(slots=True)
class UploadResult:
    """What one request's uploads did."""

    stored: int = 0
    duplicate: int = 0
    failed: int = 0
    skipped: int = 0
    nbytes: int = 0

    def counts(self) -> dict[str, int]:
        """The blocks by outcome (`OUTCOMES`), those with none left out."""
        return {o: n for o in OUTCOMES if (n := getattr(self, o))}


class HeldBlocks(Protocol):
    """The pages of the blocks being uploaded, as the caller holds them."""

    def page_of(self, key: int) -> int:
        """The engine page holding block `key`."""
        ...

    def release(self, keys: Sequence[int]) -> None:
        """The uploads are done with these blocks' pages."""
        ...


def full_blocks(num_tokens: int, num_keys: int, block_size: int) -> int:
    """How many leading blocks of a computed prompt are full (and have a key)."""
    return max(0, min(num_keys, num_tokens // block_size))


def blocks_to_store(first: int, end: int, loaded_from: Mapping[int, str], store: str) -> list[int]:
    """The blocks of `[first, end)` that go into kvstore `store` (see the module doc):
    every one but those read from `store` itself (`loaded_from`: block -> source)."""
    return [i for i in range(first, end) if loaded_from.get(i) != store]


class BlockUploader:
    """Puts blocks held in an engine's pages into one kvstore (see the module doc)."""

    def __init__(
        self,
        kv: PagedBuffers,
        sender: KVSender,
        *,
        concurrency: int = 4,
        deadline_s: float = 30.0,
    ) -> None:
        self.kv = kv
        self.sender = sender
        self.deadline_s = deadline_s
        self._slots = asyncio.Semaphore(max(1, concurrency))
        #: Set by the caller while it waits for pages: puts not yet posted are
        #: skipped (a cache fill is worth less than a request's first token).
        self.pages_wanted = False
        #: Set each time a put gives its page back.
        self.released = asyncio.Event()

    async def upload(
        self, store: PeerAddress | None, keys: Sequence[int], held: HeldBlocks
    ) -> UploadResult:
        """Put `keys` (their pages held by `held`) into `store`, each put within
        `deadline_s`.

        Releases each key's page when its put is done; never raises a transfer error
        (a failed put only means the pool does not get that block).
        """
        result = UploadResult()
        pending = list(keys)
        if store is None:
            result.skipped = len(pending)
            held.release(pending)
            return result
        broken = False

        async def one(key: int) -> None:
            nonlocal broken
            try:
                async with self._slots:
                    if broken or self.pages_wanted:
                        result.skipped += 1
                        return
                    await self._put(store, held.page_of(key), key)
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
                held.release([key])
                self.released.set()

        await asyncio.gather(*(one(k) for k in pending))
        return result

    async def _put(self, store: PeerAddress, page: int, key: int) -> None:
        layers = self.kv.num_layers
        # A tensor-parallel engine's page is cut across its ranks: one piece per run.
        cuts = self.kv.head_cuts
        rid = PutId(key, layers, self.kv.page_nbytes, len(cuts) - 1).request_id()
        items = list(
            enumerate(
                piece for layer in range(layers) for piece in self.kv.pieces(layer, page, cuts)
            )
        )
        await self.sender.send(store, rid, items, deadline_s=self.deadline_s, commit=True)
