"""fathom.cuda.landmark against fathom.scoring.landmarks: fp16 mean keys bit-identical."""

import numpy as np
from numba import cuda

from fathom.cuda.landmark import landmarks
from fathom.scoring import landmarks as ref_landmarks


def test_landmarks_are_bit_identical():
    """Random keys of spread scales, plus means on fp16 rounding ties, subnormals, signs and zero."""
    rng = np.random.default_rng(0)
    d = 8
    k = (rng.standard_normal((32, d)) * np.exp2(rng.uniform(-20, 8, d))).astype(np.float32)
    edges = np.array([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-25, -3 * 2**-26, 0.1, 65504, 0], np.float32)
    k[16:24] = edges  # 8 equal tokens: the mean is the value itself
    first = 2
    marks = cuda.to_device(np.zeros((1, first + 4, d), np.uint16))
    means = cuda.to_device(np.zeros((1, 5, d), np.float32))
    landmarks(cuda.to_device(k[None]), marks, means, first)
    got = marks.copy_to_host()[0]
    np.testing.assert_array_equal(got[first:], ref_landmarks(k).view(np.uint16))
    assert not got[:first].any()
