"""Top-k selection per query head and the union of a KV head's rows (SPEC §6, §8 step 4).

``select`` is the twin of ``fathom.selection.select`` (exactly, ties to the earlier token): a radix select of the
k-th largest score on order-preserving uint32 keys. The scan (``fathom.cuda.scan`` / ``exact``) already counted
the top key byte of every candidate, so the selection reads the scores **once**: tokens above the k-th largest
top byte win outright and those in its bin (a few percent) are appended to a candidate list; then one CTA per head
finishes the three remaining key passes on that list and breaks ties at the threshold by a second radix select on
token index, ascending. Sink, local and the unsealed tail are kept by every head.

Winners set bit ``h`` of a per-token head mask and bit ``j % 64`` of a per-group row bitmap. ``union_rows``
compacts the bitmap into the ascending row list of each KV head with each row's head mask (popcounts, then a write
at prefix offsets: it touches ``n / 64`` bitmap words and the selected rows, never every token), clearing both for
the next step. Every per-step size (context, sealed tokens) is read from the device lengths, so the launches have
grids fixed at construction.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.block import RADIX, exclusive_scan, order_key
from fathom.quantize import BLOCK

MAX_THREADS = 1024
WORDS_PER_THREAD = 4  # bitmap words (64 tokens each) per thread of the row compaction


@cuda.jit(device=True, inline=True)
def _bounds(lengths, g, heads_per_session, sink, local):
    """Context n, sealed tokens, and the candidates' range [lo, hi) of group g (SPEC §6)."""
    n = lengths[g // heads_per_session]
    n_sealed = n // BLOCK * BLOCK
    return n, n_sealed, sink, min(n_sealed, n - local)


@cuda.jit(device=True, inline=True)
def _mark(winners, any_rows, g, j, heads_bits):
    cuda.atomic.or_(winners, (g, j), heads_bits)
    cuda.atomic.or_(any_rows, (g, j // 64), np.uint64(1) << np.uint64(j % 64))


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
def _candidates_kernel(score_bits, lengths, heads_per_session, k, sink, local, per_block, top_hist, winners,
                       any_rows, cand_key, cand_idx, cand_count):
    """Grid (chunks, G, groups): tokens above the k-th largest top byte win outright; tokens in its bin are
    appended (unordered) to head h's candidate list. Block (0, 0) of each group also keeps sink, local and tail."""
    h = cuda.blockIdx.y
    g = cuda.blockIdx.z
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    n, n_sealed, lo, hi = _bounds(lengths, g, heads_per_session, sink, local)
    if cuda.blockIdx.x == 0 and h == 0:  # sink, local and tail (the ranges may overlap: marks are idempotent)
        every_head = np.uint32((1 << cuda.gridDim.y) - 1)
        for j in range(t, min(sink, n), n_threads):
            _mark(winners, any_rows, g, j, every_head)
        for j in range(max(min(n - local, n_sealed), 0) + t, n, n_threads):
            _mark(winners, any_rows, g, j, every_head)
    start = max(lo, cuda.blockIdx.x * per_block)
    stop = min(hi, (cuda.blockIdx.x + 1) * per_block)
    if start >= stop:
        return
    bit = np.uint32(1) << np.uint32(h)
    if hi - lo <= k:  # every candidate is kept
        for j in range(start + t, stop, n_threads):
            _mark(winners, any_rows, g, j, bit)
        return
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(4, np.int64)  # digit, remaining, matches in this block, list base
    _top_digit(top_hist, g, h, k, hist, state, t, n_threads)
    digit = np.uint32(state[0])
    if t == 0:
        state[2] = 0
    cuda.syncthreads()
    for j in range(start + t, stop, n_threads):
        top = order_key(score_bits[g, h, j]) >> np.uint32(24)
        if top > digit:
            _mark(winners, any_rows, g, j, bit)
        elif top == digit:
            cuda.atomic.add(state, 2, 1)
    cuda.syncthreads()
    if t == 0:  # one global reservation per block, not one per token
        state[3] = cuda.atomic.add(cand_count, (g, h), np.int32(state[2]))
        state[2] = 0
    cuda.syncthreads()
    for j in range(start + t, stop, n_threads):
        key = order_key(score_bits[g, h, j])
        if key >> np.uint32(24) == digit:
            pos = state[3] + cuda.atomic.add(state, 2, 1)
            cand_key[g, h, pos] = key
            cand_idx[g, h, pos] = j


@cuda.jit
def _ties_kernel(lengths, heads_per_session, k, sink, local, top_hist, cand_key, cand_idx, cand_count, winners,
                 any_rows):
    """One CTA per (head, group): the last three radix passes over the candidate list, then the winners.

    Ties at the threshold go to the earliest tokens: a second radix select finds the ``wanted``-th smallest token
    index among the tied candidates. Leaves ``top_hist`` and ``cand_count`` zero for the next step.
    """
    h = cuda.blockIdx.x
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(5, np.int64)  # prefix, mask, remaining, threshold, every tie kept
    bit = np.uint32(1) << np.uint32(h)
    n, n_sealed, lo, hi = _bounds(lengths, g, heads_per_session, sink, local)
    if hi - lo > k:
        m = cand_count[g, h]
        _top_digit(top_hist, g, h, k, hist, state, t, n_threads)
        if t == 0:
            state[2] = state[1]
            state[0] = state[0] << 24
            state[1] = np.int64(RADIX - 1) << 24
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
                _mark(winners, any_rows, g, cand_idx[g, h, i], bit)
    cuda.syncthreads()
    for i in range(t, RADIX, n_threads):
        top_hist[g, h, i] = 0
    if t == 0:
        cand_count[g, h] = 0


@cuda.jit(device=True, inline=True)
def _thread_words(any_rows, g, n, t):
    """This thread's bitmap words [first, stop) in its CTA's range, and how many rows they keep."""
    first = (cuda.blockIdx.x * cuda.blockDim.x + t) * WORDS_PER_THREAD
    stop = min(first + WORDS_PER_THREAD, (n + 63) // 64)
    kept = 0
    for w in range(first, stop):
        kept += cuda.popc(any_rows[g, w])
    return first, stop, kept


@cuda.jit
def _count_rows_kernel(any_rows, lengths, heads_per_session, block_rows):
    """Rows kept in each CTA's range of the bitmap: block_rows int32 [groups, CTAs]."""
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    _, _, kept = _thread_words(any_rows, g, lengths[g // heads_per_session], t)
    counts[t] = kept
    _, total = exclusive_scan(counts, t, cuda.blockDim.x)
    if t == 0:
        block_rows[g, cuda.blockIdx.x] = total


@cuda.jit
def _write_rows_kernel(any_rows, winners, lengths, heads_per_session, block_rows, row_index, head_mask, n_rows):
    """Compact the kept tokens into row_index / head_mask in ascending order; clear winners and the bitmap."""
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    max_rows = row_index.shape[1]
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    base = cuda.shared.array(1, np.int32)
    if t == 0:
        before = 0
        total = 0
        for x in range(cuda.gridDim.x):
            if x < cuda.blockIdx.x:
                before += block_rows[g, x]
            total += block_rows[g, x]
        base[0] = before
        if cuda.blockIdx.x == 0:
            n_rows[g] = min(total, max_rows)
    first, stop, kept = _thread_words(any_rows, g, lengths[g // heads_per_session], t)
    counts[t] = kept
    offset, _ = exclusive_scan(counts, t, cuda.blockDim.x)
    out = base[0] + offset
    for w in range(first, stop):
        word = any_rows[g, w]
        while word:
            low = word & (~word + np.uint64(1))  # the lowest set bit
            j = w * 64 + cuda.popc(low - np.uint64(1))
            if out < max_rows:
                row_index[g, out] = j
                head_mask[g, out] = winners[g, j]
            winners[g, j] = 0
            out += 1
            word ^= low
        any_rows[g, w] = np.uint64(0)


def select(score_bits, lengths, heads_per_session: int, k: int, sink: int, local: int, top_hist, cand_key, cand_idx,
           cand_count, winners, any_rows, threads: int = 256, select_threads: int = MAX_THREADS,
           per_block: int = 8192, stream=0) -> None:
    """Each head's top-k among its candidates (sealed tokens but sink and local), plus sink, local and tail for every
    head, marked in ``winners`` (bit h) and ``any_rows``.

    Args:
        score_bits: uint32 ``[groups, G, T]``: the bits of the float32 scores of the sealed tokens (from the scan).
        lengths: int32 ``[S]`` session lengths; group ``g`` is session ``g // heads_per_session``.
        top_hist: int32 ``[groups, G, 256]``: the candidates' top-byte counts (from the scan); left zero.
        cand_key, cand_idx: uint32 / int32 ``[groups, G, T]`` scratch; cand_count: int32 ``[groups, G]``, zero (left zero).
        winners: uint32 ``[groups, T]`` and any_rows: uint64 ``[groups, ceil(T / 64)]``, zero as allocated and as
            :func:`union_rows` leaves them.
        per_block: tokens per CTA of the pass over the scores.
    """
    groups, heads, tokens = score_bits.shape
    if score_bits.dtype != np.uint32 or winners.shape != (groups, tokens) or top_hist.shape != (groups, heads, RADIX) \
            or cand_key.shape != score_bits.shape or cand_idx.shape != score_bits.shape \
            or cand_count.shape != (groups, heads) or any_rows.shape != (groups, -(-tokens // 64)) or heads > 32:
        raise ValueError(f"score bits {score_bits.dtype} {score_bits.shape} / winners {winners.shape} / top_hist "
                         f"{top_hist.shape} / candidates {cand_key.shape} / bitmap {any_rows.shape} do not fit "
                         f"(at most 32 heads)")
    if min(k, sink, local) < 0 or not 1 <= threads <= MAX_THREADS or not 1 <= select_threads <= MAX_THREADS:
        raise ValueError(f"k, sink, local must be >= 0 and threads in 1..{MAX_THREADS}")
    if groups and heads and tokens:
        chunks = (math.ceil(tokens / per_block), heads, groups)
        _candidates_kernel[chunks, threads, stream](score_bits, lengths, heads_per_session, k, sink,
                                                    local, per_block, top_hist, winners, any_rows, cand_key, cand_idx,
                                                    cand_count)
        _ties_kernel[(heads, groups), select_threads, stream](lengths, heads_per_session, k, sink, local, top_hist,
                                                              cand_key, cand_idx, cand_count, winners, any_rows)


def union_blocks(tokens: int, threads: int) -> int:
    """CTAs per group of the row compaction over ``tokens`` (the ``block_rows`` scratch's width)."""
    return max(1, math.ceil(tokens / 64 / (threads * WORDS_PER_THREAD)))


def union_rows(any_rows, winners, lengths, heads_per_session: int, block_rows, row_index, head_mask, n_rows,
               threads: int = MAX_THREADS, stream=0) -> None:
    """Row list per KV head from :func:`select`'s marks: ``row_index int32 [groups, max_rows]`` (first
    ``n_rows[g]`` valid, ascending), ``head_mask`` (bit h: head h selected the row); clears the marks.
    ``block_rows``: int32 scratch ``[groups, union_blocks(T, threads)]``."""
    groups, words = any_rows.shape
    ctas = union_blocks(words * 64, threads)
    if not 1 <= threads <= MAX_THREADS or block_rows.shape != (groups, ctas) or winners.shape[0] != groups:
        raise ValueError(f"need threads in 1..{MAX_THREADS} and block_rows [{groups}, {ctas}]; got {threads}, "
                         f"{block_rows.shape}")
    if groups:
        _count_rows_kernel[(ctas, groups), threads, stream](any_rows, lengths, heads_per_session, block_rows)
        _write_rows_kernel[(ctas, groups), threads, stream](any_rows, winners, lengths, heads_per_session,
                                                            block_rows, row_index, head_mask, n_rows)
