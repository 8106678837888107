"""Buffers the data plane moves: zero-copy views, sizes and checksums.

A *buffer* is anything holding one C-contiguous block of bytes: a numpy array, a CPU
torch tensor (any dtype, bfloat16 included), an object exposing the buffer protocol
(bytes, bytearray, memoryview), or a device array exposing `__cuda_array_interface__`
(a CUDA torch tensor, a CuPy array). Host buffers are handed to UCX as flat uint8
numpy views of the same memory; device buffers are handed over as they are, since
ucxx reads `__cuda_array_interface__` itself (`ucxx._lib.arr.Array` takes the pointer
from it and never touches the bytes; UCX detects the memory type). Adjacent device
buffers are joined into one `DeviceRegion`, the device counterpart of a joined numpy
view. Nothing here copies memory, host or device: device memory is never hashed
(`checksum` refuses it) and never staged by this module.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import Any, Final, TypeAlias

import numpy as np
import xxhash

#: Anything `to_ucx` accepts (see the module docstring); typed loosely on purpose,
#: since torch is optional here and device arrays come from several libraries.
BufferLike: TypeAlias = Any


def _torch_bytes(tensor: Any) -> Any:
    """A flat uint8 tensor over the same memory as `tensor` (which must be contiguous)."""
    torch = sys.modules["torch"]
    if not tensor.is_contiguous():
        raise ValueError("tensor is not contiguous; the data plane moves whole blocks")
    return tensor.detach().reshape(-1).view(torch.uint8)


def _is_torch(buf: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


def is_device(buf: BufferLike) -> bool:
    """True for device (GPU) memory, which the CPU must not read directly."""
    if _is_torch(buf):
        return bool(buf.device.type != "cpu")
    return hasattr(buf, "__cuda_array_interface__")


def host_array(buf: BufferLike) -> np.ndarray:
    """A flat uint8 numpy view of a host buffer's memory (no copy).

    Raises ValueError for non-contiguous memory, TypeError for device memory or
    objects that are not buffers.
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("numpy array is not C-contiguous")
        return buf.reshape(-1).view(np.uint8)
    if _is_torch(buf):
        if buf.device.type != "cpu":
            raise TypeError("device tensor has no host view")
        return np.asarray(_torch_bytes(buf).numpy())
    if hasattr(buf, "__cuda_array_interface__"):
        raise TypeError("device array has no host view")
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"not a buffer: {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


def as_bytes_view(buf: BufferLike) -> memoryview:
    """A flat, byte-format memoryview over a host buffer's memory (no copy)."""
    arr = host_array(buf)
    return memoryview(arr.data).cast("B")


def nbytes(buf: BufferLike) -> int:
    """Size of a buffer in bytes."""
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    if _is_torch(buf):
        return int(buf.numel() * buf.element_size())
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        count = 1
        for dim in cai["shape"]:
            count *= int(dim)
        return count * int(np.dtype(cai["typestr"]).itemsize)
    return memoryview(buf).nbytes


def to_ucx(buf: BufferLike, *, writable: bool) -> Any:
    """What to hand to ucxx for `buf`: a uint8 host view, or the device array itself.

    `writable=True` (receive destinations) also checks that the memory may be written.
    """
    if is_device(buf):
        if _is_torch(buf):
            return _torch_bytes(buf)
        cai = buf.__cuda_array_interface__
        if writable and cai.get("data", (0, False))[1]:
            raise ValueError("device array is read-only")
        if cai.get("strides") is not None:
            # ucxx accepts explicit strides only when they describe C order; let it
            # check, but fail here for the common case of a sliced view.
            raise ValueError("device array is not C-contiguous")
        return buf
    arr = host_array(buf)
    if writable and not arr.flags.writeable:
        raise ValueError("destination buffer is read-only")
    return arr


#: The segment header's name for `checksum`'s algorithm.
XXH3_64: Final = "xxh3-64"
#: The segment header's name for "not checksummed" (device buffers, see `checksum`).
NO_CHECKSUM: Final = "none"


def checksum(buf: BufferLike) -> int:
    """xxh3-64 of a host buffer's raw bytes, hashed in place (zero-copy; xxhash
    releases the GIL).

    Raises TypeError for device memory: hashing it would take a copy to the host (a
    device synchronisation) or a kernel of our own, and the data plane does neither
    (a segment of device buffers travels unchecksummed: see the transport README).
    """
    if is_device(buf):
        raise TypeError("device memory is not checksummed (it would need a copy to the host)")
    return xxhash.xxh3_64_intdigest(host_array(buf).data)


