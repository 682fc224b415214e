"""Zero-copy views of torch tensors as Numba device arrays, and the freshness of the kernels cached on disk.

On a GPU, tensors and arrays share device memory through
``__cuda_array_interface__``. Under the CUDA simulator (CI) "device" memory
is host memory: tensors live on the CPU and the views go through NumPy,
still without copies, so the same code paths run in both.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from numba import config, cuda

SIMULATED = bool(config.ENABLE_CUDASIM)
DEVICE = torch.device("cpu") if SIMULATED else torch.device("cuda")
PACKAGE = Path(__file__).resolve().parents[1]  # the fathom package, whose sources the kernels compile from


def clear_stale_kernels(folder: Path = Path(__file__).resolve().parent / "__pycache__") -> bool:
    """Drop Numba's on-disk kernels of this package (``cache=True``) when any source of the package changed.

    Numba keys a cached kernel on its own file only, so an edited device function or constant imported from another
    module would otherwise load the stale kernel. The digest of every ``fathom/**/*.py`` is kept beside the cache;
    a folder that cannot be written is left alone (an installed package changes only by reinstalling, which
    touches every file). Returns whether cached kernels were dropped."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    stamp = folder / "fathom-sources.sha256"
    try:
        if stamp.is_file() and stamp.read_text() == digest.hexdigest():
            return False
        stale = list(folder.glob("*.nb[ic]"))
        for path in stale:
            path.unlink()
        folder.mkdir(exist_ok=True)
        stamp.write_text(digest.hexdigest())
        return bool(stale)
    except OSError:
        return False


if not SIMULATED:
    clear_stale_kernels()


def as_array(tensor: torch.Tensor):
    """A Numba device array viewing ``tensor`` (which must be on :data:`DEVICE`)."""
    if SIMULATED:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(tensor.detach().numpy())  # wraps, unlike passing NumPy arrays (copied per launch)
    return cuda.as_cuda_array(tensor.detach(), sync=False)  # one stream: no host sync on the tensor's stream



def launch_bounds(threads: int) -> dict:
    """``cuda.jit`` options capping a kernel at ``threads`` per block, so it compiles within that many registers
    (the simulator takes no such option)."""
    return {} if SIMULATED else {"launch_bounds": threads}
