"""fathom.cuda.scan against fathom.scoring.approx_scores (float32 tolerance), through the staging."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.gather import Staging
from fathom.cuda.scan import approx_scores
from fathom.scoring import approx_scores as ref_scores
from fathom.store import PlaneStore


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 2), heads=st.sampled_from([1, 4]),
       d=st.sampled_from([8, 16]), blocks=st.integers(1, 3), cap=st.integers(1, 2), threads=st.sampled_from([32, 96]))
def test_scan_matches_reference(seed, streams, heads, d, blocks, cap, threads):
    rng = np.random.default_rng(seed)
    n = blocks * 64
    keys = (rng.standard_normal((streams, n, d)) * np.exp(rng.uniform(-2, 2, d))).astype(np.float32)
    stores = [PlaneStore.from_keys(k, segment_blocks=cap) for k in keys]
    n_seg = -(-blocks // cap)
    planes = np.zeros((streams, n_seg, d, 4, cap), np.uint64)
    scales = np.zeros((streams, n_seg, d, cap), np.uint16)
    for s, store in enumerate(stores):
        for i, seg in enumerate(store.segments):
            planes[s, i], scales[s, i] = seg.planes, seg.scales.view(np.uint16)
    depths = rng.integers(0, 5, (streams, d)).astype(np.int8)
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)

    staging = Staging(streams, d, n_seg, cap, 4 * d, d, 8, 16, 1)
    depths_dev = cuda.to_device(depths)
    staging.stage(depths_dev, cuda.to_device(planes.reshape(-1)), cuda.to_device(scales.reshape(-1)), blocks)
    scores = cuda.device_array((streams, heads, n + 64), np.float32)
    approx_scores(cuda.to_device(q), depths_dev, staging.active, staging.n_active, staging.plane_row,
                  staging.scale_row, staging.planes, staging.scales, 4 * d, d, blocks, scores, threads=threads)
    got = scores.copy_to_host()[:, :, :n]
    for s, store in enumerate(stores):
        want = ref_scores(q[s], store.planes(), store.scales(), depths[s])
        np.testing.assert_allclose(got[s], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
