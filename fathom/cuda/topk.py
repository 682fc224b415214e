"""Top-k selection per query head and the union of a KV head's winners (SPEC §6, §8 step 4).

``select`` is the twin of ``fathom.selection.select`` (exactly, ties to the
earlier token), a radix select of the k-th largest score on order-preserving
uint32 keys. The passes over every score run on many blocks per head: a
histogram of the top key byte, then one pass where tokens above the k-th
largest byte win outright and those in its bin (a few percent) are appended to
a candidate list. One block per head finishes the three remaining key passes
on that list and breaks ties at the threshold by a second radix select, on
token index, ascending. Winners are OR-ed into one uint32 word per
(KV head, token), bit h for head h: only the k winners are written.

``union_rows`` adds sink, local and the unsealed tail (kept by every head) and
compacts, per KV head, the kept tokens into a row list with each row's head
mask, over many blocks (count, then write at prefix offsets), clearing the
winner words for the next step; ``fathom.cuda.rows`` fetches the rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

MAX_THREADS = 1024
THREADS = 512
RADIX = 256


@cuda.jit(device=True, inline=True)
def _order_key(bits):
    """uint32 key with the order of the float32 whose bits are ``bits`` (−0 counts as +0)."""
    if bits == np.uint32(0x80000000):
        bits = np.uint32(0)
    if bits >> np.uint32(31):
        return ~bits
    return bits | np.uint32(0x80000000)


@cuda.jit(device=True, inline=True)
def _block_exclusive_scan(counts, t, n_threads):
    """Exclusive prefix sum of ``counts[:n_threads]`` (shared), returned for thread ``t``; syncs."""
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


@cuda.jit
def _top_digit_kernel(score_bits, lo, hi, hist):
    """Histogram of the candidates' top key byte, grid (chunks, G, groups), added into hist int32 [groups, G, 256].

    The first radix pass is the one whose bins are crowded (the top byte is the sign and exponent), so it is
    spread over many blocks, each counting into shared memory before one global add per bin.
    """
    h = cuda.blockIdx.y
    g = cuda.blockIdx.z
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    local = cuda.shared.array(RADIX, np.int32)
    for i in range(t, RADIX, n_threads):
        local[i] = 0
    cuda.syncthreads()
    per_block = (hi - lo + cuda.gridDim.x - 1) // cuda.gridDim.x
    start = lo + cuda.blockIdx.x * per_block
    for j in range(start + t, min(start + per_block, hi), n_threads):
        cuda.atomic.add(local, np.int32(_order_key(score_bits[g, h, j]) >> np.uint32(24)), 1)
    cuda.syncthreads()
    for i in range(t, RADIX, n_threads):
        if local[i]:
            cuda.atomic.add(hist, (g, h, i), local[i])


@cuda.jit(device=True, inline=True)
def _top_digit(top_hist, g, h, k, hist, state, t, n_threads):
    """state[0] = the top key byte of the k-th largest candidate, state[1] = how many of the k fall in
    that byte's bin; from the top-digit histogram, staged through shared ``hist``. Syncs."""
    for i in range(t, RADIX, n_threads):
        hist[i] = top_hist[g, h, i]
    cuda.syncthreads()
    if t == 0:
        above = 0
        for digit in range(RADIX - 1, -1, -1):
            if above + hist[digit] >= k:
                state[0] = digit
                state[1] = k - above
                break
            above += hist[digit]
    cuda.syncthreads()


@cuda.jit
def _candidates_kernel(score_bits, lo, hi, k, top_hist, winners, cand_key, cand_idx, cand_count):
    """Grid (chunks, G, groups): tokens above the k-th largest top byte win outright (bit h of winners);
    tokens in its bin are appended (unordered) to head h's candidate list for the remaining radix passes."""
    h = cuda.blockIdx.y
    g = cuda.blockIdx.z
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(4, np.int64)  # digit, remaining, matches in this block, list base
    _top_digit(top_hist, g, h, k, hist, state, t, n_threads)
    digit = np.uint32(state[0])
    if t == 0:
        state[2] = 0
    cuda.syncthreads()
    per_block = (hi - lo + cuda.gridDim.x - 1) // cuda.gridDim.x
    start = lo + cuda.blockIdx.x * per_block
    stop = min(start + per_block, hi)
    bit = np.uint32(1) << np.uint32(h)
    for j in range(start + t, stop, n_threads):
        top = _order_key(score_bits[g, h, j]) >> np.uint32(24)
        if top > digit:
            cuda.atomic.or_(winners, (g, j), bit)
        elif top == digit:
            cuda.atomic.add(state, 2, 1)
    cuda.syncthreads()
    if t == 0:  # one global reservation per block, not one per token
        state[3] = cuda.atomic.add(cand_count, (g, h), np.int32(state[2]))
        state[2] = 0
    cuda.syncthreads()
    for j in range(start + t, stop, n_threads):
        key = _order_key(score_bits[g, h, j])
        if key >> np.uint32(24) == digit:
            pos = state[3] + cuda.atomic.add(state, 2, 1)
            cand_key[g, h, pos] = key
            cand_idx[g, h, pos] = j


