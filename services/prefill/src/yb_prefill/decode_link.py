"""Prefill's side of the control conversation with a decode instance.

Core NATS request/reply on `yb.job.decode.<id>`: `ReserveKV` sets aside the decode
pages a prefill streams into, `StartDecode` hands the request over once its KV is
committed, `AbortReservation` gives the pages back when the prefill cannot finish.
Every failure to get the answer a prefill needs is a `JobFailed` (`yb_core.protocol`)
with the status its client should see.
"""

from __future__ import annotations

import contextlib

import msgspec

from yb_core import protocol as pr
from yb_core.bus import Bus, BusError


class DecodeLink:
    """Requests to decode instances, with their replies checked."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus

    async def reserve(
        self, decode_id: str, reserve: pr.ReserveKV, timeout_s: float
    ) -> pr.KVReserved:
        """Pages on `decode_id` for the request; a refusal is a `JobFailed`."""
        reply = await self.request(decode_id, reserve, timeout_s)
        if isinstance(reply, pr.ReserveRefused):
            raise pr.JobFailed(f"decode instance {decode_id} refused: {reply.reason}")
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
            raise pr.JobFailed(f"decode instance {decode_id} unreachable: {exc}") from exc
        try:
            return pr.decode_reply_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise pr.JobFailed(f"malformed reply from decode instance: {exc}", 502) from exc
