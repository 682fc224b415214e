"""fathom.cuda.scan against fathom.scoring.approx_scores (float32 tolerance), straight from the store's records,
with ragged sessions (lengths read on the device) and the candidates' top-byte histogram, at every tier of the store
(the first ``t`` planes in the near array); and the tiered scans equal to the all-host one exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.scan import scan_planes
from fathom.layout import StoreLayout
from fathom.scoring import approx_scores
from fathom.store import PlaneStore
from tests.cuda.helpers import top_byte_histogram, write_store


def _store(rng, tokens: np.ndarray, kv_heads: int, d: int, cap: int) -> list[PlaneStore]:
    """Reference stores of random keys, ``tokens[s]`` per stream of session ``s``."""
    stores = []
    for g in range(len(tokens) * kv_heads):
        n = int(tokens[g // kv_heads])
        keys = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-2, 2, d))).astype(np.float32)
        stores.append(PlaneStore.from_keys(keys, segment_blocks=cap))
    return stores


def _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, sink, local, warps, max_tokens):
    """The stores written into a store layout of tier ``hbm_planes`` and scanned -> (scores, top_hist)."""
    streams, heads, d = q.shape
    layout = StoreLayout(streams, -(-max_tokens // 64 // cap), d, cap, hbm_planes)
    near, far = np.zeros(layout.near_words, np.uint64), np.zeros(layout.far_words, np.uint64)
    for g, store in enumerate(stores):
        write_store(store.planes(), store.scales(), layout, g, near, far)
    scores = cuda.to_device(np.full((streams, heads, max_tokens), np.nan, np.float32))
    top_hist = cuda.to_device(np.zeros((streams, heads, 256), np.int32))
    scan_planes(cuda.to_device(q), cuda.to_device(depths), cuda.to_device(tokens), kv_heads, cuda.to_device(near),
                cuda.to_device(far), layout, sink, local, scores, top_hist, warps)
    return scores.copy_to_host(), top_hist.copy_to_host()


@pytest.mark.parametrize("hbm_planes", range(5))
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 3]), d=st.sampled_from([8, 12]), cap=st.sampled_from([1, 2, 4]),
       warps=st.sampled_from([1, 2]), sink=st.integers(0, 4), local=st.integers(0, 40))
def test_scan_matches_reference(hbm_planes, seed, sessions, kv_heads, heads, d, cap, warps, sink, local):
    rng = np.random.default_rng(seed)
    max_tokens = 320
    tokens = rng.integers(1, 300, sessions).astype(np.int32)  # ragged: each session its own length
    stores = _store(rng, tokens, kv_heads, d, cap)
    streams = sessions * kv_heads
    depths = rng.integers(0, 5, (streams, d)).astype(np.int8)
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    got, hist = _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, sink, local, warps, max_tokens)
    for g, store in enumerate(stores):
        n, n_sealed = int(tokens[g // kv_heads]), store.n_sealed
        want = approx_scores(q[g], store.planes(), store.scales(), depths[g])
        np.testing.assert_allclose(got[g, :, :n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1))
        assert np.isnan(got[g, :, n_sealed:]).all()  # nothing written past the sealed tokens
        candidates = got[g, :, sink:max(min(n_sealed, n - local), sink)]
        np.testing.assert_array_equal(hist[g], top_byte_histogram(candidates))


def test_every_tier_scans_exactly_as_the_host_store():
    """The same words read from either tier: scores and histograms bit-identical at t = 0..4."""
    rng = np.random.default_rng(7)
    max_tokens, kv_heads, d, cap = 320, 1, 8, 2
    tokens = np.array([300], np.int32)  # 4 sealed blocks: 2 segments
    stores = _store(rng, tokens, kv_heads, d, cap)
    depths = rng.integers(0, 5, (kv_heads, d)).astype(np.int8)
    depths[0, :4] = [1, 2, 3, 4]  # every depth on either side of every tier
    q = rng.standard_normal((kv_heads, 3, d)).astype(np.float32)
    host = _scan(q, depths, tokens, kv_heads, stores, cap, 0, 2, 16, 2, max_tokens)
    for hbm_planes in range(1, 5):
        tiered = _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, 2, 16, 2, max_tokens)
        np.testing.assert_array_equal(tiered[0], host[0])
        np.testing.assert_array_equal(tiered[1], host[1])
