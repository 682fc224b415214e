"""The winners' K/V rows from host memory, and exact attention of each query head over its own selection
(design §6, §8 steps 5-6); the twin of ``fathom.attention.attention`` (float32 tolerance).

``gather_rows`` copies the rows of each KV head's row list (``fathom.cuda.topk.union_rows``: ascending, so
neighbouring CTAs read neighbouring host pages) — or, for dense attention, rows ``0 .. n`` — from the K/V store
``[streams, T, 2, d / 4]`` (K then V of a token side by side: one ``4·d``-byte read per row) into an HBM staging
buffer, consecutive threads on consecutive 8-byte words, several rows in flight per thread. ``attend`` then runs
a split softmax over chunks of :data:`CHUNK_ROWS` rows (one CTA per chunk: logits of every head, chunk max and sum,
weighted values) and combines the chunks per (stream, head). Every per-step size (rows, context) is read on the GPU.
Each stage keeps several loads in flight per thread: at a few thousand rows per KV head the kernels are bound by
memory latency, not bandwidth (measured on the H200, 128k × 1: softmax and combine 1.58 ms a token with 256-row
chunks, a thread per row and a CTA per stream for the combine).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom import _checks
from fathom.cuda.half import bf16_bits_to_f32

ROWS_IN_FLIGHT = 4  # rows each thread of the gather loads before it stores
V_IN_FLIGHT = 8  # rows' values each thread of the softmax loads before it accumulates them
CHUNK_ROWS = 64  # rows per CTA of the softmax
ROW_THREADS = 4  # threads sharing a row's logits, each loading every ROW_THREADS-th word of its K before any use
SOFTMAX_THREADS = CHUNK_ROWS * ROW_THREADS
COMBINE_TILE = 256  # chunks whose weights the combine holds in shared memory at once
_KERNELS: dict[tuple, object] = {}


@cuda.jit(device=True, inline=True)
def _row_count(n_rows, lengths, heads_per_session, dense, g):
    """Rows of stream ``g`` (>= 0): its session's context when ``dense``, else its row list's length (a 32-bit
    division: Numba's int64 one is a subroutine call)."""
    return lengths[np.uint32(g) // np.uint32(heads_per_session)] if dense else n_rows[g]


@cuda.jit(cache=True)
def _gather_kernel(row_index, n_rows, lengths, heads_per_session, dense, kv, staged, cached, source, slab):
    """1-D grid over every stream's row slots in order (slot = g · max_rows + r): thread x moves word
    x % (row words) of ROWS_IN_FLIGHT consecutive slots at a time, so the CTAs in flight read a window of about
    one stream's ascending rows: neighbouring host pages (the GPU's reach over host pages is a few hundred MB).
    ``cached``: each row read from its ``source`` (``fathom.cuda.row_cache``): the HBM ``slab`` on a hit, host
    memory otherwise, and written to the slab on a fill.

    Slot arithmetic is unsigned 32-bit and divides once per thread: a slot's (stream, row) advances with the slot
    (Numba types integer arithmetic as int64, and a 64-bit division per word moved made the kernel
    instruction-bound)."""
    row_words = np.uint32(kv.shape[2] * kv.shape[3])  # K and V
    half_words = np.uint32(kv.shape[3])
    max_rows = np.uint32(staged.shape[1])
    slab_slots = np.int32(slab.shape[1])
    slots = np.uint32(staged.shape[0]) * max_rows
    per_cta = np.uint32(cuda.blockDim.x) // row_words  # row slots a CTA moves at once
    lane_slot = np.uint32(cuda.threadIdx.x) // row_words
    if lane_slot >= per_cta:
        return
    w = np.uint32(cuda.threadIdx.x) - lane_slot * row_words
    half = w // half_words
    word = w - half * half_words
    step = np.uint32(cuda.gridDim.x) * per_cta * np.uint32(ROWS_IN_FLIGHT)
    step_g = step // max_rows  # a step's streams and rows: the slot's (g, r) advance without a division
    step_r = step - step_g * max_rows
    base = (np.uint32(cuda.blockIdx.x) * per_cta + lane_slot) * np.uint32(ROWS_IN_FLIGHT)
    g0 = base // max_rows
    r0 = base - g0 * max_rows
    held = cuda.local.array(ROWS_IN_FLIGHT, np.uint64)
    rows = cuda.local.array(ROWS_IN_FLIGHT, np.int32)  # each slot's source row in kv, or -1: nothing to move
    streams_of = cuda.local.array(ROWS_IN_FLIGHT, np.uint32)
    from_slab = cuda.local.array(ROWS_IN_FLIGHT, np.int32)  # the slab slot a hit reads, a fill writes, or -1
    while base < slots:
        g = g0
        r = r0
        for u in range(ROWS_IN_FLIGHT):  # consecutive slots: a row past max_rows is the next stream's
            while r >= max_rows:
                r = np.uint32(r - max_rows)
                g = np.uint32(g + 1)
            streams_of[u] = g
            rows[u] = -1
            from_slab[u] = -1
            if base + np.uint32(u) < slots:  # past the last slot, g is past the last stream
                if np.int32(r) < _row_count(n_rows, lengths, heads_per_session, dense, g):
                    rows[u] = np.int32(r) if dense else row_index[g, r]
                    if cached:
                        from_slab[u] = source[g, r]
            r = np.uint32(r + 1)
        for u in range(ROWS_IN_FLIGHT):  # every load before any store: the loads fly together
            held[u] = np.uint64(0)
            if rows[u] >= 0:
                g = streams_of[u]
                if 0 <= from_slab[u] < slab_slots:
                    held[u] = slab[g, np.uint32(from_slab[u]), half, word]
                else:
                    held[u] = kv[g, np.uint32(rows[u]), half, word]
        r = r0
        for u in range(ROWS_IN_FLIGHT):
            if rows[u] >= 0:
                g = streams_of[u]
                staged[g, r - (g - g0) * max_rows, half, word] = held[u]
                if from_slab[u] >= slab_slots:
                    slab[g, np.uint32(from_slab[u] - slab_slots), half, word] = held[u]
            r = np.uint32(r + 1)
        base = np.uint32(base + step)
        g0 = np.uint32(g0 + step_g)
        r0 = np.uint32(r0 + step_r)
        if r0 >= max_rows:
            r0 = np.uint32(r0 - max_rows)
            g0 = np.uint32(g0 + 1)


def _softmax_kernel(heads: int, words: int):
    """CTA per (chunk of CHUNK_ROWS rows, stream): partial softmax of every head over the chunk's rows."""
    key = (heads, words)
    if key in _KERNELS:
        return _KERNELS[key]
    d = 4 * words
    words_per_part = -(-words // ROW_THREADS)

    @cuda.jit(cache=True)  # its closure holds only integers: cached on disk
    def kernel(q, staged, head_mask, n_rows, lengths, heads_per_session, dense, scale, status, part_m, part_l,
               part_o):
        chunk = cuda.blockIdx.x
        g = cuda.blockIdx.y
        t = cuda.threadIdx.x
        n_threads = cuda.blockDim.x
        rows = _row_count(n_rows, lengths, heads_per_session, dense, g)
        if chunk * CHUNK_ROWS >= rows:
            return
        q_s = cuda.shared.array((heads, d), np.float32)
        p = cuda.shared.array((heads, CHUNK_ROWS), np.float32)
        red = cuda.shared.array((heads, CHUNK_ROWS), np.float32)
        stats = cuda.shared.array((2, heads), np.float32)  # chunk max, chunk sum
        partial = cuda.shared.array((heads, SOFTMAX_THREADS), np.float32)  # each thread's part of its row's logits
        for x in range(t, heads * d, n_threads):
            value = q[g, x // d, x % d]
            q_s[x // d, x % d] = value
            if chunk == 0 and not abs(value) < np.float32(np.inf):
                status[2] = 1  # a NaN/inf query: flagged, the host raises at its next call
        cuda.syncthreads()
        # logits: ROW_THREADS threads per row, each over every ROW_THREADS-th word of its K (all loaded before
        # any is used), their partial sums added in shared memory (one thread per row walking its 256-byte row one
        # load at a time was the kernel's longest chain)
        row = t // ROW_THREADS
        part = t % ROW_THREADS
        r = chunk * CHUNK_ROWS + row
        mask = np.uint32(0)
        if r < rows:
            mask = np.uint32(0xFFFFFFFF) if dense else np.uint32(head_mask[g, r])
        acc = cuda.local.array(heads, np.float32)
        for h in range(heads):
            acc[h] = np.float32(0)
        if mask:
            k_words = cuda.local.array(words_per_part, np.uint64)
            for i in range(words_per_part):
                if part + ROW_THREADS * i < words:
                    k_words[i] = staged[g, r, 0, part + ROW_THREADS * i]
            for i in range(words_per_part):
                w = part + ROW_THREADS * i
                if w < words:
                    for e in range(4):
                        k = bf16_bits_to_f32(np.uint16((k_words[i] >> np.uint64(16 * e)) & np.uint64(0xFFFF)))
                        for h in range(heads):
                            acc[h] += q_s[h, 4 * w + e] * k
        for h in range(heads):
            partial[h, t] = acc[h]
        cuda.syncthreads()
        if part == 0:
            for h in range(heads):
                logit = partial[h, t]
                for other in range(1, ROW_THREADS):
                    logit += partial[h, t + other]
                selected = (mask >> np.uint32(h)) & np.uint32(1)
                p[h, row] = logit * np.float32(scale) if selected else -np.inf
                red[h, row] = p[h, row]
        cuda.syncthreads()
        step = CHUNK_ROWS // 2
        while step > 0:  # chunk max per head
            if t < step:
                for h in range(heads):
                    red[h, t] = max(red[h, t], red[h, t + step])
            cuda.syncthreads()
            step //= 2
        if t < CHUNK_ROWS:
            for h in range(heads):
                top = red[h, 0]
                p[h, t] = math.exp(p[h, t] - top) if top > -np.inf else np.float32(0)
        cuda.syncthreads()
        if t == 0:
            for h in range(heads):
                stats[0, h] = red[h, 0]
        cuda.syncthreads()
        if t < CHUNK_ROWS:
            for h in range(heads):
                red[h, t] = p[h, t]
        cuda.syncthreads()
        step = CHUNK_ROWS // 2
        while step > 0:  # chunk sum per head
            if t < step:
                for h in range(heads):
                    red[h, t] += red[h, t + step]
            cuda.syncthreads()
            step //= 2
        valid = min(CHUNK_ROWS, rows - chunk * CHUNK_ROWS)
        # weighted values: a thread per (head, word of 4 channels); V_IN_FLIGHT rows' words loaded before any is
        # used, so loads overlap (one at a time, each row waited for its load: ~70 µs a layer); rows in order
        for x in range(t, heads * words, n_threads):
            h = x // words
            w = x % words
            o = cuda.local.array(4, np.float32)
            for e in range(4):
                o[e] = np.float32(0)
            held = cuda.local.array(V_IN_FLIGHT, np.uint64)
            for base in range(0, valid, V_IN_FLIGHT):
                for u in range(V_IN_FLIGHT):
                    if base + u < valid:
                        held[u] = staged[g, chunk * CHUNK_ROWS + base + u, 1, w]
                for u in range(V_IN_FLIGHT):
                    if base + u < valid and p[h, base + u] != 0:
                        for e in range(4):
                            v = bf16_bits_to_f32(np.uint16((held[u] >> np.uint64(16 * e)) & np.uint64(0xFFFF)))
                            o[e] += p[h, base + u] * v
            for e in range(4):
                part_o[g, chunk, h, 4 * w + e] = o[e]
        if t < heads:
            part_m[g, chunk, t] = stats[0, t]
            part_l[g, chunk, t] = red[t, 0]

    _KERNELS[key] = kernel
    return kernel


@cuda.jit(cache=True)
def _combine_kernel(n_rows, lengths, heads_per_session, dense, part_m, part_l, part_o, out):
    """CTA per (stream, head), thread per channel: the chunks' partial softmaxes combined. The chunks' weights
    ``exp(m_i − max m)`` are computed once per CTA, :data:`COMBINE_TILE` at a time into shared memory, and each thread
    loads :data:`V_IN_FLIGHT` partial outputs before it adds them (in chunk order)."""
    g = cuda.blockIdx.x
    h = cuda.blockIdx.y
    t = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    rows = _row_count(n_rows, lengths, heads_per_session, dense, g)
    chunks = min((rows + CHUNK_ROWS - 1) // CHUNK_ROWS, part_m.shape[1])
    lane_top = cuda.shared.array(32, np.float64)  # weights and sums in float64: a few values a chunk
    weight = cuda.shared.array(COMBINE_TILE, np.float64)
    mass = cuda.shared.array(COMBINE_TILE, np.float64)  # weight · the chunk's sum of exponentials
    for lane in range(t, 32, n_threads):  # 32 partial maxima, whatever the CTA's d threads
        top = -np.inf
        for i in range(lane, chunks, 32):
            top = max(top, part_m[g, i, h])
        lane_top[lane] = top
    cuda.syncthreads()
    top = -np.inf
    for lane in range(32):
        top = max(top, lane_top[lane])
    total = np.float64(0)
    o = np.float64(0)
    held = cuda.local.array(V_IN_FLIGHT, np.float32)
    for tile in range(0, chunks, COMBINE_TILE):
        in_tile = min(COMBINE_TILE, chunks - tile)
        cuda.syncthreads()  # the previous tile's weights are used
        for i in range(t, in_tile, n_threads):
            m = part_m[g, tile + i, h]
            w = math.exp(m - top) if m > -np.inf else 0.0
            weight[i] = w
            mass[i] = w * part_l[g, tile + i, h]
        cuda.syncthreads()
        for base in range(0, in_tile, V_IN_FLIGHT):
            for u in range(V_IN_FLIGHT):
                if base + u < in_tile:
                    held[u] = part_o[g, tile + base + u, h, t] if weight[base + u] != 0 else np.float32(0)
            for u in range(V_IN_FLIGHT):
                if base + u < in_tile and weight[base + u] != 0:
                    total += mass[base + u]
                    o += weight[base + u] * held[u]
    out[g, h, t] = o / total


def gather_rows(row_index, n_rows, lengths, heads_per_session: int, dense: bool, kv, staged, ctas: int,
                threads: int = 256, stream=0, source=None, slab=None) -> None:
    """Copy the listed K/V rows (``dense``: rows ``0 .. n``) of every stream into ``staged``.

    Args:
        row_index: int32 ``[streams, max_rows]``, first ``n_rows[g]`` valid; lengths: int32 ``[S]``.
        kv: uint64 ``[streams, T, 2, d / 4]`` (host-mapped): bf16 K and V of each token, 4 per word.
        staged: uint64 ``[streams, max_rows, 2, d / 4]`` (HBM).
        ctas: CTAs of the grid (about two per multiprocessor: enough loads in flight, a narrow window of pages).
        source, slab: the row cache (sparse rows only): int32 ``[streams, max_rows]`` from
            ``fathom.cuda.row_cache.assign_slots`` and its uint64 ``[streams, slots, 2, d / 4]`` HBM slab.
    """
    streams, max_rows = staged.shape[:2]
    row_words = kv.shape[2] * kv.shape[3]
    threads = max(row_words, threads // row_words * row_words)  # whole rows per CTA
    cached = source is not None
    if cached != (slab is not None) or cached and (dense or source.shape != (streams, max_rows)
                                                   or slab.shape[0] != streams or slab.shape[2:] != kv.shape[2:]):
        raise ValueError(f"a row cache needs both source [{streams}, {max_rows}] and a slab [{streams}, slots, "
                         f"{kv.shape[2]}, {kv.shape[3]}], and sparse rows")
    if row_index.shape != (streams, max_rows) or n_rows.shape != (streams,):
        raise ValueError(f"row_index must be [{streams}, {max_rows}] as staged and n_rows [{streams}], got "
                         f"{row_index.shape}, {n_rows.shape}")
    if dense and max_rows < kv.shape[1]:  # dense rows are 0 .. n with n up to T: the softmax reads all n staged
        raise ValueError(f"staged must hold every token for dense rows: max_rows >= {kv.shape[1]} (kv's T), got "
                         f"{max_rows}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    if not cached:  # placeholders of the same types (never read): one compiled kernel serves both
        source, slab = row_index, staged
    if streams and max_rows:
        _gather_kernel[ctas, threads, stream](row_index, n_rows, lengths, heads_per_session, dense, kv, staged,
                                              cached, source, slab)


def attend(q, staged, head_mask, n_rows, lengths, heads_per_session: int, dense: bool, scale: float, status, part_m,
           part_l, part_o, out, stream=0) -> None:
    """``out float32 [streams, G, d] = softmax(q kᵀ · scale) v`` of each head over its selected staged rows.

    Args:
        q: float32 ``[streams, G, d]``; staged: uint64 ``[streams, max_rows, 2, d / 4]`` from :func:`gather_rows`;
        head_mask: int32 ``[streams, max_rows]`` (bit h: head h selected the row; ignored when ``dense``);
        status: int32 flags, ``[2]`` raised for a non-finite query;
        part_m, part_l: float32 ``[streams, ceil(max_rows / CHUNK_ROWS), G]``; part_o: float32 ``[.., G, d]`` scratch.
    """
    streams, heads, d = q.shape
    chunks = part_m.shape[1]
    if part_m.shape != (streams, chunks, heads) or part_o.shape != (streams, chunks, heads, d) \
            or chunks * CHUNK_ROWS < staged.shape[1] or d % 4 or d > 1024 or staged.shape[3] != d // 4:
        raise ValueError(f"partials {part_m.shape} / {part_o.shape} do not cover {staged.shape[1]} rows of "
                         f"{heads} heads × {d} channels (d % 4 == 0, d <= 1024: a thread per channel)")
    if staged.shape[0] != streams or head_mask.shape != staged.shape[:2] or n_rows.shape != (streams,):
        raise ValueError(f"staged and head_mask must be [{streams}, max_rows] alike and n_rows [{streams}], got "
                         f"{staged.shape[:2]}, {head_mask.shape}, {n_rows.shape}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    if streams:
        _softmax_kernel(heads, d // 4)[(chunks, streams), SOFTMAX_THREADS, stream](
            q, staged, head_mask, n_rows, lengths, heads_per_session, dense, scale, status, part_m, part_l, part_o)
        _combine_kernel[(streams, heads), d, stream](n_rows, lengths, heads_per_session, dense, part_m, part_l,
                                                    part_o, out)
