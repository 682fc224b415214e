"""Landmarks on the GPU: the fp16 mean key of each sealed 8-token block (ShadowKV-style, SPEC §7).

The twin of ``fathom.scoring.landmarks``, bit-identical: NumPy's ``mean(axis=1, dtype=float32)`` over the
8 keys of a block adds them in token order (the reduced axis is not the contiguous one), divides by 8
(exact) and rounds to fp16 to nearest even; the kernel does the same, rounding in integers
(``fathom.cuda.half``) in a second kernel that reads the float32 means through a uint32 view (Numba has no
bit cast of a scalar). One thread per (stream, landmark, channel), consecutive threads on consecutive
channels. Landmarks travel as fp16 bit patterns, like the block scales.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.half import f32_abs_bits_to_f16_bits
from fathom.scoring import LANDMARK_TOKENS

THREADS = 128


@cuda.jit
def _mean_kernel(keys, means):
    """keys float32 [S, n, d] -> means float32 [S, n / 8, d], summed in token order."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    s = cuda.blockIdx.z
    if c >= keys.shape[2]:
        return
    acc = keys[s, b * LANDMARK_TOKENS, c]
    for j in range(1, LANDMARK_TOKENS):
        acc += keys[s, b * LANDMARK_TOKENS + j, c]
    means[s, b, c] = acc / np.float32(LANDMARK_TOKENS)


@cuda.jit
def _round_kernel(mean_bits, marks, first):
    """mean_bits uint32 [S, rows, d] (float32 bits) -> fp16 bits at rows first .. first + rows of marks."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    s = cuda.blockIdx.z
    if c >= mean_bits.shape[2]:
        return
    bits = mean_bits[s, b, c]
    h = f32_abs_bits_to_f16_bits(bits & np.uint32(0x7FFFFFFF))
    if bits >> np.uint32(31):
        h = np.uint16(h | np.uint16(0x8000))
    marks[s, first + b, c] = h


def landmarks(keys, marks, means, first: int = 0, stream=0, threads: int = THREADS) -> None:
    """Write the landmarks of ``keys float32 [S, n, d]`` (n % 8 == 0, within the fp16 range) into rows
    ``first .. first + n / 8`` of ``marks uint16 [S, T / 8, d]`` (fp16 bits), on ``stream``.

    ``means``: float32 scratch ``[S, >= n / 8, d]`` (C-contiguous).
    """
    n_streams, n, d = keys.shape
    if keys.dtype != np.float32 or n % LANDMARK_TOKENS:
        raise ValueError(f"keys must be float32 [S, n, d] with n % {LANDMARK_TOKENS} == 0, got {keys.dtype} "
                         f"{keys.shape}")
    rows = n // LANDMARK_TOKENS
    if marks.dtype != np.uint16 or marks.shape[0] != n_streams or marks.shape[2] != d \
            or not 0 <= first <= marks.shape[1] - rows:
        raise ValueError(f"marks must be uint16 [{n_streams}, >= {first + rows}, {d}], got {marks.dtype} "
                         f"{marks.shape}")
    if means.dtype != np.float32 or means.shape[0] != n_streams or means.shape[1] < rows or means.shape[2] != d:
        raise ValueError(f"means must be float32 [{n_streams}, >= {rows}, {d}], got {means.dtype} {means.shape}")
    if rows and n_streams:
        grid = (math.ceil(d / threads), rows, n_streams)
        _mean_kernel[grid, min(threads, d), stream](keys, means[:, :rows])
        _round_kernel[grid, min(threads, d), stream](means.view(np.uint32)[:, :rows], marks, first)
