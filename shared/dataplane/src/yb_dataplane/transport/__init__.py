"""The KV data plane: KV cache bytes between processes over UCX, zero-copy.

A process that receives KV (decode, kvstore) runs one `KVReceiver` and announces its
address (a UCX worker address and a hello tag: no socket of its own listens). Before
bytes may arrive for a request it *reserves* destination buffers (`reserve`); a
sender (prefill, kvstore) then streams *segments*
(subsets of the reservation's indices, e.g. one layer at a time) with `KVSender.send`
and finally `commit`s. Bytes move once, from the sender's memory into the reserved
buffer (UCX rendezvous into a receive posted at the destination), host or device memory; each
host buffer's xxh3-64 checksum travels in the segment header and is verified on arrival
(device memory is not hashed: see README.md, Device memory).

The receiver accepts bytes only for a request it reserved, only into indices not yet
written, of exactly the reserved size; everything else is refused with a typed reason
(`errors.Reason`) that the sender raises as a `TransferError` subclass. A sender that
dies fails the transfer (UCX endpoint error handling and keepalive), one that drops
its connection says so (`Bye`), a silent one hits the deadline; nothing hangs.

For the block store: `KVReceiver.set_reservation_factory` lets a put allocate its slots
when its first segment arrives, and `KVSender.request_fetch` asks a holder to send
blocks into the asker's own reservation (the holder serves it with
`KVReceiver.set_fetch_handler`). The wire protocol is in `wire`, the connection
handshake in `handshake`.

UCX configuration (environment defaults and their reasons) lives in `ucx_env`.
"""

from yb_dataplane.transport.address import PeerAddress
from yb_dataplane.transport.buffers import BufferLike, as_bytes_view, checksum, nbytes
from yb_dataplane.transport.errors import (
    ChecksumMismatch,
    PeerUnreachable,
    Reason,
    ReservationRefused,
    SizeMismatch,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from yb_dataplane.transport.receiver import (
    FetchHandler,
    FetchOrder,
    KVReceiver,
    Reservation,
    ReservationFactory,
)
from yb_dataplane.transport.sender import KVSender
from yb_dataplane.transport.wire import SegmentHeader

__all__ = [
    "BufferLike",
    "ChecksumMismatch",
    "FetchHandler",
    "FetchOrder",
    "KVReceiver",
    "KVSender",
    "PeerAddress",
    "PeerUnreachable",
    "Reason",
    "Reservation",
    "ReservationFactory",
    "ReservationRefused",
    "SegmentHeader",
    "SizeMismatch",
    "TransferCancelled",
    "TransferError",
    "TransferTimeout",
    "as_bytes_view",
    "checksum",
    "nbytes",
]
