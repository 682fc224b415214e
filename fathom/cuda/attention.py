"""Exact attention of each query head over its own selection, each listed K/V row read where it lives (design §6,
§8 steps 5-6); the twin of ``fathom.attention.attention`` (float32 tolerance).

``attend_rows`` reads the rows of each KV head's row list (``fathom.cuda.topk.union_rows``: ascending, so
neighbouring CTAs read neighbouring host pages) — or, for dense attention, rows ``0 .. n`` — from their source: the
row cache's HBM slab on a hit, else the K/V store ``[streams, T, 2, d / 4]`` in pinned host memory (K then V of a
token side by side; a fill also writes the slab), and runs the softmax over them in the same pass, so no row is
staged in HBM and read again (on an H100, 16 ragged 128k sessions: the staged gather and the softmax after it took
7.3 + 4.2 ms a token, this kernel 6.5 ms, where the rows' 4.1 GB at HBM rate take ~1.2 ms; docs/results.md).

One CTA per (chunk of :data:`CHUNK_ROWS` rows, stream); its warps split into groups of ``row_lanes`` lanes, each
group reading whole rows, a lane ``d / 4 / row_lanes`` 8-byte words of each row's K and V (one coalesced read per
row and half), :data:`ROWS_IN_FLIGHT` rows at a time before any is used. A group keeps an online softmax per head
(running maximum, sum and weighted values) in registers: each lane's partial logits of the batch's (row, head)
pairs are summed across the group with a transposing butterfly (every exchange halves the values a lane holds, so
``rows · G`` logits cost ``rows · G − 1`` shuffles, not ``5 · rows · G``), after which each lane holds one pair's
logit; the batch's maximum and sum per head are exchanged the same way, and each pair's weight is broadcast to the
lanes holding the values' channels. The groups of a CTA are combined in shared memory into the chunk's partial
softmax, and ``_combine_kernel`` combines the chunks per (stream, head). Every per-step size (rows, context) is read
on the GPU.

The CUDA simulator has no warp shuffles: there the exchanges go through shared memory and barriers (the same values
exchanged, so the same sums; every exchange sits where the whole CTA reaches it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from fathom import _checks
from fathom.cuda.half import bf16_bits_to_f32
from fathom.cuda.interop import SIMULATED, launch_bounds

CHUNK_ROWS = 128  # rows per CTA of the attention (one partial softmax each)
ROWS_IN_FLIGHT = 4  # rows whose K and V a group of lanes loads before it uses any (fewer where G · rows > lanes)
# Warps per CTA, at most (fewer where a CTA's shared memory would not fit: attend_warps). Measured in the whole
# 16-session 128k token on an H100 (µs a token, warps / rows in flight): 6,877 at 4 / 8, 6,861 at 8 / 2, 6,538 at
# 8 / 4, 7,343 at 2 / 8. The simulator runs every thread as a Python thread: one warp there.
ATTEND_WARPS = 1 if SIMULATED else 8
MAX_SHARED = 48 * 1024  # static shared memory a CTA may declare
MAX_D = 256  # channels: a CTA's groups' weighted values are combined in shared memory
MAX_HEADS = 8  # query heads per KV head (G)
V_IN_FLIGHT = 8  # chunks' partial outputs each thread of the combine loads before it adds them
COMBINE_TILE = 256  # chunks whose weights the combine holds in shared memory at once
FULL_MASK = 0xFFFFFFFF
_KERNELS: dict[tuple, object] = {}


def _pow2_at_least(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def lane_layout(heads: int, words: int, rows_in_flight: int = ROWS_IN_FLIGHT) -> tuple[int, int, int, int]:
    """How a group of lanes reads rows of ``words`` 8-byte words a half (``d / 4``) for ``heads`` query heads:
    ``(row_lanes, per_lane, rows, spread)``: ``row_lanes`` lanes a row (a power of two, 8..32; the heads padded to a
    power of two fit in it), ``per_lane`` words of each half a lane reads, ``rows`` a batch (at most
    ``rows_in_flight``, a power of two, and ``rows · G_padded ≤ row_lanes``: after the butterfly each lane holds one
    (row, head) logit), and ``spread`` lanes holding each such logit."""
    padded = _pow2_at_least(heads)
    row_lanes = min(32, max(8, _pow2_at_least(words), padded))
    per_lane = -(-words // row_lanes)
    rows = min(_pow2_at_least(rows_in_flight), row_lanes // padded)
    return row_lanes, per_lane, rows, row_lanes // (rows * padded)


def shared_bytes(heads: int, words: int, warps: int, rows_in_flight: int = ROWS_IN_FLIGHT) -> int:
    """Shared memory of the attention's CTA: the simulator's exchange words, the queries, and each group's running
    maxima, sums and weighted values."""
    groups = warps * (32 // lane_layout(heads, words, rows_in_flight)[0])
    return 4 * (32 * warps + heads * 4 * words + 2 * groups * heads + groups * heads * 4 * words)


def attend_warps(heads: int, words: int, rows_in_flight: int = ROWS_IN_FLIGHT) -> int:
    """Warps per CTA: :data:`ATTEND_WARPS`, halved until the CTA's shared memory fits (d = 256 at G = 8: 4)."""
    warps = ATTEND_WARPS
    while warps > 1 and shared_bytes(heads, words, warps, rows_in_flight) > MAX_SHARED:
        warps //= 2
    return warps


