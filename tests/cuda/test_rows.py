"""fathom.cuda.rows: the row gather of listed rows, the staging of the first rows and the append of new rows."""

import numpy as np
from numba import cuda

from fathom.cuda.rows import gather_rows, stage_rows, store_rows


def test_gather_rows_copies_listed_rows():
    rng = np.random.default_rng(1)
    groups, tokens, d, max_rows = 2, 50, 8, 6
    k_src = rng.integers(0, 2**16, (groups, tokens, d)).astype(np.uint16)
    v_src = rng.integers(0, 2**16, (groups, tokens, d)).astype(np.uint16)
    row_index = np.array([[0, 7, 49, 3, 0, 0], [5, 6, 0, 0, 0, 0]], np.int32)
    n_rows = np.array([4, 2], np.int32)
    k_dst = cuda.to_device(np.zeros((groups, max_rows, d), np.uint16))
    v_dst = cuda.to_device(np.zeros((groups, max_rows, d), np.uint16))
    gather_rows(cuda.to_device(row_index), cuda.to_device(n_rows), cuda.to_device(k_src), cuda.to_device(v_src),
                k_dst, v_dst, threads=8)
    for g in range(groups):
        r = row_index[g, :n_rows[g]]
        np.testing.assert_array_equal(k_dst.copy_to_host()[g, :n_rows[g]], k_src[g, r])
        np.testing.assert_array_equal(v_dst.copy_to_host()[g, :n_rows[g]], v_src[g, r])
        assert not k_dst.copy_to_host()[g, n_rows[g]:].any()


def test_store_rows_appends_after_the_held_rows():
    rng = np.random.default_rng(2)
    dst = np.zeros((3, 20, 8), np.uint16)
    src = rng.integers(0, 2**16, (3, 5, 8)).astype(np.uint16)
    dst_dev = cuda.to_device(dst)
    store_rows(cuda.to_device(src), dst_dev, 11, threads=8)
    dst[:, 11:16] = src
    np.testing.assert_array_equal(dst_dev.copy_to_host(), dst)


def test_stage_rows_copies_the_first_rows_of_every_stream():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 2**16, (2, 30, 8)).astype(np.uint16)
    dst = cuda.to_device(np.zeros((2, 24, 8), np.uint16))
    stage_rows(cuda.to_device(src), dst, 17, threads=8)
    want = np.zeros((2, 24, 8), np.uint16)
    want[:, :17] = src[:, :17]
    np.testing.assert_array_equal(dst.copy_to_host(), want)
