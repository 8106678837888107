"""Buffers the data plane moves: zero-copy views, sizes and checksums.

A *buffer* is anything holding one C-contiguous block of bytes: a numpy array, a CPU
torch tensor (any dtype, bfloat16 included), an object exposing the buffer protocol
(bytes, bytearray, memoryview), or a device array exposing `__cuda_array_interface__`
(a CUDA torch tensor, a CuPy array). Host buffers are handed to UCX as flat uint8
numpy views of the same memory; device buffers are handed over as they are, since
ucxx reads `__cuda_array_interface__` itself. Nothing here copies host memory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

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


def checksum(buf: BufferLike) -> int:
    """xxh3-64 of a buffer's raw bytes.

    Host memory is hashed in place (zero-copy; xxhash releases the GIL). Device memory
    is copied to the host first, which only a torch tensor knows how to do: that slow
    path exists for correctness, not speed.
    """
    if is_device(buf):
        if not _is_torch(buf):
            raise TypeError("checksum of a non-torch device array is not supported")
        return xxhash.xxh3_64_intdigest(_torch_bytes(buf).cpu().numpy().data)
    return xxhash.xxh3_64_intdigest(host_array(buf).data)


def address(arr: np.ndarray) -> int:
    """The address of a host array's first byte."""
    return int(arr.__array_interface__["data"][0])


def joined(parts: Sequence[Any]) -> np.ndarray | None:
    """One flat uint8 view over host arrays that lie back to back in memory, in order.

    None if any part is not a host array or the parts are not adjacent. The view
    covers exactly the parts' bytes (which are all valid memory, being adjacent), so
    UCX can move a run of pages as one message; no byte is copied.
    """
    first = parts[0]
    if not isinstance(first, np.ndarray):
        return None
    if len(parts) == 1:
        return first
    start = address(first)
    end = start
    for part in parts:
        if not isinstance(part, np.ndarray) or part.dtype != np.uint8 or part.ndim != 1:
            return None
        if address(part) != end:
            return None
        end += part.nbytes
    view: np.ndarray = np.lib.stride_tricks.as_strided(
        first, shape=(end - start,), strides=(1,), writeable=bool(first.flags.writeable)
    )
    return view


def breaks(parts: Sequence[Any]) -> list[int]:
    """The indices `i > 0` whose buffer does not start where buffer `i - 1` ends.

    A receiver hands these to its sender (in a fetch request or a reservation reply):
    the sender then puts two buffers into one UCX message only where they are adjacent
    on both ends, so every message lands straight in its destination and nothing is
    staged. Device buffers are never merged, so each is a break.
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
