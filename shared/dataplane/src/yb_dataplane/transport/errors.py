"""Typed transfer errors, and the reason codes that carry them over the wire.

A receiver refuses with a `Nack` carrying a `Reason`; the sender raises the matching
subclass, so both ends of a failed transfer name the same cause.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class Reason(enum.StrEnum):
    """Why a receiver refused a segment, a commit or a fetch."""

    UNKNOWN_REQUEST = "unknown_request"  # no reservation (never made, expired, cancelled)
    BAD_INDEX = "bad_index"  # index outside the reservation
    DUPLICATE = "duplicate"  # index already written, in flight, or twice in one segment
    SIZE_MISMATCH = "size_mismatch"  # size differs from the reserved buffer's
    CHECKSUM = "checksum"  # bytes arrived but their xxh3 differs from the header's
    INCOMPLETE = "incomplete"  # commit while indices are missing
    MALFORMED = "malformed"  # header fields inconsistent (lengths differ, ...)
    TIMEOUT = "timeout"  # a deadline passed on the receiving side
    CANCELLED = "cancelled"  # the receiver cancelled the reservation or closed
    PEER_UNREACHABLE = "peer_unreachable"  # a connection broke
    FETCH_FAILED = "fetch_failed"  # a fetch handler failed without a typed reason


class TransferError(Exception):
    """Base of every failure of the KV data plane; `reason` says which kind."""

    default_reason: ClassVar[Reason] = Reason.FETCH_FAILED

    def __init__(
        self, message: str, *, reason: Reason | None = None, indices: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        #: The precise cause (e.g. BAD_INDEX for a ReservationRefused); what goes on the wire.
        self.reason: Reason = reason if reason is not None else self.default_reason
        #: Buffer indices the failure concerns (refused or corrupted), when known.
        self.indices = indices


class PeerUnreachable(TransferError):
    """The connection could not be made, or broke (peer died or closed)."""

    default_reason = Reason.PEER_UNREACHABLE


class TransferTimeout(TransferError):
    """A deadline passed before the operation finished (silent or stuck peer)."""

    default_reason = Reason.TIMEOUT


class TransferCancelled(TransferError):
    """The reservation was cancelled, or its receiver closed."""

    default_reason = Reason.CANCELLED


class ReservationRefused(TransferError):
    """The receiver refused: no such reservation, bad index, duplicate, incomplete."""

    default_reason = Reason.UNKNOWN_REQUEST


class SizeMismatch(ReservationRefused):
    """A buffer's size differs from the size the receiver reserved for that index."""

    default_reason = Reason.SIZE_MISMATCH


class ChecksumMismatch(TransferError):
    """Bytes arrived whose xxh3-64 differs from the checksum the sender announced."""

    default_reason = Reason.CHECKSUM


_BY_REASON: dict[Reason, type[TransferError]] = {
    Reason.UNKNOWN_REQUEST: ReservationRefused,
    Reason.BAD_INDEX: ReservationRefused,
    Reason.DUPLICATE: ReservationRefused,
    Reason.INCOMPLETE: ReservationRefused,
    Reason.MALFORMED: ReservationRefused,
    Reason.SIZE_MISMATCH: SizeMismatch,
    Reason.CHECKSUM: ChecksumMismatch,
    Reason.TIMEOUT: TransferTimeout,
    Reason.CANCELLED: TransferCancelled,
    Reason.PEER_UNREACHABLE: PeerUnreachable,
    Reason.FETCH_FAILED: TransferError,
}


def error_for(reason: Reason, message: str, indices: tuple[int, ...] = ()) -> TransferError:
    """The typed exception for a reason: what a sender raises for a refusal it received."""
    return _BY_REASON.get(reason, TransferError)(message, reason=reason, indices=indices)
