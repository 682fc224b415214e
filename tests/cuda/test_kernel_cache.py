"""Numba's on-disk kernels of the package are dropped when any of its sources changed (Numba itself checks only
the kernel's own file), and kept otherwise; the cache's folder is the one Numba uses."""

import os
import subprocess
import sys

import pytest

from fathom.cuda import kernel_cache


def test_cached_kernels_are_dropped_when_a_source_changes_and_kept_otherwise(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "cuda").mkdir(parents=True)
    helper = package / "half.py"
    helper.write_text("ONE = 1\n")
    folder = tmp_path / "__pycache__"
    folder.mkdir()
    kernel = folder / "scan.kernel-12.py312.nbi"
    monkeypatch.setattr(kernel_cache, "PACKAGE", package)
    kernel.write_bytes(b"cached")
    assert kernel_cache.clear_stale_kernels(folder)  # no record of the sources yet: nothing cached is trusted
    assert not kernel.exists()
    kernel.write_bytes(b"cached")
    assert not kernel_cache.clear_stale_kernels(folder) and kernel.exists()  # sources unchanged
    helper.write_text("ONE = 2\n")  # a device function's module changed: the kernels compiled from it are stale
    assert kernel_cache.clear_stale_kernels(folder) and not kernel.exists()


def test_the_simulator_caches_nothing_and_says_so():
    if not kernel_cache.SIMULATED:
        pytest.skip("under the CUDA simulator only")
    assert kernel_cache.folder() is None and kernel_cache.use() == {}
    assert "simulator" in kernel_cache.describe()


def test_the_folder_is_the_one_numba_caches_in_and_honours_numba_cache_dir(tmp_path):
    # a process without the simulator (importing the kernels needs no GPU): Numba's cache path of a real kernel
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"} | {"NUMBA_CACHE_DIR": str(tmp_path)}
    code = "from fathom.cuda import interop, kernel_cache; print(kernel_cache.folder()); print(kernel_cache.describe())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    where, described = done.stdout.strip().splitlines()
    assert where.startswith(str(tmp_path / "cuda_")) and described == f"{where} (NUMBA_CACHE_DIR)"
    assert (tmp_path / where.rsplit("/", 1)[1] / "fathom-sources.sha256").is_file()  # the stale-kernel guard's stamp
