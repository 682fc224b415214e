"""Approximate scores from the staged planes at per-channel depths (SPEC §5, §8 step 3).

The twin of ``fathom.scoring.approx_scores`` (within float32 tolerance: the sum
over channels runs in the staging order, with FMAs). One thread per (stream,
token); a warp's 32 tokens share each plane word, so every word read is one
broadcast. The read channels' metadata, query values and decoded cell widths
(one per channel and 64-token block, not per token) sit in shared memory; the
kernel is compiled per head count G so each thread's G accumulators are
registers (indexing by a runtime G would put them in local memory). The staging layout is the one ``fathom.cuda.gather`` writes.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.half import f16_bits_to_f32
from fathom.quantize import BLOCK

THREADS = 256  # the most a block may have (its token blocks' scales are staged in shared memory)
MAX_HEADS = 16  # query heads per KV head
MAX_D = 256  # read channels per KV head
SPAN = THREADS // BLOCK + 1  # 64-token blocks one CUDA block touches
_KERNELS: dict[int, object] = {}


def _scan_kernel(heads: int):
    """The scan kernel for ``heads`` query heads: a compile-time count keeps the accumulators in registers."""
    if heads in _KERNELS:
        return _KERNELS[heads]

    @cuda.jit
    def kernel(q, depths, active, n_active, plane_row, scale_row, staged_planes, staged_scales,
               max_planes, max_channels, n_blocks, scores):
        g = cuda.blockIdx.y
        t = cuda.threadIdx.x
        first = cuda.blockIdx.x * cuda.blockDim.x
        j = first + t
        first_block = first // BLOCK
        # once per CUDA block: the read channels' query values, plane rows and decoded cell widths Δ
        q_read = cuda.shared.array((MAX_D, heads), np.float32)
        depth = cuda.shared.array(MAX_D, np.int32)
        plane_at = cuda.shared.array(MAX_D, np.int64)
        delta = cuda.shared.array((MAX_D, SPAN), np.float32)
        n_read = n_active[g]
        for i in range(t, n_read, cuda.blockDim.x):
            c = active[g, i]
            depth[i] = depths[g, c]
            plane_at[i] = np.int64(g * max_planes + plane_row[g, c]) * n_blocks
            for h in range(heads):
                q_read[i, h] = q[g, h, c]
        for x in range(t, n_read * SPAN, cuda.blockDim.x):
            i = x // SPAN
            b = first_block + x - i * SPAN
            if b < n_blocks:
                row = np.int64(g * max_channels + scale_row[g, active[g, i]])
                delta[i, x - i * SPAN] = f16_bits_to_f32(staged_scales[row * n_blocks + b]) * np.float32(0.125)
        cuda.syncthreads()
        if j < n_blocks * BLOCK:
            b = j // BLOCK
            local_block = b - first_block
            bit = np.uint64(j - b * BLOCK)
            acc = cuda.local.array(heads, np.float32)
            for h in range(heads):
                acc[h] = np.float32(0)
            for i in range(n_read):
                t_read = depth[i]
                p = 0
                for k in range(t_read):
                    p = 2 * p + np.int32((staged_planes[plane_at[i] + k * n_blocks + b] >> bit) & np.uint64(1))
                cell = np.float32(1 << (4 - t_read))
                khat = ((np.float32(p) + np.float32(0.5)) * cell - np.float32(8)) * delta[i, local_block]
                for h in range(heads):
                    acc[h] += q_read[i, h] * khat
            for h in range(heads):
                scores[g, h, j] = acc[h]

    _KERNELS[heads] = kernel
    return kernel


def approx_scores(q, depths, active, n_active, plane_row, scale_row, staged_planes, staged_scales,
                  max_planes: int, max_channels: int, n_blocks: int, scores, threads: int = THREADS) -> None:
    """Scores ``float32 [S, G, ≥ n_blocks·64]`` (first ``n_blocks·64`` columns written) of
    ``q float32 [S, G, d]`` against the staged planes read to ``depths int8 [S, d]``."""
    groups, heads, _ = q.shape
    if heads > MAX_HEADS or q.shape[2] > MAX_D or not 1 <= threads <= THREADS:
        raise ValueError(f"at most {MAX_HEADS} query heads, {MAX_D} channels and {THREADS} threads, "
                         f"got {heads}, {q.shape[2]}, {threads}")
    if scores.shape[:2] != (groups, heads) or scores.shape[2] < n_blocks * BLOCK:
        raise ValueError(f"scores must have shape ({groups}, {heads}, >= {n_blocks * BLOCK}), got {scores.shape}")
    if groups and n_blocks:
        grid = (math.ceil(n_blocks * BLOCK / threads), groups)
        _scan_kernel(heads)[grid, threads](q, depths, active, n_active, plane_row, scale_row, staged_planes,
                                           staged_scales, max_planes, max_channels, n_blocks, scores)
