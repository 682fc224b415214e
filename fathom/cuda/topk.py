"""Top-k selection per query head and the union of a KV head's rows (design §6, §8 step 4).

``select`` is the twin of ``fathom.selection.select`` (exactly, ties to the earlier token): a radix select of the
k-th largest score on order-preserving uint32 keys. The scan (``fathom.cuda.scan`` / ``exact``) already counted
the top key byte (sign and exponent) of every candidate, so the passes over the scores know the k-th largest's top
byte. Real scores crowd into one or two binades (a shared offset q · mean(k)): at 128k every candidate of a head
can share the top byte. So a first pass marks the tokens above that byte and counts the second key byte of the
tokens in its bin; a second pass marks the tokens above the k-th's second byte and appends those in its bin to a
candidate list, counting their third key byte (measured on the H200 at 32k × 16: the list of the top byte alone,
~32k a head, made one CTA per head walk it three times: 2.1× slower). Both passes read the high halves of the
scores' order keys alone (``fathom.cuda.score_keys``), two tokens a 32-bit load, and the second reads a low half
only for a token in the bin, appending it as it walks: a warp reserves its slots with one atomic add (it walked its
chunk a second time before, to append at block-scan offsets). The list is short on most heads and long on a
few: a head whose scores crowd into one bin of their top 16 bits (layer 0 of the timing bench's data and of
Qwen2.5-Coder-1.5B: up to 80% of the candidates, ``python -m bench.select_probe --census``). So two passes over the
lists run ``list_ctas`` CTAs a head: the first counts the fourth key byte of the candidates in the k-th's bin of
the top three, the second marks those above the k-th largest key, and those equal to it when all are kept; else it
appends their token indices to a buffer of ties. One CTA per head then breaks those ties by a radix select on the
token index, ascending (from the buffer, or from the list where the buffer overflowed), and clears the scratch.
Before, that CTA walked a head's whole list three to six times (two byte passes, the marking walk, the index passes):
4.6 ms of a 1M token on an H100. Sink, local and the unsealed tail are kept by every head. Histograms are counted per
thread run (a thread's tokens in one bin add once) and per warp group, and the third byte straight into the global
histogram once per digit a warp (a warp match: no shared histogram a CTA clears and flushes), so crowded bins do not
serialise on one counter. Each thread loads 4 words (8 tokens' high halves; in the list passes 4 keys) before it
uses any (one dependent load per token was the walk's chain: 5-7% less candidate time in an A/B on the H200 at 128k;
8 at a time, in an earlier form, was 10-20% slower). A pass's first round of loads goes out before it stages and
searches the histograms (they need no digit), and the second pass stages its two histograms in one round: a CTA of
a pass walks only four rounds at 128k, so each dependent trip to memory before its walk is a large part of it
(with a kernel a pass, compiled without spills: both passes 8.93 -> 7.44 ms a token at 16 × 128k, 1.44 -> 1.22 ms
at 128k × 1 on two H100s). Both passes find their digits as the list kernels do (:func:`_threshold`: one warp walks
the staged levels with no barrier between them; a CTA of the second pass reaches 2 barriers before its walk, of the
first 3 in all, where each took 5), and at many sessions a CTA walks 16,384 tokens, not 8,192
(:func:`pass_tokens_for`): both passes 7.44 -> 7.09 -> 6.62 ms a token at 16 × 128k (the token 36.0 -> 34.8-35.3
ms), 1.21 -> 1.16 ms at 128k × 1, on one H100. Loading fewer words does not pay: a second pass that loaded only the
blocks a note from the first said may hold its tokens (a quarter of them) took 3.79 ms where this one took 3.90
(docs/results.md).

Winners set bit ``h`` of a per-token head mask and bit ``j % 64`` of a per-stream row bitmap. ``union_rows``
compacts the bitmap into the ascending row list of each KV head with each row's head mask (popcounts, then a write
at prefix offsets: it touches ``n / 64`` bitmap words and the selected rows, never every token), clearing both for
the next step. A thread takes one bitmap word: with four, at 128k × 1 the 24 CTAs walked their rows' head masks
four dependent loads deep (the writes 561 -> 252 µs a token on the H200, bit-identical). Every per-step size
(context, sealed tokens) is read from the device lengths, so the launches have grids fixed at construction.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom import _checks
from fathom.cuda.block import RADIX, exclusive_scan
from fathom.cuda.interop import SIMULATED, max_registers
from fathom.cuda.score_keys import HALVES, key_columns
from fathom.quantize import BLOCK

MAX_THREADS = 1024
SUB_HISTOGRAMS = 8  # per-warp-group histograms of the tie passes
LANES = 32  # partial sums of a 256-bin histogram walk (8 bins each)
FULL_MASK = 0xFFFFFFFF
SCORES_IN_FLIGHT = 4  # scores (keys) each thread of the passes over the scores (lists) loads before it uses them
MAX_GRID_X = 2**31 - 1  # CUDA's limit on a grid's first dimension
TIES_PER_HEAD = 4096  # a head's buffer of the keys equal to the k-th largest (past it, their list is walked)


@cuda.jit(device=True, inline=True)
def _bounds(lengths, g, heads_per_session, sink, local):
    """Context n, sealed tokens, and the candidates' range [lo, hi) of stream g (design §6)."""
    n = lengths[g // heads_per_session]
    n_sealed = n // BLOCK * BLOCK
    return n, n_sealed, sink, min(n_sealed, n - local)


@cuda.jit(device=True, inline=True)
def _mark(winners, any_rows, g, j, heads_bits):
    """Set ``heads_bits`` in token j's head mask and j's bit in the bitmap (j >= 0: unsigned, so the word and bit
    are a shift and a mask and the index needs no negative wraparound)."""
    j = np.uint32(j)
    cuda.atomic.or_(winners, (g, j), heads_bits)
    cuda.atomic.or_(any_rows, (g, j >> np.uint32(6)), np.uint64(1) << np.uint64(j & np.uint32(63)))


@cuda.jit(device=True, inline=True)
def _find_digit(hist, wanted, descending, out, t, n_threads):
    """The digit where the running count of the shared 256-bin ``hist`` (from the largest digit if ``descending``,
    else the smallest) reaches ``wanted`` -> out[0], how many of the wanted fall in its bin -> out[1], the bin's count
    -> out[2]; nothing is written if the bins hold fewer. Every thread calls it; it syncs.

    32 lanes (threads 0..31, or fewer threads taking several) each sum 8 consecutive bins in walking order; after a
    barrier each lane adds the sums before its own (independent shared reads, not a dependent walk), and the one
    lane whose range crosses ``wanted`` walks its 8 bins: 8 dependent shared reads on the critical path instead of
    256. Counts stay in 32 bits (the bins hold int32)."""
    sums = cuda.shared.array(LANES, np.int32)
    step = np.uint32(n_threads)
    lane = np.uint32(t)
    while lane < LANES:
        mine = np.int32(0)
        for i in range(RADIX // LANES):
            p = lane * np.uint32(RADIX // LANES) + np.uint32(i)
            mine = np.int32(mine + hist[np.uint32(RADIX - 1) - p if descending else p])
        sums[lane] = mine
        lane = np.uint32(lane + step)
    cuda.syncthreads()
    lane = np.uint32(t)
    while lane < LANES:
        passed = np.int32(0)
        for x in range(lane):
            passed = np.int32(passed + sums[x])
        # the first lane whose running count reaches wanted (lane 0 as well when wanted <= 0)
        if passed + sums[lane] >= wanted and (lane == 0 or passed < wanted):
            for i in range(RADIX // LANES):
                p = lane * np.uint32(RADIX // LANES) + np.uint32(i)
                digit = np.uint32(RADIX - 1) - p if descending else p
                if passed + hist[digit] >= wanted:
                    out[0] = digit
                    out[1] = wanted - passed
                    out[2] = hist[digit]
                    break
                passed = np.int32(passed + hist[digit])
        lane = np.uint32(lane + step)
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _threshold(top_hist, hists, g, h, wanted, depth, staged, state, t, n_threads):
    """The top ``depth`` bytes of the key of the ``wanted``-th largest candidate of head ``h`` of stream ``g``, from
    the scan's top-byte histogram ``top_hist[g, h]`` and then ``hists[g, h, 0 .. depth - 2]`` (each counted over the
    bin the bytes before it chose): returns (those bytes in place in a uint32 key, how many of the wanted fall in
    their bin, the bin's count). The histograms are staged through shared ``staged [4, 256]`` in one round of
    loads; ``state``: shared int64 ``[3]``. Every thread calls it; it syncs."""
    entries = np.uint32(depth * RADIX)
    values = cuda.local.array(4, np.int32)
    i0 = np.uint32(t)
    while i0 < entries:  # four loads in flight before their stores
        for u in range(4):
            i = np.uint32(i0 + u * n_threads)
            row = i >> np.uint32(8)
            col = i & np.uint32(RADIX - 1)
            if i < entries:
                values[u] = top_hist[g, h, col] if row == 0 else hists[g, h, row - np.uint32(1), col]
        for u in range(4):
            i = np.uint32(i0 + u * n_threads)
            if i < entries:
                staged[i >> np.uint32(8), i & np.uint32(RADIX - 1)] = values[u]
        i0 = np.uint32(i0 + 4 * n_threads)
    cuda.syncthreads()
    return _staged_digits(staged, wanted, depth, state, t, n_threads)


if SIMULATED:
    @cuda.jit(device=True, inline=True)
    def _staged_digits(staged, wanted, depth, state, t, n_threads):
        """:func:`_threshold`'s walk of the staged histograms (simulator: the block-wide search, as the simulator
        has no warp shuffles)."""
        prefix = np.uint32(0)
        count = np.int64(0)
        for level in range(depth):
            _find_digit(staged[level], wanted, True, state, t, n_threads)
            prefix |= np.uint32(state[0]) << np.uint32(24 - 8 * level)
            wanted = state[1]
            count = state[2]
        return prefix, wanted, count
else:
    @cuda.jit(device=True, inline=True)
    def _staged_digits(staged, wanted, depth, state, t, n_threads):
        """:func:`_threshold`'s walk of the staged histograms by warp 0 alone, with no barrier between the levels:
        each lane sums 8 bins in walking order, a shuffle scan gives every lane the count before its bins, a ballot
        finds the lane where the count reaches ``wanted``, which walks its 8 bins and broadcasts the digit. The
        block-wide search (:func:`_find_digit`) took two barriers and a 31-read serial sum a level; the result
        reaches the block through ``state`` (one barrier). Same results, ``wanted <= 0`` included (digit 255)."""
        if t < 32:
            lane = np.uint32(t)
            top = np.uint32(RADIX - 1) - lane * np.uint32(RADIX // LANES)  # this lane's bins: top, top - 1, ...
            prefix = np.uint32(0)
            want = np.int32(wanted)
            count = np.int32(0)
            for level in range(depth):
                mine = np.int32(0)
                for i in range(RADIX // LANES):
                    mine = np.int32(mine + staged[level, top - np.uint32(i)])
                running = mine  # inclusive, over lanes 0 .. lane
                step = np.uint32(1)
                while step < np.uint32(LANES):
                    other = cuda.shfl_up_sync(FULL_MASK, running, step)
                    if lane >= step:
                        running = np.int32(running + other)
                    step = np.uint32(step << np.uint32(1))
                hit = cuda.ballot_sync(FULL_MASK, running >= want)
                leader = np.uint32(cuda.ffs(hit) - 1) if hit else np.uint32(LANES - 1)
                digit = np.int32(0)
                in_bin = np.int32(0)
                bin_count = np.int32(0)
                if lane == leader:
                    passed = np.int32(running - mine)
                    for i in range(RADIX // LANES):
                        c = staged[level, top - np.uint32(i)]
                        if passed + c >= want:
                            digit = np.int32(top - np.uint32(i))
                            in_bin = np.int32(want - passed)
                            bin_count = c
                            break
                        passed = np.int32(passed + c)
                digit = cuda.shfl_sync(FULL_MASK, digit, leader)
                want = cuda.shfl_sync(FULL_MASK, in_bin, leader)
                count = cuda.shfl_sync(FULL_MASK, bin_count, leader)
                prefix |= np.uint32(digit) << np.uint32(24 - 8 * level)
            if lane == 0:
                state[0] = prefix
                state[1] = want
                state[2] = count
        cuda.syncthreads()
        return np.uint32(state[0]), state[1], state[2]


@cuda.jit(device=True, inline=True)
def _add_run(hist, digit, last, run):
    """Run-length counting: add the finished run of ``last`` when the digit changes; returns (last, run)."""
    if digit == last:
        return last, np.int32(run + 1)
    if run:
        cuda.atomic.add(hist, last, run)
    return digit, np.int32(1)


if SIMULATED:
    @cuda.jit(device=True, inline=True)
    def _add_in_warp(hists, g, h, byte, digit):
        """Add 1 to ``hists[g, h, byte, digit]`` (simulator: one atomic, as the simulator has no warp match)."""
        cuda.atomic.add(hists, (g, h, byte, digit), 1)
else:
    @cuda.jit(device=True, inline=True)
    def _add_in_warp(hists, g, h, byte, digit):
        """Add 1 to the global ``hists[g, h, byte, digit]`` for every active lane: the lanes of one digit add once,
        from their lowest lane (a crowded head's candidates share few digits; lanes adding to one counter serialise).
        """
        peers = cuda.match_any_sync(cuda.activemask(), digit)
        if peers & ((np.uint32(1) << np.uint32(cuda.laneid)) - np.uint32(1)) == 0:
            cuda.atomic.add(hists, (g, h, byte, digit), cuda.popc(peers))


@cuda.jit(device=True, inline=True)
def _flush(hist, hists, g, h, byte, t, n_threads):
    """Add a CTA's shared 256-bin ``hist`` into ``hists[g, h, byte]`` (non-zero bins only; indexed in full: passing
    the row as a view took the passes' kernel, then one for both, from 40 to 42 registers). Syncs first."""
    cuda.syncthreads()
    for i in range(t, RADIX, n_threads):
        if hist[i]:
            cuda.atomic.add(hists, (g, h, byte, i), hist[i])


@cuda.jit(device=True, inline=True)
def _token(w, e):
    """Token ``e`` (0 or 1) of key word ``w`` (``fathom.cuda.score_keys``): ``64 (w // 32) + w % 32 + 32 e``."""
    return ((w >> np.uint32(5)) << np.uint32(6)) | (w & np.uint32(31)) | (np.uint32(e) << np.uint32(5))


@cuda.jit(device=True, inline=True)
def _append_one(keys, g, h, w, e, pos, cand_key, cand_idx, hists):
    """Write the key of token ``e`` of word ``w`` at ``pos`` of the list (its halves read again: a found candidate is
    rare, and holding the pass's words for it cost registers) and count its third key byte."""
    shift = np.uint32(16 * e)
    high = (keys[g, h, 0, w] >> shift) & np.uint32(0xFFFF)
    low = (keys[g, h, 1, w] >> shift) & np.uint32(0xFFFF)
    key = (high << np.uint32(16)) | low
    cand_key[g, h, pos] = key
    cand_idx[g, h, pos] = _token(w, e)
    _add_in_warp(hists, g, h, 1, (key >> np.uint32(8)) & np.uint32(0xFF))


if SIMULATED:
    @cuda.jit(device=True, inline=True)
    def _append(found, first, step, keys, g, h, cand_key, cand_idx, list_sizes, hists):
        """Append the candidates ``found`` marks (bit ``2u + e``: token ``e`` of word ``first + u · step``) to the list
        (simulator: a slot reserved a candidate, as it has no warp vote)."""
        for u in range(SCORES_IN_FLIGHT):
            for e in range(2):
                if found >> np.uint32(2 * u + e) & np.uint32(1):
                    pos = np.uint32(cuda.atomic.add(list_sizes, (g, h, 0), 1))
                    _append_one(keys, g, h, np.uint32(first + u * step), e, pos, cand_key, cand_idx, hists)
else:
    @cuda.jit(device=True, inline=True)
    def _append(found, first, step, keys, g, h, cand_key, cand_idx, list_sizes, hists):
        """Append the candidates ``found`` marks (bit ``2u + e``: token ``e`` of word ``first + u · step``) to the
        list: for each bit some lane set, one reservation a warp by its lowest such lane, and each lane's slot past
        the lanes below it (a vote and a popcount). Every lane of the warp calls it (whole warps: :func:`select`
        takes threads in multiples of 32). The list is unordered (the passes over it mark by key; ties go to the
        earliest index by a radix select)."""
        if cuda.ballot_sync(FULL_MASK, found != 0) == 0:  # most rounds of a warp find none
            return
        lane = np.uint32(cuda.laneid)
        below = (np.uint32(1) << lane) - np.uint32(1)
        for u in range(SCORES_IN_FLIGHT):
            for e in range(2):
                mine = found >> np.uint32(2 * u + e) & np.uint32(1)
                voters = np.uint32(cuda.ballot_sync(FULL_MASK, mine != 0))
                if voters:
                    leader = np.uint32(cuda.ffs(voters) - 1)
                    base = np.int32(0)
                    if lane == leader:
                        base = cuda.atomic.add(list_sizes, (g, h, 0), np.int32(cuda.popc(voters)))
                    base = cuda.shfl_sync(FULL_MASK, base, leader)
                    if mine:
                        pos = np.uint32(base + cuda.popc(voters & below))
                        _append_one(keys, g, h, np.uint32(first + u * step), e, pos, cand_key, cand_idx, hists)


@cuda.jit(device=True, inline=True)
def _candidates_pass(keys, lengths, heads_per_session, k, sink, local, per_block, level, top_hist, hists, winners,
                     any_rows, cand_key, cand_idx, list_sizes):
    """Grid (chunks, G, streams), one pass over the high halves of the keys of a chunk's tokens for head h (the
    split keys, ``fathom.cuda.score_keys``: word ``w`` of ``keys[g, h, 0]`` holds two tokens' high halves):
    ``level`` 0 marks the tokens above the k-th's top byte and counts the second byte of those in its bin; level 1
    marks the tokens above its second byte, appends those in its bin to the candidate list and counts their third
    byte (see the module). Block (0, 0) of each stream also keeps sink, local and tail, in level 0."""
    h = cuda.blockIdx.y
    g = cuda.blockIdx.z
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    n, n_sealed, lo, hi = _bounds(lengths, g, heads_per_session, sink, local)
    if level == 0 and cuda.blockIdx.x == 0 and h == 0:  # sink, local, tail (ranges may overlap: marks idempotent)
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
        if level == 0:
            for j in range(start + t, stop, n_threads):
                _mark(winners, any_rows, g, j, bit)
        return
    # 32-bit unsigned indices and counts in the walks: Numba types int arithmetic and range() as int64, and a signed
    # index pays for a negative-index wraparound
    highs_of = keys[g, h, 0]
    step = np.uint32(n_threads)
    end = np.uint32((((stop - 1) >> 6) + 1) << 5)  # the words of the blocks holding tokens start .. stop - 1
    highs = cuda.local.array(SCORES_IN_FLIGHT, np.uint32)
    p0 = np.uint32(((start >> 6) << 5) + t)
    # the walk's first loads go out before the histograms are staged and searched: they need no digit, and their
    # latency then overlaps the searches' instead of following them
    for u in range(SCORES_IN_FLIGHT):
        p = np.uint32(p0 + u * step)
        highs[u] = highs_of[p] if p < end else np.uint32(0)
    hist = cuda.shared.array(RADIX, np.int32)  # level 0: the second byte's counts in the k-th's top-byte bin
    staged = cuda.shared.array((2, RADIX), np.int32)  # the top byte's histogram; level 1: the second byte's too
    state = cuda.shared.array(3, np.int64)
    if level == 0:  # cleared before the search's first barrier, which orders it before the walk's counts
        i = np.uint32(t)
        while i < RADIX:
            hist[i] = 0
            i = np.uint32(i + n_threads)
    # both levels' histograms staged in one round and walked by one warp: two barriers, where a block-wide search a
    # level took two each (and level 0 one more to clear its histogram)
    prefix, _, _ = _threshold(top_hist, hists, g, h, k, level + 1, staged, state, t, n_threads)
    digit1 = prefix >> np.uint32(24)
    digit2 = (prefix >> np.uint32(16)) & np.uint32(0xFF)  # level 0: 0, not read
    first_token = np.uint32(start)
    end_token = np.uint32(stop)
    lane = np.uint32(t & 31)
    last = np.uint32(RADIX)
    run = np.int32(0)
    while p0 - lane < end:  # uniform in a warp: every lane reaches the append's votes
        found = np.uint32(0)  # level 1: bit 2u + e, token e of word p0 + u · step is in the k-th's bin
        for u in range(SCORES_IN_FLIGHT):
            p = np.uint32(p0 + u * step)
            for e in range(2):
                j = _token(p, e)
                if p < end and first_token <= j < end_token:
                    high = (highs[u] >> np.uint32(16 * e)) & np.uint32(0xFFFF)
                    top = high >> np.uint32(8)
                    second = high & np.uint32(0xFF)
                    if level == 0:
                        if top > digit1:
                            _mark(winners, any_rows, g, j, bit)
                        elif top == digit1:
                            last, run = _add_run(hist, second, last, run)
                    elif top == digit1:
                        if second > digit2:
                            _mark(winners, any_rows, g, j, bit)
                        elif second == digit2:
                            found |= np.uint32(1) << np.uint32(2 * u + e)
        if level == 1:
            _append(found, p0, step, keys, g, h, cand_key, cand_idx, list_sizes, hists)
        p0 = np.uint32(p0 + SCORES_IN_FLIGHT * step)
        for u in range(SCORES_IN_FLIGHT):  # the next round's loads, every one before any use: they fly together
            p = np.uint32(p0 + u * step)
            highs[u] = highs_of[p] if p < end else np.uint32(0)
    if level == 0:
        if run:
            cuda.atomic.add(hist, last, run)
        _flush(hist, hists, g, h, 0, t, n_threads)


# A kernel a level, each compiled with its level a constant: one kernel for both held both levels' variables, and
# ptxas spilled across its walk (sm_90 at 40 registers: 16 bytes stored, 88 loaded, a load a token of the walk).
# 40 registers hold 6 CTAs an SM at 256 threads (42 hold 5) and these passes are bound by their loads' latency: the
# cap keeps them there
@cuda.jit(cache=True, **max_registers(40))
def _first_pass_kernel(keys, lengths, heads_per_session, k, sink, local, per_block, top_hist, hists, winners,
                       any_rows, cand_key, cand_idx, list_sizes):
    """:func:`_candidates_pass` at level 0."""
    _candidates_pass(keys, lengths, heads_per_session, k, sink, local, per_block, 0, top_hist, hists, winners,
                     any_rows, cand_key, cand_idx, list_sizes)


@cuda.jit(cache=True, **max_registers(40))
def _second_pass_kernel(keys, lengths, heads_per_session, k, sink, local, per_block, top_hist, hists, winners,
                        any_rows, cand_key, cand_idx, list_sizes):
    """:func:`_candidates_pass` at level 1."""
    _candidates_pass(keys, lengths, heads_per_session, k, sink, local, per_block, 1, top_hist, hists, winners,
                     any_rows, cand_key, cand_idx, list_sizes)


@cuda.jit(cache=True)
def _list_kernel(lengths, heads_per_session, k, sink, local, level, top_hist, hists, cand_key, cand_idx, list_sizes,
                 ties, winners, any_rows):
    """Grid (CTAs a head, G, streams), one pass over head h's candidate list, the CTAs of a head taking every
    ``gridDim.x``-th stretch of ``blockDim.x`` candidates: ``level`` 2 counts the fourth key byte of those in the
    k-th's bin of the top three; level 3 marks the candidates above the k-th largest key, and those equal to it when
    they are all kept, else appends their token indices to ``ties[g, h]`` (their count in ``list_sizes[g, h, 1]``,
    past the buffer's end too: the ties kernel then walks the list instead)."""
    h = cuda.blockIdx.y
    g = cuda.blockIdx.z
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    n, n_sealed, lo, hi = _bounds(lengths, g, heads_per_session, sink, local)
    m = np.uint32(list_sizes[g, h, 0])
    if hi - lo <= k or np.uint32(cuda.blockIdx.x * n_threads) >= m:  # a CTA of no candidates: no barrier reached
        return
    staged = cuda.shared.array((4, RADIX), np.int32)
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(3, np.int64)
    prefix, wanted, count = _threshold(top_hist, hists, g, h, k, level + 1, staged, state, t, n_threads)
    if level == 2:
        for i in range(t, RADIX, n_threads):
            hist[i] = 0
        cuda.syncthreads()
    bin_ = prefix >> np.uint32(8)
    all_kept = count == wanted  # level 3: every key equal to the threshold is kept (the usual case)
    bit = np.uint32(1) << np.uint32(h)
    keys = cand_key[g, h]
    indices = cand_idx[g, h]
    capacity = np.uint32(ties.shape[2])
    step = np.uint32(cuda.gridDim.x * n_threads)
    held = cuda.local.array(SCORES_IN_FLIGHT, np.uint32)
    last = np.uint32(RADIX)
    run = np.int32(0)
    i0 = np.uint32(cuda.blockIdx.x * n_threads + t)
    while i0 < m:
        for u in range(SCORES_IN_FLIGHT):  # every load before any use: the loads fly together
            i = np.uint32(i0 + u * step)
            held[u] = keys[i] if i < m else np.uint32(0)
        for u in range(SCORES_IN_FLIGHT):
            i = np.uint32(i0 + u * step)
            if i < m:
                key = held[u]
                if level == 2:
                    if key >> np.uint32(8) == bin_:
                        last, run = _add_run(hist, key & np.uint32(0xFF), last, run)
                elif key > prefix or (key == prefix and all_kept):
                    _mark(winners, any_rows, g, indices[i], bit)
                elif key == prefix:
                    pos = np.uint32(cuda.atomic.add(list_sizes, (g, h, 1), 1))
                    if pos < capacity:
                        ties[g, h, pos] = indices[i]
        i0 = np.uint32(i0 + SCORES_IN_FLIGHT * step)
    if level == 2:
        if run:
            cuda.atomic.add(hist, last, run)
        _flush(hist, hists, g, h, 2, t, n_threads)


@cuda.jit(device=True, inline=True)
def _index_pass(keys, indices, m, keyed, threshold, shift, prefix, mask, subs, hist, t, n_threads):
    """Histogram of one byte (at ``shift``) of the token indices ``indices[:m]`` matching ``prefix`` under ``mask``
    (when ``keyed``, only those whose ``keys`` equal ``threshold``), counted in per-warp-group sub-histograms, summed
    into ``hist``. Syncs. Indices are unsigned 32-bit (no negative wraparound, no 64-bit arithmetic)."""
    step = np.uint32(n_threads)
    i = np.uint32(t)
    while i < SUB_HISTOGRAMS * RADIX:
        subs[i >> np.uint32(8), i & np.uint32(RADIX - 1)] = 0
        i = np.uint32(i + step)
    cuda.syncthreads()
    sub = np.uint32(t >> 5) & np.uint32(SUB_HISTOGRAMS - 1)  # the warp's group
    end = np.uint32(m)
    i = np.uint32(t)
    while i < end:
        if not keyed or keys[i] == threshold:
            value = np.uint32(indices[i])
            if value & mask == prefix:
                cuda.atomic.add(subs, (sub, np.uint32((value >> shift) & np.uint32(RADIX - 1))), 1)
        i = np.uint32(i + step)
    cuda.syncthreads()
    i = np.uint32(t)
    while i < RADIX:
        total = np.int32(0)
        for x in range(SUB_HISTOGRAMS):
            total = np.int32(total + subs[x, i])
        hist[i] = total
        i = np.uint32(i + step)
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _earliest_ties(keys, indices, m, keyed, threshold, remaining, hi, g, bit, winners, any_rows, subs, hist, state, t,
                   n_threads):
    """Mark the ``remaining`` earliest of the token indices ``indices[:m]`` (when ``keyed``, of those whose ``keys``
    equal ``threshold``): a radix select on the index, high byte first. Every thread calls it; it syncs."""
    prefix = np.uint32(0)
    mask = np.uint32(0)
    # every candidate index is below hi: the bytes above hi - 1's are zero in all of them, their passes would each
    # find digit 0 with the count unchanged (at 128k one pass of four is skipped, at 32k two)
    index_bytes = np.uint32(0)
    above = np.uint32(hi - 1)
    while above:
        above >>= np.uint32(8)
        index_bytes = np.uint32(index_bytes + 1)
    for pass_ in range(4):
        shift = np.uint32(24 - 8 * pass_)
        if shift < np.uint32(8) * index_bytes:
            _index_pass(keys, indices, m, keyed, threshold, shift, prefix, mask, subs, hist, t, n_threads)
            _find_digit(hist, remaining, False, state, t, n_threads)
            prefix |= np.uint32(state[0]) << shift
            mask |= np.uint32(RADIX - 1) << shift
            remaining = state[1]
            cuda.syncthreads()
    i = np.uint32(t)  # prefix is now the latest index kept
    while i < m:
        if (not keyed or keys[i] == threshold) and np.uint32(indices[i]) <= prefix:
            _mark(winners, any_rows, g, indices[i], bit)
        i = np.uint32(i + n_threads)


@cuda.jit(cache=True)
def _ties_kernel(lengths, heads_per_session, k, sink, local, top_hist, hists, cand_key, cand_idx, list_sizes, ties,
                 winners, any_rows):
    """One CTA per (head, stream): where the keys equal to the k-th largest are not all kept, the earliest of them
    (a radix select on the token index over ``ties``, or over the candidate list where ``ties`` overflowed), marked.
    Leaves ``top_hist``, ``hists`` and ``list_sizes`` zero for the next step."""
    h = cuda.blockIdx.x
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    staged = cuda.shared.array((4, RADIX), np.int32)
    hist = cuda.shared.array(RADIX, np.int32)
    subs = cuda.shared.array((SUB_HISTOGRAMS, RADIX), np.int32)
    state = cuda.shared.array(3, np.int64)
    bit = np.uint32(1) << np.uint32(h)
    n, n_sealed, lo, hi = _bounds(lengths, g, heads_per_session, sink, local)
    if hi - lo > k:
        threshold, remaining, count = _threshold(top_hist, hists, g, h, k, 4, staged, state, t, n_threads)
        if count != remaining:  # the remaining earliest of the keys == threshold, by radix select on the index
            n_ties = np.uint32(list_sizes[g, h, 1])
            if n_ties <= np.uint32(ties.shape[2]):
                _earliest_ties(cand_key[g, h], ties[g, h], n_ties, False, threshold, remaining, hi, g, bit, winners,
                               any_rows, subs, hist, state, t, n_threads)
            else:  # the buffer overflowed: the list holds them
                _earliest_ties(cand_key[g, h], cand_idx[g, h], np.uint32(list_sizes[g, h, 0]), True, threshold,
                               remaining, hi, g, bit, winners, any_rows, subs, hist, state, t, n_threads)
    cuda.syncthreads()
    i = np.uint32(t)
    while i < RADIX:
        top_hist[g, h, i] = 0
        for x in range(3):
            hists[g, h, x, i] = 0
        i = np.uint32(i + n_threads)
    if t < 2:
        list_sizes[g, h, t] = 0


@cuda.jit(device=True, inline=True)
def _thread_word(any_rows, g, n, t):
    """This thread's bitmap word index (unsigned 32-bit: no negative wraparound) in its CTA's range, whether it lies
    within the stream's ``n`` tokens, and how many rows it keeps."""
    w = np.uint32(cuda.blockIdx.x * cuda.blockDim.x + t)
    inside = w < np.uint32(np.uint32(max(n, 0) + 63) >> np.uint32(6))
    return w, inside, np.int32(cuda.popc(any_rows[g, w])) if inside else np.int32(0)


@cuda.jit(cache=True)
def _count_rows_kernel(any_rows, lengths, heads_per_session, block_rows):
    """Rows kept in each CTA's range of the bitmap: block_rows int32 [streams, CTAs]."""
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    _, _, kept = _thread_word(any_rows, g, lengths[g // heads_per_session], t)
    counts[t] = kept
    _, total = exclusive_scan(counts, t, cuda.blockDim.x)
    if t == 0:
        block_rows[g, cuda.blockIdx.x] = total


@cuda.jit(cache=True)
def _write_rows_kernel(any_rows, winners, lengths, heads_per_session, block_rows, row_index, head_mask, n_rows):
    """Compact the kept tokens into row_index / head_mask in ascending order; clear winners and the bitmap. The
    rows of the CTAs before this one are summed by every thread (their loads in flight together), not walked by
    one."""
    g = cuda.blockIdx.y
    t = cuda.threadIdx.x
    max_rows = row_index.shape[1]
    counts = cuda.shared.array(MAX_THREADS, np.int32)
    sums = cuda.shared.array(2, np.int32)  # rows before this CTA's range, rows of the stream
    if t == 0:
        sums[0] = 0
        sums[1] = 0
    cuda.syncthreads()
    before = np.int32(0)
    total = np.int32(0)
    x = np.uint32(t)
    while x < np.uint32(cuda.gridDim.x):
        rows = block_rows[g, x]
        if x < np.uint32(cuda.blockIdx.x):
            before = np.int32(before + rows)
        total = np.int32(total + rows)
        x = np.uint32(x + cuda.blockDim.x)
    if total:
        cuda.atomic.add(sums, 0, before)
        cuda.atomic.add(sums, 1, total)
    w, inside, kept = _thread_word(any_rows, g, lengths[g // heads_per_session], t)
    counts[t] = kept
    offset, _ = exclusive_scan(counts, t, cuda.blockDim.x)  # syncs: the sums are complete after it
    if cuda.blockIdx.x == 0 and t == 0:
        n_rows[g] = min(sums[1], max_rows)
    out = np.uint32(sums[0] + offset)
    max_out = np.uint32(max_rows)
    if inside:
        word = any_rows[g, w]
        while word:
            low = word & (~word + np.uint64(1))  # the lowest set bit
            j = np.uint32((w << np.uint32(6)) + np.uint32(cuda.popc(low - np.uint64(1))))
            if out < max_out:
                row_index[g, out] = j
                head_mask[g, out] = winners[g, j]
            winners[g, j] = 0
            out = np.uint32(out + 1)
            word ^= low
        any_rows[g, w] = np.uint64(0)


def list_ctas_for(streams: int, heads: int, multiprocessors: int) -> int:
    """CTAs a query head of the passes over the candidate lists: enough that a layer's heads fill the GPU about four
    CTAs an SM deep, and at least four (a crowded head's list is walked by that many; the CTAs a shorter list leaves
    without candidates exit at once)."""
    return max(4, -(-4 * multiprocessors // max(streams * heads, 1)))


PASS_TOKENS = 8192  # tokens a CTA of the passes over the scores walks, at least
MAX_PASS_TOKENS = 16384  # and at most: the longest walk measured
PASS_CTAS_PER_SM = 16  # the passes' CTAs an SM below which a CTA's tokens are not doubled


def pass_tokens_for(streams: int, heads: int, tokens: int, multiprocessors: int) -> int:
    """Tokens a CTA of the two passes over the scores walks (:func:`select`'s ``per_block``): :data:`PASS_TOKENS`,
    doubled up to :data:`MAX_PASS_TOKENS` while the passes' grid over ``tokens`` would still hold
    :data:`PASS_CTAS_PER_SM` CTAs an SM. A CTA pays a fixed chain (staging and searching the histograms, their
    barriers) before its few rounds of loads, so where a layer's CTAs come in many waves fewer and longer ones pay it
    less often; where they do not fill the GPU, shorter ones spread the walk. Measured on H100s, 36 layers: the
    selection alone (``python -m bench.select_probe``), 16 ragged sessions of 128k 8.45 -> 7.78 ms a token at 16,384
    tokens a CTA, one session 1.66 -> 1.81 ms; in the whole 16-session token (``bench timing``, graph mode) both
    passes 7.09 -> 6.62 ms and the token 35.71 -> 34.83 ms. One session of 128k or 1M keeps 8,192.

    Example: ``pass_tokens_for(16 * 8, 4, 131072, 132)`` is 16384; ``pass_tokens_for(8, 4, 131072, 132)`` 8192."""
    per = PASS_TOKENS
    while per < MAX_PASS_TOKENS and streams * heads * -(-tokens // (2 * per)) >= PASS_CTAS_PER_SM * multiprocessors:
        per *= 2
    return per


def select(keys, lengths, heads_per_session: int, k: int, sink: int, local: int, top_hist, hists, cand_key,
           cand_idx, list_sizes, ties, winners, any_rows, threads: int = 256, select_threads: int = MAX_THREADS,
           per_block: int = 8192, list_ctas: int = 4, stream=0) -> None:
    """Each head's top-k among its candidates (sealed tokens but sink and local), plus sink, local and tail for every
    head, marked in ``winners`` (bit h) and ``any_rows``.

    Args:
        keys: uint32 ``[streams, G, 2, key_columns(T)]``: the split order keys of the sealed tokens' scores (from the
            scan; ``fathom.cuda.score_keys``).
        lengths: int32 ``[S]`` session lengths; stream ``g`` is session ``g // heads_per_session``.
        top_hist: int32 ``[streams, G, 256]``: the candidates' top-byte counts (from the scan); hists: int32
            ``[streams, G, 3, 256]`` scratch, zero (the second, third and fourth key bytes' counts); both left zero.
        cand_key, cand_idx: uint32 / int32 ``[streams, G, T]`` scratch (the candidate lists); list_sizes: int32
            ``[streams, G, 2]``, zero (each list's length and its ties'), left zero.
        ties: int32 ``[streams, G, C]`` scratch, ``C >= 1``: the token indices of the keys equal to the k-th largest
            where they are not all kept (more than ``C`` and the ties kernel walks the list for them instead).
        winners: uint32 ``[streams, T]`` and any_rows: uint64 ``[streams, ceil(T / 64)]``, zero as allocated and as
            :func:`union_rows` leaves them.
        threads: per CTA of the passes over the scores and over the lists, whole warps; select_threads: per CTA of
            the ties kernel (one a head); per_block: tokens per CTA of the two passes over the scores
            (:func:`pass_tokens_for`); list_ctas: CTAs a head of the two passes over its list
            (:func:`list_ctas_for`).

    Example (``keys``: the scan's uint32 ``[streams, G, 2, key_columns(T)]``, ``hist``: its counts of the top bytes):
        select(keys, lengths, H, 512, 4, 32, hist, hists, cand_key, cand_idx, list_sizes, ties, winners, any_rows,
               list_ctas=list_ctas_for(streams, G, 132))
    """
    streams, heads = keys.shape[:2]
    tokens = winners.shape[1] if winners.ndim == 2 else -1
    if keys.dtype != np.uint32 or keys.shape != (streams, heads, HALVES, key_columns(tokens)) \
            or winners.shape != (streams, tokens) \
            or top_hist.shape != (streams, heads, RADIX) or hists.shape != (streams, heads, 3, RADIX) \
            or cand_key.shape != (streams, heads, tokens) or cand_idx.shape != cand_key.shape \
            or list_sizes.shape != (streams, heads, 2) or ties.ndim != 3 or ties.shape[:2] != (streams, heads) \
            or ties.shape[2] < 1 or any_rows.shape != (streams, -(-tokens // 64)) or heads > 32:
        raise ValueError(f"keys {keys.dtype} {keys.shape} / winners {winners.shape} / histograms "
                         f"{top_hist.shape} {hists.shape} / candidates {cand_key.shape} {cand_idx.shape} / list sizes "
                         f"{list_sizes.shape} / ties {ties.shape} / bitmap {any_rows.shape} do not fit (at most 32 "
                         "heads)")
    if min(k, sink, local) < 0 or not 32 <= threads <= MAX_THREADS or threads % 32 \
            or not 32 <= select_threads <= MAX_THREADS \
            or not _checks.is_integer(per_block) or per_block < 1 or not _checks.is_integer(list_ctas) \
            or not 1 <= list_ctas <= MAX_GRID_X:
        raise ValueError(f"k, sink, local must be >= 0, threads a multiple of 32 in 32..{MAX_THREADS} (the second "
                         f"pass votes across whole warps), select_threads in "
                         f"32..{MAX_THREADS}, per_block an integer >= 1, list_ctas an integer in 1..{MAX_GRID_X}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    if streams and heads and tokens:
        chunks = (math.ceil(tokens / per_block), heads, streams)
        for kernel in (_first_pass_kernel, _second_pass_kernel):
            kernel[chunks, threads, stream](keys, lengths, heads_per_session, k, sink, local, per_block, top_hist,
                                            hists, winners, any_rows, cand_key, cand_idx, list_sizes)
        for level in (2, 3):
            _list_kernel[(list_ctas, heads, streams), threads, stream](lengths, heads_per_session, k, sink, local,
                                                                      level, top_hist, hists, cand_key, cand_idx,
                                                                      list_sizes, ties, winners, any_rows)
        _ties_kernel[(heads, streams), select_threads, stream](lengths, heads_per_session, k, sink, local,
                                                              top_hist, hists, cand_key, cand_idx, list_sizes, ties,
                                                              winners, any_rows)


def union_blocks(tokens: int, threads: int) -> int:
    """CTAs per stream of the row compaction over ``tokens`` (the ``block_rows`` scratch's width)."""
    return max(1, math.ceil(tokens / 64 / threads))


def union_rows(any_rows, winners, lengths, heads_per_session: int, block_rows, row_index, head_mask, n_rows,
               threads: int = MAX_THREADS, stream=0) -> None:
    """Row list per KV head from :func:`select`'s marks: ``row_index int32 [streams, max_rows]`` (first
    ``n_rows[g]`` valid, ascending), ``head_mask`` (bit h: head h selected the row); clears the marks.
    ``block_rows``: int32 scratch ``[streams, union_blocks(T, threads)]``."""
    streams, words = any_rows.shape
    ctas = union_blocks(words * 64, threads)
    if not 1 <= threads <= MAX_THREADS or block_rows.shape != (streams, ctas) or winners.shape[0] != streams:
        raise ValueError(f"need threads in 1..{MAX_THREADS} and block_rows [{streams}, {ctas}]; got {threads}, "
                         f"{block_rows.shape}")
    if head_mask.shape != row_index.shape or row_index.shape[0] != streams or n_rows.shape != (streams,) \
            or winners.shape[1] > words * 64:
        raise ValueError(f"row_index and head_mask must be [{streams}, max_rows] alike, n_rows [{streams}], winners "
                         f"within the bitmap's {words * 64} tokens; got {row_index.shape}, {head_mask.shape}, "
                         f"{n_rows.shape}, {winners.shape}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    if streams:
        _count_rows_kernel[(ctas, streams), threads, stream](any_rows, lengths, heads_per_session, block_rows)
        _write_rows_kernel[(ctas, streams), threads, stream](any_rows, winners, lengths, heads_per_session,
                                                            block_rows, row_index, head_mask, n_rows)
