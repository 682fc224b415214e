"""fathom.cuda.topk against fathom.selection: selections equal (ties to the earlier token) and the union row list."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.topk import select, union_rows
from fathom.selection import Selection
from fathom.selection import select as ref_select


def _scores(rng, groups, heads, n_scored, levels):
    """Scores with many exact ties (few distinct levels) and both signs of zero."""
    s = rng.integers(-levels, levels + 1, (groups, heads, n_scored)).astype(np.float32) * np.float32(0.37)
    s[s == 0] = np.where(rng.random((s == 0).sum()) < 0.5, np.float32(-0.0), np.float32(0.0))
    return s


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), groups=st.integers(1, 2), heads=st.sampled_from([1, 3]),
       n=st.integers(1, 300), k=st.integers(0, 70), sink=st.integers(0, 5), local=st.integers(0, 40),
       levels=st.sampled_from([2, 1000]), threads=st.sampled_from([1, 16, 32]))
def test_select_and_union_match_reference(seed, groups, heads, n, k, sink, local, levels, threads):
    rng = np.random.default_rng(seed)
    n_scored = n // 64 * 64
    scores = _scores(rng, groups, heads, max(n_scored, 1), levels)
    winners = cuda.to_device(np.zeros((groups, n + 3), np.uint32))
    top_hist = cuda.to_device(np.zeros((groups, heads, 256), np.int32))
    cand_key = cuda.device_array((groups, heads, max(n_scored, 1)), np.uint32)
    cand_idx = cuda.device_array((groups, heads, max(n_scored, 1)), np.int32)
    cand_count = cuda.to_device(np.zeros((groups, heads), np.int32))
    select(cuda.to_device(scores), n_scored, n, k, sink, local, top_hist, cand_key, cand_idx, cand_count, winners,
           threads=threads, per_block=40, select_threads=threads)
    assert not top_hist.copy_to_host().any() and not cand_count.copy_to_host().any()  # zero for the next step

    max_rows = n + 1
    row_index = cuda.device_array((groups, max_rows), np.int32)
    head_mask = cuda.device_array((groups, max_rows), np.uint32)
    n_rows = cuda.device_array(groups, np.int32)
    block_rows = cuda.device_array((groups, -(-n // 50)), np.int32)
    union_rows(winners, heads, n_scored, n, sink, local, block_rows, row_index, head_mask, n_rows,
               threads=threads, per_block=50)
    assert not winners.copy_to_host().any()  # cleared for the next step
    sel = Selection(k=k, sink=sink, local=local)
    for g in range(groups):
        want = ref_select(scores[g, :, :n_scored], n, sel)
        rows = np.flatnonzero(want.any(axis=0))
        assert n_rows.copy_to_host()[g] == len(rows)
        np.testing.assert_array_equal(row_index.copy_to_host()[g, :len(rows)], rows)
        bits = (head_mask.copy_to_host()[g, :len(rows), None] >> np.arange(heads)) & 1
        np.testing.assert_array_equal(bits.astype(bool), want[:, rows].T)

