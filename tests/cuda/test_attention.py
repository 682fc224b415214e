"""fathom.cuda.attention against fathom.attention.attention: each head's softmax over its own selection of the listed
K/V rows, each read from its source (the row store, or the row cache's slab), float32 tolerance; dense over every
row of each session."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.attention import attention
from fathom.cuda.attention import (CHUNK_ROWS, MAX_SHARED, attend_rows, attend_warps, lane_layout, plan_attention,
                                   shared_bytes)


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _words(x: np.ndarray) -> np.ndarray:
    """float32 [..., d] -> its bf16 bits as uint64 words [..., d / 4]."""
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint64)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), heads=st.sampled_from([1, 3]), d=st.sampled_from([8, 16]),
       dense=st.booleans(), rows=st.integers(1, 300))
def test_attend_rows_matches_reference(seed, streams, heads, d, dense, rows):
    rng = np.random.default_rng(seed)
    tokens = 320
    k, v = _bf16(rng.standard_normal((2, streams, tokens, d)).astype(np.float32) * 2)
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    kv = np.stack([_words(k), _words(v)], axis=2)  # [streams, T, 2, d / 4]
    lengths = np.full(streams, rows, np.int32)  # one KV head per session: lengths are per stream
    n_rows = rng.integers(1, rows + 1, streams).astype(np.int32)
    row_index = np.zeros((streams, rows), np.int32)  # each stream's n_rows distinct rows of its context, ascending
    for g in range(streams):
        row_index[g, :n_rows[g]] = np.sort(rng.choice(rows, n_rows[g], replace=False))
    head_mask = rng.integers(0, 1 << heads, (streams, rows)).astype(np.int32)
    head_mask[np.arange(streams), 0] = (1 << heads) - 1  # every head selects at least one row
    max_rows = tokens
    chunks = -(-max_rows // CHUNK_ROWS)
    part = [cuda.device_array((streams, chunks, heads), np.float32) for _ in range(2)]
    part_o = cuda.device_array((streams, chunks, heads, d), np.float32)
    out = cuda.device_array((streams, heads, d), np.float32)
    status = cuda.to_device(np.zeros(4, np.int32))
    mask_dev = cuda.to_device(np.pad(head_mask, ((0, 0), (0, max_rows - rows))))
    rows_dev = cuda.to_device(np.pad(row_index, ((0, 0), (0, max_rows - rows))))
    attend_rows(cuda.to_device(q), rows_dev, mask_dev, cuda.to_device(n_rows), cuda.to_device(lengths), 1, dense,
                cuda.to_device(kv), 0.3, status, *part, part_o, out)
    got = out.copy_to_host()
    for g in range(streams):
        if dense:
            want = attention(q[g], k[g, :rows], v[g, :rows], scale=0.3)
        else:
            listed = row_index[g, :n_rows[g]]
            mask = ((head_mask[g, :n_rows[g], None] >> np.arange(heads)) & 1).T.astype(bool)
            want = attention(q[g], k[g, listed], v[g, listed], mask, scale=0.3)
        np.testing.assert_allclose(got[g], want, rtol=1e-4, atol=1e-5)
    assert not status.copy_to_host().any()


def test_a_plan_runs_on_its_arrays_contents_at_each_run():
    """Planned once (its checks and flat views made then), run twice with the query and the rows changed in place
    between the runs: each run is the reference over the contents it found, as a decode step built once and run
    every token needs."""
    rng = np.random.default_rng(3)
    heads, d, tokens = 2, 8, 200
    k, v = _bf16(rng.standard_normal((2, 1, tokens, d)).astype(np.float32))
    kv = cuda.to_device(np.stack([_words(k), _words(v)], axis=2))
    q, row_index, head_mask = cuda.device_array((1, heads, d), np.float32), cuda.to_device(
        np.zeros((1, tokens), np.int32)), cuda.to_device(np.full((1, tokens), (1 << heads) - 1, np.int32))
    n_rows, lengths = cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.array([tokens], np.int32))
    chunks = -(-tokens // CHUNK_ROWS)
    part = [cuda.device_array((1, chunks, heads), np.float32) for _ in range(2)]
    out, status = cuda.device_array((1, heads, d), np.float32), cuda.to_device(np.zeros(4, np.int32))
    plan = plan_attention(q, row_index, head_mask, n_rows, lengths, 1, False, kv, 0.5, status, *part,
                          cuda.device_array((1, chunks, heads, d), np.float32), out)
    for rows in (np.array([0, 5, 9]), np.sort(rng.choice(tokens, 150, replace=False))):  # 150: two chunks
        query = rng.standard_normal((1, heads, d)).astype(np.float32)
        q.copy_to_device(query)
        row_index.copy_to_device(np.pad(rows, (0, tokens - len(rows))).astype(np.int32)[None])
        n_rows.copy_to_device(np.array([len(rows)], np.int32))
        plan.run()
        np.testing.assert_allclose(out.copy_to_host()[0], attention(query[0], k[0, rows], v[0, rows], scale=0.5),
                                   rtol=1e-4, atol=1e-5)
    assert not status.copy_to_host().any()


@pytest.mark.gpu  # the simulator would take minutes: a model's head dims over thousands of rows, many chunks
@pytest.mark.parametrize("heads, d", [(4, 64), (3, 64), (4, 128), (6, 128), (4, 256), (8, 256)])
def test_attend_rows_matches_reference_at_model_head_dims(heads, d):
    """The models' shapes (G = 3 and 6 padded to 4 and 8 heads; d = 256 at G = 8 runs on 4 warps, not 8)."""
    rng = np.random.default_rng(d + heads)
    streams, tokens, rows = 2, 4096, 1800
    k, v = _bf16(rng.standard_normal((2, streams, tokens, d)).astype(np.float32))
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    kv = np.stack([_words(k), _words(v)], axis=2)
    lengths = np.full(streams, tokens, np.int32)
    n_rows = np.array([rows, rows // 3], np.int32)
    row_index = np.zeros((streams, rows), np.int32)
    for g in range(streams):
        row_index[g, :n_rows[g]] = np.sort(rng.choice(tokens, n_rows[g], replace=False))
    head_mask = rng.integers(1, 1 << heads, (streams, rows)).astype(np.int32)
    chunks = -(-rows // CHUNK_ROWS)
    parts = [cuda.device_array((streams, chunks, heads), np.float32) for _ in range(2)]
    out = cuda.device_array((streams, heads, d), np.float32)
    attend_rows(cuda.to_device(q), cuda.to_device(row_index), cuda.to_device(head_mask), cuda.to_device(n_rows),
                cuda.to_device(lengths), 1, False, cuda.to_device(kv), d ** -0.5, cuda.to_device(np.zeros(4, np.int32)),
                *parts, cuda.device_array((streams, chunks, heads, d), np.float32), out)
    got = out.copy_to_host()
    for g in range(streams):
        listed = row_index[g, :n_rows[g]]
        mask = ((head_mask[g, :n_rows[g], None] >> np.arange(heads)) & 1).T.astype(bool)
        want = attention(q[g], k[g, listed], v[g, listed], mask, scale=d ** -0.5)
        np.testing.assert_allclose(got[g], want, rtol=1e-4, atol=1e-5)


def _check_rows_from_sources(seed: int, heads: int, d: int, tokens: int, rows: int, slots: int) -> None:
    """Two streams' listed rows, each a hit (its K/V in the slab, garbage in host memory), a fill (read from host
    memory and written to its slot) or a bypass (read from host memory): the reference over the true rows, and each
    filled slot holding its row's words afterwards."""
    rng = np.random.default_rng(seed)
    streams = 2
    k, v = _bf16(rng.standard_normal((2, streams, tokens, d)).astype(np.float32))
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    kv = np.stack([_words(k), _words(v)], axis=2)
    n_rows = np.array([rows, rows // 2 + 1], np.int32)
    row_index = np.zeros((streams, rows), np.int32)
    source = np.full((streams, rows), -1, np.int32)
    slab = rng.integers(0, 2**63, (streams, slots) + kv.shape[2:], dtype=np.uint64)  # stale slots
    stored = kv.copy()  # host memory: a hit's row there is garbage, so only its slab copy gives the reference
    for g in range(streams):
        listed = np.sort(rng.choice(tokens, n_rows[g], replace=False))
        row_index[g, :n_rows[g]] = listed
        kind = rng.choice(3, n_rows[g], p=[0.6, 0.25, 0.15])  # hit, fill, bypass
        kind[0] = 2  # a miss in the first batch
        slot = rng.permutation(slots)[:n_rows[g]]
        hit, fill = np.flatnonzero(kind == 0), np.flatnonzero(kind == 1)
        source[g, hit], source[g, fill] = slot[hit], slot[fill] + slots
        slab[g, slot[hit]] = kv[g, listed[hit]]
        stored[g, listed[hit]] = rng.integers(0, 2**63, (len(hit),) + kv.shape[2:], dtype=np.uint64)
    head_mask = rng.integers(1, 1 << heads, (streams, rows)).astype(np.int32)
    chunks = -(-rows // CHUNK_ROWS)
    parts = [cuda.device_array((streams, chunks, heads), np.float32) for _ in range(2)]
    out, slab_dev = cuda.device_array((streams, heads, d), np.float32), cuda.to_device(slab)
    attend_rows(cuda.to_device(q), cuda.to_device(row_index), cuda.to_device(head_mask), cuda.to_device(n_rows),
                cuda.to_device(np.full(streams, tokens, np.int32)), 1, False, cuda.to_device(stored), d ** -0.5,
                cuda.to_device(np.zeros(4, np.int32)), *parts, cuda.device_array((streams, chunks, heads, d),
                                                                                 np.float32), out,
                cuda.to_device(source), slab_dev)
    got, slab_after = out.copy_to_host(), slab_dev.copy_to_host()
    for g in range(streams):
        listed = row_index[g, :n_rows[g]]
        mask = ((head_mask[g, :n_rows[g], None] >> np.arange(heads)) & 1).T.astype(bool)
        np.testing.assert_allclose(got[g], attention(q[g], k[g, listed], v[g, listed], mask, scale=d ** -0.5),
                                   rtol=1e-4, atol=1e-5)
        filled = source[g, :n_rows[g]] >= slots
        np.testing.assert_array_equal(slab_after[g, source[g, :n_rows[g]][filled] - slots], kv[g, listed[filled]])


def test_each_row_is_read_from_its_source_and_a_fill_writes_its_slot():
    """Hits from the slab, fills and bypasses from host memory: the reference over the rows, the fills in the
    slab."""
    _check_rows_from_sources(5, 3, 16, tokens=120, rows=80, slots=96)  # G = 3: a padded head


@pytest.mark.gpu  # the simulator would take minutes
@pytest.mark.parametrize("heads, d", [(4, 128), (3, 64), (8, 256)])
def test_each_row_is_read_from_its_source_at_model_head_dims(heads, d):
    """The same at the models' shapes, over many chunks."""
    _check_rows_from_sources(heads * d, heads, d, tokens=4096, rows=1800, slots=2048)


def test_far_negative_logits_over_many_chunks_at_a_small_head_dim():
    """Every logit near −2400 across chunks (two: a whole one and a partial one; the simulator is slow), with d = 8
    channels (the combine's CTA has fewer threads than the 32 partial maxima it reads): exp(logit − max) must not
    underflow to a zero sum."""
    streams, heads, d, rows = 1, 2, 8, CHUNK_ROWS + 5
    rng = np.random.default_rng(7)
    k = _bf16(np.full((rows, d), 3.0, np.float32) + rng.uniform(0, 0.1, (rows, d)).astype(np.float32))
    v = _bf16(rng.standard_normal((rows, d)).astype(np.float32))
    q = np.full((streams, heads, d), -100.0, np.float32)
    kv = np.stack([_words(k), _words(v)], axis=1).reshape(1, rows, 2, d // 4)  # [1, T, 2, d / 4], C strides
    lengths = n_rows = np.array([rows], np.int32)
    chunks = -(-rows // CHUNK_ROWS)
    parts = [cuda.device_array((streams, chunks, heads), np.float32) for _ in range(2)]
    out = cuda.device_array((streams, heads, d), np.float32)
    no_rows = cuda.to_device(np.zeros((1, rows), np.int32))
    attend_rows(cuda.to_device(q), no_rows, no_rows, cuda.to_device(n_rows), cuda.to_device(lengths), 1, True,
                cuda.to_device(kv), 1.0, cuda.to_device(np.zeros(4, np.int32)), *parts,
                cuda.device_array((streams, chunks, heads, d), np.float32), out)
    np.testing.assert_allclose(out.copy_to_host()[0], attention(q[0], k, v, scale=1.0), rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # a NaN query: NaN out, flagged
def test_a_non_finite_query_raises_the_flag():
    kv = np.ones((1, 64, 2, 1), np.uint64)
    q = np.array([[[np.nan, 0, 0, 0]]], np.float32)
    status = cuda.to_device(np.zeros(4, np.int32))
    parts = [cuda.device_array((1, 1, 1), np.float32) for _ in range(2)]
    lengths, n_rows = cuda.to_device(np.array([64], np.int32)), cuda.to_device(np.array([0], np.int32))
    no_rows = cuda.to_device(np.zeros((1, 64), np.int32))
    attend_rows(cuda.to_device(q), no_rows, no_rows, n_rows, lengths, 1, True, cuda.to_device(kv), 1.0, status,
                *parts, cuda.device_array((1, 1, 1, 4), np.float32), cuda.device_array((1, 1, 4), np.float32))
    assert status.copy_to_host()[2] == 1


def _attend_dense(kv, heads: int = 1, d: int = 4, length: int = 64, **kwargs) -> None:
    """``attend_rows`` over every row of one stream's ``kv`` (dense, one partial chunk): the refusals' call."""
    lengths, n_rows = cuda.to_device(np.array([length], np.int32)), cuda.to_device(np.array([0], np.int32))
    no_rows = cuda.to_device(np.zeros((1, 64), np.int32))
    parts = [cuda.device_array((1, 1, heads), np.float32) for _ in range(2)]
    q, out = (cuda.device_array((1, heads, d), np.float32) for _ in range(2))
    attend_rows(q, no_rows, no_rows, n_rows, lengths, 1, True, kv, 1.0, cuda.to_device(np.zeros(4, np.int32)), *parts,
                cuda.device_array((1, 1, heads, d), np.float32), out, **kwargs)


def test_partials_must_cover_every_row_a_stream_can_read():
    """Dense rows are 0 .. n with n up to kv's T, sparse ones up to the row list's length: partials for fewer chunks
    are refused, not written past."""
    with pytest.raises(ValueError, match=rf"chunks · {CHUNK_ROWS} >= {2 * CHUNK_ROWS} rows"):
        _attend_dense(cuda.to_device(np.zeros((1, 2 * CHUNK_ROWS, 2, 1), np.uint64)), length=300)


def test_a_strided_row_store_is_refused():
    """The kernel reads its arrays flat, by offsets: a view with other strides is refused, not misread."""
    kv = cuda.to_device(np.zeros((1, 64, 4, 1), np.uint64))[:, :, ::2]  # [1, 64, 2, 1], every other word
    with pytest.raises(ValueError, match="kv must be C-contiguous"):
        _attend_dense(kv)


def test_a_cta_whose_shared_memory_would_not_fit_is_refused():
    """At G = 8, d = 256 the default warps are halved until the CTA fits; asking for more warps is refused."""
    assert shared_bytes(8, 64, attend_warps(8, 64)) <= MAX_SHARED < shared_bytes(8, 64, 8)
    with pytest.raises(ValueError, match="warps must be an integer in 1..32 whose CTA fits"):
        _attend_dense(cuda.to_device(np.zeros((1, 64, 2, 64), np.uint64)), heads=8, d=256, warps=8)


@pytest.mark.parametrize("heads, words", [(1, 2), (3, 2), (4, 32), (6, 32), (8, 64), (3, 16), (8, 1)])
def test_lane_layout_holds_one_logit_a_lane_group(heads, words):
    """After the butterfly every (row, head) logit of a batch sits in ``spread`` lanes of a group, and a group's
    lanes cover a row's words."""
    row_lanes, per_lane, rows_in_flight, spread = lane_layout(heads, words)
    padded = 1 << (heads - 1).bit_length()
    assert row_lanes in (8, 16, 32) and 32 % row_lanes == 0
    assert row_lanes * per_lane >= words and row_lanes * (per_lane - 1) < words
    assert rows_in_flight * padded * spread == row_lanes and rows_in_flight >= 1
