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
