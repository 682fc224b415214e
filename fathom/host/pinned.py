"""Page-locked host memory mapped into the GPU's address space, with an explicit lifetime.

``cuMemHostAlloc(DEVICEMAP | PORTABLE)`` through cuda-python: the same bytes are
a NumPy array on the host and, through ``__cuda_array_interface__``, a Numba
device array that kernels read over PCIe (zero-copy).
The memory is freed by :meth:`MappedBuffer.close` (or leaving a ``with``
block), never by garbage collection, so its lifetime is the owner's decision;
views taken before ``close`` are invalid afterwards, and asking a closed buffer
for a view raises.

Under the CUDA simulator there is no device: the buffer is ordinary host memory
with the same interface, so the host API runs in CI.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
from numba import cuda

from fathom.cuda.interop import SIMULATED


def _check(result):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


class MappedBuffer:
    """A C-contiguous ``shape``/``dtype`` array in pinned, device-mapped host memory (zero-filled)."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        if SIMULATED:
            self._simulated = cuda.mapped_array(self.shape, self.dtype)
            self._host = np.asarray(self._simulated)
            self._host[...] = 0
            self._ptr = self._device_ptr = None
        else:
            from cuda.bindings import driver

            cuda.current_context()  # the primary context, shared with torch, must be current
            flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
            self._ptr = int(_check(driver.cuMemHostAlloc(max(self.nbytes, 1), flags)))
            self._device_ptr = int(_check(driver.cuMemHostGetDevicePointer(self._ptr, 0)))
            raw = (ctypes.c_byte * max(self.nbytes, 1)).from_address(self._ptr)
            self._host = np.frombuffer(raw, np.uint8, self.nbytes).view(self.dtype).reshape(self.shape)
            self._host[...] = 0
        self.closed = False

    @property
    def host(self) -> np.ndarray:
        """The NumPy view (host side)."""
        self._alive()
        return self._host

    @property
    def device_ptr(self) -> int:
        self._alive()
        return self._device_ptr

    @property
    def host_ptr(self) -> int:
        self._alive()
        return self._ptr

    def interface(self) -> dict:
        """``__cuda_array_interface__`` of the device mapping."""
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.device_ptr, False), "version": 3,
                "strides": None, "stream": None}

    def device(self):
        """A Numba device array on the mapping (kernels read host memory over PCIe)."""
        self._alive()
        if SIMULATED:
            return self._simulated
        return cuda.from_cuda_array_interface(self.interface(), owner=self, sync=False)

    def close(self) -> None:
        """Free the memory; every view taken from this buffer is invalid afterwards."""
        if not self.closed and self._ptr is not None:
            from cuda.bindings import driver

            cuda.synchronize()  # no kernel may still be reading it
            _check(driver.cuMemFreeHost(self._ptr))
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _alive(self) -> None:
        if self.closed:
            raise ValueError("this MappedBuffer has been closed")