def address(arr: np.ndarray) -> int:
    """The address of a host array's first byte."""
    return int(arr.__array_interface__["data"][0])


class DeviceRegion:
    """`nbytes` bytes of device memory from `ptr`, as one flat uint8 array.

    Exposes `__cuda_array_interface__` (version 3), so ucxx moves the region as one
    message. It keeps `parts` (the buffers it covers) alive as long as it lives.
    """

    __slots__ = ("__cuda_array_interface__", "nbytes", "parts", "ptr")

    def __init__(self, ptr: int, nbytes: int, parts: Sequence[Any], *, readonly: bool) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.parts = tuple(parts)
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, readonly),
            "strides": None,
            "version": 3,
        }


def _extent(part: Any) -> tuple[Hashable, int, int, bool] | None:
    """(memory domain, first byte, size, read-only) of a buffer as `to_ucx` returned
    it, or None if it cannot be joined.

    Two buffers may be joined only within one domain: host memory, one torch
    storage (pages of one KV cache tensor; never across two device allocations that
    merely happen to be adjacent, which one UCX message could not cover), or other
    device arrays (which carry no allocation identity: adjacency is taken to mean
    one allocation, as for the pages of one cache).
    """
    if isinstance(part, np.ndarray):
        if part.dtype != np.uint8 or part.ndim != 1:
            return None
        return "host", address(part), int(part.nbytes), not part.flags.writeable
    if _is_torch(part):
        if part.device.type == "cpu" or not part.is_contiguous():
            return None
        storage = part.untyped_storage().data_ptr()
        size = int(part.numel() * part.element_size())
        return ("torch", str(part.device), storage), int(part.data_ptr()), size, False
    cai = getattr(part, "__cuda_array_interface__", None)
    if cai is None or cai.get("strides") is not None or cai.get("mask") is not None:
        return None
    ptr, readonly = cai["data"]
    return "device-array", int(ptr), nbytes(part), bool(readonly)


def joined(parts: Sequence[Any]) -> np.ndarray | DeviceRegion | Any | None:
    """One buffer over parts that lie back to back in memory, in order, or None.

    Parts are buffers as `to_ucx` returned them. Host parts give a flat uint8 numpy
    view, device parts a `DeviceRegion`; a single part is returned as it is. None if
    a part cannot be joined, the parts are not adjacent or not in one memory domain
    (see `_extent`). The result covers exactly the parts' bytes (all valid memory,
    being adjacent), so UCX can move a run of pages as one message; nothing is
    copied.
    """
    first = parts[0]
    if len(parts) == 1:
        return first if isinstance(first, np.ndarray) or is_device(first) else None
    extents = [_extent(part) for part in parts]
    head = extents[0]
    if head is None:
        return None
    domain, start, end, readonly = head[0], head[1], head[1], False
    for extent in extents:
        if extent is None or extent[0] != domain or extent[1] != end:
            return None
        end += extent[2]
        readonly = readonly or extent[3]
    if domain == "host":
        view: np.ndarray = np.lib.stride_tricks.as_strided(
            first, shape=(end - start,), strides=(1,), writeable=bool(first.flags.writeable)
        )
        return view
    return DeviceRegion(start, end - start, parts, readonly=readonly)


def adjacent_key(part: Any) -> tuple[Hashable, int, int] | None:
    """(domain, first byte, size) of a buffer as `to_ucx` returned it, for grouping
    runs of adjacent buffers (`joined` accepts a run whose keys follow each other);
    None if it cannot be joined with anything."""
    extent = _extent(part)
    return None if extent is None else extent[:3]


def breaks(parts: Sequence[Any]) -> list[int]:
    """The indices `i > 0` whose buffer does not start where buffer `i - 1` ends.

    A receiver hands these to its sender (in a fetch request or a reservation reply):
    the sender then puts two buffers into one UCX message only where they are adjacent
    on both ends, so every message lands straight in its destination and nothing is
    staged. Device buffers are merged like host ones (within one allocation).
    """
    return [i for i in range(1, len(parts)) if joined(parts[i - 1 : i + 1]) is None]


def copy_into(target: Any, source: np.ndarray) -> None:
    """Copy host bytes into a destination as `to_ucx` returned it (host or torch device)."""
    if isinstance(target, np.ndarray):
        np.copyto(target, source)
    elif _is_torch(target):
        torch = sys.modules["torch"]
        target.copy_(torch.from_numpy(source))
    else:
        raise TypeError(f"cannot copy into {type(target).__name__}")
