"""Numba's on-disk cache of the package's kernels (``cache=True``): where it lives, dropping what a source change made
stale, and which kernels a process compiled or loaded from it.

Numba picks the folder once per source folder, the first of these that it can write (every kernel of
``fathom/cuda`` shares it):

1. ``$NUMBA_CACHE_DIR/cuda_<hash of fathom/cuda's path>`` when ``NUMBA_CACHE_DIR`` is set;
2. ``fathom/cuda/__pycache__``, beside the sources (a checkout, an editable install, a writable site-packages);
3. Numba's user-wide cache, ``~/.cache/numba/cuda_<hash>`` on Linux (a read-only install).

A kernel is found there by its signature, its closure's values (the shape-specialised scan, exact-score and
softmax kernels: one entry per shape), the GPU's compute capability and its own source file's time stamp. A
process that finds every kernel it launches there compiles nothing: ``python -m fathom.integrations.warmup`` fills
it ahead of time. Under the CUDA simulator nothing is compiled and nothing is cached.

Example (on a GPU)::

    from fathom.cuda import kernel_cache
    print(kernel_cache.describe())        # /…/fathom/cuda/__pycache__ (beside the sources)
    before = kernel_cache.use()
    ...                                   # build decoders, run steps
    after = kernel_cache.use()            # {"scan._scan_kernel(4, 32, 4)": KernelUse(compiled=1, loaded=0), ...}
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from numba import config

SIMULATED = bool(config.ENABLE_CUDASIM)
PACKAGE = Path(__file__).resolve().parents[1]  # the fathom package, whose sources the kernels compile from
SOURCES = Path(__file__).resolve().parent  # fathom/cuda: where every cached kernel is defined


@dataclass(frozen=True)
class KernelUse:
    """Signatures of one kernel that a process compiled (and wrote to the cache) or loaded from the cache."""

    compiled: int = 0
    loaded: int = 0


def folder() -> Path | None:
    """The folder Numba caches the package's kernels in (see the module's docstring), as Numba reports it for one
    of them; None under the simulator."""
    if SIMULATED:
        return None
    from fathom.cuda.append import _finish_kernel  # any kernel of fathom/cuda: they share the folder

    return Path(_finish_kernel.stats.cache_path)


def describe() -> str:
    """:func:`folder` and the rule that chose it, for a person reading a log."""
    where = folder()
    if where is None:
        return "none: the CUDA simulator compiles nothing"
    if config.CACHE_DIR:
        return f"{where} (NUMBA_CACHE_DIR)"
    if where == SOURCES / "__pycache__":
        return f"{where} (beside the sources)"
    return f"{where} (Numba's user-wide cache: the sources' folder is not writable)"


def clear_stale_kernels(where: Path | None = None) -> bool:
    """Drop the package's kernels cached in ``where`` (default: :func:`folder`) when any source of the package
    changed.

    Numba keys a cached kernel on its own file only, so an edited device function or constant imported from another
    module would otherwise load the stale kernel. The digest of every ``fathom/**/*.py`` is kept beside the cache;
    a folder that cannot be written is left alone (an installed package changes only by reinstalling, which
    touches every file). Returns whether cached kernels were dropped."""
    where = folder() if where is None else where
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    stamp = where / "fathom-sources.sha256"
    try:
        if stamp.is_file() and stamp.read_text() == digest.hexdigest():
            return False
        stale = list(where.glob("*.nb[ic]"))
        for path in stale:
            path.unlink()
        where.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest.hexdigest())
        return bool(stale)
    except OSError:
        return False


def use() -> dict[str, KernelUse]:
    """Every kernel of ``fathom.cuda`` this process has launched, by name (``module.function``, with the shape key
    for the shape-specialised ones: ``scan._scan_kernel(4, 32, 4)``): the signatures it compiled and those it loaded
    from the cache, counted since the process started. Empty under the simulator."""
    if SIMULATED:
        return {}
    from numba.cuda.dispatcher import CUDADispatcher

    import fathom.cuda

    kernels: dict[int, tuple[str, CUDADispatcher]] = {}
    for info in pkgutil.iter_modules(fathom.cuda.__path__):
        module = importlib.import_module(f"fathom.cuda.{info.name}")
        for value in vars(module).values():
            if isinstance(value, CUDADispatcher) and value.py_func.__module__ == module.__name__:
                kernels[id(value)] = (f"{info.name}.{value.py_func.__name__}", value)
        for key, value in getattr(module, "_KERNELS", {}).items():  # one kernel per shape, made by a factory
            factory = value.py_func.__qualname__.split(".<locals>")[0]
            kernels[id(value)] = (f"{info.name}.{factory}{key}", value)
    used = {}
    for name, kernel in kernels.values():
        stats = kernel.stats
        compiled, loaded = sum(stats.cache_misses.values()), sum(stats.cache_hits.values())
        if compiled or loaded:
            used[name] = KernelUse(compiled, loaded)
    return dict(sorted(used.items()))
