"""The data plane's wire protocol, on one screen.

A connection joins a `KVSender` to a `KVReceiver`. It is made without any listening
socket (see `address`): the sender creates a UCX endpoint from the receiver's worker
address and sends a `Hello` with the receiver's hello tag, carrying its own worker
address and the base of its private tag space; the receiver creates an endpoint back
from that address and answers `Welcome` with the base of its own tag space. From
then on each side sends on its endpoint with tags hashed from the *other* side's
base and posts its receives with tags hashed from its own, so tags never collide
across connections. Three kinds of messages travel:

    CTRL   sender -> receiver   a control frame: SegmentHeader | Commit | FetchRequest
    REPLY  receiver -> sender   a control frame: Ack | Nack, matched to `seq`
    DATA   sender -> receiver   raw bytes of one buffer; tag = data_tag(seq, position)

Closing an endpoint tells the peer nothing (UCX only notices a dead *process*), so a
side that drops a connection while the peer lives sends it a `Bye` (on CTRL or
REPLY, from a short-lived endpoint of its own, since the dropped one can no longer
send); the peer then drops its half too and nothing waits on a dead connection.

A control frame is a 4-byte little-endian length and a msgpack body: one struct of
the tagged union `Message` (array_like; the tag is the first element). The receiver
keeps one receive posted for the next frame into a `MAX_FRAME`-byte buffer, so a frame
is a single UCX message and needs no separate size message.

A segment is a header followed, without waiting, by its DATA messages: one per
buffer, or one per *span* of buffers that lie back to back in the sender's memory
(consecutive pages of one layer of an engine's KV cache), so that a run of small
pages costs one UCX message, not one each (`SegmentHeader.spans`). The receiver
validates the header, then posts each receive straight into the reserved destination
(UCX rendezvous: the payload moves once, from the sender's memory into the
destination, when the receive is posted); a span whose destinations are not back to
back in the receiver's memory lands in a staging buffer and is copied out. Checksums
stay per buffer. Every DATA message has its own tag, so the order in which
segments' messages are posted does not matter and concurrent segments on one
endpoint never mix. A header with `commit` set also commits the request once the
segment is verified: one round trip instead of two for a transfer sent as one
segment. A refused segment's payloads are
drained into a scratch sink (or, past `DRAIN_LIMIT`, the endpoint is closed), so no
message is ever left unmatched and the stream stays usable.

Evolution: fields are only ever appended, with defaults; never reordered (array_like).
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from yb_dataplane.transport.errors import Reason

#: Largest control frame, bytes (a header costs ~25 bytes per buffer: ~40k buffers).
MAX_FRAME: Final = 1 << 20
#: Refused payload bytes one segment may drain into scratch before the link is closed.
DRAIN_LIMIT: Final = 64 << 20

#: Version of this protocol, sent in `Hello`; a receiver refuses any other. 2: segment
#: headers name their checksum algorithm (device buffers travel unchecksummed).
PROTOCOL_VERSION: Final = 2
#: Largest `Hello` frame (a worker address is a few hundred bytes).
MAX_HELLO: Final = 64 << 10

CTRL_TAG: Final = 1
REPLY_TAG: Final = 2
_DATA_BASE: Final = 16
_POSITION_BITS: Final = 20
#: Most buffers in one segment (position field of the data tag).
MAX_SEGMENT_BUFFERS: Final = 1 << _POSITION_BITS


def data_tag(seq: int, position: int) -> int:
    """The tag of the `position`-th DATA message (buffer or span) of segment `seq`.

    Kept below 2**61 so that Python's `hash()` (which ucxx applies) is the identity.
    """
    return _DATA_BASE + (seq << _POSITION_BITS) + position


class SegmentHeader(msgspec.Struct, tag="seg", array_like=True, frozen=True, gc=False):
    """Announces one segment: which reserved indices, how many bytes, which checksums.

    `spans[m]` is how many consecutive buffers (in header order) DATA message `m`
    carries; empty means one message per buffer. `commit`: commit the request once
    this segment is verified (send it last). `note`: with `commit`, a message for the
    reservation's owner that the commit delivers (`Reservation.note`): what the
    sender would otherwise send it over another channel right after the commit.
    """

    seq: int
    request_id: str
    indices: list[int]
    sizes: list[int]
    checksums: list[int]
    spans: list[int] = []
    commit: bool = False
    #: How `checksums` were computed: "xxh3-64", or "none" for a segment of device
    #: buffers, which nobody hashes (their checksums are 0 and are not verified).
    checksum: str = "xxh3-64"
    #: Added last with a default: a frame from an older sender still decodes.
    note: bytes = b""

    def message_spans(self) -> list[int]:
        """Buffers per DATA message (one each when `spans` is empty)."""
        return list(self.spans) if self.spans else [1] * len(self.indices)


class Commit(msgspec.Struct, tag="commit", array_like=True, frozen=True, gc=False):
    """The sender is done with `request_id`: the receiver checks completeness. `note`
    as in `SegmentHeader`."""

    seq: int
    request_id: str
    note: bytes = b""


class FetchRequest(msgspec.Struct, tag="fetch", array_like=True, frozen=True, gc=False):
    """Asks a holder to send the blocks `keys` into `reply_to`'s reservation `request_id`."""

    seq: int
    request_id: str
    keys: list[str]
    reply_to: str
    deadline_ms: int
    # The asker's reservation indices whose destination does not follow the previous
    # index's in its memory (see `buffers.breaks`). Added last with a default, so an
    # older asker's frame still decodes (None: it may get spans that it must stage).
    breaks: list[int] | None = None


