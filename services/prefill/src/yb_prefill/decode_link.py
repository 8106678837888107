"""Prefill's side of the control conversation with a decode instance.

Core NATS request/reply on `yb.job.decode.<id>`: `ReserveKV` sets aside the decode
pages a prefill streams into, `StartDecode` hands the request over once its KV is
committed, `AbortReservation` gives the pages back when the prefill cannot finish.
Every failure to get the answer a prefill needs is a `JobFailed` (`yb_core.protocol`)
with the status its client should see.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import msgspec

from yb_core import protocol as pr
from yb_core.bus import Bus, BusError

if TYPE_CHECKING:
    from yb_engine.kv_cache import PagedKVCache

#: How much sooner than the requester gives up a decode instance must answer a
#: reservation that waits for pages (`ReserveKV.wait_s`): its reply's way back.
RESERVE_REPLY_MARGIN_S = 2.0


class DecodeLink:
    """Requests to decode instances, with their replies checked."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus

    async def reserve_for(
        self,
        job: pr.PrefillJob,
        prefill_instance: str,
        cache: PagedKVCache,
        num_layers: int,
        timeout_s: float,
        head_cuts: list[int] | None = None,
    ) -> pr.KVReserved:
        """Pages for `job` on its decode instance, which must lay them out as this
        side's `cache` does for `num_layers` layers (the whole model's, for a stage
        that holds only some): the same pages, layers, bytes per page and tokens per
        page, cut at `head_cuts` (None: whole pages). A mismatch gives the reservation
        back and fails the job (500: a misconfigured cluster)."""
        layout = (
            cache.pages_for(len(job.token_ids)),
            num_layers,
            cache.page_nbytes,
            cache.block_size,
        )
        decode_id = job.decision.decode_instance
        reserve = pr.ReserveKV(
            request_id=job.request_id,
            prefill_instance=prefill_instance,
            num_tokens=len(job.token_ids),
            sampling=job.sampling,
            token_subject=job.token_subject,
            deadline=job.deadline,
            prompt_token_ids=job.token_ids,
            trace_headers=job.trace_headers,
            ttft_started=job.decision.time,
            priority=job.priority,
            attempt=job.attempt,
            generated_tokens=job.generated_tokens,
            head_cuts=head_cuts or [],
            wait_s=max(0.0, timeout_s - RESERVE_REPLY_MARGIN_S),
            preemptible=job.preemptible,
        )
        reply = await self.reserve(decode_id, reserve, timeout_s)
        found = (reply.num_pages, reply.num_layers, reply.page_nbytes, reply.block_size)
        if reply.head_cuts != (head_cuts or []):
            await self.abort(decode_id, job.request_id, "layout mismatch")
            raise pr.JobFailed(
                f"decode instance {decode_id} reserved pages cut at {reply.head_cuts}, "
                f"not at {head_cuts}: it predates tensor-parallel transfers",
                status=500,
            )
        if found != layout:
            await self.abort(decode_id, job.request_id, "layout mismatch")
            raise pr.JobFailed(
                f"decode KV layout {found[0]}x{found[1]}x{found[2]}B ({found[3]}-token "
                f"pages) does not match prefill's {layout[0]}x{layout[1]}x{layout[2]}B "
                f"({layout[3]}-token pages)",
                status=500,
            )
        return reply

    async def reserve(
        self, decode_id: str, reserve: pr.ReserveKV, timeout_s: float
    ) -> pr.KVReserved:
        """Pages on `decode_id` for the request; a refusal is a `JobFailed` that
        blames the decode instance (a re-plan avoids it)."""
        reply = await self.request(decode_id, reserve, timeout_s)
        if isinstance(reply, pr.ReserveRefused):
            raise pr.JobFailed(
                f"decode instance {decode_id} refused: {reply.reason}", failed_instance=decode_id
            )
        if not isinstance(reply, pr.KVReserved):
            raise pr.JobFailed(f"unexpected reply from decode instance: {type(reply).__name__}")
        return reply

    async def start(self, decode_id: str, start: pr.StartDecode, timeout_s: float) -> None:
        """Hand the request over; decode verifies the commit before it acknowledges."""
        ack = await self.request(decode_id, start, timeout_s)
        if not isinstance(ack, pr.DecodeAck) or not ack.ok:
            reason = ack.reason if isinstance(ack, pr.DecodeAck) else type(ack).__name__
            raise pr.JobFailed(f"decode instance did not start the request: {reason}")

    async def abort(self, decode_id: str, request_id: str, reason: str) -> None:
        """Give the reservation back (best effort, 2 s: the reservation also expires)."""
        with contextlib.suppress(pr.JobFailed):
            await self.request(
                decode_id, pr.AbortReservation(request_id=request_id, reason=reason), 2.0
            )

    async def request(
        self, decode_id: str, message: pr.DecodeControl, timeout_s: float
    ) -> pr.DecodeReply:
        """One control message and its decoded reply."""
        try:
            msg = await self._bus.request(
                pr.decode_control_subject(decode_id), pr.encode(message), timeout_s=timeout_s
            )
        except BusError as exc:
            raise pr.JobFailed(
                f"decode instance {decode_id} unreachable: {exc}", failed_instance=decode_id
            ) from exc
        try:
            return pr.decode_reply_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise pr.JobFailed(f"malformed reply from decode instance: {exc}", 502) from exc