@cuda.jit
def _select_kernel(lo, hi, k, top_hist, cand_key, cand_idx, cand_count, winners):
    """One block per head: the last three radix passes over its candidate list, then the winners.

    Ties at the threshold go to the earliest tokens: a second radix select finds the ``wanted``-th
    smallest token index among the tied candidates. Leaves ``top_hist`` and ``cand_count`` zero.
    """
    h = cuda.blockIdx.x
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(5, np.int64)  # prefix, mask, remaining, threshold, every tie kept
    bit = np.uint32(1) << np.uint32(h)
    if hi - lo <= k:  # every candidate is kept
        for j in range(lo + t, hi, n_threads):
            cuda.atomic.or_(winners, (g, j), bit)
        return
    m = cand_count[g, h]
    _top_digit(top_hist, g, h, k, hist, state, t, n_threads)
    if t == 0:
        state[2] = state[1]
        state[0] = state[0] << 24
        state[1] = np.int64(RADIX - 1) << 24
    for i in range(t, RADIX, n_threads):
        top_hist[g, h, i] = 0
    cuda.syncthreads()
    # key passes descending (largest first), then index passes ascending (earliest first) among the ties
    for pass_ in range(7):
        on_index = pass_ >= 3
        shift = np.uint32(16 - 8 * pass_) if not on_index else np.uint32(24 - 8 * (pass_ - 3))
        if pass_ == 3:
            if t == 0:
                state[3] = state[0]  # the threshold key
                state[4] = 1 if hist[state[0] & (RADIX - 1)] == state[2] else 0  # no tie to break (usual)
                state[0] = 0
                state[1] = 0
            cuda.syncthreads()
            if state[4]:
                break
        for i in range(t, RADIX, n_threads):
            hist[i] = 0
        cuda.syncthreads()
        prefix = np.uint32(state[0])
        mask = np.uint32(state[1])
        threshold = np.uint32(state[3])
        for i in range(t, m, n_threads):
            key = cand_key[g, h, i]
            value = np.uint32(cand_idx[g, h, i]) if on_index else key
            if (not on_index or key == threshold) and value & mask == prefix:
                cuda.atomic.add(hist, np.int32((value >> shift) & np.uint32(RADIX - 1)), 1)
        cuda.syncthreads()
        if t == 0:
            passed = 0
            remaining = state[2]
            for d in range(RADIX):
                digit = RADIX - 1 - d if not on_index else d
                if passed + hist[digit] >= remaining:
                    state[0] = state[0] | (np.int64(digit) << np.int64(shift))
                    state[2] = remaining - passed
                    break
                passed += hist[digit]
            state[1] = state[1] | (np.int64(RADIX - 1) << np.int64(shift))
        cuda.syncthreads()
    threshold = np.uint32(state[3])
    last_tie = np.uint32(0xFFFFFFFF) if state[4] else np.uint32(state[0])
    for i in range(t, m, n_threads):
        key = cand_key[g, h, i]
        if key > threshold or (key == threshold and np.uint32(cand_idx[g, h, i]) <= last_tie):
            cuda.atomic.or_(winners, (g, cand_idx[g, h, i]), bit)
    cuda.syncthreads()
    if t == 0:
        cand_count[g, h] = 0


@cuda.jit(device=True, inline=True)
def _row_heads(winners, g, j, n, n_scored, sink, local, all_heads):
    """Bit mask of the heads that keep token j: its top-k bits, or every head for sink, local and tail."""
    if j < sink or j >= n - local or j >= n_scored:
        return all_heads
    return winners[g, j]


@cuda.jit(device=True)
def _thread_rows(winners, g, t, n, n_scored, sink, local, all_heads, per_block):
    """This thread's token range in its block of per_block tokens, and how many rows it keeps there."""
    per_thread = (per_block + cuda.blockDim.x - 1) // cuda.blockDim.x
    start = cuda.blockIdx.x * per_block + t * per_thread
    stop = min(start + per_thread, (cuda.blockIdx.x + 1) * per_block, n)
    kept = 0
    for j in range(start, stop):
        if _row_heads(winners, g, j, n, n_scored, sink, local, all_heads):
            kept += 1
    return start, stop, kept


@cuda.jit
def _count_rows_kernel(winners, n, n_scored, sink, local, all_heads, per_block, block_rows):
    """Rows kept in each block of per_block tokens: block_rows int32 [groups, blocks]."""
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    _, _, kept = _thread_rows(winners, g, t, n, n_scored, sink, local, all_heads, per_block)
    counts[t] = kept
    _, total = _block_exclusive_scan(counts, t, cuda.blockDim.x)
    if t == 0:
        block_rows[g, cuda.blockIdx.x] = total


