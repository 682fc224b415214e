"""Block-wide building blocks for the kernels (shared memory only: they run under the CUDA simulator too)."""

from __future__ import annotations

import numpy as np
from numba import cuda

RADIX = 256


@cuda.jit(device=True, inline=True)
def exclusive_scan(counts, t, n_threads):
    """Exclusive prefix sum of ``counts[:n_threads]`` (shared, int32/int64), in place; returns (thread ``t``'s
    exclusive prefix, total). Every thread of the block must call it; it syncs. Threads past ``n_threads`` take part
    in the barriers only: their slots are scratch (a slot's sum reads slots below it)."""
    t = np.uint32(t)  # unsigned 32-bit indices: no negative wraparound, no 64-bit arithmetic
    mine = counts[t]
    offset = np.uint32(1)
    while offset < n_threads:
        cuda.syncthreads()
        v = counts[t - offset] if t >= offset else 0
        cuda.syncthreads()
        counts[t] += v
        offset = np.uint32(offset << np.uint32(1))
    cuda.syncthreads()
    total = counts[np.uint32(n_threads - 1)]
    excl = counts[t] - mine
    cuda.syncthreads()
    return excl, total


@cuda.jit(device=True, inline=True)
def order_key(bits):
    """uint32 key with the order of the float32 whose bits are ``bits`` (−0 counts as +0)."""
    if bits == np.uint32(0x80000000):
        bits = np.uint32(0)
    if bits >> np.uint32(31):
        return ~bits
    return bits | np.uint32(0x80000000)


@cuda.jit(device=True, inline=True)
def flush_histogram(hist, top_hist, g, heads, t, n_threads):
    """Add a CTA's shared ``hist [heads, 256]`` into ``top_hist[g]`` (non-zero bins only). Syncs first."""
    cuda.syncthreads()
    x = np.uint32(t)  # unsigned 32-bit: the bin's row and column are a shift and a mask
    while x < heads * RADIX:
        row = x >> np.uint32(8)
        col = x & np.uint32(RADIX - 1)
        if hist[row, col]:
            cuda.atomic.add(top_hist, (g, row, col), hist[row, col])
        x = np.uint32(x + n_threads)
