"""fathom.cuda.topk against fathom.selection: selections equal (ties to the earlier token) and the ascending union
row list, with ragged sessions (lengths read on the device)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.topk import select, union_blocks, union_rows
from fathom.selection import Selection
from fathom.selection import select as ref_select
from tests.cuda.helpers import top_byte_histogram


def _scores(rng, streams, heads, tokens, levels):
    """Scores with many exact ties (few distinct levels), both signs of zero, and crowded in a binade (an offset)."""
    s = rng.integers(-levels, levels + 1, (streams, heads, tokens)).astype(np.float32) * np.float32(0.37)
    s[rng.random(s.shape) < 0.5] += np.float32(1000.0)
    s[s == 0] = np.where(rng.random((s == 0).sum()) < 0.5, np.float32(-0.0), np.float32(0.0))
    return s


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 3]), k=st.integers(0, 70), sink=st.integers(0, 5), local=st.integers(0, 40),
       levels=st.sampled_from([2, 1000]), threads=st.sampled_from([32, 64]), per_block=st.sampled_from([40, 320]))
def test_select_and_union_match_reference(seed, sessions, kv_heads, heads, k, sink, local, levels, threads, per_block):
    """Both passes over the scores split across CTAs (per_block = 40) or not (320): the k-th's top-byte bin is split
    by its second byte on every path."""
    rng = np.random.default_rng(seed)
    tokens = 320
    lengths = rng.integers(1, tokens + 1, sessions).astype(np.int32)
    streams = sessions * kv_heads
    scores = _scores(rng, streams, heads, tokens, levels)
    hist = np.zeros((streams, heads, 256), np.int32)
    for g in range(streams):  # what the scan counts: the candidates' top bytes
        n = lengths[g // kv_heads]
        hist[g] = top_byte_histogram(scores[g, :, sink:max(min(n // 64 * 64, n - local), sink)])
    winners = cuda.to_device(np.zeros((streams, tokens), np.uint32))
    any_rows = cuda.to_device(np.zeros((streams, tokens // 64), np.uint64))
    top_hist = cuda.to_device(hist)
    hist2 = cuda.to_device(np.zeros_like(hist))
    cand_key = cuda.device_array((streams, heads, tokens), np.uint32)
    cand_idx = cuda.device_array((streams, heads, tokens), np.int32)
    cand_count = cuda.to_device(np.zeros((streams, heads), np.int32))
    lengths_dev = cuda.to_device(lengths)
    select(cuda.to_device(scores.view(np.uint32)), lengths_dev, kv_heads, k, sink, local, top_hist, hist2, cand_key,
           cand_idx, cand_count, winners, any_rows, threads=threads, select_threads=threads,
           per_block=per_block)
    assert not top_hist.copy_to_host().any() and not hist2.copy_to_host().any()  # zero for the next step
    assert not cand_count.copy_to_host().any()

    max_rows = tokens
    row_index = cuda.device_array((streams, max_rows), np.int32)
    head_mask = cuda.device_array((streams, max_rows), np.uint32)
    n_rows = cuda.device_array(streams, np.int32)
    block_rows = cuda.device_array((streams, union_blocks(tokens, threads)), np.int32)
    union_rows(any_rows, winners, lengths_dev, kv_heads, block_rows, row_index, head_mask, n_rows, threads)
    assert not winners.copy_to_host().any() and not any_rows.copy_to_host().any()  # cleared for the next step
    sel = Selection(k=k, sink=sink, local=local)
    for g in range(streams):
        n = int(lengths[g // kv_heads])
        want = ref_select(scores[g, :, :n // 64 * 64], n, sel)
        rows = np.flatnonzero(want.any(axis=0))
        assert n_rows.copy_to_host()[g] == len(rows)
        np.testing.assert_array_equal(row_index.copy_to_host()[g, :len(rows)], rows)
        bits = (head_mask.copy_to_host()[g, :len(rows), None] >> np.arange(heads)) & 1
        np.testing.assert_array_equal(bits.astype(bool), want[:, rows].T)


def test_a_kernel_refuses_streams_and_sessions_that_do_not_agree():
    """heads_per_session must divide the streams and lengths hold one per session: else the kernels index past
    lengths (the wrappers of the scan, plan, selection, row union, gather and attention share the check)."""
    import pytest

    from fathom import _checks

    lengths = np.zeros(2, np.int32)
    _checks.stream_sessions(4, 2, lengths)
    for streams, heads_per_session, message in ((4, 0, "heads_per_session"), (4, 3, "heads_per_session"),
                                                (4, True, "heads_per_session"), (2, 2, "lengths must hold")):
        with pytest.raises(ValueError, match=message):
            _checks.stream_sessions(streams, heads_per_session, lengths)