@cuda.jit
def _write_rows_kernel(winners, n, n_scored, sink, local, all_heads, per_block, block_rows,
                       row_index, head_mask, n_rows):
    """Compact the kept tokens into row_index / head_mask, and clear winners for the next step."""
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    max_rows = row_index.shape[1]
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    base = cuda.shared.array(1, np.int32)
    if t == 0:
        before = 0
        for i in range(cuda.blockIdx.x):
            before += block_rows[g, i]
        base[0] = before
        if cuda.blockIdx.x == cuda.gridDim.x - 1:
            n_rows[g] = min(before + block_rows[g, cuda.blockIdx.x], max_rows)
    start, stop, kept = _thread_rows(winners, g, t, n, n_scored, sink, local, all_heads, per_block)
    counts[t] = kept
    pos, _ = _block_exclusive_scan(counts, t, cuda.blockDim.x)
    pos += base[0]
    for j in range(start, stop):
        heads = _row_heads(winners, g, j, n, n_scored, sink, local, all_heads)
        if heads:
            if pos < max_rows:
                row_index[g, pos] = j
                head_mask[g, pos] = heads
            pos += 1
        if j < winners.shape[1]:
            winners[g, j] = 0


def select(scores, n_scored: int, n: int, k: int, sink: int, local: int, top_hist, cand_key, cand_idx,
           cand_count, winners, threads: int = THREADS, per_block: int = 4096,
           select_threads: int = MAX_THREADS) -> None:
    """Each head's top-k among the candidates (not sink, local or tail), as bit h of ``winners``.

    Args:
        scores: float32 ``[groups, G, ≥ n_scored]``: scores of the sealed tokens ``0..n_scored``.
        n: context length (tokens ``n_scored..n`` are the unsealed tail); k, sink, local: SPEC §6.
        top_hist: int32 ``[groups, G, 256]``, all zero (as allocated, and as every call leaves it).
        cand_key, cand_idx: uint32 / int32 ``[groups, G, ≥ n_scored]`` scratch; cand_count: int32 ``[groups, G]``,
            all zero (as allocated, and as every call leaves it).
        winners: uint32 ``[groups, ≥ n]``, all zero (as allocated, and as :func:`union_rows` leaves it).
        per_block: tokens per block of the passes over every score.
    """
    groups, heads = scores.shape[:2]
    if scores.dtype != np.float32 or scores.shape[2] < n_scored or winners.shape[0] != groups \
            or winners.shape[1] < n or not 0 <= n_scored <= n or top_hist.shape != (groups, heads, RADIX) \
            or cand_key.shape[:2] != (groups, heads) or cand_key.shape[2] < n_scored \
            or cand_idx.shape != cand_key.shape or cand_count.shape != (groups, heads) or heads > 32:
        raise ValueError(f"scores {scores.dtype} {scores.shape} / winners {winners.shape} / top_hist "
                         f"{top_hist.shape} / candidates {cand_key.shape} do not fit n_scored = {n_scored}, "
                         f"n = {n} (at most 32 heads)")
    if min(k, sink, local) < 0 or not 1 <= threads <= MAX_THREADS or not 1 <= select_threads <= MAX_THREADS:
        raise ValueError(f"k, sink, local must be >= 0 and threads in 1..{MAX_THREADS}")
    if not (groups and heads and n):
        return
    bits = scores.view(np.uint32)
    lo, hi = sink, min(n_scored, n - local)
    if hi - lo > k:
        chunks = (math.ceil((hi - lo) / per_block), heads, groups)
        _top_digit_kernel[chunks, threads](bits, lo, hi, top_hist)
        _candidates_kernel[chunks, threads](bits, lo, hi, k, top_hist, winners, cand_key, cand_idx, cand_count)
    # one block per head: as many threads as a block may have (the grid being small), but no more than tokens
    _select_kernel[(heads, groups), max(1, min(select_threads, hi - lo))](lo, hi, k, top_hist, cand_key, cand_idx,
                                                                          cand_count, winners)


def union_rows(winners, heads: int, n_scored: int, n: int, sink: int, local: int, block_rows,
               row_index, head_mask, n_rows, threads: int = THREADS, per_block: int = 4096) -> None:
    """Row list per KV head from the winners of :func:`select` plus sink, local and tail.

    Writes ``row_index int32 [groups, max_rows]`` (first ``n_rows[g]`` valid, ascending), ``head_mask``
    (bit h: head h selected the row), ``n_rows int32 [groups]``, and clears ``winners``.
    ``block_rows``: int32 scratch ``[groups, ≥ ceil(n / per_block)]``. Two launches over
    ``ceil(n / per_block)`` blocks per KV head: count, then write at the prefix offsets.
    """
    groups = winners.shape[0]
    blocks = math.ceil(n / per_block)
    if not 1 <= heads <= 32 or not 1 <= threads <= MAX_THREADS or block_rows.shape[0] != groups \
            or block_rows.shape[1] < blocks or winners.shape[1] < n:
        raise ValueError(f"need 1..32 heads, threads in 1..{MAX_THREADS}, block_rows [{groups}, >= {blocks}] and "
                         f"winners [{groups}, >= {n}]; got {heads}, {threads}, {block_rows.shape}, {winners.shape}")
    if groups and n:
        all_heads = (1 << heads) - 1
        args = (winners, n, n_scored, sink, local, all_heads, per_block, block_rows)
        _count_rows_kernel[(blocks, groups), threads](*args)
        _write_rows_kernel[(blocks, groups), threads](*args, row_index, head_mask, n_rows)
