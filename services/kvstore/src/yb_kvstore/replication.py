"""Carrying out the conductor's `ReplicationPlanned` decisions addressed to this store.

A hot prefix held on too few hosts is copied here from `source_instance`: this store
reserves DRAM slots for the blocks it lacks, asks the source to send them (the fetch
path of the transport, straight into the slots, one buffer per block), and commits
each verified block like a put, so its `BlockStored` events tell the index of the new
copy. A plan that cannot be carried out (source gone, slab layout unknown, slots all
pinned) is logged and dropped: replication is an optimisation, never a requirement.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from yb_core import events as ev
from yb_core.telemetry import get_logger
from yb_dataplane.peers import PeerDirectory
from yb_dataplane.transport import KVReceiver, KVSender, TransferError
from yb_dataplane.transport.blocks import fetch_request_id, key_text
from yb_kvstore.slab import SlabFull
from yb_kvstore.store import BlockStore

log = get_logger(__name__)


class Replicator:
    """Fetches planned hot blocks from another store into this one."""

    def __init__(
        self,
        instance_id: str,
        store: BlockStore,
        receiver: KVReceiver,
        sender: KVSender,
        peers: PeerDirectory,
        *,
        deadline_s: float = 30.0,
        on_outcome: Callable[[str, int], None] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self._store = store
        self._receiver = receiver
        self._sender = sender
        self._peers = peers
        self._deadline_s = deadline_s
        self._on_outcome = on_outcome or (lambda _outcome, _n: None)

    async def carry_out(self, plan: ev.ReplicationPlanned) -> int:
        """Copy the plan's missing blocks here; returns how many were stored."""
        if plan.target_instance != self.instance_id:
            return 0
        wanted = [k for k in dict.fromkeys(plan.block_hashes) if k not in self._store]
        if not wanted:
            return 0
        source = self._peers.address(plan.source_instance)
        block_nbytes = self._store.dram.block_nbytes
        if source is None or not block_nbytes:
            why = "source unknown" if source is None else "block layout not known yet"
            log.info("replication_skipped", source=plan.source_instance, reason=why)
            self._on_outcome("skipped", len(wanted))
            return 0
        keys: list[int] = []
        slots = []
        try:
            for key in wanted:
                slot = self._store.reserve_put(key, block_nbytes)
                if slot is not None:  # None: it arrived meanwhile
                    keys.append(key)
                    slots.append(slot)
        except (ValueError, SlabFull) as exc:
            log.info("replication_skipped", reason=str(exc))
        if not keys:
            self._on_outcome("skipped", len(wanted))
            return 0
        request_id = fetch_request_id(f"repl.{uuid.uuid4().hex[:12]}", 1)
        reservation = self._receiver.reserve(request_id, slots, deadline_s=self._deadline_s)
        try:
            await self._sender.request_fetch(
                source,
                request_id,
                [key_text(k) for k in keys],
                reply_to=self._receiver.address,
                deadline_s=self._deadline_s,
                breaks=reservation.breaks(),
            )
            await reservation.wait_committed()
        except TransferError as exc:
            self._receiver.cancel(request_id)
            for key in keys:
                self._store.abort_put(key)
            log.warning("replication_failed", source=plan.source_instance, error=str(exc))
            self._on_outcome("failed", len(keys))
            return 0
        checksums = reservation.checksums
        for i, key in enumerate(keys):
            self._store.commit_put(key, checksums[i : i + 1])
        log.info("replicated", source=plan.source_instance, blocks=len(keys), demand=plan.demand)
        self._on_outcome("stored", len(keys))
        return len(keys)
