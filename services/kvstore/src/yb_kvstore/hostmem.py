"""Page-locked ("pinned") host memory for the DRAM tier, when CUDA is present.

GPUs copy to and from host memory by DMA, which needs pages the kernel cannot move.
From ordinary (pageable) memory every copy first goes through a pinned bounce buffer
of the CUDA driver (or of UCX's cuda_copy transport): an extra copy, and half the
bandwidth. Registering the slab with `cudaHostRegister` makes its pages DMA-able in
place, so blocks move between a GPU engine and the store's slab in one copy.

The kvstore image carries no torch, so the CUDA runtime is called through ctypes
(`libcudart`, from the system or an `nvidia-*` wheel); where libcudart is missing and
a CUDA torch is importable, torch's copy of the runtime is used instead. Without a
CUDA device the memory stays pageable, which is all a CPU cluster needs.

Registering costs what pinning costs: every page of the slab becomes resident at
once (the slab is otherwise lazily mapped), and the process opens a CUDA context on
device 0. `register` says what it did and why; the store logs it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

#: `cudaHostRegisterPortable`: pinned for every CUDA context of the process, not only
#: the one current when it was registered.
_HOST_REGISTER_PORTABLE: Final = 1

_CUDART_NAMES: Final = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


@dataclass(frozen=True, slots=True)
class HostMemory:
    """What `register` did with a block of host memory: pinned or not, and how or why."""

    pinned: bool
    how: str


#: `register`'s signature, for injection in `DramSlab`.
Register = Callable[[np.ndarray], HostMemory]


def _cudart_candidates() -> list[str]:
    found = ctypes.util.find_library("cudart")
    names = [found] if found else []
    names += list(_CUDART_NAMES)
    # The nvidia-cuda-runtime wheels (torch's CUDA builds pull them in).
    for base in sys.path:
        for pattern in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"):
            names += sorted(glob.glob(os.path.join(base, pattern)))
    return names


def _load_cudart() -> Any:
    for name in _cudart_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class _CudaRuntime:
    """The three calls of the CUDA runtime API this module needs, through ctypes."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]

    def _error(self, code: int) -> str:
        text = self._lib.cudaGetErrorString(code)
        return f"{text.decode() if text else 'error'} ({code})"

    def device_count(self) -> tuple[int, str]:
        count = ctypes.c_int(0)
        code = self._lib.cudaGetDeviceCount(ctypes.byref(count))
        return (count.value, "") if code == 0 else (0, self._error(code))

    def register(self, ptr: int, size: int) -> str:
        """ "" on success, else the error."""
        code = self._lib.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        return "" if code == 0 else self._error(code)

    def unregister(self, ptr: int) -> None:
        self._lib.cudaHostUnregister(ptr)


def _torch_runtime() -> tuple[Any, str]:
    """torch's CUDA runtime bindings if a CUDA torch is importable, else (None, why)."""
    if importlib.util.find_spec("torch") is None:
        return None, "no libcudart and no torch"
    import torch

    if not torch.cuda.is_available():
        return None, "no libcudart, and torch sees no CUDA device"
    return torch.cuda.cudart(), ""


def register(array: np.ndarray) -> HostMemory:
    """Page-lock `array`'s memory if a CUDA device is present; unregistered again when
    the array is freed. Never raises: pageable memory works, only slower with GPUs."""
    ptr = int(array.__array_interface__["data"][0])
    size = int(array.nbytes)
    if size == 0:
        return HostMemory(False, "pageable (empty)")
    lib = _load_cudart()
    if lib is not None:
        runtime = _CudaRuntime(lib)
        count, error = runtime.device_count()
        if count == 0:
            return HostMemory(False, f"pageable (no CUDA device: {error or 'none found'})")
        error = runtime.register(ptr, size)
        if error:
            return HostMemory(False, f"pageable (cudaHostRegister failed: {error})")
        weakref.finalize(array, runtime.unregister, ptr)
        return HostMemory(True, "pinned (cudaHostRegister through libcudart)")
    cudart, why = _torch_runtime()
    if cudart is None:
        return HostMemory(False, f"pageable ({why})")
    code = cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
    if int(code) != 0:
        return HostMemory(False, f"pageable (torch's cudaHostRegister failed: {code})")
    weakref.finalize(array, cudart.cudaHostUnregister, ptr)
    return HostMemory(True, "pinned (cudaHostRegister through torch)")
