"""fathom.cuda.plan against fathom.waterfill.waterfill_batched: depths equal bit for bit."""

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.plan import waterfill
from fathom.waterfill import importance, waterfill_batched


def _gaps_ok(w: np.ndarray) -> bool:
    """No two distinct plane gains of a group within 1e-6 relative (the bisection cannot split those)."""
    for row in w:
        gains = np.unique(np.concatenate([0.75 * row[row > 0] * 4.0 ** -t for t in range(4)]))
        if len(gains) > 1 and np.min(np.diff(np.log(gains))) < 1e-6:
            return False
    return True


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), groups=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([8, 16, 40]), budget=st.floats(0, 80), zeros=st.integers(0, 3))
def test_waterfill_matches_reference(seed, groups, heads, d, budget, zeros):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((groups, heads, d)) * np.exp(rng.uniform(-3, 3, d))).astype(np.float32)
    q[:, :, :zeros] = 0  # channels of zero importance are never read
    sigma2 = np.exp(rng.uniform(-4, 4, (groups, d)))
    w = importance(q, sigma2)
    assume(_gaps_ok(w))
    depths = cuda.to_device(np.full((groups, d), -1, np.int8))
    waterfill(cuda.to_device(q), cuda.to_device(sigma2), budget, depths)
    np.testing.assert_array_equal(depths.copy_to_host(), waterfill_batched(w, budget))


def test_all_zero_and_all_fit():
    q = np.zeros((2, 2, 8), np.float32)
    q[1] = 1.0
    sigma2 = np.ones((2, 8))
    depths = cuda.to_device(np.full((2, 8), -1, np.int8))
    waterfill(cuda.to_device(q), cuda.to_device(sigma2), 1000.0, depths)
    np.testing.assert_array_equal(depths.copy_to_host(), [[0] * 8, [4] * 8])
