"""fathom.cuda.topk against fathom.selection: selections equal (ties to the earlier token) and the ascending union
row list, with ragged sessions (lengths read on the device)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.block import exclusive_scan
from fathom.cuda.score_keys import score_keys
from fathom.cuda.topk import MAX_PASS_TOKENS, PASS_CTAS_PER_SM, PASS_TOKENS, _find_digit, pass_tokens_for, select, \
    union_blocks, union_rows
from fathom.selection import Selection
from fathom.selection import select as ref_select
from tests.cuda.helpers import top_byte_histogram


def _scores(rng, streams, heads, tokens, levels):
    """Scores with many exact ties (few distinct levels), both signs of zero, and crowded in a binade (an offset)."""
    s = rng.integers(-levels, levels + 1, (streams, heads, tokens)).astype(np.float32) * np.float32(0.37)
    s[rng.random(s.shape) < 0.5] += np.float32(1000.0)
    s[s == 0] = np.where(rng.random((s == 0).sum()) < 0.5, np.float32(-0.0), np.float32(0.0))
    return s


def _select_matches_reference(scores, lengths, kv_heads, k, sink, local, threads, per_block, list_ctas, capacity):
    """Select and compact on the device; every stream's rows and head masks equal the reference's, and the scratch
    is left zero for the next step."""
    streams, heads, tokens = scores.shape
    hist = np.zeros((streams, heads, 256), np.int32)
    for g in range(streams):  # what the scan counts: the candidates' top bytes
        n = lengths[g // kv_heads]
        hist[g] = top_byte_histogram(scores[g, :, sink:max(min(n // 64 * 64, n - local), sink)])
    winners = cuda.to_device(np.zeros((streams, tokens), np.uint32))
    any_rows = cuda.to_device(np.zeros((streams, tokens // 64), np.uint64))
    top_hist = cuda.to_device(hist)
    hists = cuda.to_device(np.zeros((streams, heads, 3, 256), np.int32))
    cand_key = cuda.device_array((streams, heads, tokens), np.uint32)
    cand_idx = cuda.device_array((streams, heads, tokens), np.int32)
    list_sizes = cuda.to_device(np.zeros((streams, heads, 2), np.int32))
    ties = cuda.device_array((streams, heads, capacity), np.int32)
    lengths_dev = cuda.to_device(lengths)
    select(cuda.to_device(score_keys(scores)), lengths_dev, kv_heads, k, sink, local, top_hist, hists, cand_key,
           cand_idx, list_sizes, ties, winners, any_rows, threads=threads, select_threads=threads,
           per_block=per_block, list_ctas=list_ctas)
    assert not top_hist.copy_to_host().any() and not hists.copy_to_host().any()  # zero for the next step
    assert not list_sizes.copy_to_host().any()

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


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 3]), k=st.integers(0, 70), sink=st.integers(0, 5), local=st.integers(0, 40),
       levels=st.sampled_from([2, 1000]), threads=st.sampled_from([32, 64]), per_block=st.sampled_from([80, 320]),
       list_ctas=st.sampled_from([1, 3]), capacity=st.sampled_from([1, 320]))
def test_select_and_union_match_reference(seed, sessions, kv_heads, heads, k, sink, local, levels, threads, per_block,
                                          list_ctas, capacity):
    """Both passes over the scores split across CTAs (per_block = 80: their edges inside 64-token blocks) or not
    (320), both over the candidate lists too (list_ctas), and the keys equal to the k-th largest held in their
    buffer or past it (capacity 1): the k-th's bins are split by every key byte on every path."""
    rng = np.random.default_rng(seed)
    tokens = 320
    lengths = rng.integers(1, tokens + 1, sessions).astype(np.int32)
    scores = _scores(rng, sessions * kv_heads, heads, tokens, levels)
    _select_matches_reference(scores, lengths, kv_heads, k, sink, local, threads, per_block, list_ctas, capacity)


@given(streams=st.integers(1, 4096), heads=st.integers(1, 8), tokens=st.integers(1, 2**21),
       multiprocessors=st.integers(1, 264))
