"""The HBM row cache's bookkeeping on the GPU: the twin of ``fathom.row_cache.RowCache.assign`` (bit-exact).

One CTA per stream, every size read on the device (no host sync, a grid fixed at construction):

1. each listed row looks up its position's slot: a hit stamps the slot with the step; every row's source is its
   slot or ``-1``, and the misses are compacted in row order;
2. a 256-bin histogram of the slots' ages (``step - stamp``, capped; empty slots oldest; counted by runs of one
   age, since the slots a step fills sit side by side), prefix-summed from the oldest bin, gives the age at which
   the oldest slots not hit this step number as many as the misses;
3. a pass over the slots in order ranks the victims (older than that age, or at it within the count) and the
   i-th victim takes the i-th miss: the position's old slot entry is cleared, the new one set, the row's source
   written (``slot + slots``: the gather fills the slot); misses beyond the victims keep source ``-1`` and bypass
   the cache.

Each thread walks a contiguous run of the rows and of the slots, so a pass costs one block prefix sum (of per-run
counts; the victims' two counts packed in one int64), not one per ``blockDim`` items: the kernel's latency is a
fixed cost of every layer's step. A run read from global memory is uncoalesced (a warp's lanes read 32 runs
apart), so the slots' ages are first read coalesced, 4 slots a thread, and packed a byte a slot into each run's
words in shared memory; a run is a multiple of 4 slots and runs lie an odd number of words apart, so a warp reading
its runs' j-th words hits 32 banks, one load for 4 slots (:func:`age_layout`; up to 36,864 slots at 1,024 threads;
a larger slab reads its runs from global memory in each pass). Measured on the H200 at 128k × 1, the cache at
steady state, µs a token at 8,192 / 16,384 / 32,768 slots: 756 / 990 / 1,385 (in one process against the previous
layout, 740 against 778 at 8,192 and 1,417 against 1,599 at 32,768). The previous layout kept a byte a slot, each
run's bytes side by side (a warp's lanes 8 to 32 bytes apart: 8-way bank conflicts on every read): 789 / 1,060 /
1,573; with the histogram's pass over runs read from global memory, 756 / 1,136 / 2,346; every pass over slots in
global memory, 828 at 8,192. What is left grows with the slots at ~0.7 ns a slot and layer: one SM reads a
stream's 8 bytes of bookkeeping a slot.

When a layer's streams leave most multiprocessors idle (:func:`parts_pay`: a batch of one or a few sessions), the
same step runs as four short kernels instead, the slab cut in parts of :data:`PART_SLOTS` slots: the rows' pass (a
CTA a stream); each part's age histogram added into the stream's; in each part the threshold from that histogram
and the part's victim counts; in each part its victims ranked after the parts before it, and assigned. The victims
keep their slot order, so the result is the same to the bit. Measured on the H200 at 32,768 slots, µs a token of
36 layers (one CTA a stream / parts): 8 streams (128k × 1) 1,385 / 855; 32 streams 1,408 / 1,223; 128 streams
1,753 / 3,158 (three passes over the bookkeeping in global memory, not one, where every SM already has a stream).

``fathom.cuda.attention.attend_rows`` then reads each row from its source: the slab (a hit), or host memory (and
writes the slab on a fill).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fathom.cuda.block import RADIX, exclusive_scan
from fathom.row_cache import AGE_CAP, EMPTY

MAX_THREADS = 1024
CHUNK = 4  # items of a run per trip: their loads go before any store, so they are in flight together
AGE_WORDS = 9216  # shared words of packed ages: up to 36,864 slots at 1,024 threads (runs of 9 words)
PART_SLOTS = 2048  # slots of a stream one CTA of the parts' age passes walks
PART_THREADS = 256  # threads of such a CTA: runs of 8 slots
NO_VICTIM = AGE_CAP + 1  # the threshold age of a step without misses


def parts_pay(streams: int, multiprocessors: int) -> bool:
    """Whether a step's slots go in parts (four kernels) rather than one CTA a stream: when a layer's streams leave
    most multiprocessors idle (measured on the H200 at 32,768 slots, µs a token of 36 layers, one CTA a stream
    against parts: 8 streams 1,385 / 855, 32 streams 1,408 / 1,223, 128 streams 1,753 / 3,158)."""
    return 4 * streams <= multiprocessors


def parts(slots: int, part_slots: int = PART_SLOTS) -> int:
    """CTAs a stream's slab of ``slots`` takes in the parts' age passes (the width of the ``victims`` scratch)."""
    return max(1, -(-slots // part_slots))


def scratch_shapes(streams: int, slots: int, part_slots: int = PART_SLOTS) -> dict[str, tuple[tuple[int, ...],
                                                                                             type]]:
    """Shapes and dtypes of the parts' scratch (:func:`assign_slots`): the age histogram, each part's victim counts,
    the threshold (shared by every layer's step: a step leaves nothing in them that the next one reads)."""
    return {"age_hist": ((streams, RADIX), np.int32), "victims": ((streams, parts(slots, part_slots)), np.int64),
            "cut": ((streams, 2), np.int32)}


def age_layout(slots: int, threads: int) -> tuple[int, int, bool]:
    """The slot runs' shape as the kernel computes it: (slots a thread's run, words between two runs in shared
    memory, whether the slab's ages fit there). A run is a multiple of 4 slots, so its ages pack into whole
    words (a byte a slot); the stride is odd, so a warp's lanes reading their runs' j-th words hit 32 banks."""
    per = (-(-slots // threads) + 3) // 4 * 4
    stride = per // 4 | 1
    return per, stride, stride * threads <= AGE_WORDS


@cuda.jit(device=True, inline=True)
def _age(old, stamped, step):
    """A slot's age from its position (``old``) and stamp: empty slots are the oldest."""
    return AGE_CAP if old < 0 else np.int32(min(step - stamped, AGE_CAP))


@cuda.jit(device=True, inline=True)
def _run(t, nt, count):
    """Thread ``t``'s contiguous run ``[lo, hi)`` of ``count`` items: one prefix sum per pass, not one per
    ``nt`` items."""
    per = np.int32(np.uint32(np.uint32(count) + np.uint32(nt - 1)) // np.uint32(nt))  # a 32-bit division
    return np.int32(min(t * per, count)), np.int32(min((t + 1) * per, count))


@cuda.jit(device=True, inline=True)
def _slot_layout(nt, slots):
    """:func:`age_layout` on the device: (words of a run's packed ages, the stride between two runs' first
    words, whether the slab's ages fit in shared memory). A run is ``4 · words`` slots."""
    per = np.uint32(np.uint32(np.uint32(slots) + np.uint32(nt - 1)) // np.uint32(nt))
    words = np.uint32(np.uint32(per + np.uint32(3)) >> np.uint32(2))
    stride = np.uint32(words | np.uint32(1))
    return words, stride, stride * np.uint32(nt) <= np.uint32(AGE_WORDS)


@cuda.jit(device=True, inline=True)
def _read_ages(ages, held, position, stamp, g, s, hi, step):
    """The ages of slots ``s .. s + 3`` (those at or past ``hi``: the run's last again, not used); ``held``:
    scratch."""
    for k in range(CHUNK):
        at = min(np.int32(s + k), np.int32(hi - 1))
        held[k] = position[g, at]
        ages[k] = stamp[g, at]
    for k in range(CHUNK):
        ages[k] = _age(held[k], ages[k], step)


@cuda.jit(device=True, inline=True)
def _four_ages(ages, held, age_words, kept, word, position, stamp, g, s, hi, step):
    """The ages of slots ``s .. s + 3`` of a thread's run into ``ages`` (those at or past ``hi``: not used): one
    shared word when the slab's ages are kept there, else read again (``held``: scratch)."""
    if kept:
        packed = age_words[word]
        for k in range(CHUNK):
            ages[k] = np.int32((packed >> np.uint32(8 * k)) & np.uint32(0xFF))
    else:
        _read_ages(ages, held, position, stamp, g, s, hi, step)


@cuda.jit(device=True, inline=True)
def _add_run(hist, age, last, run):
    """Run-length counting of the slots' ages: add the finished run of ``last`` when the age changes (slots filled
    in one step sit side by side and share their age); returns (last, run). Hit slots (age 0) are not counted."""
    if age == last:
        return last, np.int32(run + 1)
    if run and last >= 1:
        cuda.atomic.add(hist, last, run)
    return age, np.int32(1)


@cuda.jit(device=True, inline=True)
def _list_rows(row_index, n, slot_of, stamp, miss_rows, source, g, step, counts, got, t, nt):
    """The rows' pass: each listed row looks up its position's slot, a hit stamps it, every row's source is its slot
    or EMPTY, and the misses are compacted in row order; returns the misses. Syncs (the stamps are visible to the
    CTA after it)."""
    lo, hi = _run(t, nt, n)
    mine = np.int32(0)
    r = lo
    while r < hi:
        for k in range(CHUNK):  # past hi: the run's last row again (read, not used)
            got[k] = slot_of[g, row_index[g, min(np.int32(r + k), np.int32(hi - 1))]]
        for k in range(CHUNK):
            if r + k < hi:
                if got[k] >= 0:
                    stamp[g, got[k]] = step
                else:
                    mine += 1
                source[g, r + k] = got[k]  # a miss's EMPTY stays unless it takes a victim
        r = np.int32(r + CHUNK)
    counts[t] = mine
    offset, misses = exclusive_scan(counts, t, nt)
    offset = np.int32(offset)
    r = lo
    while r < hi:  # the thread's own sources, just written: one load a row, not two dependent ones
        for k in range(CHUNK):
            got[k] = source[g, min(np.int32(r + k), np.int32(hi - 1))]
        for k in range(CHUNK):
            if r + k < hi and got[k] < 0:
                miss_rows[g, offset] = r + k
                offset = np.int32(offset + 1)
        r = np.int32(r + CHUNK)
    return np.int32(misses)


@cuda.jit(device=True, inline=True)
def _threshold(bins, misses, counts, state, t, nt):
    """From the 256 age bins of a stream's slots not hit this step (``bins[age]``): state[0] = the age at which the
    oldest, counted from the oldest bin down, number as many as the misses (:data:`NO_VICTIM` without misses, 0 when
    the slots are too few: every slot not hit is a victim, the rest of the misses bypass), state[1] = the victims
    taken at it. Syncs."""
    blo, bhi = _run(t, nt, RADIX)  # bins from the oldest (bin j: age AGE_CAP - j): the prefix counts older slots
    mine = np.int32(0)
    for j in range(blo, bhi):
        mine += bins[AGE_CAP - j]
    counts[t] = mine
    older, eligible = exclusive_scan(counts, t, nt)
    if misses == 0:
        if t == 0:
            state[0] = NO_VICTIM
            state[1] = 0
    elif eligible < misses:
        if t == 0:
            state[0] = 0
            state[1] = 0
    else:
        for j in range(blo, bhi):
            age = AGE_CAP - j
            count = bins[age]
            if age >= 1 and older < misses <= older + count:
                state[0] = age
                state[1] = misses - older
            older += count
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _victims_of_four(ages, s, hi, threshold):
    """Victims among slots ``s .. s + 3`` of a run (those at or past ``hi``: not counted): older than the threshold
    in the low 32 bits, at it in the high 32, packed for one prefix sum."""
    mine = np.int64(0)
    for k in range(CHUNK):
        if s + k < hi:
            if ages[k] > threshold:
                mine += 1
            elif ages[k] == threshold and threshold >= 1:
                mine += np.int64(1) << np.int64(32)
    return mine


@cuda.jit(device=True, inline=True)
def _take_four(ages, held, got, row_index, slot_of, position, stamp, miss_rows, source, g, s, hi, step, slots,
               threshold, at_threshold, older_before, equal_before):
    """Slots ``s .. s + 3`` of a run, their ages in ``ages`` (those at or past ``hi``: not used), with
    ``older_before`` / ``equal_before`` victims before them: each victim (older than the threshold, or at it within
    the count) takes the miss of its rank — the position's old slot entry cleared, the new one set, the row's
    source ``slot + slots``. Returns the two counts past them. ``held``, ``got``: scratch."""
    for k in range(CHUNK):  # the miss each victim takes (-1: not a victim)
        is_older = s + k < hi and ages[k] > threshold
        is_equal = s + k < hi and threshold >= 1 and ages[k] == threshold
        got[k] = -1
        if is_older or (is_equal and equal_before < at_threshold):
            got[k] = np.int32(older_before + min(equal_before, at_threshold))
        if is_older:
            older_before = np.int32(older_before + 1)
        elif is_equal:
            equal_before = np.int32(equal_before + 1)
    for k in range(CHUNK):  # the victims' old positions and the misses' rows, then the misses' positions
        if got[k] >= 0:
            held[k] = position[g, np.int32(s + k)]
            got[k] = miss_rows[g, got[k]]
    for k in range(CHUNK):
        if got[k] >= 0:
            ages[k] = row_index[g, got[k]]
    for k in range(CHUNK):
        if got[k] >= 0:
            pos = ages[k]
            if held[k] >= 0:
                slot_of[g, held[k]] = EMPTY
            slot = np.int32(s + k)
            slot_of[g, pos] = slot
            position[g, slot] = pos
            stamp[g, slot] = step
            source[g, got[k]] = np.int32(slot + slots)
    return older_before, equal_before


@cuda.jit(cache=True)
def _assign_kernel(row_index, n_rows, slot_of, position, stamp, clock, counters, miss_rows, source):
    """Indices are int32 (``np.int32(...)``) and strided loops ``while`` loops: Numba types integer arithmetic and
    ``range`` as int64. The runs go ``CHUNK`` items a trip with every load first: the compiler cannot tell the
    arrays apart, so a load after a store waits for it, and a row's two dependent loads would each wait a full
    memory latency."""
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    slots = np.int32(position.shape[1])
    n = n_rows[g]
    step = np.int32(clock[g] + 1)
    counts = cuda.shared.array(MAX_THREADS, np.int64)
    hist = cuda.shared.array(RADIX, np.int32)
    state = cuda.shared.array(2, np.int64)  # threshold age, victims taken at it
    age_words = cuda.shared.array(AGE_WORDS, np.uint32)  # each run's ages, 4 a word, read once from global memory
    got = cuda.local.array(CHUNK, np.int32)  # a trip's loaded slots / positions (registers: constant indices)
    held = cuda.local.array(CHUNK, np.int32)
    ages = cuda.local.array(CHUNK, np.int32)  # then the victims' new positions
    i = t
    while i < RADIX:
        hist[i] = 0
        i = np.int32(i + nt)
    # 1. hits (stamped), each row's slot or EMPTY in its source; then the misses compacted in row order
    misses = _list_rows(row_index, n, slot_of, stamp, miss_rows, source, g, step, counts, got, t, nt)
    # 2. the ages of the slots not hit this step: read once, coalesced (4 slots a thread, 16 bytes a lane), into
    #    each run's packed words in shared memory when they fit there; then counted over the thread's run by runs
    #    of one age; the threshold age from the oldest down
    run_words, stride, kept = _slot_layout(nt, slots)
    lo = np.int32(min(np.uint32(t) * run_words * np.uint32(CHUNK), np.uint32(slots)))
    hi = np.int32(min(np.uint32(t + 1) * run_words * np.uint32(CHUNK), np.uint32(slots)))
    word0 = np.int32(np.uint32(t) * stride)
    if kept:
        groups = np.uint32(np.uint32(slots) + np.uint32(CHUNK - 1)) // np.uint32(CHUNK)
        q = np.uint32(t)
        while q < groups:
            for k in range(CHUNK):
                at = min(np.int32(q * np.uint32(CHUNK) + np.uint32(k)), np.int32(slots - 1))
                held[k] = position[g, at]
                ages[k] = stamp[g, at]
            packed = np.uint32(0)
            for k in range(CHUNK):
                packed |= np.uint32(_age(held[k], ages[k], step)) << np.uint32(8 * k)
            owner = np.uint32(q // run_words)  # the thread whose run holds these 4 slots
            age_words[owner * stride + (q - owner * run_words)] = packed
            q = np.uint32(q + np.uint32(nt))
        cuda.syncthreads()
    last = np.int32(-1)
    run = np.int32(0)
    s = lo
    word = word0
    while s < hi:
        _four_ages(ages, held, age_words, kept, word, position, stamp, g, s, hi, step)
        for k in range(CHUNK):
            if s + k < hi:
                last, run = _add_run(hist, ages[k], last, run)
        s = np.int32(s + CHUNK)
        word = np.int32(word + 1)
    if run and last >= 1:
        cuda.atomic.add(hist, last, run)
    cuda.syncthreads()
    _threshold(hist, misses, counts, state, t, nt)
    threshold = np.int32(state[0])
    at_threshold = np.int32(state[1])
    # 3. victims in slot order (older than the threshold, or at it within the count); the i-th takes the i-th miss.
    #    The thread's run of slots is the one it aged in 2.
    mine = np.int64(0)
    s = lo
    word = word0
    while s < hi:
        _four_ages(ages, held, age_words, kept, word, position, stamp, g, s, hi, step)
        mine += _victims_of_four(ages, s, hi, threshold)
        s = np.int32(s + CHUNK)
        word = np.int32(word + 1)
    counts[t] = mine
    offset, _ = exclusive_scan(counts, t, nt)
    older_before = np.int32(offset & 0xFFFFFFFF)
    equal_before = np.int32(offset >> np.int64(32))
    s = lo
    word = word0
    while s < hi:
        _four_ages(ages, held, age_words, kept, word, position, stamp, g, s, hi, step)
        older_before, equal_before = _take_four(ages, held, got, row_index, slot_of, position, stamp, miss_rows,
                                                source, g, s, hi, step, slots, threshold, at_threshold, older_before,
                                                equal_before)
        s = np.int32(s + CHUNK)
        word = np.int32(word + 1)
    if t == 0:
        clock[g] = step
        counters[g, 0] = n - misses
        counters[g, 1] += n - misses
        counters[g, 2] += n


@cuda.jit(device=True, inline=True)
def _part_run(g, part_slots, slots, t, nt):
    """This thread's run ``[lo, hi)`` of slots within its CTA's part of stream ``g``'s slab."""
    first = np.int32(cuda.blockIdx.y * part_slots)
    lo, hi = _run(t, nt, max(min(part_slots, slots - first), 0))
    return np.int32(first + lo), np.int32(first + hi)


@cuda.jit(cache=True)
def _rows_kernel(row_index, n_rows, slot_of, stamp, clock, counters, miss_rows, source, age_hist):
    """CTA per stream: each listed row looks up its position's slot; a hit stamps it with the step; every row's
    source is its slot or EMPTY; the misses are compacted in row order; the clock and counters advance and the
    stream's age histogram is cleared for the next kernel (integers and runs as in :func:`_assign_kernel`)."""
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = n_rows[g]
    step = np.int32(clock[g] + 1)
    counts = cuda.shared.array(MAX_THREADS, np.int64)
    got = cuda.local.array(CHUNK, np.int32)  # a trip's loaded slots (registers: constant indices)
    i = t
    while i < RADIX:
        age_hist[g, i] = 0
        i = np.int32(i + nt)
    misses = _list_rows(row_index, n, slot_of, stamp, miss_rows, source, g, step, counts, got, t, nt)
    if t == 0:
        clock[g] = step
        counters[g, 0] = n - misses
        counters[g, 1] += n - misses
        counters[g, 2] += n


@cuda.jit(cache=True)
def _age_hist_kernel(n_rows, counters, position, stamp, clock, part_slots, age_hist):
    """Grid (streams, parts): the ages of a part's slots (``step - stamp``, capped; empty slots oldest; the hits
    just stamped are age 0 and not counted), counted by runs of one age into shared bins, then added to the
    stream's histogram. Nothing to count without misses."""
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    if n_rows[g] == counters[g, 0]:
        return
    slots = np.int32(position.shape[1])
    step = clock[g]
    hist = cuda.shared.array(RADIX, np.int32)
    held = cuda.local.array(CHUNK, np.int32)
    ages = cuda.local.array(CHUNK, np.int32)
    i = t
    while i < RADIX:
        hist[i] = 0
        i = np.int32(i + nt)
    cuda.syncthreads()
    lo, hi = _part_run(g, part_slots, slots, t, nt)
    last = np.int32(-1)
    run = np.int32(0)
    s = lo
    while s < hi:
        _read_ages(ages, held, position, stamp, g, s, hi, step)
        for k in range(CHUNK):
            if s + k < hi:
                last, run = _add_run(hist, ages[k], last, run)
        s = np.int32(s + CHUNK)
    if run and last >= 1:
        cuda.atomic.add(hist, last, run)
    cuda.syncthreads()
    i = t
    while i < RADIX:
        if hist[i]:
            cuda.atomic.add(age_hist, (g, i), hist[i])
        i = np.int32(i + nt)


@cuda.jit(device=True, inline=True)
def _victim_counts(ages, held, position, stamp, g, lo, hi, step, threshold):
    """This thread's victims in ``[lo, hi)``, packed as :func:`_victims_of_four`'s."""
    mine = np.int64(0)
    s = lo
    while s < hi:
        _read_ages(ages, held, position, stamp, g, s, hi, step)
        mine += _victims_of_four(ages, s, hi, threshold)
        s = np.int32(s + CHUNK)
    return mine


@cuda.jit(cache=True)
def _victim_count_kernel(n_rows, counters, position, stamp, clock, part_slots, age_hist, cut, victims):
    """Grid (streams, parts): the threshold age from the stream's histogram — the age at which the oldest slots not
    hit this step, counted from the oldest bin down, number as many as the misses — then the part's victims (older
    than it, or at it), packed as in :func:`_victim_counts`. Part 0 keeps the threshold for the last kernel."""
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    misses = np.int32(n_rows[g] - counters[g, 0])
    if misses == 0:
        if cuda.blockIdx.y == 0 and t == 0:
            cut[g, 0] = NO_VICTIM
            cut[g, 1] = 0
        return
    slots = np.int32(position.shape[1])
    step = clock[g]
    counts = cuda.shared.array(PART_THREADS, np.int64)
    state = cuda.shared.array(2, np.int32)  # threshold age, victims taken at it
    held = cuda.local.array(CHUNK, np.int32)
    ages = cuda.local.array(CHUNK, np.int32)
    _threshold(age_hist[g], misses, counts, state, t, nt)
    threshold = state[0]
    if cuda.blockIdx.y == 0 and t == 0:
        cut[g, 0] = threshold
        cut[g, 1] = state[1]
    lo, hi = _part_run(g, part_slots, slots, t, nt)
    counts[t] = _victim_counts(ages, held, position, stamp, g, lo, hi, step, threshold)
    _, total = exclusive_scan(counts, t, nt)
    if t == 0:
        victims[g, cuda.blockIdx.y] = total


@cuda.jit(cache=True)
def _take_kernel(row_index, slot_of, position, stamp, clock, miss_rows, source, part_slots, cut, victims):
    """Grid (streams, parts): the victims in slot order (older than the threshold, or at it within the count),
    ranked after those of the parts before; the i-th takes the i-th miss: the position's old slot entry is
    cleared, the new one set, the row's source written (``slot + slots``: the gather fills the slot)."""
    g = cuda.blockIdx.x
    p = cuda.blockIdx.y
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    threshold = cut[g, 0]
    if threshold == NO_VICTIM:
        return
    at_threshold = cut[g, 1]
    slots = np.int32(position.shape[1])
    step = clock[g]
    counts = cuda.shared.array(PART_THREADS, np.int64)
    before = cuda.shared.array(1, np.int64)
    got = cuda.local.array(CHUNK, np.int32)
    held = cuda.local.array(CHUNK, np.int32)
    ages = cuda.local.array(CHUNK, np.int32)  # then the victims' new positions
    if t == 0:
        total = np.int64(0)
        for x in range(p):  # a few parts: independent loads
            total += victims[g, x]
        before[0] = total
    lo, hi = _part_run(g, part_slots, slots, t, nt)
    counts[t] = _victim_counts(ages, held, position, stamp, g, lo, hi, step, threshold)
    offset, _ = exclusive_scan(counts, t, nt)  # syncs: before[0] is written
    offset += before[0]
    older_before = np.int32(offset & 0xFFFFFFFF)
    equal_before = np.int32(offset >> np.int64(32))
    s = lo
    while s < hi:
        _read_ages(ages, held, position, stamp, g, s, hi, step)
        older_before, equal_before = _take_four(ages, held, got, row_index, slot_of, position, stamp, miss_rows,
                                                source, g, s, hi, step, slots, threshold, at_threshold, older_before,
                                                equal_before)
        s = np.int32(s + CHUNK)


def assign_slots(row_index, n_rows, slot_of, position, stamp, clock, counters, miss_rows, source,
                 threads: int = MAX_THREADS, stream=0, scratch=None, part_slots: int = PART_SLOTS,
                 part_threads: int = PART_THREADS) -> None:
    """One step of the row cache of every stream (``RowCache.assign``'s twin).

    Args:
        row_index: int32 ``[streams, max_rows]``, the first ``n_rows[g]`` ascending (``fathom.cuda.topk.union_rows``).
        slot_of: int32 ``[streams, T]``; position, stamp: int32 ``[streams, slots]``; clock: int32 ``[streams]``.
        counters: int64 ``[streams, 3]``: this step's hits, hits and lookups in all.
        miss_rows: int32 ``[streams, max_rows]`` scratch; source: int32 ``[streams, max_rows]`` out, each row's
            slot (hit), slot + slots (fill) or -1 (bypass).
        threads: of the one CTA a stream (or of the parts' rows kernel).
        scratch: None for one CTA a stream; else the slab in parts of ``part_slots`` slots, a CTA of
            ``part_threads`` each, with the scratch arrays of :func:`scratch_shapes` (age_hist, victims, cut).

    Example (under ``NUMBA_ENABLE_CUDASIM=1`` or on a GPU): a stream of 4 slots, its first step misses both rows::

        >>> import numpy as np
        >>> from numba import cuda
        >>> from fathom.row_cache import RowCache
        >>> ref = RowCache(1, 4, 16)
        >>> d = [cuda.to_device(getattr(ref, x)) for x in ("slot_of", "position", "stamp", "clock")]
        >>> rows, source = cuda.to_device(np.array([[3, 9]], np.int32)), cuda.device_array((1, 2), np.int32)
        >>> scratch = [cuda.device_array(*spec) for spec in scratch_shapes(1, 4).values()]
        >>> assign_slots(rows, cuda.to_device(np.array([2], np.int32)), *d, cuda.to_device(np.zeros((1, 3), np.int64)),
        ...              cuda.device_array((1, 2), np.int32), source, threads=32, scratch=scratch)
        >>> source.copy_to_host().tolist()  # both fill: slots 0 and 1, plus the 4 slots
        [[4, 5]]
    """
    streams, max_rows = row_index.shape
    slots = position.shape[1]
    if not 32 <= threads <= MAX_THREADS or position.shape[0] != streams or stamp.shape != position.shape \
            or source.shape != row_index.shape or miss_rows.shape != row_index.shape or counters.shape != (streams, 3) \
            or slots >= 1 << 31:
        raise ValueError(f"row cache arrays do not fit rows {row_index.shape}, slots {position.shape}, "
                         f"counters {counters.shape} (threads in 32..{MAX_THREADS})")
    if scratch is not None:
        want = scratch_shapes(streams, slots, part_slots)
        if not 32 <= part_threads <= PART_THREADS or part_slots < 1 or len(scratch) != 3 \
                or any(a.shape != shape for a, (shape, _) in zip(scratch, want.values())):
            raise ValueError(f"parts need part threads in 32..{PART_THREADS}, part slots >= 1 and scratch "
                             f"{[shape for shape, _ in want.values()]}")
    if not streams:
        return
    if scratch is None:
        _assign_kernel[streams, threads, stream](row_index, n_rows, slot_of, position, stamp, clock, counters,
                                                miss_rows, source)
        return
    age_hist, victims, cut = scratch
    grid = (streams, parts(slots, part_slots))
    _rows_kernel[streams, threads, stream](row_index, n_rows, slot_of, stamp, clock, counters, miss_rows, source,
                                           age_hist)
    _age_hist_kernel[grid, part_threads, stream](n_rows, counters, position, stamp, clock, part_slots, age_hist)
    _victim_count_kernel[grid, part_threads, stream](n_rows, counters, position, stamp, clock, part_slots, age_hist,
                                                     cut, victims)
    _take_kernel[grid, part_threads, stream](row_index, slot_of, position, stamp, clock, miss_rows, source,
                                             part_slots, cut, victims)
