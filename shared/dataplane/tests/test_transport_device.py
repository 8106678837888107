"""Device buffers through a real UCX sender and receiver, without a GPU.

`HostCAI` is a device-like buffer: it exposes `__cuda_array_interface__` (and nothing
else) over host memory. ucxx takes the pointer from that interface exactly as it does
for a CUDA tensor (`ucxx._lib.arr.Array`), and UCX detects the memory behind it as
host memory, so the bytes really move; everything of ours on the way (`to_ucx`,
`joined`, spans, breaks, checksums, the receive path) takes the device branch. What
must hold: bytes arrive, adjacent pages travel as one region, and nothing is staged.
The same transfer with CUDA tensors is the `cuda` test at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from prometheus_client import CollectorRegistry

from yb_dataplane.transport import KVReceiver, KVSender, checksum
from yb_dataplane.transport.buffers import DeviceRegion, breaks, is_device, joined, to_ucx
from yb_dataplane.transport.sender import _spans

PAGE = 4096


class HostCAI:
    """`__cuda_array_interface__` (v3) over a C-contiguous host array; no buffer protocol."""

    def __init__(self, array: np.ndarray, *, readonly: bool = False) -> None:
        assert array.flags.c_contiguous
        self.array = array  # keeps the memory alive
        self.__cuda_array_interface__ = {
            "shape": (array.nbytes,),
            "typestr": "|u1",
            "data": (array.__array_interface__["data"][0], readonly),
            "strides": None,
            "version": 3,
        }


def pages(arena: np.ndarray, count: int, gap: int = 0) -> list[HostCAI]:
    """`count` device-like pages of PAGE bytes cut from `arena`, `gap` bytes apart."""
    return [HostCAI(arena[i * (PAGE + gap) : i * (PAGE + gap) + PAGE]) for i in range(count)]


def ptr(buf: Any) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


def staged_metric(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("yb_kv_staged_bytes_total")


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[KVReceiver, CollectorRegistry]]:
    rx = KVReceiver()
    registry = CollectorRegistry()
    rx.export_metrics(registry)
    await rx.start()
    try:
        yield rx, registry
    finally:
        await rx.close()


def test_device_like_buffers_join_only_when_adjacent() -> None:
    arena = np.zeros(6 * PAGE, np.uint8)
    rows = pages(arena, 6)
    assert all(is_device(r) for r in rows)
    assert to_ucx(rows[0], writable=True) is rows[0]

    region = joined(rows[1:4])
    assert isinstance(region, DeviceRegion)
    assert region.nbytes == 3 * PAGE and ptr(region) == ptr(rows[1])
    assert region.__cuda_array_interface__["data"][1] is False
    assert joined([rows[0]]) is rows[0]  # one device buffer is its own message
    assert joined([rows[0], rows[2]]) is None
    assert joined([rows[1], rows[0]]) is None
    # Never across memory domains, even where addresses touch.
    assert joined([rows[0], arena[PAGE : 2 * PAGE]]) is None
    # A read-only part makes the region read-only.
    ro = HostCAI(arena[PAGE : 2 * PAGE], readonly=True)
    assert joined([rows[0], ro]).__cuda_array_interface__["data"][1] is True  # type: ignore[union-attr]

    gapped = pages(np.zeros(4 * (PAGE + 64), np.uint8), 4, gap=64)
    assert breaks(rows) == []
    assert breaks(gapped) == [1, 2, 3]

    spans, messages = _spans(rows, [PAGE] * 6, list(range(6)), None)
    assert spans == [6] and isinstance(messages[0], DeviceRegion)
    assert messages[0].nbytes == 6 * PAGE
    spans, messages = _spans(rows, [PAGE] * 6, list(range(6)), {3})
    assert spans == [3, 3] and ptr(messages[1]) == ptr(rows[3])
    assert _spans(gapped, [PAGE] * 4, list(range(4)), None) == ([], gapped)


def test_device_memory_is_never_hashed() -> None:
    with pytest.raises(TypeError, match="device memory"):
        checksum(HostCAI(np.zeros(8, np.uint8)))


def test_real_ucxx_takes_a_device_like_buffer_as_cuda() -> None:
    # The class the transport hands every buffer to: it must read the CUDA array
    # interface (not fail, not fall back to the buffer protocol).
    from ucxx._lib.arr import Array

    arena = np.zeros(3 * PAGE, np.uint8)
    wrapped = Array(joined(pages(arena, 3)))
    assert wrapped.cuda is True
    assert wrapped.nbytes == 3 * PAGE and wrapped.c_contiguous


async def send_and_receive(
    sender: KVSender,
    receiver: KVReceiver,
    sources: Sequence[Any],
    destinations: Sequence[Any],
    request_id: str,
) -> list[int]:
    reservation = receiver.reserve(request_id, destinations, deadline_s=20.0)
    items = list(enumerate(sources))
    await sender.send(
        receiver.address,
        request_id,
        items,
        deadline_s=20.0,
        commit=True,
        receiver_breaks=reservation.breaks(),
    )
    await asyncio.wait_for(reservation.wait_committed(), 20.0)
    return reservation.checksums


@pytest.mark.parametrize("gap", [0, 64], ids=["adjacent", "apart"])
async def test_device_pages_move_with_nothing_staged(
    receiver: tuple[KVReceiver, CollectorRegistry],
    sender: KVSender,
    gap: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from yb_dataplane.transport.link import Link
    from yb_dataplane.transport.wire import data_tag

    posted: dict[str, list[Any]] = {"send": [], "recv": []}
    real_send, real_recv = Link.post_send, Link.post_recv

    def spy(kind: str, real: Any) -> Any:
        def post(self: Link, buffer: Any, tag: int) -> Any:
            if tag >= data_tag(0, 0):
                posted[kind].append(buffer)
            return real(self, buffer, tag)

        return post

    monkeypatch.setattr(Link, "post_send", spy("send", real_send))
    monkeypatch.setattr(Link, "post_recv", spy("recv", real_recv))
    rx, registry = receiver
    count = 8
    data = np.random.default_rng(7).integers(0, 256, count * PAGE, dtype=np.uint8)
    src_arena = data.copy()
    dst_arena = np.zeros(count * (PAGE + gap), np.uint8)
    # Sources are adjacent (one layer of a cache); destinations adjacent or not.
    sums = await send_and_receive(
        sender, rx, pages(src_arena, count), pages(dst_arena, count, gap), f"dev-{gap}"
    )
    for i in range(count):
        start = i * (PAGE + gap)
        assert np.array_equal(dst_arena[start : start + PAGE], data[i * PAGE : (i + 1) * PAGE])
    assert sums == [0] * count  # device to device: nobody hashed anything
    # What UCX was handed: device memory only, one region per run of adjacent pages.
    messages = 1 if gap == 0 else count
    assert len(posted["send"]) == len(posted["recv"]) == messages
    assert all(is_device(b) and not isinstance(b, np.ndarray) for b in posted["recv"])
    assert ptr(posted["recv"][0]) == ptr(pages(dst_arena, 1)[0])
    if gap == 0:
        assert isinstance(posted["recv"][0], DeviceRegion)
        assert posted["recv"][0].nbytes == count * PAGE
    assert rx.staged_bytes == 0
    assert staged_metric(registry) == 0.0


async def test_device_sender_to_a_host_receiver_and_back(
    receiver: tuple[KVReceiver, CollectorRegistry], sender: KVSender
) -> None:
    rx, registry = receiver
    count = 4
    data = np.random.default_rng(11).integers(0, 256, count * PAGE, dtype=np.uint8)
    host_dst = np.zeros(count * PAGE, np.uint8)
    host_views = [host_dst[i * PAGE : (i + 1) * PAGE] for i in range(count)]
    # Device to host: unchecksummed on the wire; the host side hashes what landed, so
    # a store still records a real xxh3 for every block it keeps.
    sums = await send_and_receive(sender, rx, pages(data.copy(), count), host_views, "d2h")
    assert np.array_equal(host_dst, data)
    assert sums == [xxhash.xxh3_64_intdigest(v.tobytes()) for v in host_views]

    # Host to device: xxh3 announced; a device destination takes it as announced.
    dev_dst = np.zeros(count * PAGE, np.uint8)
    sums = await send_and_receive(sender, rx, host_views, pages(dev_dst, count), "h2d")
    assert np.array_equal(dev_dst, data)
    assert sums == [checksum(v) for v in host_views]
    assert rx.staged_bytes == 0 and staged_metric(registry) == 0.0


@pytest.mark.cuda
async def test_cuda_tensor_pages_move_with_nothing_staged(
    receiver: tuple[KVReceiver, CollectorRegistry], sender: KVSender
) -> None:
    rx, registry = receiver
    layers, count = 2, 16
    source = torch.randint(0, 256, (layers, count, PAGE), dtype=torch.uint8, device="cuda")
    dest = torch.zeros_like(source)
    src = [source[layer, i] for layer in range(layers) for i in range(count)]
    dst = [dest[layer, i] for layer in range(layers) for i in range(count)]
    torch.cuda.synchronize()
    await send_and_receive(sender, rx, src, dst, "cuda")
    assert torch.equal(dest, source)
    assert rx.staged_bytes == 0 and staged_metric(registry) == 0.0
