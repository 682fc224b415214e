"""The HBM row cache's bookkeeping on the GPU: the twin of ``fathom.row_cache.RowCache.assign`` (bit-exact).

One CTA per query group, every size read on the device (no host sync, a grid fixed at construction):

1. each listed row looks up its position's slot: a hit stamps the slot with the step; the misses are compacted
   in row order (block prefix sums);
2. a 256-bin histogram of the slots' ages (``step - stamp``, capped; empty slots oldest) gives the age at which
   the oldest slots, not hit this step, number as many as the misses;
3. one pass over the slots in order ranks the victims (older than that age, or at it within the count) with one
   prefix sum of two packed counters, and the i-th victim takes the i-th miss: the position's old slot entry is
   cleared, the new one set, the row's source written (``slot + slots``: the gather fills the slot);
4. misses beyond the victims bypass the cache (source ``-1``).

``fathom.cuda.attention.gather_rows`` then reads each row from its source: the slab (a hit), or host memory (and
writes the slab on a fill).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fathom.cuda.block import RADIX, exclusive_scan
from fathom.row_cache import AGE_CAP, EMPTY

MAX_THREADS = 1024
_PACK = 16  # the victims' prefix sum counts slots older than the threshold in the low 16 bits, at it above


@cuda.jit(device=True, inline=True)
def _age(position, stamp, g, s, step):
    if position[g, s] < 0:
        return AGE_CAP
    return min(step - stamp[g, s], AGE_CAP)


@cuda.jit(cache=True)
def _assign_kernel(row_index, n_rows, slot_of, position, stamp, clock, counters, miss_rows, source):
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    slots = position.shape[1]
    n = n_rows[g]
    step = clock[g] + 1
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(3, np.int32)  # threshold age, victims taken at it, victims in all
    misses = 0
    for base in range(0, n, nt):  # 1. hits, and the misses in row order (every thread runs every iteration)
        r = base + t
        miss = 0
        if r < n:
            slot = slot_of[g, row_index[g, r]]
            if slot >= 0:
                stamp[g, slot] = step
                source[g, r] = slot
            else:
                miss = 1
        counts[t] = miss
        offset, total = exclusive_scan(counts, t, nt)
        if miss:
            miss_rows[g, misses + offset] = r
        misses += total
    for i in range(t, RADIX, nt):
        hist[i] = 0
    cuda.syncthreads()  # the hits' stamps are visible to every thread
    for s in range(t, slots, nt):  # 2. ages of the slots not hit this step
        age = _age(position, stamp, g, s, step)
        if age >= 1:
            cuda.atomic.add(hist, age, 1)
    cuda.syncthreads()
    if t == 0:
        taken = 0
        state[0] = 0  # too few slots: every one not hit is a victim
        state[1] = 0
        for age in range(AGE_CAP, 0, -1):
            if taken + hist[age] >= misses:
                state[0] = age
                state[1] = misses - taken
                taken = misses
                break
            taken += hist[age]
        state[2] = taken
    cuda.syncthreads()
    threshold = state[0]
    at_threshold = state[1]
    victims = state[2]
    older = 0
    equal = 0
    for base in range(0, slots, nt):  # 3. victims in slot order, the i-th filled by the i-th miss
        s = base + t
        is_older = False
        is_equal = False
        if s < slots:
            age = _age(position, stamp, g, s, step)
            is_older = age > threshold
            is_equal = threshold >= 1 and age == threshold
        counts[t] = (1 if is_older else 0) + ((1 << _PACK) if is_equal else 0)
        offset, total = exclusive_scan(counts, t, nt)
        equal_before = equal + (offset >> _PACK)
        if is_older or (is_equal and equal_before < at_threshold):
            r = miss_rows[g, older + (offset & ((1 << _PACK) - 1)) + min(equal_before, at_threshold)]
            pos = row_index[g, r]
            old = position[g, s]
            if old >= 0:
                slot_of[g, old] = EMPTY
            slot_of[g, pos] = s
            position[g, s] = pos
            stamp[g, s] = step
            source[g, r] = s + slots
        older += total & ((1 << _PACK) - 1)
        equal += total >> _PACK
    for i in range(victims + t, misses, nt):  # 4. the rest bypass the cache
        source[g, miss_rows[g, i]] = EMPTY
    if t == 0:
        clock[g] = step
        counters[g, 0] = n - misses
        counters[g, 1] += n - misses
        counters[g, 2] += n


def assign_slots(row_index, n_rows, slot_of, position, stamp, clock, counters, miss_rows, source,
                 threads: int = MAX_THREADS, stream=0) -> None:
    """One step of the row cache of every query group (``RowCache.assign``'s twin).

    Args:
        row_index: int32 ``[groups, max_rows]``, the first ``n_rows[g]`` ascending (``fathom.cuda.topk.union_rows``).
        slot_of: int32 ``[groups, T]``; position, stamp: int32 ``[groups, slots]``; clock: int32 ``[groups]``.
        counters: int64 ``[groups, 3]``: this step's hits, hits and lookups in all.
        miss_rows: int32 ``[groups, max_rows]`` scratch; source: int32 ``[groups, max_rows]`` out, each row's
            slot (hit), slot + slots (fill) or -1 (bypass).
    """
    groups, max_rows = row_index.shape
    if not 32 <= threads <= MAX_THREADS or threads & (threads - 1) or position.shape[0] != groups \
            or stamp.shape != position.shape or source.shape != row_index.shape \
            or miss_rows.shape != row_index.shape or counters.shape != (groups, 3) or position.shape[1] >= 1 << 31:
        raise ValueError(f"row cache arrays do not fit rows {row_index.shape}, slots {position.shape}, "
                         f"counters {counters.shape} (threads a power of two in 32..{MAX_THREADS})")
    if groups:
        _assign_kernel[groups, threads, stream](row_index, n_rows, slot_of, position, stamp, clock, counters,
                                                miss_rows, source)
