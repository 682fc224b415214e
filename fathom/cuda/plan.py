"""Reverse water-filling for every stream of a layer in one launch (design §5).

The twin of ``fathom.waterfill.waterfill_batched(importance(q, sigma2), budget, gains)``
(design §5's gains, or a per-stream table of calibrated relative gains γ: the
gains ``w · γ`` and the bounds from the largest and smallest positive gain, as
the reference takes them), bit-for-bit away from exact ties: one CUDA block per stream, the 30 bisection
steps in log θ with the reference's bounds and all-fit rule, the cost summed in
quarter bits (integers, so exact in any order).

The bisection is latency-bound (one stream's 128 channels per block), so it
decides ``split_bits`` steps per round: the round evaluates the cost at the
``2^split_bits − 1`` midpoints those steps can reach (a complete binary tree,
each midpoint formed by the same float64 halvings the sequential steps would
make), one midpoint per lane and the channels split over the warps, then
every thread walks the tree by the costs (the bounds stay in registers: one
barrier a round). The steps taken, and so θ, are the sequential bisection's
exactly: 6 rounds of 31 midpoints replace 30 dependent steps.

Only the first round counts the whole table. After each round the plane gains
a later θ can still split, those between the new bounds, go to a list in shared
memory; those above the upper bound every later θ counts, and the round's cost
at that bound has them. The later rounds count the list, which shrinks as the
interval does: on Qwen2.5-Coder-1.5B's captured queries (8k prose, design gains
at 48 bits, the rounds replayed in NumPy: docs/results.md) 3% of the table is
left after the first round (a mean of 14 of a stream's 512 gains, 30 of a pooled
line's 1,024), one or two gains after the second; a list that one trip of every
warp counts is not narrowed again. The costs are the whole table's, to the bit.
At 128k × 1 on an H100 the pooled line's plan (one CTA counting 1,024 channels)
went from 1,115 to 657 µs a token, and the per-stream one (8 CTAs of 128) from
382 to 354 µs (docs/results.md).

Precision: the bisection runs in float64 like the reference. A float32 θ has a
relative resolution of 6e-8, coarser than the bisection's final interval
(``log(w_max / w_min) / 2^30``), so float32 would flip depths whenever two
gains lie within ~1e-7 of each other; float64 leaves only libm-vs-libdevice
last-ulp differences in ``log``/``exp``, which move a depth only if a gain sits
within ~1e-15 of a bisection point. The importance ``Σ_h q²`` is summed in
float32 in head order like NumPy's reduction over axis -2; each square is
rounded to float32 on its own (``mul.rn``, which NVVM never contracts into an
FMA with the sum: an FMA would round differently).
The bounds are the reference's: log θ between half the smallest positive
4th-plane gain and twice the largest gain (neither is a gain, so no rounding of
``exp(log(x))`` can land on one), each computed as a sum of logs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import libdevice

from fathom import _checks
from fathom.cuda.interop import SIMULATED
from fathom.quantize import BLOCK, MAX_DEPTH
from fathom.waterfill import BISECTION_STEPS

THREADS = 32  # SparQ's top channels: one block per stream
MAX_D = 512  # channels a stream (head dim)
MAX_LINE = 1024  # channels on one water line: a stream's, or every KV head's of a session (pooled)
MAX_THREADS = 256  # water-filling: 32 lanes (midpoints) × up to 8 warps (channel slices)
MAX_SPLIT_BITS = 5  # 31 midpoints per round: one per lane
GAIN_ROWS = MAX_LINE + 3 * (MAX_THREADS // 32)  # the rounds read 4 channels of a slice a trip: zero rows past
# the line
LIST_CAPACITY = MAX_DEPTH * MAX_LINE  # the candidate list holds a whole table (uint16 entries: 4 · MAX_LINE < 2^16)
# The simulator runs every thread in Python and pays for every barrier: one warp costs it the least (and 5 steps a
# round, 6 rounds and 5 narrowings, less than one step: 30 and 29).
WATERFILL_THREADS = 32 if SIMULATED else MAX_THREADS


@cuda.jit(cache=True)
def _waterfill_kernel(q, sigma2, scale_sq_sum, from_store, lengths, heads_per_session, pool, budget_quarters,
                      split_bits, tabled, gamma, depths):
    """q float32 [streams, G, d], sigma2 / scale_sq_sum float64 [streams, d], from_store uint8 [streams] -> depths
    int8 [streams, d]. ``tabled``: the plane gains are ``w · gamma[stream, c, t]`` (float64 [streams, d, 4]), else
    design §5's ``(3/4) w 4^-(t-1)`` (``gamma`` not read). Block ``g`` plans the ``pool`` streams ``g · pool ..``
    on one water line of ``pool · d`` channels (channel ``c`` of the line is channel ``c % d`` of stream
    ``g · pool + c // d``) under ``budget_quarters`` for them all: ``pool`` 1 plans a stream alone, the KV heads of
    a session pooled (``fathom.methods.pooled_depths``).

    A stream with ``from_store`` set reads σ² as the mean of the store's squared block scales over its sealed blocks
    (``scale_sq_sum`` / blocks, ``lengths`` on the GPU, as ``fathom.decode.HeadIndex.store_variance`` divides); the
    others read ``sigma2`` (calibration). The block's threads are ``lanes`` (at most 32) × channel slices.

    Integers are int32 (``np.int32(...)``) and strided loops ``while`` loops: Numba types integer arithmetic and
    ``range`` as int64, and a range's trip count with a runtime step costs a 64-bit division. Every thread keeps
    the bounds in registers and walks the tree itself, so a round costs one barrier."""
    first_stream = np.int32(cuda.blockIdx.x * pool)
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    wide = n_threads >= 32
    lanes = np.int32(32) if wide else n_threads
    lane = np.int32(t & 31) if wide else t
    part = np.int32(t >> 5) if wide else np.int32(0)  # this thread's channel slice
    parts = np.int32(n_threads >> 5) if wide else np.int32(1)
    n_heads = np.int32(q.shape[1])
    d = np.int32(q.shape[2])
    line = np.int32(pool * d)  # channels on the water line
    fit = np.int32(min(budget_quarters, 2.0 ** 30))  # cost <= budget_quarters: costs are integers below 2^30
    gain = cuda.shared.array((GAIN_ROWS, MAX_DEPTH), np.float64)  # each channel's plane gains (design or w · γ)
    part_max = cuda.shared.array(MAX_THREADS, np.float64)
    part_min = cuda.shared.array(MAX_THREADS, np.float64)
    part_all = cuda.shared.array(MAX_THREADS, np.int32)
    # each midpoint's cost, heap order from the root; round r adds into buffer r % 3 (at 32 (r % 3)), zeroed in
    # round r - 1 (before its barrier) and last read by round r - 3's walk (before round r - 2's barrier)
    cost = cuda.shared.array(3 * 32, np.int32)
    bounds = cuda.shared.array(3, np.float64)  # log_lo, log_hi, all_fit
    # the plane gains (row · 4 + plane) a later θ can still split, and how many were kept, by round parity
    # (``_narrow``)
    candidates = cuda.shared.array(LIST_CAPACITY, np.uint16)
    tally = cuda.shared.array(2, np.int32)

    # every global load of a channel is issued up front, none waits on another (the σ² source is picked after)
    my_max = 0.0
    my_min = np.inf
    my_all = np.int32(0)
    i = t
    while i < line:
        g = np.int32(first_stream + i // d)
        c = np.int32(i - (g - first_stream) * d)
        stored = from_store[g] != 0
        blocks = np.float64(max(np.int32(lengths[np.uint32(g) // np.uint32(heads_per_session)] // BLOCK), 1))
        from_scales = scale_sq_sum[g, c]
        calibrated = sigma2[g, c]
        acc = np.float32(0)
        for h in range(n_heads):
            acc = acc + _square(q[g, h, c])
        s2 = from_scales / blocks if stored else calibrated
        wc = s2 * np.float64(acc)
        if tabled:  # w · γ, the reference's product; the bounds come from the gains themselves
            read = np.int32(0)
            for k in range(MAX_DEPTH):
                gk = wc * gamma[g, c, k]
                gain[i, k] = gk
                my_max = max(my_max, gk)
                if gk > 0:
                    my_min = min(my_min, gk)
                    read = np.int32(read + 1)
            my_all += 4 * read + (1 if read > 0 else 0)  # every plane of positive gain: γ falls in t, a prefix
        else:
            g1 = 0.75 * wc  # the gains are exact power-of-two scalings of 0.75 w
            gain[i, 0] = g1
            gain[i, 1] = g1 * 0.25
            gain[i, 2] = g1 * 0.0625
            gain[i, 3] = g1 * 0.015625
            my_max = max(my_max, wc)
            if wc > 0:
                my_min = min(my_min, wc)
                my_all += 4 * MAX_DEPTH + 1
        i = np.int32(i + n_threads)
    part_max[t] = my_max
    part_min[t] = my_min
    part_all[t] = my_all
    i = np.int32(n_threads + t)
    while i < MAX_THREADS:  # identities past the block: the folds read every entry
        part_max[i] = 0.0
        part_min[i] = np.inf
        part_all[i] = 0
        i = np.int32(i + n_threads)
    c = np.int32(line + t)
    while c < line + 3 * parts:
        for k in range(MAX_DEPTH):
            gain[c, k] = 0.0
        c = np.int32(c + n_threads)
    i = t
    while i < 32:
        cost[i] = 0
        i = np.int32(i + n_threads)
    if t == 0:  # round 0's tally (parity 0)
        tally[0] = 0
    # max, min and an integer sum: exact in any order (no NaN enters: max and min keep the first operand on NaN)
    cuda.syncthreads()
    if t < 32:  # entry t folds t + 32 k
        my_max, my_min, my_all = _combine(_fold(part_max, part_min, part_all, t, 64, 4),
                                          _fold(part_max, part_min, part_all, np.int32(t + 32), 64, 4))
        part_max[t] = my_max
        part_min[t] = my_min
        part_all[t] = my_all
    cuda.syncthreads()
    if t == 0:
        w_max, w_min, cost_all = _combine(_combine(_fold(part_max, part_min, part_all, 0, 4, 8),
                                                   _fold(part_max, part_min, part_all, 1, 4, 8)),
                                          _combine(_fold(part_max, part_min, part_all, 2, 4, 8),
                                                   _fold(part_max, part_min, part_all, 3, 4, 8)))
        if w_max > 0 and tabled:  # (the largest and smallest positive gain)
            bounds[1] = math.log(2.0) + math.log(w_max)
            bounds[0] = math.log(0.5) + math.log(w_min)
        elif w_max > 0:
            bounds[1] = math.log(2 * 0.75) + math.log(w_max)
            bounds[0] = math.log(0.5 * 0.75 * 0.015625) + math.log(w_min)
        else:
            bounds[1] = 0.0
            bounds[0] = 0.0
        bounds[2] = 1.0 if cost_all <= fit else 0.0
    cuda.syncthreads()
    lo = bounds[0]
    hi = bounds[1]
    everything = bounds[2] != 0.0

    if not everything:  # (block-uniform) else θ decides nothing
        steps = np.int32(split_bits)
        midpoints = np.int32((1 << steps) - 1)
        buf = np.int32(0)
        done = np.int32(0)
        parity = np.int32(0)
        listed = False  # the candidate list holds every plane gain a later θ can still split (round 0: the table)
        n_listed = np.int32(0)
        base = np.int32(0)  # quarter bits of the gains above every θ still to come
        cost_hi = np.int32(0)  # the cost at the upper bound (none above twice the largest gain)
        pad = np.int32(MAX_DEPTH * line)  # plane 1 of the first zero row past the line: counts nowhere
        while done < BISECTION_STEPS:
            after = np.int32(buf + 32) if buf < 64 else np.int32(0)
            m = lane
            while m < midpoints:
                cost[np.uint32(after + m)] = 0
                node = np.int32(m + 1)  # heap index: its bits below the leading one are the path (0: the cost fit)
                mlo = lo
                mhi = hi
                for bit in range(MAX_SPLIT_BITS - 2, -1, -1):
                    if node >> np.int32(bit + 1):  # a bit below the leading one
                        mid = 0.5 * (mlo + mhi)
                        if (node >> np.int32(bit)) & 1:
                            mlo = mid
                        else:
                            mhi = mid
                theta = math.exp(0.5 * (mlo + mhi))
                if listed:  # the listed gains of this slice above θ, four entries a trip (past the list: the pad)
                    mine = np.int32(0)
                    e = part
                    while e < n_listed:
                        for k in range(4):
                            j = np.int32(e + k * parts)
                            entry = np.int32(candidates[np.uint32(j)]) if j < n_listed else pad
                            if gain[np.uint32(entry >> 2), np.uint32(entry & 3)] > theta:
                                mine = np.int32(mine + (5 if entry & 3 == 0 else 4))
                        e = np.int32(e + 4 * parts)
                else:
                    # this slice's channels whose plane t gain exceeds θ, one count per plane (four independent
                    # chains); four channels a trip, their loads in flight together (the zero rows past d count none)
                    above_1 = above_2 = above_3 = above_4 = np.int32(0)
                    c = part
                    while c < line:
                        for k in range(4):
                            row = np.uint32(c + k * parts)  # unsigned: no wraparound of a negative index
                            above_1 = np.int32(above_1 + (gain[row, 0] > theta))
                            above_2 = np.int32(above_2 + (gain[row, 1] > theta))
                            above_3 = np.int32(above_3 + (gain[row, 2] > theta))
                            above_4 = np.int32(above_4 + (gain[row, 3] > theta))
                        c = np.int32(c + 4 * parts)
                    # Σ 4 b + (b > 0) quarter bits: the gains fall in t, so b > 0 exactly when plane 1's gain
                    # exceeds θ
                    mine = np.int32(5 * above_1 + 4 * (above_2 + above_3 + above_4))
                cuda.atomic.add(cost, np.uint32(buf + m), mine)
                m = np.int32(m + lanes)
            cuda.syncthreads()
            node = np.int32(1)  # the sequential steps, their costs known
            for k in range(MAX_SPLIT_BITS):
                if k < steps:
                    mid = 0.5 * (lo + hi)
                    at_mid = np.int32(base + cost[np.uint32(buf + node - 1)])
                    if at_mid <= fit:
                        hi = mid
                        cost_hi = at_mid
                        node = np.int32(2 * node)
                    else:
                        lo = mid
                        node = np.int32(2 * node + 1)
            buf = after
            done = np.int32(done + steps)
            # narrow, unless one trip of every warp already counts the list (block-uniform)
            if done < BISECTION_STEPS and not (listed and n_listed <= 4 * parts):
                n_listed = _narrow(gain, candidates, tally, parity, listed, n_listed, line, lo, hi, t, n_threads)
                listed = True
                base = cost_hi  # the gains above the upper bound, counted at it (by the same exp of the same point)
                parity = np.int32(1 - parity)

    theta = math.exp(hi)
    i = t
    while i < line:
        g = np.int32(first_stream + i // d)
        c = np.int32(i - (g - first_stream) * d)
        if everything:
            depths[g, c] = _depth_at(gain, i, 0.0)  # every plane of positive gain
        else:
            depths[g, c] = _depth_at(gain, i, theta)
        i = np.int32(i + n_threads)


@cuda.jit(device=True, inline=True)
def _narrow(gain, candidates, tally, parity, listed, n_listed, line, lo, hi, t, n_threads):
    """After a round: keep the plane gains in ``(exp(lo), exp(hi)]``, the only ones a later θ (between the two)
    can split; returns how many. Reads the list if ``listed``, else every gain of the line's table. (Those above
    ``exp(hi)``, which every later θ counts, the caller has: the round's cost at ``hi``.) The list is compacted in
    place a chunk of ``n_threads`` entries at a time (a chunk is read before any of it is written, and its writes
    land below its end). Every thread calls it; it syncs. The list's order is an atomic's: the costs are integer
    sums, exact in any order.

    A gain is classified against ``exp`` of the bounds, a later θ is ``exp`` of a point between them: the same
    function of a smaller or larger argument. The bounds lie at least ``log(w_max / w_min) / 2^30`` apart in log θ,
    ~1e-8 relative, far more than the last-ulp error of ``exp``, so no rounding reverses that order."""
    theta_lo = math.exp(lo)
    theta_hi = math.exp(hi)
    if t == 0:  # the next round's tally: last read before this round's first barrier
        tally[np.uint32(1 - parity)] = 0
    if listed:
        start = np.int32(0)
        while start < n_listed:  # (block-uniform)
            j = np.int32(start + t)
            keep = False
            entry = np.int32(0)
            if j < n_listed:
                entry = np.int32(candidates[np.uint32(j)])
                value = gain[np.uint32(entry >> 2), np.uint32(entry & 3)]
                keep = theta_lo < value <= theta_hi
            cuda.syncthreads()
            if keep:
                candidates[np.uint32(cuda.atomic.add(tally, np.uint32(parity), 1))] = np.uint16(entry)
            start = np.int32(start + n_threads)
    else:
        entry = t
        while entry < MAX_DEPTH * line:
            value = gain[np.uint32(entry >> 2), np.uint32(entry & 3)]
            if theta_lo < value <= theta_hi:
                candidates[np.uint32(cuda.atomic.add(tally, np.uint32(parity), 1))] = np.uint16(entry)
            entry = np.int32(entry + n_threads)
    cuda.syncthreads()
    return tally[np.uint32(parity)]


@cuda.jit(device=True, inline=True)
def _fold(part_max, part_min, part_all, first, stride, count):
    """(max, min, sum) of the ``count`` entries ``first + k stride`` (a constant ``count``: their loads go
    together)."""
    my_max = part_max[first]
    my_min = part_min[first]
    my_all = part_all[first]
    for k in range(1, count):
        i = np.uint32(first + k * stride)
        my_max = max(my_max, part_max[i])
        my_min = min(my_min, part_min[i])
        my_all = np.int32(my_all + part_all[i])
    return my_max, my_min, my_all


@cuda.jit(device=True, inline=True)
def _combine(a, b):
    return max(a[0], b[0]), min(a[1], b[1]), np.int32(a[2] + b[2])


@cuda.jit(device=True, inline=True)
def _square(x):
    """float32 ``x²`` rounded on its own (PTX ``mul.rn``): NVVM contracts a plain product and the sum it feeds into
    an FMA, which rounds once."""
    if SIMULATED:
        return x * x
    return libdevice.fmul_rn(x, x)


@cuda.jit(device=True, inline=True)
def _depth_at(gain, c, theta):
    """``#{t : g_t > θ}`` of channel ``c``."""
    c = np.uint32(c)  # no wraparound of a negative index
    return np.int32((1 if gain[c, 0] > theta else 0) + (1 if gain[c, 1] > theta else 0)
                    + (1 if gain[c, 2] > theta else 0) + (1 if gain[c, 3] > theta else 0))


def waterfill(q, sigma2, scale_sq_sum, from_store, budget: float, depths, lengths, heads_per_session: int = 1,
              threads: int = WATERFILL_THREADS, split_bits: int = MAX_SPLIT_BITS, stream=0, gains=None,
              pooled: bool = False) -> None:
    """Depths of every stream under ``budget`` bits per token, one block of ``threads`` per stream (at most 32, or a
    multiple of 32 up to 256), ``split_bits`` bisection steps decided per round (1, 2, 3 or 5: a divisor of 30).
    The twin of ``waterfill_batched(importance(q, σ²), budget, gains)``; ``pooled``: one block per session, its
    ``heads_per_session`` streams (KV heads) on one water line whose mean cost is at most ``budget``, the twin of
    ``fathom.methods.pooled_depths``.

    Args:
        q: float32 device array ``[streams, G, d]`` (the G query heads of each KV head, in the store's basis).
        sigma2: float64 ``[streams, d]`` calibration channel variances, read by the streams ``from_store`` leaves
            at 0.
        scale_sq_sum: float64 ``[streams, d]`` the store's sums of squared block scales, read by the streams whose
            ``from_store`` is 1, divided on the GPU by each stream's sealed blocks (``lengths`` int32 ``[S]``,
            stream ``g`` is session ``g // heads_per_session``). Either may be the other's array where no stream
            reads it.
        from_store: uint8 ``[streams]``: each stream's σ² source (the per-head store mixes them).
        budget: bits per token (finite, >= 0).
        depths: int8 ``[streams, d]``, written.
        gains: None (design §5's plane gains) or float64 ``[streams, d, 4]``, each stream's relative plane gains γ
            (non-negative and non-increasing in the plane, as ``fathom.waterfill.waterfill_batched`` takes them;
            ``fathom.methods.gain_table`` makes them from a calibration).
    """
    streams, _, d = q.shape
    if gains is not None and (gains.dtype != np.float64 or gains.shape != (streams, d, MAX_DEPTH)):
        raise ValueError(f"gains must be float64 [{streams}, {d}, {MAX_DEPTH}], got {gains.dtype} {gains.shape}")
    for name, x in (("sigma2", sigma2), ("scale_sq_sum", scale_sq_sum)):
        if q.dtype != np.float32 or x.dtype != np.float64 or x.shape != (streams, d):
            raise ValueError(f"q must be float32 [streams, G, d] and {name} float64 [streams, d], "
                             f"got {q.dtype} {q.shape} and {x.dtype} {x.shape}")
    if from_store.shape != (streams,) or from_store.dtype != np.uint8:
        raise ValueError(f"from_store must be uint8 [{streams}], got {from_store.dtype} {from_store.shape}")
    if depths.shape != (streams, d) or depths.dtype != np.int8:
        raise ValueError(f"depths must be int8 {(streams, d)}, got {depths.dtype} {depths.shape}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    pool = heads_per_session if pooled else 1
    if pool * d > MAX_LINE:
        raise ValueError(f"a water line holds at most {MAX_LINE} channels, got {pool} streams of {d}")
    if d > MAX_D or not (1 <= threads <= 32 or (threads <= MAX_THREADS and threads % 32 == 0)):
        raise ValueError(f"d must be <= {MAX_D} and threads in 1..32 or a multiple of 32 up to {MAX_THREADS}, "
                         f"got d = {d}, threads = {threads}")
    if not 1 <= split_bits <= MAX_SPLIT_BITS or BISECTION_STEPS % split_bits:
        raise ValueError(f"split_bits must divide {BISECTION_STEPS} and lie in 1..{MAX_SPLIT_BITS}, got {split_bits}")
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be finite and >= 0 bits per token, got {budget}")
    if streams:
        # cost <= budget  <=>  4 * cost <= 4 * budget: quarter bits are integers, 4 * budget is exact (a pooled
        # line's mean cost <= budget  <=>  its cost <= pool * budget, as pooled_depths plans it)
        # without a table the kernel reads none: σ² stands in for it (float64, never indexed)
        gamma = sigma2.reshape((streams, d, 1)) if gains is None else gains
        _waterfill_kernel[streams // pool, threads, stream](q, sigma2, scale_sq_sum, from_store, lengths,
                                                           heads_per_session, pool, 4.0 * pool * float(budget),
                                                           split_bits, gains is not None, gamma, depths)


@cuda.jit(cache=True)
def _top_channels_kernel(q, r, depths):
    """One block per stream: depth 4 on the r channels with the largest Σ_h |q[h, c]| (ties to the lower channel)."""
    g = cuda.blockIdx.x
    n_heads, d = q.shape[1], q.shape[2]
    score = cuda.shared.array(MAX_D, np.float32)
    for c in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        acc = np.float32(0)
        for h in range(n_heads):  # in head order, like NumPy's reduction over axis -2
            acc += abs(q[g, h, c])
        score[c] = acc
    cuda.syncthreads()
    for c in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        rank = 0
        for other in range(d):
            if score[other] > score[c] or (score[other] == score[c] and other < c):
                rank += 1
        depths[g, c] = MAX_DEPTH if rank < r else 0


def top_channels(q, r: int, depths, threads: int = THREADS, stream=0) -> None:
    """SparQ's depths: the twin of ``fathom.methods.QueryTopChannels.depths`` (``argsort(-Σ|q|, stable)[:r]``)."""
    streams, _, d = q.shape
    if d > MAX_D or depths.shape != (streams, d) or depths.dtype != np.int8:
        raise ValueError(f"d must be <= {MAX_D} and depths int8 [{streams}, {d}], got {d}, {depths.dtype} "
                         f"{depths.shape}")
    if not _checks.is_integer(r) or not 0 <= r <= d:
        raise ValueError(f"r must be an integer in 0..{d} channels, got {r!r}")
    if streams:
        _top_channels_kernel[streams, min(threads, d), stream](q, r, depths)
