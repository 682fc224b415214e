"""The HBM row cache's bookkeeping on the GPU: the twin of ``fathom.row_cache.RowCache.assign`` (bit-exact).

One CTA per stream, every size read on the device (no host sync, a grid fixed at construction):

1. each listed row looks up its position's slot: a hit stamps the slot with the step; the misses are compacted
   in row order;
2. a 256-bin histogram of the slots' ages (``step - stamp``, capped; empty slots oldest), prefix-summed from the
   oldest bin, gives the age at which the oldest slots not hit this step number as many as the misses;
3. a pass over the slots in order ranks the victims (older than that age, or at it within the count) and the
   i-th victim takes the i-th miss: the position's old slot entry is cleared, the new one set, the row's source
   written (``slot + slots``: the gather fills the slot);
4. misses beyond the victims bypass the cache (source ``-1``).

Each thread walks a contiguous run of the rows and of the slots, so a pass costs one block prefix sum (of per-run
counts; the victims' two counts packed in one int64), not one per ``blockDim`` items: the kernel's latency is a
fixed cost of every layer's step.

``fathom.cuda.attention.gather_rows`` then reads each row from its source: the slab (a hit), or host memory (and
writes the slab on a fill).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fathom.cuda.block import RADIX, exclusive_scan
from fathom.row_cache import AGE_CAP, EMPTY

MAX_THREADS = 1024


@cuda.jit(device=True, inline=True)
def _age(position, stamp, g, s, step):
    if position[g, s] < 0:
        return AGE_CAP
    return min(step - stamp[g, s], AGE_CAP)


@cuda.jit(device=True, inline=True)
def _run(t, nt, count):
    """Thread ``t``'s contiguous run ``[lo, hi)`` of ``count`` items: one prefix sum per pass, not one per
    ``nt`` items."""
    per = (count + nt - 1) // nt
    return min(t * per, count), min((t + 1) * per, count)


@cuda.jit(cache=True)
def _assign_kernel(row_index, n_rows, slot_of, position, stamp, clock, counters, miss_rows, source):
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    slots = position.shape[1]
    n = n_rows[g]
    step = clock[g] + 1
    counts = cuda.shared.array(MAX_THREADS, np.int64)
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(3, np.int64)  # threshold age, victims taken at it, victims in all
    for i in range(t, RADIX, nt):
        hist[i] = 0
    # 1. hits (stamped), and the misses compacted in row order
    lo, hi = _run(t, nt, n)
    mine = 0
    for r in range(lo, hi):
        slot = slot_of[g, row_index[g, r]]
        if slot >= 0:
            stamp[g, slot] = step
            source[g, r] = slot
        else:
            mine += 1
    counts[t] = mine
    offset, misses = exclusive_scan(counts, t, nt)  # syncs: the stamps are visible to every thread after it
    for r in range(lo, hi):
        if slot_of[g, row_index[g, r]] < 0:
            miss_rows[g, offset] = r
            offset += 1
    # 2. the ages of the slots not hit this step; the threshold age from the oldest down
    for s in range(t, slots, nt):
        age = _age(position, stamp, g, s, step)
        if age >= 1:
            cuda.atomic.add(hist, age, 1)
    cuda.syncthreads()
    lo, hi = _run(t, nt, RADIX)  # bins from the oldest (bin j: age AGE_CAP - j): the prefix counts older slots
    mine = 0
    for j in range(lo, hi):
        mine += hist[AGE_CAP - j]
    counts[t] = mine
    older, eligible = exclusive_scan(counts, t, nt)
    if misses == 0:
        if t == 0:
            state[0] = AGE_CAP + 1  # no victims
            state[1] = 0
            state[2] = 0
    elif eligible < misses:
        if t == 0:
            state[0] = 0  # too few slots: every slot not hit is a victim, the rest of the misses bypass
            state[1] = 0
            state[2] = eligible
    else:
        for j in range(lo, hi):
            age = AGE_CAP - j
            if age >= 1 and older < misses <= older + hist[age]:
                state[0] = age
                state[1] = misses - older
                state[2] = misses
            older += hist[age]
    cuda.syncthreads()
    threshold = state[0]
    at_threshold = state[1]
    victims = state[2]
    # 3. victims in slot order (older than the threshold, or at it within the count); the i-th takes the i-th miss
    lo, hi = _run(t, nt, slots)
    mine = 0
    for s in range(lo, hi):
        age = _age(position, stamp, g, s, step)
        if age > threshold:
            mine += 1
        elif age == threshold and threshold >= 1:
            mine += np.int64(1) << np.int64(32)
    counts[t] = mine
    offset, _ = exclusive_scan(counts, t, nt)
    older_before = offset & 0xFFFFFFFF
    equal_before = offset >> np.int64(32)
    for s in range(lo, hi):
        age = _age(position, stamp, g, s, step)
        is_older = age > threshold
        is_equal = threshold >= 1 and age == threshold
        if is_older or (is_equal and equal_before < at_threshold):
            r = miss_rows[g, older_before + min(equal_before, at_threshold)]
            pos = row_index[g, r]
            old = position[g, s]
            if old >= 0:
                slot_of[g, old] = EMPTY
            slot_of[g, pos] = s
            position[g, s] = pos
            stamp[g, s] = step
            source[g, r] = s + slots
        if is_older:
            older_before += 1
        elif is_equal:
            equal_before += 1
    for i in range(victims + t, misses, nt):  # 4. the rest bypass the cache
        source[g, miss_rows[g, i]] = EMPTY
    if t == 0:
        clock[g] = step
        counters[g, 0] = n - misses
        counters[g, 1] += n - misses
        counters[g, 2] += n


def assign_slots(row_index, n_rows, slot_of, position, stamp, clock, counters, miss_rows, source,
                 threads: int = MAX_THREADS, stream=0) -> None:
    """One step of the row cache of every stream (``RowCache.assign``'s twin).

    Args:
        row_index: int32 ``[streams, max_rows]``, the first ``n_rows[g]`` ascending (``fathom.cuda.topk.union_rows``).
        slot_of: int32 ``[streams, T]``; position, stamp: int32 ``[streams, slots]``; clock: int32 ``[streams]``.
        counters: int64 ``[streams, 3]``: this step's hits, hits and lookups in all.
        miss_rows: int32 ``[streams, max_rows]`` scratch; source: int32 ``[streams, max_rows]`` out, each row's
            slot (hit), slot + slots (fill) or -1 (bypass).
    """
    streams, max_rows = row_index.shape
    if not 32 <= threads <= MAX_THREADS or position.shape[0] != streams or stamp.shape != position.shape \
            or source.shape != row_index.shape or miss_rows.shape != row_index.shape or counters.shape != (streams, 3) \
            or position.shape[1] >= 1 << 31:
        raise ValueError(f"row cache arrays do not fit rows {row_index.shape}, slots {position.shape}, "
                         f"counters {counters.shape} (threads in 32..{MAX_THREADS})")
    if streams:
        _assign_kernel[streams, threads, stream](row_index, n_rows, slot_of, position, stamp, clock, counters,
                                                miss_rows, source)
