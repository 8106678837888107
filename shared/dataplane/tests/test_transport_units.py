"""The transport's pure parts: addresses, the wire format, buffers and checksums."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import xxhash

from yb_dataplane.transport import (
    ChecksumMismatch,
    PeerAddress,
    Reason,
    ReservationRefused,
    SizeMismatch,
    TransferError,
    as_bytes_view,
    checksum,
    nbytes,
)
from yb_dataplane.transport.buffers import to_ucx
from yb_dataplane.transport.errors import error_for
from yb_dataplane.transport.wire import (
    MAX_FRAME,
    Ack,
    Commit,
    FetchRequest,
    FrameError,
    Message,
    Nack,
    SegmentHeader,
    data_tag,
    decode_frame,
    encode_frame,
)


def test_peer_address_round_trips_through_its_wire_string() -> None:
    worker = bytes(range(256)) + b"\x00\xff" * 3
    addr = PeerAddress("10.0.0.7", 0xDEADBEEF12345678, worker)
    wire = addr.to_wire()
    assert wire == str(addr) and wire.startswith("ucx://10.0.0.7/deadbeef12345678/")
    assert PeerAddress.parse(wire) == addr == PeerAddress.from_wire(wire)
    v6 = PeerAddress("::1", 7, b"w")
    assert PeerAddress.parse(v6.to_wire()) == v6
    # The log label is short and tells different receivers apart.
    assert len(addr.label) < 40 and addr.label != PeerAddress("10.0.0.7", 8, worker).label
    for bad in (
        "10.0.0.7:4711",  # the old host:port form
        "ucx://host/12",
        "ucx:///12/d29ya2Vy",
        "ucx://host/zz/d29ya2Vy",
        "ucx://host/0/d29ya2Vy",
        "ucx://host/12/",
        "ucx://host/12/not*base64",
        "ucx://host/12/d29y*2Vy",
        "ucx://a/b/12/d29ya2Vy",
    ):
        with pytest.raises(ValueError):
            PeerAddress.parse(bad)
    with pytest.raises(ValueError):
        PeerAddress("h", 1, b"x" * (17 << 10))


def test_every_message_survives_a_frame() -> None:
    messages: list[Message] = [
        SegmentHeader(3, "req", [0, 5], [10, 1 << 40], [0, (1 << 64) - 1]),
        Commit(4, "req"),
        Commit(4, "req", b"\x92\x01hand-over"),
        SegmentHeader(9, "req", [1], [8], [0], commit=True, note=b"\x00note"),
        FetchRequest(5, "req", ["a", "b"], "127.0.0.1:9", 1500),
        Ack(6),
        Nack(7, Reason.CHECKSUM, "bad bytes", [2]),
        Nack(8, Reason.DUPLICATE, "twice"),
    ]
    for message in messages:
        frame = encode_frame(message)
        buffer = bytearray(MAX_FRAME)
        buffer[: len(frame)] = frame
        assert decode_frame(buffer) == message
    # array_like: the tag is the first element, fields follow in order.
    body = bytes(encode_frame(Commit(4, "req")))[4:]
    assert msgspec.msgpack.decode(body) == ["commit", 4, "req", b""]
    # A note added last with a default: an older receiver's `Commit`, without it,
    # still reads the frame (msgspec drops trailing fields it does not know).

    class OlderCommit(msgspec.Struct, tag="commit", array_like=True):
        seq: int
        request_id: str

    older = msgspec.msgpack.decode(
        bytes(encode_frame(Commit(4, "req", b"n")))[4:], type=OlderCommit
    )
    assert (older.seq, older.request_id) == (4, "req")


def test_bad_frames_are_rejected() -> None:
    with pytest.raises(FrameError):
        decode_frame(bytearray(2))
    with pytest.raises(FrameError):
        decode_frame(bytearray(b"\xff\xff\xff\x7f" + b"\0" * 8))
    junk = bytearray(64)
    junk[:4] = (5).to_bytes(4, "little")
    junk[4:9] = msgspec.msgpack.encode(["nope", 1])[:5]
    with pytest.raises(FrameError):
        decode_frame(junk)
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame(FetchRequest(1, "r", ["k" * 1000] * 2000, "h:1", 1))


def test_data_tags_are_distinct_and_hash_to_themselves() -> None:
    tags = {data_tag(seq, pos) for seq in range(50) for pos in range(50)}
    assert len(tags) == 2500
    big = data_tag((1 << 40) - 1, (1 << 20) - 1)
    assert big < (1 << 61) - 1 and hash(big) == big


def test_errors_map_reasons_to_types() -> None:
    assert isinstance(error_for(Reason.SIZE_MISMATCH, "x"), SizeMismatch)
    assert isinstance(error_for(Reason.SIZE_MISMATCH, "x"), ReservationRefused)
    assert isinstance(error_for(Reason.CHECKSUM, "x"), ChecksumMismatch)
    refused = error_for(Reason.BAD_INDEX, "x", (9,))
    assert type(refused) is ReservationRefused
    assert refused.reason is Reason.BAD_INDEX and refused.indices == (9,)
    assert type(error_for(Reason.FETCH_FAILED, "x")) is TransferError


def test_views_and_checksums_are_zero_copy_over_any_host_buffer() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = as_bytes_view(arr)
    assert view.format == "B" and view.nbytes == 48 == nbytes(arr)
    arr[0, 0] = 42.0
    assert bytes(view[:4]) == np.float32(42.0).tobytes()  # same memory, not a copy
    assert checksum(arr) == xxhash.xxh3_64_intdigest(arr.tobytes())

    tensor = torch.arange(10, dtype=torch.float32).to(torch.bfloat16)
    assert nbytes(tensor) == 20
    assert checksum(tensor) == xxhash.xxh3_64_intdigest(tensor.view(torch.uint8).numpy().tobytes())
    as_bytes_view(tensor)[0] = 0x7F
    assert tensor.view(torch.uint8)[0].item() == 0x7F

    raw = bytearray(b"hello")
    assert checksum(raw) == checksum(b"hello") == xxhash.xxh3_64_intdigest(b"hello")
    assert as_bytes_view(memoryview(raw)).tobytes() == b"hello"


def test_destinations_must_be_writable_contiguous_buffers() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        to_ucx(np.zeros((4, 4))[:, 0], writable=False)
    with pytest.raises(ValueError, match="contiguous"):
        to_ucx(torch.zeros(4, 4).t(), writable=True)
    with pytest.raises(ValueError, match="read-only"):
        to_ucx(b"abc", writable=True)
    with pytest.raises(TypeError):
        to_ucx(object(), writable=False)
    out = to_ucx(torch.zeros(3, dtype=torch.float16), writable=True)
    assert out.dtype == np.uint8 and out.nbytes == 6


def test_adjacent_buffers_group_into_spans() -> None:
    from yb_dataplane.transport.buffers import joined
    from yb_dataplane.transport.sender import _spans

    cache = np.zeros((6, 100), np.uint8)
    rows = [cache[i] for i in range(6)]
    other = np.zeros(100, np.uint8)
    sources = [rows[0], rows[1], rows[2], other, rows[4], rows[5]]
    spans, messages = _spans(sources, [100] * 6, list(range(6)), None)
    assert spans == [3, 1, 2]
    assert [m.nbytes for m in messages] == [300, 100, 200]
    assert messages[0].__array_interface__["data"][0] == rows[0].__array_interface__["data"][0]
    # Buffers that are not adjacent, or out of order, travel one by one (no spans).
    assert _spans([rows[1], rows[0]], [100, 100], [0, 1], None) == ([], [rows[1], rows[0]])
    assert joined([rows[0], rows[2]]) is None
    # The receiver's layout splits runs further: at its breaks, and wherever the
    # reservation indices are not consecutive.
    spans, _ = _spans(sources, [100] * 6, list(range(6)), {2})
    assert spans == [2, 1, 1, 2]
    assert _spans(sources, [100] * 6, [0, 1, 5, 6, 7, 9], set())[0] == [2, 1, 1, 1, 1]


def test_a_binding_holds_ucx_to_the_interface_of_its_host() -> None:
    from yb_dataplane.transport.ucx_env import Binding

    assert Binding.for_host("127.0.0.1") == Binding("lo", 0)
    assert Binding.for_host("::1", 4800).options() == {
        "NET_DEVICES": "lo",
        "TCP_PORT_RANGE": "4800-4800",
    }
    assert Binding.for_host("0.0.0.0").options() == {}
    with pytest.raises(ValueError, match="not an address of any interface"):
        Binding.for_host("192.0.2.254" if not _local("192.0.2.254") else "198.51.100.254")
    with pytest.raises(ValueError, match="ucx_port"):
        Binding.for_host("127.0.0.1", 70000)


def _local(host: str) -> bool:
    from yb_core.netaddr import interface_of

    return interface_of(host) is not None