def test_pass_tokens_double_only_while_the_passes_grid_stays_many_waves_deep(streams, heads, tokens, multiprocessors):
    """The passes' tokens a CTA: 8,192, or 16,384 where the grid at 16,384 still holds 16 CTAs an SM (never more:
    the longest walk measured)."""
    per = pass_tokens_for(streams, heads, tokens, multiprocessors)
    doubled = streams * heads * -(-tokens // MAX_PASS_TOKENS) >= PASS_CTAS_PER_SM * multiprocessors
    assert per == (MAX_PASS_TOKENS if doubled else PASS_TOKENS)


def test_pass_tokens_at_the_timed_settings():
    """Qwen3-8B's shape (8 KV heads, G = 4) on 132 SMs: one session of 128k or 1M keeps 8,192 tokens a CTA (as timed
    at 128k × 1), 16 sessions of 128k take 16,384 (timed: the passes 7.09 -> 6.62 ms of a token)."""
    assert [pass_tokens_for(8 * s, 4, n, 132) for s, n in ((1, 2**17), (1, 2**20), (16, 2**17))] == \
        [8192, 8192, 16384]


@pytest.mark.parametrize("capacity", [1, 320])
def test_ties_are_broken_from_their_buffer_and_past_it(capacity):
    """A crowded head: every candidate in one bin of the top 16 key bits (a list longer than a list pass's CTAs
    take at once), and the k-th largest key shared by more candidates than are kept, so the earliest of them are
    chosen by index: from the ties' buffer, or (capacity 1) by walking the list."""
    rng = np.random.default_rng(7)
    tokens, k = 320, 60
    scores = (np.float32(1000.0) + rng.integers(0, 4, (1, 2, tokens)).astype(np.float32) * np.float32(0.0625))
    keys = np.sort(scores[0, 0, 4:288])[::-1]  # the candidates: past sink 4, before local 32
    assert (keys[:k] == keys[k - 1]).sum() < (keys == keys[k - 1]).sum()  # the ties are cut: kept by index
    _select_matches_reference(scores, np.array([tokens], np.int32), 1, k, 4, 32, 32, 320, 3, capacity)


def test_a_kernel_refuses_streams_and_sessions_that_do_not_agree():
    """heads_per_session must divide the streams and lengths hold one per session: else the kernels index past
    lengths (the wrappers of the scan, plan, selection, row union, gather and attention share the check)."""
    from fathom import _checks

    lengths = np.zeros(2, np.int32)
    _checks.stream_sessions(4, 2, lengths)
    for streams, heads_per_session, message in ((4, 0, "heads_per_session"), (4, 3, "heads_per_session"),
                                                (4, True, "heads_per_session"), (2, 2, "lengths must hold")):
        with pytest.raises(ValueError, match=message):
            _checks.stream_sessions(streams, heads_per_session, lengths)


@cuda.jit
def _find_digit_kernel(hist_in, wanted, descending, out):
    t = cuda.threadIdx.x
    hist = cuda.shared.array(256, np.int32)
    state = cuda.shared.array(3, np.int64)
    for i in range(t, 256, cuda.blockDim.x):
        hist[i] = hist_in[i]
    if t == 0:
        for i in range(3):
            state[i] = -1
    cuda.syncthreads()
    _find_digit(hist, wanted, descending, state, t, cuda.blockDim.x)
    if t == 0:
        for i in range(3):
            out[i] = state[i]


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), threads=st.sampled_from([1, 7, 32, 64]), descending=st.booleans(),
       sparse=st.booleans())
def test_find_digit_walks_as_a_running_count(seed, threads, descending, sparse):
    """The digit where the running count reaches wanted, for blocks under and over 32 threads, wanted <= 0 (the
    first digit) and wanted past the total (nothing written)."""
    rng = np.random.default_rng(seed)
    hist = rng.integers(0, 5, 256).astype(np.int32)
    if sparse:
        hist[rng.random(256) < 0.9] = 0
    order = np.arange(256)[::-1] if descending else np.arange(256)
    running = np.cumsum(hist[order])
    for wanted in (0, 1, int(running[-1]) // 2 + 1, int(running[-1]), int(running[-1]) + 1):
        out = cuda.to_device(np.zeros(3, np.int64))
        _find_digit_kernel[1, threads](cuda.to_device(hist), wanted, descending, out)
        if wanted > running[-1]:
            want = [-1, -1, -1]
        else:
            i = int(np.argmax(running >= wanted))
            want = [order[i], wanted - (running[i] - hist[order[i]]), hist[order[i]]]
        np.testing.assert_array_equal(out.copy_to_host(), want)


@cuda.jit
def _exclusive_scan_kernel(values, excl, total):
    t = cuda.threadIdx.x
    counts = cuda.shared.array(64, np.int64)
    counts[t] = values[t]
    excl[t], total[t] = exclusive_scan(counts, t, cuda.blockDim.x)


def test_exclusive_scan_matches_cumsum():
    """fathom.cuda.block.exclusive_scan for block sizes not a power of two as well."""
    rng = np.random.default_rng(0)
    for threads in (1, 5, 33, 64):
        values = rng.integers(0, 1000, threads).astype(np.int64)
        excl = cuda.to_device(np.zeros(threads, np.int64))
        total = cuda.to_device(np.zeros(threads, np.int64))
        _exclusive_scan_kernel[1, threads](cuda.to_device(values), excl, total)
        np.testing.assert_array_equal(excl.copy_to_host(), np.cumsum(values) - values)
        assert (total.copy_to_host() == values.sum()).all()


def test_union_spans_several_ctas_per_stream():
    """One bitmap word per thread: at 2 threads a stream of 5 words is three CTAs, each summing the rows of the CTAs
    before it; ragged lengths, a short row list (max_rows) and marks cleared."""
    rng = np.random.default_rng(7)
    streams, tokens, threads = 4, 320, 2
    lengths = np.array([320, 130], np.int32)  # two sessions, two KV heads each
    marks = rng.random((streams, tokens)) < 0.3
    for g in range(streams):
        marks[g, lengths[g // 2]:] = False
    masks = np.where(marks, rng.integers(1, 16, (streams, tokens)), 0).astype(np.uint32)
    bitmap = np.zeros((streams, tokens // 64), np.uint64)
    for g, j in zip(*np.nonzero(marks)):
        bitmap[g, j // 64] |= np.uint64(1) << np.uint64(j % 64)
    winners, any_rows = cuda.to_device(masks), cuda.to_device(bitmap)
    max_rows = 90
    row_index = cuda.device_array((streams, max_rows), np.int32)
    head_mask = cuda.device_array((streams, max_rows), np.uint32)
    n_rows = cuda.device_array(streams, np.int32)
    block_rows = cuda.device_array((streams, union_blocks(tokens, threads)), np.int32)
    assert block_rows.shape[1] == 3
    union_rows(any_rows, winners, cuda.to_device(lengths), 2, block_rows, row_index, head_mask, n_rows, threads)
    assert not winners.copy_to_host().any() and not any_rows.copy_to_host().any()
    for g in range(streams):
        rows = np.flatnonzero(marks[g])
        kept = min(len(rows), max_rows)
        assert n_rows.copy_to_host()[g] == kept
        np.testing.assert_array_equal(row_index.copy_to_host()[g, :kept], rows[:kept])
        np.testing.assert_array_equal(head_mask.copy_to_host()[g, :kept], masks[g, rows[:kept]])