@cuda.jit(device=True, inline=True)
def _row_count(n_rows, lengths, heads_per_session, dense, g):
    """Rows of stream ``g`` (>= 0): its session's context when ``dense``, else its row list's length (a 32-bit
    division: Numba's int64 one is a subroutine call)."""
    return lengths[np.uint32(g) // np.uint32(heads_per_session)] if dense else n_rows[g]


if SIMULATED:
    def _from_lane(swap, t, value, source):
        """``value`` of thread ``source`` of this warp (simulator: through shared memory; every thread of the CTA
        calls it)."""
        swap[t] = value
        cuda.syncthreads()
        other = swap[source]
        cuda.syncthreads()
        return other

    def _xor_lane(swap, t, value, offset):
        """``value`` of lane ``t ^ offset`` (simulator: :func:`_from_lane` of that thread)."""
        return _from_lane(swap, t, value, t ^ offset)
else:
    @cuda.jit(device=True, inline=True)
    def _xor_lane(swap, t, value, offset):
        """``value`` of lane ``t ^ offset`` (a warp shuffle; ``swap`` is the simulator's)."""
        return cuda.shfl_xor_sync(FULL_MASK, value, offset)

    @cuda.jit(device=True, inline=True)
    def _from_lane(swap, t, value, source):
        """``value`` of thread ``source`` of this warp (a warp shuffle)."""
        return cuda.shfl_sync(FULL_MASK, value, source % 32)


def _attend_kernel(heads: int, words: int, warps: int, in_flight: int):
    """CTA per (chunk of CHUNK_ROWS rows, stream): each head's partial softmax over the chunk's rows."""
    key = (heads, words, warps, in_flight)
    if key in _KERNELS:
        return _KERNELS[key]
    d = 4 * words
    threads = 32 * warps
    padded = _pow2_at_least(heads)
    row_lanes, per_lane, rows_in_flight, spread = lane_layout(heads, words, in_flight)
    values = rows_in_flight * padded  # (row, head) logits of a batch, row-major
    groups = warps * (32 // row_lanes)  # groups of lanes in a CTA
    batch = groups * rows_in_flight  # rows a CTA reads at once
    lane_steps = row_lanes.bit_length() - 1  # butterfly steps across a group
    row_steps = rows_in_flight.bit_length() - 1  # steps across a batch's rows (one head)
    channels = 4 * per_lane  # channels a lane holds
    row_words = 2 * words  # a row's K and V
    exact = row_lanes * per_lane == words  # every lane reads words: no bounds check
    neg_inf = np.float32(-np.inf)

    @cuda.jit(cache=True, **launch_bounds(threads))  # its closure holds only numbers: cached on disk
    def kernel(q, row_index, head_mask, list_rows, n_rows, lengths, heads_per_session, dense, kv, kv_rows, cached,
               source, slab, slab_rows, scale, status, part_m, part_l, part_o):
        chunk = cuda.blockIdx.x
        g = cuda.blockIdx.y
        t = cuda.threadIdx.x
        rows = _row_count(n_rows, lengths, heads_per_session, dense, g)
        first = chunk * CHUNK_ROWS
        if first >= rows:
            return
        last = min(first + CHUNK_ROWS, rows)
        swap = cuda.shared.array(threads, np.float32)  # the simulator's exchanges
        q_s = cuda.shared.array((heads, d), np.float32)
        top_s = cuda.shared.array((groups, heads), np.float32)
        sum_s = cuda.shared.array((groups, heads), np.float32)
        out_s = cuda.shared.array((groups, heads, d), np.float32)
        for x in range(t, heads * d, threads):
            value = q[g, x // d, x % d]
            q_s[x // d, x % d] = value
            if chunk == 0 and not abs(value) < np.float32(np.inf):
                status[2] = 1  # a NaN/inf query: flagged, the host raises at its next call
        cuda.syncthreads()
        lane = t % row_lanes
        group = t // row_lanes
        group_base = t - lane
        mine = lane // spread  # the (row, head) logit this lane holds after the butterfly
        my_row = mine // padded
        my_head = mine % padded
        # the arrays are flat (plan_attention): a stream's rows, slots and row list start at these words
        slab_slots = np.int32(slab_rows)
        kv_base = np.uint64(g) * np.uint64(kv_rows) * np.uint64(row_words)
        slab_base = np.uint64(g) * np.uint64(slab_rows) * np.uint64(row_words)
        list_base = np.uint32(g) * np.uint32(list_rows)

        q_r = cuda.local.array((heads, channels), np.float32)  # this lane's channels of every head's query
        o = cuda.local.array((heads, channels), np.float32)  # its channels of every head's weighted values
        for h in range(heads):
            for i in range(per_lane):
                w = lane + row_lanes * i
                for e in range(4):
                    q_r[h, 4 * i + e] = q_s[h, 4 * w + e] if w < words else np.float32(0)
                    o[h, 4 * i + e] = np.float32(0)
        top = neg_inf  # my_head's running maximum and sum of exponentials (every lane holding the head: the same)
        total = np.float32(0)
        k_held = cuda.local.array((rows_in_flight, per_lane), np.uint64)
        v_held = cuda.local.array((rows_in_flight, per_lane), np.uint64)
        masks = cuda.local.array(rows_in_flight, np.uint32)
        slots = cuda.local.array(rows_in_flight, np.int32)  # each row's slab slot (a hit; a fill: + slots) or -1
        part = cuda.local.array(values, np.float32)
        weight = cuda.local.array(heads, np.float32)
        for b0 in range(first, last, batch):  # the same trips in every thread: the exchanges are CTA-uniform
            for u in range(rows_in_flight):  # every load before any use: the rows fly together
                r = np.uint32(b0 + group * rows_in_flight + u)
                masks[u] = np.uint32(0)
                slots[u] = -1
                for i in range(per_lane):
                    k_held[u, i] = np.uint64(0)
                    v_held[u, i] = np.uint64(0)
                if r < last:
                    listed = np.uint32(list_base + r)
                    masks[u] = np.uint32(FULL_MASK) if dense else np.uint32(head_mask[listed])
                    slot = np.int32(source[listed]) if cached else np.int32(-1)
                    slots[u] = slot
                    hit = 0 <= slot < slab_slots
                    # 32-bit offsets within the stream's rows (or slots), one 64-bit add of the stream's base
                    row = np.uint32(slot) if hit else (r if dense else np.uint32(row_index[listed]))
                    at = (slab_base if hit else kv_base) + np.uint64(row * np.uint32(row_words) + lane)
                    for i in range(per_lane):
                        if exact or lane + row_lanes * i < words:
                            if hit:
                                k_held[u, i] = slab[at + np.uint64(row_lanes * i)]
                                v_held[u, i] = slab[at + np.uint64(words + row_lanes * i)]
                            else:
                                k_held[u, i] = kv[at + np.uint64(row_lanes * i)]
                                v_held[u, i] = kv[at + np.uint64(words + row_lanes * i)]
            # this lane's part of every (row, head) logit of the batch
            for x in range(values):
                part[x] = np.float32(0)
            for u in range(rows_in_flight):
                for i in range(per_lane):
                    for e in range(4):
                        k = bf16_bits_to_f32(np.uint32(k_held[u, i] >> np.uint64(16 * e)) & np.uint32(0xFFFF))
                        for h in range(heads):
                            part[u * padded + h] += q_r[h, 4 * i + e] * k
            # the butterfly: at each step a lane keeps half its values (its partner the other half) and adds the
            # partner's share of them, so after log2(values) steps lane ``l`` holds value l // spread of the group;
            # the steps left add the lanes holding the same value
            for step in range(lane_steps):  # constant trip counts: unrolled, every index a constant (registers)
                offset = row_lanes >> (step + 1)
                upper = (lane & offset) != 0
                half = values >> (step + 1)  # values a lane holds after this step (0: every step past the split)
                for x in range(values // 2):
                    if x < half:
                        send = part[x] if upper else part[x + half]
                        keep = part[x + half] if upper else part[x]
                        part[x] = keep + _xor_lane(swap, t, send, offset)
                if half == 0:
                    part[0] += _xor_lane(swap, t, part[0], offset)
            mask = np.uint32(0)
            for u in range(rows_in_flight):
                if u == my_row:
                    mask = masks[u]
            selected = my_head < heads and (mask >> np.uint32(my_head)) & np.uint32(1) != np.uint32(0)
            logit = part[0] * np.float32(scale) if selected else neg_inf
            # the batch's maximum and sum per head: across the lanes of the same head (rows differ in bits
            # log2(spread · padded) .. of the lane)
            batch_top = logit
            for step in range(row_steps):
                batch_top = max(batch_top, _xor_lane(swap, t, batch_top, (spread * padded) << step))
            new_top = max(top, batch_top)
            rescale = math.exp(top - new_top) if new_top > neg_inf else np.float32(1)
            p = math.exp(logit - new_top) if logit > neg_inf else np.float32(0)
            batch_sum = p
            for step in range(row_steps):
                batch_sum += _xor_lane(swap, t, batch_sum, (spread * padded) << step)
            total = total * rescale + batch_sum
            top = new_top
            # weighted values: every head's rescale, then each row's weights from the lanes holding them
            for h in range(heads):
                weight[h] = _from_lane(swap, t, rescale, group_base + h * spread)
            for h in range(heads):
                for c in range(channels):
                    o[h, c] *= weight[h]
            for u in range(rows_in_flight):
                for h in range(heads):
                    weight[h] = _from_lane(swap, t, p, group_base + (u * padded + h) * spread)
                for i in range(per_lane):
                    for e in range(4):
                        v = bf16_bits_to_f32(np.uint32(v_held[u, i] >> np.uint64(16 * e)) & np.uint32(0xFFFF))
                        for h in range(heads):
                            o[h, 4 * i + e] += weight[h] * v
            if cached:  # a miss that fills a slot: the row into the slab (after its use: the stores wait for loads)
                for u in range(rows_in_flight):
                    if slots[u] >= slab_slots:
                        at = slab_base + np.uint64(np.uint32(slots[u] - slab_slots) * np.uint32(row_words) + lane)
                        for i in range(per_lane):
                            if exact or lane + row_lanes * i < words:
                                slab[at + np.uint64(row_lanes * i)] = k_held[u, i]
                                slab[at + np.uint64(words + row_lanes * i)] = v_held[u, i]

        # the chunk's partial softmax: the groups' combined in shared memory
        if my_row == 0 and lane % spread == 0 and my_head < heads:
            top_s[group, my_head] = top
            sum_s[group, my_head] = total
        for h in range(heads):
            for i in range(per_lane):
                w = lane + row_lanes * i
                if w < words:
                    for e in range(4):
                        out_s[group, h, 4 * w + e] = o[h, 4 * i + e]
        cuda.syncthreads()
        for x in range(t, heads * d, threads):
            h = x // d
            c = x % d
            chunk_top = neg_inf
            for j in range(groups):
                chunk_top = max(chunk_top, top_s[j, h])
            acc = np.float32(0)
            mass = np.float32(0)
            for j in range(groups):
                if top_s[j, h] > neg_inf:
                    scaled = math.exp(top_s[j, h] - chunk_top)
                    acc += scaled * out_s[j, h, c]
                    mass += scaled * sum_s[j, h]
            part_o[g, chunk, h, c] = acc
            if c == 0:
                part_m[g, chunk, h] = chunk_top
                part_l[g, chunk, h] = mass

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


@dataclass(frozen=True)
class AttendPlan:
    """One (stream-free) launch of the attention and its combine, checked and laid out once by
    :func:`plan_attention`: its kernel chosen, its arrays' flat views made. :meth:`run` only enqueues, so a step run
    every token (eagerly: a captured graph never calls Python) pays no checks and no views."""

    kernel: object  # the attention kernel compiled for (G, d / 4, warps, rows in flight)
    grid: tuple[int, int]  # (chunks, streams)
    threads: int
    args: tuple
    combine_grid: tuple[int, int]  # (streams, G)
    combine_threads: int  # d
    combine_args: tuple

    def run(self, stream=0) -> None:
        """Enqueue the attention and its combine on ``stream``."""
        if self.grid[1]:
            self.kernel[self.grid, self.threads, stream](*self.args)
            _combine_kernel[self.combine_grid, self.combine_threads, stream](*self.combine_args)


def plan_attention(q, row_index, head_mask, n_rows, lengths, heads_per_session: int, dense: bool, kv, scale: float,
                   status, part_m, part_l, part_o, out, source=None, slab=None, warps: int | None = None,
                   rows_in_flight: int = ROWS_IN_FLIGHT) -> AttendPlan:
    """Check :func:`attend_rows`'s arguments (the same) and lay its launch out once: the plan's :meth:`AttendPlan.run`
    computes ``out`` from the arrays' contents at the time it runs.

    Example (a decode step built once and run every token)::

        attend = plan_attention(q, row_index, head_mask, n_rows, lengths, H, False, kv, d ** -0.5, status, part_m,
                                part_l, part_o, out, source, slab)
        attend.run(stream)  # every step, after the selection has filled row_index, head_mask, n_rows
    """
    streams, heads, d = q.shape
    max_rows = row_index.shape[1]
    chunks = part_m.shape[1]
    if not 1 <= heads <= MAX_HEADS or d % 4 or not 0 < d <= MAX_D:
        raise ValueError(f"1..{MAX_HEADS} query heads and a multiple of 4 channels up to {MAX_D}, got {heads}, {d}")
    if not _checks.is_integer(rows_in_flight) or rows_in_flight not in (1, 2, 4, 8, 16):
        raise ValueError(f"rows_in_flight must be one of 1, 2, 4, 8, 16, got {rows_in_flight!r}")
    if warps is None:
        warps = attend_warps(heads, d // 4, rows_in_flight)
    if not _checks.is_integer(warps) or not 1 <= warps <= 32 \
            or shared_bytes(heads, d // 4, warps, rows_in_flight) > MAX_SHARED:
        raise ValueError(f"warps must be an integer in 1..32 whose CTA fits {MAX_SHARED} bytes of shared memory "
                         f"(attend_warps: {attend_warps(heads, d // 4, rows_in_flight)} at G = {heads}, d = {d}), "
                         f"got {warps!r}")
    if kv.shape[0] != streams or kv.shape[2:] != (2, d // 4):
        raise ValueError(f"kv must be [{streams}, T, 2, {d // 4}], got {kv.shape}")
    if row_index.shape[0] != streams or head_mask.shape != row_index.shape or n_rows.shape != (streams,):
        raise ValueError(f"row_index and head_mask must be [{streams}, max_rows] alike and n_rows [{streams}], got "
                         f"{row_index.shape}, {head_mask.shape}, {n_rows.shape}")
    covered = kv.shape[1] if dense else max_rows  # dense rows are 0 .. n with n up to T
    if part_m.shape != (streams, chunks, heads) or part_l.shape != part_m.shape \
            or part_o.shape != (streams, chunks, heads, d) or chunks * CHUNK_ROWS < covered:
        raise ValueError(f"partials {part_m.shape} / {part_l.shape} / {part_o.shape} must be [{streams}, chunks, "
                         f"{heads}(, {d})] with chunks · {CHUNK_ROWS} >= {covered} rows")
    if out.shape != q.shape:
        raise ValueError(f"out must be {q.shape} as q, got {out.shape}")
    cached = source is not None
    if cached != (slab is not None) or cached and (dense or source.shape != row_index.shape
                                                   or slab.shape[0] != streams or slab.shape[2:] != kv.shape[2:]):
        raise ValueError(f"a row cache needs both source [{streams}, {max_rows}] and a slab [{streams}, slots, 2, "
                         f"{d // 4}], and sparse rows")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    for name, x in (("row_index", row_index), ("head_mask", head_mask), ("kv", kv), ("source", source),
                    ("slab", slab)):
        if x is not None and not x.is_c_contiguous():  # read flat, by offsets: a view's strides would be misread
            raise ValueError(f"{name} must be C-contiguous")
    if not cached:  # placeholders of the same types (never read): one compiled kernel serves both
        source, slab = row_index, kv
    flat = lambda x: x.reshape(x.size)  # noqa: E731  (views: the kernel indexes them by 32-bit offsets)
    return AttendPlan(
        _attend_kernel(heads, d // 4, warps, rows_in_flight), (chunks, streams), 32 * warps,
        (q, flat(row_index), flat(head_mask), max_rows, n_rows, lengths, heads_per_session, dense, flat(kv),
         kv.shape[1], cached, flat(source), flat(slab), slab.shape[1], scale, status, part_m, part_l, part_o),
        (streams, heads), d, (n_rows, lengths, heads_per_session, dense, part_m, part_l, part_o, out))


def attend_rows(q, row_index, head_mask, n_rows, lengths, heads_per_session: int, dense: bool, kv, scale: float,
                status, part_m, part_l, part_o, out, source=None, slab=None, warps: int | None = None,
                rows_in_flight: int = ROWS_IN_FLIGHT, stream=0) -> None:
    """``out float32 [streams, G, d] = softmax(q kᵀ · scale) v`` of each head over its selected rows, each row read
    from its source (dense: every row ``0 .. n`` of the session): :func:`plan_attention` and its run, at once.

    Args:
        q: float32 ``[streams, G, d]`` (G ≤ 8, d a multiple of 4, at most 256).
        row_index: int32 ``[streams, max_rows]``, the first ``n_rows[g]`` valid (ignored when ``dense``);
            head_mask: int32 ``[streams, max_rows]`` (bit h: head h selected the row; ignored when ``dense``);
            n_rows: int32 ``[streams]``; lengths: int32 ``[S]`` (stream ``g`` is session ``g // heads_per_session``).
        kv: uint64 ``[streams, T, 2, d / 4]`` (host-mapped): bf16 K and V of each token, 4 per word.
        status: int32 flags, ``[2]`` raised for a non-finite query.
        part_m, part_l: float32 ``[streams, chunks, G]``, part_o: float32 ``[streams, chunks, G, d]`` scratch, with
            ``chunks · CHUNK_ROWS`` covering ``max_rows`` (dense: ``T``); out: float32 ``[streams, G, d]``.
        source, slab: the row cache (sparse rows only): int32 ``[streams, max_rows]`` from
            ``fathom.cuda.row_cache.assign_slots`` (a hit's slot, a fill's slot + slots, or -1) and its uint64
            ``[streams, slots, 2, d / 4]`` HBM slab, which a fill writes.
        warps: warps per CTA of the attention (None: :func:`attend_warps`).
        rows_in_flight: rows whose K and V a group of lanes loads before it uses any (a power of two; fewer where
            ``G · rows`` would exceed a group's lanes: :func:`lane_layout`).

    Example (``fathom.attention.attention(q[g], k[g, rows], v[g, rows], mask)`` for every stream g)::

        attend_rows(q, row_index, head_mask, n_rows, lengths, 1, False, kv, d ** -0.5, status, part_m, part_l,
                    part_o, out)
    """
    plan_attention(q, row_index, head_mask, n_rows, lengths, heads_per_session, dense, kv, scale, status, part_m,
                   part_l, part_o, out, source, slab, warps, rows_in_flight).run(stream)
