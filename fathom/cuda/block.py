"""Block-wide building blocks for the kernels (shared memory only: they run under the CUDA simulator too)."""

from __future__ import annotations

import numpy as np
from numba import cuda

RADIX = 256


@cuda.jit(device=True, inline=True)
def exclusive_scan(counts, t, n_threads):
    """Exclusive prefix sum of ``counts[:n_threads]`` (shared, int32/int64), in place; returns (thread ``t``'s
    exclusive prefix, total). Every thread of the block must call it; it syncs."""
    mine = counts[t]
    offset = 1
    while offset < n_threads:
        cuda.syncthreads()
        v = counts[t - offset] if t >= offset else 0
        cuda.syncthreads()
        counts[t] += v
        offset *= 2
    cuda.syncthreads()
    total = counts[n_threads - 1]
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
    for x in range(t, heads * RADIX, n_threads):
        if hist[x // RADIX, x % RADIX]:
            cuda.atomic.add(top_hist, (g, x // RADIX, x % RADIX), hist[x // RADIX, x % RADIX])
