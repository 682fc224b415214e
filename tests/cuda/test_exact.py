"""fathom.cuda.exact against fathom.scoring.exact_scores / landmark_scores (float32 tolerance): scores of the sealed
tokens from bf16 K rows or fp16 landmarks, with ragged sessions (lengths read on the device), sessions shorter than
sink + local, and the candidates' top-byte histogram."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.exact import scan_rows
from fathom.scoring import LANDMARK_TOKENS, exact_scores, landmark_scores, landmarks
from tests.cuda.helpers import read_scores, top_byte_histogram, unwritten_keys


def _bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 [..., d] -> its bf16 bits as uint64 words [..., d / 4]."""
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint64)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 3]), d=st.sampled_from([4, 12]), marks=st.booleans(), sink=st.integers(0, 5),
       local=st.integers(0, 80))
def test_scan_rows_matches_reference(seed, sessions, kv_heads, heads, d, marks, sink, local):
    rng = np.random.default_rng(seed)
    tokens = 320
    lengths = rng.integers(1, tokens + 1, sessions).astype(np.int32)
    streams = sessions * kv_heads
    k = torch.from_numpy(rng.standard_normal((streams, tokens, d)).astype(np.float32) * 3).bfloat16().float().numpy()
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    if marks:  # fp16 landmarks of every 8-token block, one half per row
        table = np.stack([landmarks(k[g]) for g in range(streams)])  # [streams, T / 8, d]
        rows = table.view(np.uint16).view(np.uint64)[:, :, None, :]
    else:  # bf16 K rows beside zero V rows
        rows = np.stack([_bf16_words(k), np.zeros_like(_bf16_words(k))], axis=2)
    keys = unwritten_keys(streams, heads, tokens)
    top_hist = cuda.to_device(np.zeros((streams, heads, 256), np.int32))
    scan_rows(cuda.to_device(q), cuda.to_device(rows), not marks, LANDMARK_TOKENS if marks else 1,
              cuda.to_device(lengths), kv_heads, sink, local, keys, top_hist, threads=32)
    got, hist = read_scores(keys, tokens), top_hist.copy_to_host()
    for g in range(streams):
        n = int(lengths[g // kv_heads])
        n_sealed = n // 64 * 64
        want = landmark_scores(q[g], table[g, :n_sealed // LANDMARK_TOKENS]) if marks \
            else exact_scores(q[g], k[g, :n_sealed])
        np.testing.assert_allclose(got[g, :, :n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1))
        assert np.isnan(got[g, :, n_sealed:]).all()  # nothing written past the sealed tokens
        candidates = got[g, :, sink:max(min(n_sealed, n - local), sink)]
        np.testing.assert_array_equal(hist[g], top_byte_histogram(candidates))


def test_every_tile_fits_in_static_shared_memory():
    """A CTA may declare 48 KiB of static shared memory (ptxas refuses more): the tile of 64 rows at d = 256 with
    the query and histogram of G = 8 heads took 49664 bytes. Every G the decoder takes (1..8) at every d fits."""
    from fathom.cuda.block import RADIX
    from fathom.cuda.exact import MAX_WORDS, rows_per_cta

    for heads in range(1, 9):
        for words in range(1, MAX_WORDS + 1):
            rows = rows_per_cta(words, heads)
            assert rows >= 1
            assert 8 * rows * (words + 1) + 4 * heads * (4 * words + RADIX) <= 48 * 1024, (heads, words)


def test_the_largest_group_and_head_dim_score_as_the_reference():
    """G = 8 at d = 256: a tile of 63 rows (not a power of two), so 64 sealed tokens take two CTAs."""
    rng = np.random.default_rng(5)
    heads, d, tokens = 8, 256, 128
    k = torch.from_numpy(rng.standard_normal((1, tokens, d)).astype(np.float32)).bfloat16().float().numpy()
    q = rng.standard_normal((1, heads, d)).astype(np.float32)
    rows = np.stack([_bf16_words(k), np.zeros_like(_bf16_words(k))], axis=2)
    keys = unwritten_keys(1, heads, tokens)
    top_hist = cuda.to_device(np.zeros((1, heads, 256), np.int32))
    scan_rows(cuda.to_device(q), cuda.to_device(rows), True, 1, cuda.to_device(np.array([100], np.int32)), 1, 4, 16,
              keys, top_hist, threads=32)
    want = exact_scores(q[0], k[0, :64])
    got = read_scores(keys, tokens)[0]
    np.testing.assert_allclose(got[:, :64], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.isnan(got[:, 64:]).all()
    np.testing.assert_array_equal(top_hist.copy_to_host()[0], top_byte_histogram(got[:, 4:64]))
