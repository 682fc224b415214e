"""K/V rows in (mapped, pinned) host memory: the gather of the selected rows (SPEC §8 step 5),
the staging of the first rows of every stream (the scan of landmark and oracle) and the append of new rows.

Rows are bf16 stored as raw 16-bit words and moved as 8-byte words (``d % 4 == 0``),
consecutive threads on consecutive words, so a warp moves whole 256-byte rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda


@cuda.jit
def _gather_rows_kernel(row_index, n_rows, words_per_row, max_tokens, k_src, v_src, k_dst, v_dst):
    """Copy rows ``row_index[g, :n_rows[g]]`` of stream g: 8-byte words, one row = words_per_row words."""
    g = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    r = i // words_per_row
    if r >= n_rows[g]:
        return
    w = i - r * words_per_row
    src = (g * max_tokens + row_index[g, r]) * words_per_row + w
    dst = (g * row_index.shape[1] + r) * words_per_row + w
    k_dst[dst] = k_src[src]
    v_dst[dst] = v_src[src]


@cuda.jit
def _store_rows_kernel(src, dst, first_row, rows, words_per_row, max_tokens):
    """src words [S·rows·wpr] -> dst words of rows first_row.. of each stream's [max_tokens, wpr]."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    per_stream = rows * words_per_row
    if i >= src.shape[0]:
        return
    s = i // per_stream
    rest = i - s * per_stream
    dst[(s * max_tokens + first_row) * words_per_row + rest] = src[i]


def gather_rows(row_index, n_rows, k_src, v_src, k_dst, v_dst, threads: int = 256) -> None:
    """Copy the listed K and V rows of every stream in one launch.

    Args:
        k_src, v_src: 16-bit ``[S, max_tokens, d]`` row stores (bf16 bits; d % 4 == 0), host-mapped or device.
        k_dst, v_dst: 16-bit ``[S, max_rows, d]`` device buffers; rows past ``n_rows[g]`` are left as they were.
    """
    groups, max_tokens, d = k_src.shape
    max_rows = row_index.shape[1]
    if d % 4 or k_src.dtype.itemsize != 2 or v_src.shape != k_src.shape or k_dst.shape != (groups, max_rows, d) \
            or v_dst.shape != k_dst.shape:
        raise ValueError(f"rows must be 16-bit [S, tokens, d] with d % 4 == 0 and destinations "
                         f"{(groups, max_rows, d)}; got {k_src.shape}, {v_src.shape}, {k_dst.shape}, {v_dst.shape}")
    words = d // 4
    if groups and max_rows:
        grid = (math.ceil(max_rows * words / threads), groups)
        _gather_rows_kernel[grid, threads](row_index, n_rows, words, max_tokens,
                                           _words(k_src), _words(v_src), _words(k_dst), _words(v_dst))


def _words(rows):
    """A 16-bit ``[S, T, d]`` C-contiguous array as flat 8-byte words (no copy)."""
    return rows.reshape(rows.size).view(np.uint64)


@cuda.jit
def _stage_rows_kernel(src, dst, words, src_words, dst_words):
    """The first ``words`` 8-byte words of each stream: src [S·src_words] -> dst [S·dst_words]."""
    g = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < words:
        dst[g * dst_words + i] = src[g * src_words + i]


def stage_rows(src, dst, rows: int, threads: int = 256) -> None:
    """Copy rows ``0 .. rows`` of every stream of ``src`` 16-bit ``[S, T, d]`` (host-mapped or device) into
    ``dst [S, ≥ rows, d]`` (device), coalesced 8-byte words: the whole-prefix read of landmark and oracle."""
    streams, tokens, d = src.shape
    if src.dtype.itemsize != 2 or dst.dtype.itemsize != 2 or d % 4 or dst.shape[0] != streams \
            or dst.shape[2] != d or not 0 <= rows <= min(tokens, dst.shape[1]):
        raise ValueError(f"cannot stage {rows} 16-bit rows of {src.shape} into {dst.shape} (d % 4 == 0)")
    words = rows * d // 4
    if streams and words:
        threads = min(threads, words)
        _stage_rows_kernel[(math.ceil(words / threads), streams), threads](
            _words(src), _words(dst), words, tokens * d // 4, dst.shape[1] * d // 4)


def store_rows(src, dst, first_row: int, stream=0, threads: int = 256) -> None:
    """Write ``src`` 16-bit ``[S, m, d]`` (contiguous) into rows ``first_row .. first_row + m`` of ``dst [S, T, d]``,
    on ``stream``."""
    streams, m, d = src.shape
    if src.dtype.itemsize != 2 or dst.dtype.itemsize != 2 or dst.shape[0] != streams or dst.shape[2] != d or d % 4 \
            or not 0 <= first_row <= dst.shape[1] - m:
        raise ValueError(f"cannot store 16-bit rows {src.shape} at row {first_row} of {dst.shape}")
    if src.size:
        words = _words(src)
        threads = min(threads, words.shape[0])  # a small append launches no idle threads
        _store_rows_kernel[math.ceil(words.shape[0] / threads), threads, stream](words, _words(dst), first_row, m,
                                                                                 d // 4, dst.shape[1])
