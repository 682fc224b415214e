"""fathom.cuda.pack against fathom.quantize: codes and scales bit-identical."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom import reference as ref
from fathom.cuda.pack import pack


def _keys(seed: int, n: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    spread = np.exp2(rng.uniform(-20, 12, size=d)).astype(np.float32)  # channel scales from subnormal fp16 up
    k = (rng.standard_normal((n, d)) * spread).astype(np.float32)
    k[rng.random((n, d)) < 0.05] = 0.0
    k[:, rng.integers(d)] = 0.0  # an all-zero channel: scale 0, code 8
    return k


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), blocks=st.integers(1, 3), d=st.sampled_from([8, 12, 16]),
       block0=st.integers(0, 2))
def test_pack_is_bit_identical(seed, blocks, d, block0):
    n = blocks * 64
    k = _keys(seed, n, d)
    cap = block0 + blocks + 1
    planes = cuda.to_device(np.zeros((1, d, 4, cap), np.uint64))
    scales = cuda.to_device(np.zeros((1, d, cap), np.uint16))
    sq = cuda.to_device(np.zeros((1, d), np.float64))
    pack(cuda.to_device(k[None]), planes, scales, block0, sq)
    codes, want_scales = ref.quantize(k)
    got_planes = planes.copy_to_host()[0]
    got_scales = scales.copy_to_host()[0].view(np.float16)
    np.testing.assert_array_equal(got_planes[:, :, block0:block0 + blocks], ref.pack_planes(codes))
    np.testing.assert_array_equal(got_scales[:, block0:block0 + blocks].view(np.uint16), want_scales.view(np.uint16))
    assert not got_planes[:, :, block0 + blocks:].any() and not got_planes[:, :, :block0].any()
    np.testing.assert_allclose(sq.copy_to_host()[0], np.square(want_scales.astype(np.float64)).sum(axis=1))


def test_fp16_rounding_edges():
    """Ties to even, subnormals and the largest finite fp16, through the block max."""
    edges = np.array([65504, 65519.99, 1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 2**-25 * 1.0001, 3 * 2**-26,
                      2**-14 * (1 - 2**-12), 6.1e-5, 0.1, 1 / 3], np.float32)
    k = np.zeros((64, len(edges)), np.float32)
    k[7] = -edges  # the max is of |k|
    planes = cuda.to_device(np.zeros((1, len(edges), 4, 1), np.uint64))
    scales = cuda.to_device(np.zeros((1, len(edges), 1), np.uint16))
    pack(cuda.to_device(k[None]), planes, scales)
    np.testing.assert_array_equal(scales.copy_to_host()[0, :, 0], edges.astype(np.float16).view(np.uint16))
    codes, _ = ref.quantize(k)
    np.testing.assert_array_equal(planes.copy_to_host()[0], ref.pack_planes(codes))
