"""fathom.cuda.scan against fathom.scoring.approx_scores (float32 tolerance), straight from the store's records,
with ragged sessions (lengths read on the device) and the candidates' top-byte histogram."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.scan import scan_planes
from fathom.layout import StoreLayout
from fathom.scoring import approx_scores
from fathom.store import PlaneStore
from tests.cuda.helpers import top_byte_histogram, write_store


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 3]), d=st.sampled_from([8, 12]), cap=st.sampled_from([1, 2, 4]),
       warps=st.sampled_from([1, 2]), sink=st.integers(0, 4), local=st.integers(0, 40))
def test_scan_matches_reference(seed, sessions, kv_heads, heads, d, cap, warps, sink, local):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 300, sessions).astype(np.int32)  # ragged: each session its own length
    groups, max_tokens = sessions * kv_heads, 320
    layout = StoreLayout(groups, -(-max_tokens // 64 // cap), d, cap)
    records = np.zeros(layout.words, np.uint64)
    stores = []
    for g in range(groups):
        n = int(tokens[g // kv_heads])
        keys = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-2, 2, d))).astype(np.float32)
        stores.append(PlaneStore.from_keys(keys, segment_blocks=cap))
        write_store(stores[-1].planes(), stores[-1].scales(), layout, g, records)
    depths = rng.integers(0, 5, (groups, d)).astype(np.int8)
    q = rng.standard_normal((groups, heads, d)).astype(np.float32)
    scores = cuda.to_device(np.full((groups, heads, max_tokens), np.nan, np.float32))
    top_hist = cuda.to_device(np.zeros((groups, heads, 256), np.int32))
    scan_planes(cuda.to_device(q), cuda.to_device(depths), cuda.to_device(tokens), kv_heads, cuda.to_device(records),
                layout, sink, local, scores, top_hist, warps)
    got, hist = scores.copy_to_host(), top_hist.copy_to_host()
    for g, store in enumerate(stores):
        n, n_sealed = int(tokens[g // kv_heads]), store.n_sealed
        want = approx_scores(q[g], store.planes(), store.scales(), depths[g])
        np.testing.assert_allclose(got[g, :, :n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1))
        assert np.isnan(got[g, :, n_sealed:]).all()  # nothing written past the sealed tokens
        candidates = got[g, :, sink:max(min(n_sealed, n - local), sink)]
        np.testing.assert_array_equal(hist[g], top_byte_histogram(candidates))
