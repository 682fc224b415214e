"""Mapped pinned host memory: kernels read what the host wrote, and a closed buffer refuses use."""

import numpy as np
import pytest
from numba import cuda

from fathom.cuda.rows import gather_rows
from fathom.host.pinned import MappedBuffer


def test_kernel_reads_mapped_host_memory():
    with MappedBuffer((2, 10, 8), np.uint16) as k, MappedBuffer((2, 10, 8), np.uint16) as v:
        k.host[...] = np.arange(k.host.size, dtype=np.uint16).reshape(k.shape)
        v.host[...] = 7
        rows = cuda.to_device(np.array([[9, 2], [0, 5]], np.int32))
        k_dst = cuda.device_array((2, 2, 8), np.uint16)
        v_dst = cuda.device_array((2, 2, 8), np.uint16)
        gather_rows(rows, cuda.to_device(np.array([2, 2], np.int32)), k.device(), v.device(), k_dst, v_dst)
        np.testing.assert_array_equal(k_dst.copy_to_host(), k.host[[[0], [1]], [[9, 2], [0, 5]]])
        assert (v_dst.copy_to_host() == 7).all()
    with pytest.raises(ValueError, match="closed"):
        k.device()


@pytest.mark.gpu
def test_mapping_is_zero_copy():
    """The device view is the host memory itself: a kernel write shows on the host without a copy."""
    with MappedBuffer((4, 8), np.uint16) as buf:
        src = cuda.to_device(np.full((4, 8), 3, np.uint16))
        from fathom.cuda.rows import store_rows
        store_rows(src.reshape(4, 1, 8), buf.device().reshape(4, 1, 8), 0)
        cuda.synchronize()
        assert (buf.host == 3).all() and buf.device_ptr != 0
