"""Scores from 16-bit rows read straight from host memory (design §7, §8 step 3): the oracle's exact ``q · k`` over
the bf16 K rows, and landmark's ``q · mark`` over the fp16 mean keys, every token of an 8-token block taking its
block's score. The twins of ``fathom.scoring.exact_scores`` / ``landmark_scores`` (float32 tolerance), written as
``fathom.cuda.scan``'s are (split order keys, ``fathom.cuda.score_keys``), and like it they count the top byte of
every candidate's score for the selection.

One CTA per (tile of up to 128 rows, stream): the tile's rows are read coalesced (consecutive threads on
consecutive 8-byte words of a row) into shared memory, then each thread scores one row. Rows past a session's
sealed tokens (read from the device lengths) are not read.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.block import RADIX, flush_histogram
from fathom.cuda.half import bf16_bits_to_f32, f16_bits_to_f32
from fathom.cuda.score_keys import check_keys, store_one
from fathom.quantize import BLOCK

THREADS = 128
MAX_WORDS = 64  # 8-byte words per row: d <= 256
TILE_WORDS = 4224  # shared words of a tile (33 KiB): 128 rows at d = 128
SHARED_BYTES = 48 * 1024  # the static shared memory a CTA may declare (ptxas refuses a kernel past it)
_KERNELS: dict[tuple, object] = {}


def rows_per_cta(words: int, heads: int) -> int:
    """Rows of a tile: at most 128 and :data:`TILE_WORDS`, and within the shared memory the query and histogram of
    ``heads`` heads leave (float32 ``[heads, d]``, int32 ``[heads, 256]``: at G = 8, d = 256 a 64-row tile would
    overrun it by 512 bytes)."""
    left = SHARED_BYTES - heads * 4 * (4 * words + RADIX)
    return min(128, TILE_WORDS // (words + 1), left // (8 * (words + 1)))


def _row_kernel(heads: int, bf16: bool, tokens_per_row: int, words: int):
    key = (heads, bf16, tokens_per_row, words)
    if key in _KERNELS:
        return _KERNELS[key]
    ROWS = rows_per_cta(words, heads)
    stride = words + 1  # +1: rows fall in different banks (shared sizes must be constants for Numba)
    d = 4 * words

    @cuda.jit(cache=True)  # its closure holds only integers: cached on disk
    def kernel(q, rows, lengths, heads_per_session, sink, local, halves, top_hist):
        g = cuda.blockIdx.y
        t = cuda.threadIdx.x
        n_threads = cuda.blockDim.x
        n = lengths[g // heads_per_session]
        n_sealed = n // BLOCK * BLOCK
        first = cuda.blockIdx.x * ROWS
        valid = min(ROWS, n_sealed // tokens_per_row - first)
        if valid <= 0:
            return
        tile = cuda.shared.array((ROWS, stride), np.uint64)
        q_all = cuda.shared.array((heads, d), np.float32)
        hist = cuda.shared.array((heads, RADIX), np.int32)
        for x in range(t, heads * RADIX, n_threads):
            hist[x // RADIX, x % RADIX] = 0
        for x in range(t, heads * d, n_threads):
            q_all[x // d, x % d] = q[g, x // d, x % d]
        for x in range(t, valid * words, n_threads):
            tile[x // words, x % words] = rows[g, first + x // words, 0, x % words]
        cuda.syncthreads()
        lo_cand = sink
        hi_cand = min(n_sealed, n - local)
        for r in range(t, valid, n_threads):
            acc = cuda.local.array(heads, np.float32)
            for h in range(heads):
                acc[h] = np.float32(0)
            for w in range(words):
                word = tile[r, w]
                for e in range(4):
                    bits = np.uint16((word >> np.uint64(16 * e)) & np.uint64(0xFFFF))
                    if bf16:
                        value = bf16_bits_to_f32(bits)
                    else:  # fp16 landmark (signed)
                        value = f16_bits_to_f32(bits & np.uint16(0x7FFF))
                        if bits >> 15:
                            value = -value
                    for h in range(heads):
                        acc[h] += q_all[h, 4 * w + e] * value
            for h in range(heads):
                key = np.uint32(0)
                counted = 0
                for e in range(tokens_per_row):
                    j = (first + r) * tokens_per_row + e
                    key = store_one(halves, g, h, j, acc[h])
                    if lo_cand <= j < hi_cand:
                        counted += 1
                if counted:  # a row's tokens share its score: one add
                    cuda.atomic.add(hist, (h, np.int32(key >> np.uint32(24))), counted)
        flush_histogram(hist, top_hist, g, heads, t, n_threads)

    _KERNELS[key] = kernel
    return kernel


def scan_rows(q, rows, bf16: bool, tokens_per_row: int, lengths, heads_per_session: int, sink: int, local: int,
              keys, top_hist, threads: int = THREADS, stream=0) -> None:
    """Scores of every sealed token from 16-bit rows, and the candidates' top-byte histogram.

    Args:
        q: float32 ``[streams, G, d]`` (raw basis).
        rows: uint64 ``[streams, R, halves, d / 4]``: row ``r`` is half 0 of ``rows[g, r]`` (bf16 K rows of the
            K/V store, or fp16 landmarks with one half), 4 values per word.
        bf16: the rows hold bf16 (K rows) or fp16 (landmarks); tokens_per_row: 1 (K rows) or 8 (landmarks).
        lengths, heads_per_session, sink, local, keys, top_hist: as in ``fathom.cuda.scan.scan_planes``.
    """
    streams, heads, d = q.shape
    if d % 4 or d // 4 > MAX_WORDS or rows.shape[3] != d // 4:
        raise ValueError(f"rows must hold d / 4 words with d % 4 == 0 and d <= {4 * MAX_WORDS}; got d = {d}, "
                         f"rows {rows.shape}")
    if heads < 1 or rows_per_cta(d // 4, heads) < 1:  # the query and histograms alone would fill shared memory
        most = (SHARED_BYTES - 8 * (d // 4 + 1)) // (4 * (d + RADIX))
        raise ValueError(f"q must have 1..{most} query heads at d = {d}, got {heads}")
    check_keys(keys, streams, heads)
    if streams:
        grid = (math.ceil(rows.shape[1] / rows_per_cta(d // 4, heads)), streams)
        kernel = _row_kernel(heads, bf16, tokens_per_row, d // 4)
        kernel[grid, threads, stream](q, rows, lengths, heads_per_session, sink, local, keys.view(np.uint16), top_hist)
