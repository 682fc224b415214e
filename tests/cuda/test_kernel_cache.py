"""Numba's on-disk kernels of the package are dropped when any of its sources changed (Numba itself checks only
the kernel's own file), and kept otherwise."""

from fathom.cuda import interop


def test_cached_kernels_are_dropped_when_a_source_changes_and_kept_otherwise(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "cuda").mkdir(parents=True)
    helper = package / "half.py"
    helper.write_text("ONE = 1\n")
    folder = tmp_path / "__pycache__"
    folder.mkdir()
    kernel = folder / "scan.kernel-12.py312.nbi"
    monkeypatch.setattr(interop, "PACKAGE", package)
    kernel.write_bytes(b"cached")
    assert interop.clear_stale_kernels(folder)  # no record of the sources yet: nothing cached is trusted
    assert not kernel.exists()
    kernel.write_bytes(b"cached")
    assert not interop.clear_stale_kernels(folder) and kernel.exists()  # sources unchanged
    helper.write_text("ONE = 2\n")  # a device function's module changed: the kernels compiled from it are stale
    assert interop.clear_stale_kernels(folder) and not kernel.exists()
