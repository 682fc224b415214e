"""fathom.cuda.pack against fathom.quantize + fathom.scoring.landmarks: codes, scales and landmarks bit-identical,
for the blocks an append completes (read from the device lengths: the open block's tail, then new keys), at every
tier of the store (the first ``t`` planes in the near array)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom import reference as ref
from fathom.cuda.pack import seal_blocks
from fathom.layout import StoreLayout
from fathom.scoring import landmarks


def _keys(seed: int, n: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    spread = np.exp2(rng.uniform(-20, 12, size=d)).astype(np.float32)  # channel scales from subnormal fp16 up
    k = (rng.standard_normal((n, d)) * spread).astype(np.float32)
    k[rng.random((n, d)) < 0.05] = 0.0
    k[:, rng.integers(d)] = 0.0  # an all-zero channel: scale 0, code 8
    return k


def _seal(keys: np.ndarray, n0: int, m: int, cap: int, status=(0, 0, 0, 0), hbm_planes: int = 0):
    """Seal what appending keys[n0:n0 + m] to a store holding keys[:n0] completes
    -> (layout, near, far, σ² sums, marks)."""
    n, d = keys.shape
    layout = StoreLayout(streams=1, segments=-(-n // 64 // cap) + 1, d=d, cap=cap, hbm_planes=hbm_planes)
    near = cuda.to_device(np.zeros(layout.near_words, np.uint64))
    far = cuda.to_device(np.zeros(layout.far_words, np.uint64))
    tail = np.zeros((1, 64, d), np.float32)
    tail[0, :n0 % 64] = keys[n0 // 64 * 64:n0]
    sq = cuda.to_device(np.zeros((1, d), np.float64))
    marks = cuda.to_device(np.zeros((1, n // 8 + 8, d), np.uint16))
    seal_blocks(cuda.to_device(keys[None, n0:n0 + m]), cuda.to_device(tail), cuda.to_device(np.array([n0], np.int32)),
                cuda.to_device(np.array([0], np.int32)), 1, cuda.to_device(np.array(status, np.int32)), near, far,
                (near if hbm_planes else far).view(np.uint16), layout, sq, marks, True)
    return layout, near.copy_to_host(), far.copy_to_host(), sq.copy_to_host()[0], marks.copy_to_host()[0]


@pytest.mark.parametrize("hbm_planes", range(5))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), n0=st.integers(0, 130), m=st.integers(1, 140), d=st.sampled_from([8, 12]),
       cap=st.sampled_from([1, 2]))
def test_seal_is_bit_identical(hbm_planes, seed, n0, m, d, cap):
    keys = _keys(seed, n0 + m, d)
    layout, near, far, sq, marks = _seal(keys, n0, m, cap, hbm_planes=hbm_planes)
    first, stop = n0 // 64, (n0 + m) // 64  # the blocks this append completes
    planes, scales = layout.read(near, far, 0, stop)
    if stop > first:
        codes, want_scales = ref.quantize(keys[first * 64:stop * 64])
        np.testing.assert_array_equal(planes[:, :, first:], ref.pack_planes(codes))
        np.testing.assert_array_equal(scales[:, first:].view(np.uint16), want_scales.view(np.uint16))
        np.testing.assert_allclose(sq, np.square(want_scales.astype(np.float64)).sum(axis=1), rtol=1e-12)
        np.testing.assert_array_equal(marks[first * 8:stop * 8], landmarks(keys[first * 64:stop * 64]).view(np.uint16))
    assert not planes[:, :, :first].any() and not marks[:first * 8].any() and not marks[stop * 8:].any()


def test_fp16_rounding_edges():
    """Ties to even, subnormals and the largest finite fp16, through the block max."""
    edges = np.array([65504, 65519.99, 1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 2**-25 * 1.0001, 3 * 2**-26,
                      2**-14 * (1 - 2**-12), 6.1e-5, 0.1, 1 / 3], np.float32)
    k = np.zeros((64, len(edges)), np.float32)
    k[7] = -edges  # the max is of |k|
    layout, near, far, _, _ = _seal(k, 0, 64, 1)
    planes, scales = layout.read(near, far, 0, 1)
    np.testing.assert_array_equal(scales[:, 0].view(np.uint16), edges.astype(np.float16).view(np.uint16))
    codes, _ = ref.quantize(k)
    np.testing.assert_array_equal(planes, ref.pack_planes(codes))


def test_a_flagged_or_dry_append_seals_nothing():
    keys = _keys(0, 128, 8)
    for status in ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1)):
        _, near, far, sq, marks = _seal(keys, 0, 128, 2, status, hbm_planes=2)
        assert not near.any() and not far.any() and not sq.any() and not marks.any()
