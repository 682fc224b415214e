"""Page-locked host memory mapped into the GPU's address space, with an explicit lifetime.

The bytes are an anonymous ``mmap`` (page-aligned, transparent huge pages asked for), faulted in by zero-filling
on torch's CPU threads, then page-locked and mapped with ``cuMemHostRegister(DEVICEMAP | PORTABLE)`` through
cuda-python. Measured on the H200 machine for 8 GB: ``cuMemHostAlloc`` 1.3-1.8 GB/s, and on a worker thread it
stalls the main thread's GPU work 2.5x (the driver's lock); this way 3.4-3.8 GB/s, 1.1x beside GPU work, and
freeing 8x faster (``bench/results/pinned-probe.json``, ``python -m bench.pinned_probe``). So a cache can allocate its layers on a worker
thread while the prefill runs (``fathom.host.cache``).
The same bytes are a NumPy array on the host and, through ``__cuda_array_interface__``, a torch tensor on the GPU
that kernels read over PCIe (zero-copy). The memory is freed by :meth:`MappedBuffer.close` (or leaving a ``with``
block), never by garbage collection, so its lifetime is the owner's decision; views taken before ``close`` are
invalid afterwards (their owner must not use them: ``fathom.host.cache.HostKVCache`` refuses every call once
closed), and asking a closed buffer for a view raises.

Under the CUDA simulator there is no device: the buffer is ordinary host memory with the same interface, so the
host API runs in CI.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap

import numpy as np
import torch
from numba import cuda

from fathom.cuda.interop import DEVICE, SIMULATED


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
        self._map = None
        if SIMULATED:
            self._host = np.zeros(self.shape, self.dtype)
            self._ptr = self._device_ptr = None
        else:
            from cuda.bindings import driver

            cuda.current_context()  # the primary context, shared with torch, must be current (on any thread)
            size = max(self.nbytes, 1)
            self._map = mmap.mmap(-1, size)  # anonymous: page-aligned and zero
            with contextlib.suppress(AttributeError, OSError):  # huge pages fault 512x fewer times where allowed
                self._map.madvise(mmap.MADV_HUGEPAGE)
            anchor = ctypes.c_char.from_buffer(self._map)
            self._ptr = ctypes.addressof(anchor)
            del anchor  # no buffer export may outlive this line, or the map cannot be closed
            raw = np.frombuffer((ctypes.c_byte * size).from_address(self._ptr), np.uint8)
            torch.from_numpy(raw).zero_()  # faults every page in, in parallel on torch's CPU threads
            flags = driver.CU_MEMHOSTREGISTER_DEVICEMAP | driver.CU_MEMHOSTREGISTER_PORTABLE
            registered = False
            try:  # a refused registration or mapping leaves nothing behind: no pages locked, no map
                _check(driver.cuMemHostRegister(self._ptr, size, flags))
                registered = True
                self._device_ptr = int(_check(driver.cuMemHostGetDevicePointer(self._ptr, 0)))
            except BaseException:
                if registered:
                    driver.cuMemHostUnregister(self._ptr)
                self._map.close()
                raise
            self._host = raw[:self.nbytes].view(self.dtype).reshape(self.shape)
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

    def tensor(self) -> torch.Tensor:
        """A torch tensor on :data:`~fathom.cuda.interop.DEVICE` viewing the mapping (kernels read host memory over
        PCIe). It does not own the memory: unusable after :meth:`close`."""
        self._alive()
        if SIMULATED:
            return torch.from_numpy(self._host)
        return torch.as_tensor(_Interface(self), device=DEVICE)

    def close(self) -> None:
        """Free the memory; every view taken from this buffer is invalid afterwards."""
        if not self.closed and self._ptr is not None:
            from cuda.bindings import driver

            cuda.synchronize()  # no kernel may still be reading it
            _check(driver.cuMemHostUnregister(self._ptr))
            self._host = None
            self._map.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _alive(self) -> None:
        if self.closed:
            raise ValueError("this MappedBuffer has been closed")


class _Interface:
    """``__cuda_array_interface__`` of a buffer's device mapping (what ``torch.as_tensor`` imports)."""

    def __init__(self, buffer: MappedBuffer):
        self.__cuda_array_interface__ = {"shape": buffer.shape, "typestr": buffer.dtype.str,
                                         "data": (buffer.device_ptr, False), "version": 3, "strides": None,
                                         "stream": None}