class Ack(msgspec.Struct, tag="ack", array_like=True, frozen=True, gc=False):
    """The segment, commit or fetch `seq` succeeded."""

    seq: int


class Nack(msgspec.Struct, tag="nack", array_like=True, frozen=True, gc=False):
    """The segment, commit or fetch `seq` was refused, with why and which indices."""

    seq: int
    reason: Reason
    message: str
    indices: list[int] = []


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True, gc=False):
    """A sender's offer of a connection: how to reach it and where its tags start."""

    version: int
    worker: bytes
    recv_base: int
    name: str = ""


class Welcome(msgspec.Struct, tag="welcome", array_like=True, frozen=True, gc=False):
    """The receiver's acceptance: the base of its tag space (0: refused, see `reason`)."""

    recv_base: int
    reason: str = ""


class Bye(msgspec.Struct, tag="bye", array_like=True, frozen=True, gc=False):
    """The other side dropped this connection; drop your half too."""

    reason: str = ""


Message = SegmentHeader | Commit | FetchRequest | Ack | Nack | Hello | Welcome | Bye

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(Message)
_LEN: Final = struct.Struct("<I")


class FrameError(Exception):
    """A control frame that cannot be decoded: the peer is not speaking this protocol."""


def encode_frame(message: Message) -> bytearray:
    """Length-prefixed msgpack frame for `message`; raises ValueError past MAX_FRAME."""
    frame = bytearray(_LEN.size)
    _encoder.encode_into(message, frame, _LEN.size)
    body = len(frame) - _LEN.size
    if len(frame) > MAX_FRAME:
        raise ValueError(f"control frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    _LEN.pack_into(frame, 0, body)
    return frame


def decode_frame(buffer: bytearray | memoryview) -> Message:
    """Decode the frame at the start of `buffer` (a receive buffer of MAX_FRAME bytes)."""
    view = memoryview(buffer)
    if len(view) < _LEN.size:
        raise FrameError("short frame")
    (body,) = _LEN.unpack_from(view, 0)
    if body > len(view) - _LEN.size:
        raise FrameError(f"frame length {body} exceeds the buffer")
    try:
        message: Message = _decoder.decode(view[_LEN.size : _LEN.size + body])
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise FrameError(str(exc)) from exc
    return message
