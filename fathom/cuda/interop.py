"""Zero-copy views of torch tensors as Numba device arrays, and launch bounds.

On a GPU, tensors and arrays share device memory through
``__cuda_array_interface__``. Under the CUDA simulator (CI) "device" memory
is host memory: tensors live on the CPU and the views go through NumPy,
still without copies, so the same code paths run in both.
"""

from __future__ import annotations

import torch
from numba import config, cuda

from fathom.cuda.kernel_cache import clear_stale_kernels

SIMULATED = bool(config.ENABLE_CUDASIM)
DEVICE = torch.device("cpu") if SIMULATED else torch.device("cuda")

if not SIMULATED:  # before any kernel of the package is loaded from Numba's cache (fathom.cuda.kernel_cache)
    clear_stale_kernels()


def as_array(tensor: torch.Tensor):
    """A Numba device array viewing ``tensor`` (which must be on :data:`DEVICE`)."""
    if SIMULATED:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(tensor.detach().numpy())  # wraps, unlike passing NumPy arrays (copied per launch)
    return cuda.as_cuda_array(tensor.detach(), sync=False)  # one stream: no host sync on the tensor's stream


def launch_bounds(threads: int, ctas_per_sm: int = 1) -> dict:
    """``cuda.jit`` options capping a kernel at ``threads`` per block and asking for ``ctas_per_sm`` such blocks
    resident on a multiprocessor, so it compiles within the registers that many CTAs leave a thread (65,536 /
    (threads · ctas_per_sm)); the simulator takes no such option."""
    if SIMULATED:
        return {}
    # one CTA an SM as the plain count: given (threads, 1), ptxas spilled the scan's registers differently
    return {"launch_bounds": threads if ctas_per_sm == 1 else (threads, ctas_per_sm)}


def max_registers(count: int) -> dict:
    """``cuda.jit`` options capping a kernel at ``count`` registers a thread (the simulator takes no such option)."""
    return {} if SIMULATED else {"max_registers": count}


def multiprocessors() -> int:
    """The GPU's streaming multiprocessors, which launch shapes are sized by (the simulator: 1, as it runs one)."""
    return 1 if SIMULATED else torch.cuda.get_device_properties(DEVICE).multi_processor_count
