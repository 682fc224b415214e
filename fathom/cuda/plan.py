"""Reverse water-filling for every stream of a layer in one launch (design §5).

The twin of ``fathom.waterfill.waterfill_batched(importance(q, sigma2), budget)``,
bit-for-bit away from exact ties: one CUDA block per stream, the 30 bisection
steps in log θ with the reference's bounds and all-fit rule, the cost summed in
quarter bits (integers, so exact in any order).

The bisection is latency-bound (one stream's 128 channels per block), so it
decides ``split_bits`` steps per round: the round evaluates the cost at the
``2^split_bits − 1`` midpoints those steps can reach (a complete binary tree,
each midpoint formed by the same float64 halvings the sequential steps would
make), one midpoint per lane and the channels split over the warps, then
thread 0 walks the tree by the costs. The steps taken, and so θ, are the
sequential bisection's exactly: 6 rounds of 31 midpoints replace 30 dependent
steps.

Precision: the bisection runs in float64 like the reference. A float32 θ has a
relative resolution of 6e-8, coarser than the bisection's final interval
(``log(w_max / w_min) / 2^30``), so float32 would flip depths whenever two
gains lie within ~1e-7 of each other; float64 leaves only libm-vs-libdevice
last-ulp differences in ``log``/``exp``, which move a depth only if a gain sits
within ~1e-15 of a bisection point. The importance ``Σ_h q²`` is summed in
float32 in head order like NumPy's reduction over axis -2; each square is
formed in float64 (exact) and rounded to float32 so no multiply-add can be
contracted into an FMA, which would round differently.
The bounds are the reference's: log θ between half the smallest positive
4th-plane gain and twice the largest gain (neither is a gain, so no rounding of
``exp(log(x))`` can land on one), each computed as a sum of logs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom import _checks
from fathom.cuda.interop import SIMULATED
from fathom.quantize import BLOCK, MAX_DEPTH
from fathom.waterfill import BISECTION_STEPS

THREADS = 32  # SparQ's top channels: one block per stream
MAX_D = 512  # shared-memory size of one stream's importances
MAX_THREADS = 256  # water-filling: 32 lanes (midpoints) × up to 8 warps (channel slices)
MAX_SPLIT_BITS = 5  # 31 midpoints per round: one per lane
# The simulator runs every thread in Python: one step per round and one warp cost it the least.
WATERFILL_THREADS = 32 if SIMULATED else MAX_THREADS
SPLIT_BITS = 1 if SIMULATED else MAX_SPLIT_BITS


@cuda.jit(cache=True)
def _waterfill_kernel(q, sigma2, scale_sq_sum, from_store, lengths, heads_per_session, budget_quarters, split_bits,
                      depths):
    """q float32 [streams, G, d], sigma2 / scale_sq_sum float64 [streams, d], from_store uint8 [streams] -> depths
    int8 [streams, d].

    A stream with ``from_store`` set reads σ² as the mean of the store's squared block scales over its sealed blocks
    (``scale_sq_sum`` / blocks, ``lengths`` on the GPU, as ``fathom.decode.HeadIndex.store_variance`` divides); the
    others read ``sigma2`` (calibration). The block's threads are ``lanes`` (at most 32) × channel slices."""
    g = cuda.blockIdx.x
    blocks = max(lengths[g // heads_per_session] // BLOCK, 1)
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    lanes = min(32, n_threads)
    lane = t % lanes
    part = t // lanes  # this thread's channel slice
    parts = n_threads // lanes
    n_heads = q.shape[1]
    d = q.shape[2]
    w = cuda.shared.array(MAX_D, np.float64)
    part_cost = cuda.shared.array(MAX_THREADS, np.int64)  # [slice, midpoint] in the rounds
    part_max = cuda.shared.array(MAX_THREADS, np.float64)
    part_min = cuda.shared.array(MAX_THREADS, np.float64)
    cost = cuda.shared.array(32, np.int64)  # each midpoint's cost, heap order from the root
    bounds = cuda.shared.array(3, np.float64)  # log_lo, log_hi, all_fit

    my_max = 0.0
    my_min = np.inf
    my_all = 0
    for c in range(t, d, n_threads):
        acc = np.float32(0)
        for h in range(n_heads):
            x = np.float64(q[g, h, c])
            acc = acc + np.float32(x * x)
        s2 = scale_sq_sum[g, c] / np.float64(blocks) if from_store[g] else sigma2[g, c]
        wc = s2 * np.float64(acc)
        w[c] = wc
        my_max = max(my_max, wc)
        if wc > 0:
            my_min = min(my_min, wc)
            my_all += 4 * MAX_DEPTH + 1
    part_max[t] = my_max
    part_min[t] = my_min
    part_cost[t] = my_all
    cuda.syncthreads()
    if t < lanes:  # max, min and an integer sum: exact in any order
        for i in range(t + lanes, n_threads, lanes):
            part_max[t] = max(part_max[t], part_max[i])
            part_min[t] = min(part_min[t], part_min[i])
            part_cost[t] += part_cost[i]
    cuda.syncthreads()
    if t == 0:
        w_max = 0.0
        w_min = np.inf
        cost_all = 0
        for i in range(lanes):
            w_max = max(w_max, part_max[i])
            w_min = min(w_min, part_min[i])
            cost_all += part_cost[i]
        if w_max > 0:
            bounds[1] = math.log(2 * 0.75) + math.log(w_max)
            bounds[0] = math.log(0.5 * 0.75 * 0.015625) + math.log(w_min)
        else:
            bounds[1] = 0.0
            bounds[0] = 0.0
        bounds[2] = 1.0 if cost_all <= budget_quarters else 0.0
    cuda.syncthreads()

    midpoints = (1 << split_bits) - 1
    for _ in range(BISECTION_STEPS // split_bits):
        for m in range(lane, midpoints, lanes):
            node = m + 1  # heap index: its bits below the leading one are the path (0: the cost fit)
            level = 0
            while (node >> (level + 1)) > 0:
                level += 1
            lo = bounds[0]
            hi = bounds[1]
            for bit in range(level - 1, -1, -1):
                mid = 0.5 * (lo + hi)
                if (node >> bit) & 1:
                    lo = mid
                else:
                    hi = mid
            theta = math.exp(0.5 * (lo + hi))
            mine = 0
            for c in range(part, d, parts):
                b = _depth_at(w[c], theta)
                mine += 4 * b + (1 if b > 0 else 0)
            part_cost[part * 32 + m] = mine
        cuda.syncthreads()
        for m in range(t, midpoints, n_threads):
            total = 0
            for x in range(parts):
                total += part_cost[x * 32 + m]
            cost[m] = total
        cuda.syncthreads()
        if t == 0:  # the sequential steps, their costs known
            node = 1
            for _ in range(split_bits):
                mid = 0.5 * (bounds[0] + bounds[1])
                if cost[node - 1] <= budget_quarters:
                    bounds[1] = mid
                    node = 2 * node
                else:
                    bounds[0] = mid
                    node = 2 * node + 1
        cuda.syncthreads()

    theta = math.exp(bounds[1])
    everything = bounds[2] != 0.0
    for c in range(t, d, n_threads):
        if everything:
            depths[g, c] = MAX_DEPTH if w[c] > 0 else 0
        else:
            depths[g, c] = _depth_at(w[c], theta)


@cuda.jit(device=True, inline=True)
def _depth_at(wc, theta):
    """``#{t : (3/4) w 4^-(t-1) > θ}``: the gains are exact power-of-two scalings of 0.75 w."""
    g1 = 0.75 * wc
    return (1 if g1 > theta else 0) + (1 if g1 * 0.25 > theta else 0) + \
        (1 if g1 * 0.0625 > theta else 0) + (1 if g1 * 0.015625 > theta else 0)


def waterfill(q, sigma2, scale_sq_sum, from_store, budget: float, depths, lengths, heads_per_session: int = 1,
              threads: int = WATERFILL_THREADS, split_bits: int = SPLIT_BITS, stream=0) -> None:
    """Depths of every stream under ``budget`` bits per token, one block of ``threads`` per stream (at most 32, or a
    multiple of 32 up to 256), ``split_bits`` bisection steps decided per round (1, 2, 3 or 5: a divisor of 30).

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
    """
    streams, _, d = q.shape
    for name, x in (("sigma2", sigma2), ("scale_sq_sum", scale_sq_sum)):
        if q.dtype != np.float32 or x.dtype != np.float64 or x.shape != (streams, d):
            raise ValueError(f"q must be float32 [streams, G, d] and {name} float64 [streams, d], "
                             f"got {q.dtype} {q.shape} and {x.dtype} {x.shape}")
    if from_store.shape != (streams,) or from_store.dtype != np.uint8:
        raise ValueError(f"from_store must be uint8 [{streams}], got {from_store.dtype} {from_store.shape}")
    if depths.shape != (streams, d) or depths.dtype != np.int8:
        raise ValueError(f"depths must be int8 {(streams, d)}, got {depths.dtype} {depths.shape}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    if d > MAX_D or not (1 <= threads <= 32 or (threads <= MAX_THREADS and threads % 32 == 0)):
        raise ValueError(f"d must be <= {MAX_D} and threads in 1..32 or a multiple of 32 up to {MAX_THREADS}, "
                         f"got d = {d}, threads = {threads}")
    if not 1 <= split_bits <= MAX_SPLIT_BITS or BISECTION_STEPS % split_bits:
        raise ValueError(f"split_bits must divide {BISECTION_STEPS} and lie in 1..{MAX_SPLIT_BITS}, got {split_bits}")
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be finite and >= 0 bits per token, got {budget}")
    if streams:
        # cost <= budget  <=>  4 * cost <= 4 * budget: quarter bits are integers, 4 * budget is exact
        _waterfill_kernel[streams, threads, stream](q, sigma2, scale_sq_sum, from_store, lengths, heads_per_session,
                                                   4.0 * float(budget), split_bits, depths)


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
