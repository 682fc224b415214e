"""Mapped pinned host memory: kernels read what the host wrote (zero-copy), and a closed buffer refuses use."""

import numpy as np
import pytest
import torch

from fathom.cuda.interop import DEVICE, SIMULATED
from fathom.host.pinned import MappedBuffer


def test_the_tensor_view_is_the_host_memory():
    with MappedBuffer((4, 8), np.uint16) as buf:
        assert not buf.host.any()  # zero-filled
        buf.host[...] = np.arange(32, dtype=np.uint16).reshape(4, 8)
        view = buf.tensor()
        assert view.device.type == DEVICE.type and tuple(view.shape) == (4, 8)
        np.testing.assert_array_equal(view.cpu().numpy(), buf.host)
        view[1] = 7  # a write on the device side shows on the host without a copy
        if not SIMULATED:
            torch.cuda.synchronize()
        assert (buf.host[1] == 7).all()
    for use in (lambda: buf.host, lambda: buf.tensor(), lambda: buf.device_ptr):
        with pytest.raises(ValueError, match="closed"):
            use()
    buf.close()  # closing twice is harmless


def test_a_cache_beyond_the_hosts_memory_is_refused_before_allocating():
    from fathom.host.cache import CacheShape, HostKVCache

    shape = CacheShape(sessions=64, layers=64, kv_heads=8, head_dim=128, max_tokens=1 << 24)  # ~17 TB
    with pytest.raises(ValueError, match="GB of pinned host memory.*max_tokens"):
        HostKVCache(shape)


def test_layers_are_pinned_in_the_background_and_made_at_first_use():
    from fathom.host.cache import CacheShape, HostKVCache

    shape = CacheShape(sessions=1, layers=3, kv_heads=1, head_dim=8, max_tokens=128)
    with HostKVCache(shape) as cache:
        k = torch.ones((1, 1, 2, 8), device=DEVICE)
        cache.append(2, k, k)  # the last layer first: it waits for its own memory only
        assert cache.lengths(2).tolist() == [2] and cache.lengths(0).tolist() == [0]
        assert cache.pinned_bytes == cache.status.nbytes + 3 * sum(
            buffer.nbytes for buffer in (cache.layer(0).kv, cache.layer(0).marks, cache.layer(0).pinned.records["raw"]))
    unused = HostKVCache(shape)
    unused.close()  # closing while layers are still being pinned (or never used) frees them all
    assert unused.closed


def test_a_tiered_cache_pins_only_the_planes_beyond_its_tier():
    """At tier t the store's scales and first t planes are in HBM (``hbm_bytes``), the rest pinned (``pinned_bytes``);
    ``hbm_planes_for`` gives back t for exactly those bytes; ``store`` alone means t = 0 ("host") or 4 ("device")."""
    from dataclasses import replace

    from fathom.host.cache import CacheShape, HostKVCache, hbm_planes_for

    base = CacheShape(sessions=1, layers=2, kv_heads=1, head_dim=8, max_tokens=128)
    assert base.layout.hbm_planes == 0 and replace(base, store="device").layout.hbm_planes == 4
    for t in range(5):
        shape = replace(base, hbm_planes=t)
        with HostKVCache(shape) as cache:
            layer = cache.layer(0)
            far = layer.pinned.records.get("raw")
            assert (far is None) == (t == 4)  # nothing pinned for the store when every plane is in HBM
            assert cache.pinned_bytes == cache.status.nbytes + 2 * (
                layer.kv.nbytes + layer.marks.nbytes + (far.nbytes if far else 0))
            assert cache.hbm_bytes == 2 * 8 * layer.stores["raw"].near.numel()
            assert hbm_planes_for(cache.hbm_bytes, shape) == t
            assert t == 0 or hbm_planes_for(cache.hbm_bytes - 1, shape) == t - 1
    with pytest.raises(ValueError, match="hbm_planes"):
        replace(base, hbm_planes=5)
    with pytest.raises(ValueError, match="stores must be 1 or 2"):
        hbm_planes_for(0, base, stores=-1)


def test_a_layer_whose_pinning_fails_partway_releases_what_it_pinned(monkeypatch):
    from fathom.host import cache as cache_module

    made = []

    class Failing(MappedBuffer):
        def __init__(self, shape, dtype):
            if len(made) == 2:
                raise RuntimeError("out of pinned memory")
            super().__init__(shape, dtype)
            made.append(self)

    monkeypatch.setattr(cache_module, "MappedBuffer", Failing)
    shape = cache_module.CacheShape(sessions=1, layers=1, kv_heads=1, head_dim=8, max_tokens=128)
    with cache_module.HostKVCache(shape) as cache:
        with pytest.raises(RuntimeError, match="out of pinned memory"):
            cache.layer(0)
    assert len(made) == 2 and all(buffer.closed for buffer in made)


@pytest.mark.parametrize("refused", ["cuMemHostRegister", "cuMemHostGetDevicePointer"])
def test_a_refused_registration_leaves_no_pages_locked_and_no_map(monkeypatch, refused):
    """The GPU path driven through a driver that refuses one call (the simulator's path allocates no pinned
    memory): the error surfaces, the map is closed, and pages registered before a refused mapping are unregistered."""
    import mmap

    from cuda.bindings import driver

    from fathom.host import pinned

    maps, calls = [], []

    class Map(mmap.mmap):
        def __init__(self, *args):
            maps.append(self)

    def answer(name, *values):
        def call(*args):
            calls.append(name)
            return (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY if name == refused else driver.CUresult.CUDA_SUCCESS,
                    *values)
        return call

    monkeypatch.setattr(pinned, "SIMULATED", False)
    monkeypatch.setattr(pinned.mmap, "mmap", Map)
    for name, values in (("cuMemHostRegister", ()), ("cuMemHostGetDevicePointer", (1 << 40,)),
                         ("cuMemHostUnregister", ())):
        monkeypatch.setattr(driver, name, answer(name, *values))
    with pytest.raises(RuntimeError, match="CUDA driver call failed"):
        MappedBuffer((4, 8), np.uint16)
    assert len(maps) == 1 and maps[0].closed
    assert calls[-1] == (refused if refused == "cuMemHostRegister" else "cuMemHostUnregister")
