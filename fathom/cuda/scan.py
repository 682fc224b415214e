"""The plane scan: approximate scores read straight from the store, wherever it lives (design §5, §8 steps 2-3).

The twin of ``fathom.scoring.approx_scores`` (within float32 tolerance: the sum over channels runs in another
order, with FMAs), its scores written as split order keys (``fathom.cuda.score_keys``: a lane's two tokens of a
block as one word of each half; the selection's passes read the high halves alone), that also counts the top byte
of every candidate's score for the selection (``fathom.cuda.topk``), so the selection's passes know the k-th's top
byte before they start.

One CUDA block (CTA) per (stream, part of a segment), launched stream-fastest so that CTAs start segment by segment and
the sessions' last segments start last; the warps of a part-filled segment's CTA that hold no sealed block skip the
scoring, so that CTA is short (measured when a CTA of 32 warps scored a whole segment, part-filled or not: 8 streams of
128k tokens and a few sealed blocks past them, 8 × 17 such CTAs on the H200's 132 SMs, took 3.3–3.5 ms a token of 36
layers against 2.1 at 128k exactly). The decoder's CTA has 8 warps (:data:`SCAN_WARPS`), compiled for four of them an SM
(:func:`resident_ctas`: the widest CTA's 32 warps, each thread its 64 registers), so a CTA waiting on its first chunk's
loads or at a barrier leaves the SM to three others. It reads, for every channel ``c`` the depths read (to depth
``b_c``), the channel's run ``[scales | planes 0 .. b_c-1]`` (``fathom.layout``) in chunks of whole runs through shared
memory, the next chunk's loads in flight (held in registers) while the current one is scored. The store is tiered by
plane (``t = layout.hbm_planes``): each word is loaded from the tier holding it — scales and planes ``< t`` from the
near array in HBM, planes ``t .. b_c-1`` from the far array in mapped pinned host memory, over PCIe — so a run is one
contiguous piece of each tier; ``t = 0`` is the all-host store, ``t = 4`` the all-HBM one. A read is a run's part in one
CTA's blocks: with ``cap = 128``-block segments, 0.3–1.1 KB contiguous for the decoder's 32 blocks a CTA at G = 4 (a
tiered read's far part ``(b_c − t)`` × 256 bytes), 1.3–4.3 KB for a whole segment's (one CTA of 32 warps). Scattered
256-byte pieces reached a third of the link's rate in a probe, yet at 1M × 1, where the link binds, the 8-warp CTAs took
2.8% less time a token than the 32-warp ones (H100). Each warp scores ``blocks_per_warp`` 64-token blocks, two tokens
per lane (token ``j`` of a block is bit ``j`` of its plane words), each query head accumulated in registers, so the
kernel is compiled per (G, warps, blocks per warp). It walks a chunk channel by channel, each channel's slot, depth and
queries read once for all of the warp's blocks (measured on the H200: 17% less scan time than block by block, the same
scores to the bit). Sizes that change per step — each session's sealed blocks — are read from the device lengths, so one
launch with a fixed grid serves every step.

Integers in the loops are unsigned 32-bit offsets (``np.uint32``): Numba types integer arithmetic as int64 and pays
a negative-index wraparound on signed indices, which made the per-channel loop 1,197 SASS instructions for a warp's
four blocks at G = 4. The plane loop runs exactly the channel's depth (the same in every lane: a uniform branch), two
blocks per pass, and a thread's chunk words find their slots by walking on from the previous word's (336
instructions a channel with the depth a predicate over four unrolled planes; the chunk loop without it 1,087 ->
1,004), and the chunk's loads stay in registers (reading four blocks per pass spilled them to local memory, whose
store waits for the load). A warp's scales are one shared word (constant shifts, at most two loads a channel), each
widened by the GPU's fp16 conversion (one instruction, where integer operations took nine), and each plane's bit
lands where the 4-bit code holds it (a shift and a masked OR a token, no shift of the prefix): read in the SASS
(sm_90, ``ptxas``, ``nvdisasm``; docs/gpu.md), the per-channel loop of a warp's blocks is 143 + 36·b instructions at
G = 4 (was 196 + 40·b), 348 + 144·b at G = 1 (533 + 160·b) and 117 + 18·b at G = 8 (140 + 20·b), the scores the
same to the bit (an A/B of both kernels under the simulator, subnormal scales included). The midpoint kernel gathers
each prefix into the bits of a float (2^19 + C / 8), so a token's bracket is one exact add where an integer
conversion and an FMA were: 137 + 36·b at G = 4, 319 + 144·b at G = 1, 113 + 18·b at G = 8, the same registers and
spills, the scores the same to the bit (A/B under the simulator). Every active channel reads plane 0, so it is read
before the plane loop and the prefix starts from it (no prefix set for every token, no loop guard before it):
159 + 36·(b − 1) at G = 4 (was 137 + 36·b), 419 + 144·(b − 1) at G = 1 and 128 + 18·(b − 1) at G = 8
(``python -m bench.sass``), the scores the same to the bit (the simulator's scan tests); on an H100 the scan took
6–7% less time (14.52 -> 13.48 ms a 1M token). Eight blocks a warp at G = 4 (16 warps of 128 registers) cut another
17% of the instructions a token and made the scan 14–36% slower: half the warps an SM hide the loads' latency worse.
The prefix is now the float 2 + C / 8, whose k̂ is one FMA a token (:data:`MIDPOINT_BASE`), and a CTA finds its
active channels and run slots in one block scan of packed counts, each chunk's first slot by its own thread
(:data:`RUN_BITS`; a scan, another scan and thread 0's walk before): 154 + 36·(b − 1) at G = 4, half the spill
stores (156 bytes, 12 held chunk words spilled after their loads against 24), 398 + 144·(b − 1) at G = 1 and
123 + 18·(b − 1) at G = 8; the scores the same to the bit (the simulator's scan and decoder tests, and an H100's GPU
tests). On an H100, 16 ragged sessions of 128k: the scan 13.6 -> 12.4 ms a token, the token 34.3–34.6 -> 33.0–33.1
ms. CTAs of 4 warps, eight an SM, were slower at every setting (docs/results.md).

Score of token ``j`` in channel ``c`` read to depth ``b`` (design §2): with ``P`` the ``b``-bit prefix of its code,
``k̂ = ((P + 0.5) · 2^(4-b) − 8) · Δ`` and ``score[h, j] += q[h, c] · k̂``. Through a reconstruction table
(``levels``, the calibrated cell means of ``fathom.calibration``) ``k̂ = levels[c, b - 1, P] · Δ``: the kernel reads
the table :func:`scan_levels` lays out, indexed by the code as the plane loop gathers it (``P · 2^(4-b)``), so a
token's read is one load where the midpoint is one FMA, in a kernel compiled per
case. Its index is a 32-bit sum: Numba widens an unsigned sum to 64 bits, whose address arithmetic cost four
instructions a token and made ptxas spill every held chunk word at G = 4 (166 -> 155 + 36·b a channel, 644 -> 328
bytes of spill stores).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom import _checks
from fathom.cuda.block import RADIX, exclusive_scan, flush_histogram
from fathom.cuda.half import f16_bits_to_f32, f32_from_bits
from fathom.cuda.interop import launch_bounds
from fathom.cuda.layout import plane_in_near, plane_word, record_offset, scales_in_near
from fathom.cuda.score_keys import check_keys, store_pair
from fathom.layout import SCALES_PER_WORD
from fathom.quantize import BLOCK, CELLS, PLANES

MAX_D = 256
MAX_HEADS = 8
WIDEST_WARPS = 32  # the widest CTA (fewer warps where its blocks would pass a segment or MAX_CTA_BLOCKS)
SCAN_WARPS = 8  # the decoder's CTA on a GPU: four of them an SM at G = 4 (see resident_ctas)
CHUNK_WORDS = 3072  # run words the widest CTA stages per chunk (24 KiB; a chunk may overrun by one run) at G <= 4
# Blocks a CTA scores: its staging buffer holds a chunk plus one run of up to 4 planes of them. At G = 1, 32 warps of
# 16 blocks (512) would declare 52 KB of static shared memory, past the 48 KB a CTA may (ptxas refuses the kernel).
MAX_CTA_BLOCKS = 256
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: a stream's CTAs
RUN_BITS = 20  # an active channel's count in the packed scan sits above its run's words (< 2^20: 256 channels of
# at most 1,089 words)
RUN_MASK = (1 << RUN_BITS) - 1
MIDPOINT_BASE = 2.0  # the float whose mantissa's unit is 2^-22: 2 + C / 8 is its bits OR C << 19
MIDPOINT_BASE_BITS = int(np.float32(MIDPOINT_BASE).view(np.uint32))  # its bits: exponent 128, mantissa 0
_KERNELS: dict[tuple, object] = {}


def blocks_per_warp(heads: int) -> int:
    """64-token blocks per warp: ``2 · blocks · heads`` fp32 accumulators per thread, at most 32."""
    return 1 << int(math.log2(max(16 // heads, 1)))


def resident_ctas(heads: int, cap: int, warps: int) -> int:
    """CTAs the scan is compiled to keep on a multiprocessor when asked for CTAs of ``warps`` warps: as many as make
    up the widest CTA's warps (:func:`launch_shape` at :data:`WIDEST_WARPS`), so a thread keeps the registers that
    CTA leaves it (64 at G ≥ 3; G = 1 and 2's shapes have fewer warps and more): a smaller CTA is a finer grain of
    the same warps an SM, not fewer warps. Measured on an H100 at G = 4 (fathom@48, t = 2, the whole token): CTAs of
    8 warps, four an SM, against one of 32: 16 sessions of 8k–128k 33.89 / 33.91 ms against 35.36 / 35.50 (the scan
    13.6 ms against 15.0), 1M × 1 25.41 against 26.15, 128k × 1 7.16 against 7.17; two of 16 warps: the scan 13.9 ms
    at 16 sessions."""
    return max(1, launch_shape(heads, cap, WIDEST_WARPS)[0] // launch_shape(heads, cap, warps)[0])


def staged_words(heads: int, resident: int) -> int:
    """Run words a CTA stages per chunk when ``resident`` CTAs share a multiprocessor: the widest CTA's
    :data:`CHUNK_WORDS`, halved at G > 4 (within 48 KiB of shared memory beside G's arrays), shared among them, so
    a thread of a finer grain holds as many words as one of the widest CTA (more spill the held words to local
    memory, whose stores wait for their loads: ptxas, sm_90)."""
    return (CHUNK_WORDS if heads <= 4 else CHUNK_WORDS // 2) // resident


def launch_shape(heads: int, cap: int, warps: int) -> tuple[int, int]:
    """(warps, blocks per warp) of the scan's CTA for ``heads`` query heads, ``cap``-block segments and at most
    ``warps`` warps: a CTA scores at most a segment and at most :data:`MAX_CTA_BLOCKS` blocks."""
    per_warp = min(blocks_per_warp(heads), cap)
    return min(warps, cap // per_warp, MAX_CTA_BLOCKS // per_warp), per_warp


@cuda.jit(device=True, inline=True)
def _load_chunk(held, near, far, start, chan, chunk_first, x, near_segment, far_segment, local0, valid, cap,
                scale_words, near_record_words, far_record_words, hbm_planes, part_scale_words, t, held_words, threads,
                per_cta):
    """Issue this thread's loads of chunk ``x`` into ``held`` (no use of the values: they stay in flight), each
    word from the tier holding it. ``near_segment`` / ``far_segment``: the record of channel 0 of this CTA's segment
    in each array (``record_offset``; a channel's record is ``channel`` records on). ``held_words``, ``threads``,
    ``per_cta``: the kernel's constants (inlined). Offsets within a chunk are 32-bit, addresses 64-bit.

    A thread's words lie ``threads`` apart, in ascending order: the slot holding each is found by walking on from
    the previous one's (``start`` ascending; a few steps each, where a binary search took ~log2(actives))."""
    lo = np.uint32(chunk_first[x])
    hi = np.uint32(chunk_first[x + 1])
    base = np.uint32(start[lo])
    extent = np.uint32(start[hi]) - base
    i = lo
    for r in range(held_words):
        f = np.uint32(t + r * threads)
        held[r] = np.uint64(0)
        if f < extent:
            word = np.uint32(base + f)
            while np.uint32(start[i + np.uint32(1)]) <= word:  # start[hi] = base + extent > word: stops below hi
                i = np.uint32(i + 1)
            off = np.uint32(word - np.uint32(start[i]))
            near_record = near_segment + chan[i] * near_record_words
            far_record = far_segment + chan[i] * far_record_words
            if off < part_scale_words:
                if scales_in_near(hbm_planes):
                    held[r] = near[np.uint64(near_record + local0 // SCALES_PER_WORD + off)]
                else:
                    held[r] = far[np.uint64(far_record + local0 // SCALES_PER_WORD + off)]
            else:
                rest = np.uint32(off - part_scale_words)
                plane = np.uint32(rest // per_cta)
                b = np.uint32(rest - plane * per_cta)
                if b < valid:
                    if plane_in_near(plane, hbm_planes):
                        held[r] = near[np.uint64(plane_word(near_record, plane, local0 + b, scale_words, cap,
                                                            hbm_planes))]
                    else:
                        held[r] = far[np.uint64(plane_word(far_record, plane, local0 + b, scale_words, cap,
                                                           hbm_planes))]


def scan_levels(levels: np.ndarray) -> np.ndarray:
    """A reconstruction table ``float32 [..., d, 4, 16]`` (``fathom.quantize.dequantize``'s, in units of Δ) laid
    out as the scan reads it: entry ``[..., c, b - 1, C]`` is ``levels[..., c, b - 1, C >> (4 - b)] / 8``, the
    level of the code whose ``b``-bit prefix, placed where the 4-bit code holds it, is ``C`` (the plane loop's
    prefix), in units of the fp16 scale ``s = 8Δ`` (dividing by 8 is exact). Entries no prefix reaches are
    repeats. The result is C-contiguous whatever the input's strides (a broadcast or transposed table too): the
    kernel reads it as one flat array."""
    levels = np.asarray(levels, np.float32)
    if levels.ndim < 3 or levels.shape[-2:] != (PLANES, CELLS):
        raise ValueError(f"levels must have shape [..., d, {PLANES}, {CELLS}], got {levels.shape}")
    code = np.arange(CELLS)
    out = np.empty(levels.shape, np.float32)  # not empty_like: it keeps a view's strides
    for b in range(1, PLANES + 1):
        out[..., b - 1, :] = levels[..., b - 1, code >> (PLANES - b)] * np.float32(0.125)
    return out


def _scan_kernel(heads: int, warps: int, per_warp: int, levels: bool, resident: int):
    key = (heads, warps, per_warp, levels, resident)
    if key in _KERNELS:
        return _KERNELS[key]
    threads = 32 * warps
    per_cta = warps * per_warp  # blocks per CTA
    max_run = per_cta // SCALES_PER_WORD + 2 + PLANES * per_cta  # words of the longest run (scale words + planes)
    chunk_words = staged_words(heads, resident)
    buffer_words = chunk_words + max_run
    held_words = -(-buffer_words // threads)  # registers per thread holding the next chunk
    if max_run >= chunk_words:  # a chunk's first slot is found from its start alone (below)
        raise ValueError(f"a run of {max_run} words must be shorter than a chunk's {chunk_words}")
    slots = MAX_D + 1  # shared sizes must be constants, not expressions, for Numba on the GPU
    chunk_slots = MAX_D + 2
    pairs = 2 * per_warp
    group = 2 if per_warp % 2 == 0 else 1  # blocks whose planes one pass of the plane loop reads
    group_tokens = 2 * group  # a thread's tokens in them
    aligned = per_warp % SCALES_PER_WORD == 0  # a warp's scales start on a slot word
    # The midpoint kernel gathers a prefix as the float 2 + C / 8 (its bits: 2's, and C 19 bits up, where the
    # mantissa's unit is 2^-22), so a token's k̂ is one exact FMA, with no integer conversion; the table kernel
    # gathers C itself, an index into the channel's row.
    prefix_base = 0 if levels else MIDPOINT_BASE_BITS
    first_bit = 8 if levels else 1 << 22  # where plane 0's bit lands
    first_shift = 29 if levels else 10  # the right shift taking a token's plane-0 bit there, less its lane

    # Its closure holds only integers: cached on disk. Numba's cache keys on the closure's values, not on the launch
    # bounds: ``resident`` is in the closure through ``chunk_words`` (a different word count for every CTA count).
    @cuda.jit(cache=True, **launch_bounds(threads, resident))
    def kernel(q, depths, lengths, heads_per_session, near, far, n_seg, cap, scale_words, near_record_words,
               far_record_words, hbm_planes, sink, local, keys, top_hist, cells):
        g = cuda.blockIdx.x
        parts = cap // per_cta
        seg = cuda.blockIdx.y // parts
        local0 = (cuda.blockIdx.y - seg * parts) * per_cta  # first block of this CTA within its segment
        n = lengths[g // heads_per_session]
        n_blocks = n // BLOCK
        first_block = seg * cap + local0
        if first_block >= n_blocks:
            return
        valid = min(per_cta, n_blocks - first_block)
        t = cuda.threadIdx.x
        lane = np.uint32(t % 32)
        warp = t // 32
        d = q.shape[2]
        # this KV head's table (levels; the midpoint kernel neither reads nor computes it)
        kv_cells = np.uint32(g % heads_per_session) * np.uint32(d * PLANES * CELLS) if levels else np.uint32(0)

        chan = cuda.shared.array(MAX_D, np.int32)  # active channels, in channel order
        depth = cuda.shared.array(MAX_D, np.int32)
        start = cuda.shared.array(slots, np.int32)  # slot start of active i (run words, all chunks)
        chunk_first = cuda.shared.array(chunk_slots, np.int32)  # first active of each chunk (+ sentinel)
        q_read = cuda.shared.array((MAX_D, heads), np.float32)
        counts = cuda.shared.array(threads, np.int32)
        hist = cuda.shared.array((heads, RADIX), np.int32)
        buffer = cuda.shared.array(buffer_words, np.uint64)
        for x in range(t, heads * RADIX, threads):
            hist[x // RADIX, x % RADIX] = 0
        part_scale_words = (local0 + per_cta - 1) // SCALES_PER_WORD - local0 // SCALES_PER_WORD + 1

        # the active channels and their run slots: one block scan over the channels, threads-wide at a time, of
        # their counts packed in one word (an active channel 1 << RUN_BITS, its run's words below)
        actives = 0
        words = 0
        for c0 in range(0, d, threads):
            c = c0 + t
            width = min(threads, d - c0)  # the scans span this round's channels only (d = 128: 7 steps, not 10)
            read = np.int32(depths[g, c]) if c < d else np.int32(0)
            counts[t] = (1 << RUN_BITS) + part_scale_words + read * per_cta if read > 0 else 0
            before, total = exclusive_scan(counts, t, width)
            if read > 0:
                i = actives + (before >> RUN_BITS)
                chan[i] = c
                depth[i] = read
                for h in range(heads):
                    q_read[i, h] = q[g, h, c]
                start[i] = words + (before & RUN_MASK)
            actives += total >> RUN_BITS
            words += total & RUN_MASK
        cuda.syncthreads()  # every thread's start[] of the last round is written before any is read
        # A chunk starts where a slot starts past the next chunk_words boundary. A run is shorter than a chunk
        # (max_run < chunk_words), so consecutive slots' starts lie in the same or the next chunk_words: the chunk of
        # slot i is start[i] // chunk_words, and each chunk's first slot is found by its thread, not by a walk.
        for i in range(t, actives, threads):
            chunk = np.uint32(start[i]) // chunk_words
            if i == 0 or np.uint32(start[i - 1]) // chunk_words != chunk:
                chunk_first[chunk] = i
        n_chunks = np.uint32(start[actives - 1]) // chunk_words + 1 if actives > 0 else 0
        if t == 0:
            start[actives] = words
            chunk_first[n_chunks] = actives
        cuda.syncthreads()

        acc = cuda.local.array((pairs, heads), np.float32)
        for x in range(2 * per_warp):
            for h in range(heads):
                acc[x, h] = np.float32(0)
        held = cuda.local.array(held_words, np.uint64)
        # this warp's first block, the slot word holding its fp16 scale and that scale's index in it, and its plane-0
        # word in a slot. The CTA's first block is a multiple of per_cta, so with per_warp a multiple of 4 the warp's
        # scales start on a word: block jb's scale is then at constant word jb // 4 and index jb % 4 past it.
        first_b = np.uint32(warp * per_warp)
        first_scale = first_b + np.uint32(0 if aligned else local0 % SCALES_PER_WORD)
        scale_word = np.uint32(first_scale // SCALES_PER_WORD)
        scale_index = np.uint32(0 if aligned else first_scale % SCALES_PER_WORD)
        first_plane = first_b + np.uint32(part_scale_words)
        q_i = cuda.local.array(heads, np.float32)  # channel i's queries, in registers
        prefix = cuda.local.array(group_tokens, np.uint32)  # code prefixes of a group of blocks' tokens, in registers
        near_segment = record_offset(g, seg, 0, n_seg, d, near_record_words)
        far_segment = record_offset(g, seg, 0, n_seg, d, far_record_words)
        if n_chunks > 0:
            _load_chunk(held, near, far, start, chan, chunk_first, 0, near_segment, far_segment, local0, valid, cap,
                        scale_words, near_record_words, far_record_words, hbm_planes, part_scale_words, t, held_words,
                        threads, per_cta)
        for x in range(n_chunks):
            cuda.syncthreads()  # the previous chunk is scored: its buffer may be overwritten
            for r in range(held_words):
                f = t + r * threads
                if f < buffer_words:
                    buffer[f] = held[r]
            cuda.syncthreads()
            if x + 1 < n_chunks:  # the next chunk's loads fly while this one is scored
                _load_chunk(held, near, far, start, chan, chunk_first, x + 1, near_segment, far_segment, local0,
                            valid, cap, scale_words, near_record_words, far_record_words, hbm_planes,
                            part_scale_words, t, held_words, threads, per_cta)
            lo = chunk_first[x]
            hi = chunk_first[x + 1] if first_b < valid else lo
            # channel by channel, each of this warp's blocks: what depends on the channel alone (its slot, depth,
            # queries) is read once for the warp's blocks; each token's sum still runs over the channels in order.
            # A warp whose blocks all lie past ``valid`` (a session's last, part-filled segment) scores nothing (a
            # branch uniform in the warp, with no barrier inside), so such a CTA costs its sealed blocks, not a whole
            # segment's; a warp's blocks past ``valid`` beside sealed ones are scored from the zero words the chunk
            # holds there, and never written: no per-block branch in the loop.
            for i in range(lo, hi):
                slot = np.uint32(start[i] - start[lo])
                t_read = np.uint32(depth[i])
                # k̂ = ((P + 0.5) · 2^(4-b) − 8) · Δ with Δ = s / 8, s the fp16 scale widened, is
                # (C / 8 + 2^(-b) − 1) · s with C = P · 2^(4-b), the prefix as the plane loop gathers it: the bracket
                # is exact in float32 (small integers and halves, divided by 8) and s / 8 is exact, so the product
                # rounds as the reference's does. The midpoint kernel's prefix is the float x = 2 + C / 8, so k̂ is
                # x · s + (2^(-b) − 3) · s: the second product is exact (6 significant bits times the scale's 11) and
                # an FMA rounds the sum once, to the reference's k̂ (a block's product computed once for its tokens).
                offset = f32_from_bits((np.uint32(127) - t_read) << np.uint32(23)) - np.float32(
                    1 if levels else 1 + MIDPOINT_BASE)
                cell_row = np.uint32(kv_cells + (np.uint32(chan[i]) * np.uint32(PLANES) + t_read - np.uint32(1))
                                     * np.uint32(CELLS)) if levels else np.uint32(0)
                for h in range(heads):
                    q_i[h] = q_read[i, h]
                for first in range(0, per_warp, group):
                    # the b-bit code prefixes of ``group`` blocks' tokens, plane by plane: the depth is the channel's,
                    # the same in every lane, so past plane 0 the loop runs exactly b − 1 times and no unread plane
                    # issues an instruction (two blocks at a time: four at a time spilled the held chunk words at G = 4)
                    plane_at = np.uint32(slot + first_plane + first)
                    plane_end = np.uint32(plane_at + t_read * per_cta)
                    # plane p's bit of token ``lane`` (bit ``lane`` of the word's low half) and of token ``lane + 32``
                    # (of its high half) lands at bit 3 - p, where the 4-bit code holds it (one higher in the
                    # midpoint kernel): one shift and one masked OR a token and plane, and the prefix reads
                    # C = P · 2^(4-b) (the midpoint kernel's: 2 + C / 8 as a float)
                    to_bit = np.uint64(first_shift) + np.uint64(lane)  # plane p's right shift: first_shift + lane + p
                    bit = np.uint32(first_bit)
                    for x in range(group):  # plane 0, read by every active channel: the prefix starts from it
                        plane = buffer[np.uint32(plane_at + np.uint32(x))]
                        prefix[2 * x] = np.uint32(prefix_base) | (np.uint32((plane << np.uint64(32)) >> to_bit) & bit)
                        prefix[2 * x + 1] = np.uint32(prefix_base) | (np.uint32(plane >> to_bit) & bit)
                    plane_at = np.uint32(plane_at + per_cta)
                    to_bit += np.uint64(1)
                    bit = np.uint32(bit >> np.uint32(1))
                    while plane_at < plane_end:
                        for x in range(group):
                            plane = buffer[np.uint32(plane_at + np.uint32(x))]
                            prefix[2 * x] |= np.uint32((plane << np.uint64(32)) >> to_bit) & bit
                            prefix[2 * x + 1] |= np.uint32(plane >> to_bit) & bit
                        plane_at = np.uint32(plane_at + per_cta)
                        to_bit += np.uint64(1)
                        bit = np.uint32(bit >> np.uint32(1))
                    for x in range(group):
                        jb = first + x
                        s_idx = np.uint32(scale_index + jb)  # aligned: a constant, as are the word and shift
                        word = buffer[np.uint64(slot + scale_word + s_idx // SCALES_PER_WORD)]
                        shift = np.uint32(16 * (s_idx % SCALES_PER_WORD))
                        scale = f16_bits_to_f32(np.uint32(word >> shift) & np.uint32(0xFFFF))
                        if levels:  # the prefix indexes the channel's row of the table at its depth
                            k_lo = cells[np.uint32(cell_row + prefix[2 * x])] * scale
                            k_hi = cells[np.uint32(cell_row + prefix[2 * x + 1])] * scale
                        else:  # (2 + C / 8) · s + (2^(-b) − 3) · s: one FMA a token
                            bracket = offset * scale
                            k_lo = cuda.fma(f32_from_bits(prefix[2 * x]), scale, bracket)
                            k_hi = cuda.fma(f32_from_bits(prefix[2 * x + 1]), scale, bracket)
                        for h in range(heads):
                            acc[2 * jb, h] += q_i[h] * k_lo
                            acc[2 * jb + 1, h] += q_i[h] * k_hi

        # scores (their split order keys), and the top-byte histogram of the candidates (not sink / local; tail tokens
        # are never scored)
        lo_cand = sink
        hi_cand = min(n_blocks * BLOCK, n - local)
        for h in range(heads):  # a thread's tokens in one bin add once: crowded bins do not serialise
            last = np.uint32(RADIX)
            run = 0
            for jb in range(per_warp):
                b = warp * per_warp + jb
                if b < valid:
                    # the lane's two tokens are one word of each half (fathom.cuda.score_keys): two stores
                    key0, key1 = store_pair(keys, g, h, np.uint32((first_block + b) * (BLOCK // 2) + lane),
                                            acc[2 * jb, h], acc[2 * jb + 1, h])
                    for half in range(2):
                        j = (first_block + b) * BLOCK + lane + 32 * half
                        if lo_cand <= j < hi_cand:
                            digit = (key1 if half else key0) >> np.uint32(24)
                            if digit == last:
                                run += 1
                            else:
                                if run:
                                    cuda.atomic.add(hist, (h, last), run)
                                last = digit
                                run = 1
            if run:
                cuda.atomic.add(hist, (h, last), run)
        flush_histogram(hist, top_hist, g, heads, t, threads)

    _KERNELS[key] = kernel
    return kernel


def scan_planes(q, depths, lengths, heads_per_session: int, near, far, layout, sink: int, local: int, keys,
                top_hist, warps: int = 32, stream=0, levels=None) -> None:
    """Scores of every sealed token and the top-byte histogram of the candidates, straight from the store.

    Args:
        q: float32 ``[streams, G, d]`` queries in the store's basis; depths: int8 ``[streams, d]`` in 0..4.
        lengths: int32 ``[S]`` session lengths (on the GPU); stream ``g`` is session ``g // heads_per_session``.
        near: uint64 ``[layout.near_words]`` the store's near tier (HBM: scales and planes ``0 .. t-1``); far:
            uint64 ``[layout.far_words]`` its far tier (host-mapped: planes ``t .. 3``, and the scales at t = 0);
            layout: :class:`fathom.layout.StoreLayout` (``t = layout.hbm_planes``).
        sink, local: design §6 (candidates are sealed tokens ``sink .. min(n_sealed, n − local)``).
        keys: uint32 ``[streams, G, 2, C]``, ``2C ≥ n``: the scores' split order keys (``fathom.cuda.score_keys``),
            those of tokens ``0 .. n_sealed`` written; top_hist: int32
            ``[streams, G, 256]``, counts added (``fathom.cuda.topk.select`` consumes and clears them).
        warps: warps per CTA (at most 32); a CTA scores ``warps · blocks_per_warp(G)`` blocks, at most a segment
            and at most :data:`MAX_CTA_BLOCKS` (:func:`launch_shape`).
        levels: float32 ``[heads_per_session, d, 4, 16]`` on the GPU, each KV head's reconstruction table as
            :func:`scan_levels` lays it out (finite: not checked here, on the GPU), or None (the cells' midpoints).

    Example (the reference's scores, ``fathom.scoring.approx_scores(q[g], planes, scales, depths[g], table)``, are
    ``keys_to_scores(keys.copy_to_host())[g]``):
        scan_planes(q, depths, lengths, H, near, far, layout, 0, 0, keys, top_hist,
                    levels=cuda.to_device(scan_levels(tables)))  # tables: float32 [H, d, 4, 16]
    """
    streams, heads, d = q.shape
    if not 1 <= heads <= MAX_HEADS or d > MAX_D or not 1 <= warps <= WIDEST_WARPS:
        raise ValueError(f"1..{MAX_HEADS} query heads per KV head, at most {MAX_D} channels and 1..{WIDEST_WARPS} "
                         f"warps, got {heads}, {d}, {warps}")
    if layout.d != d:  # the records' addresses count d channels per segment
        raise ValueError(f"layout.d must equal q's {d} channels, got {layout.d}")
    if depths.shape != (streams, d) or depths.dtype != np.int8:
        raise ValueError(f"depths must be int8 [{streams}, {d}], got {depths.dtype} {depths.shape}")
    _checks.stream_sessions(streams, heads_per_session, lengths)
    check_keys(keys, streams, heads)
    if levels is not None:
        if levels.shape != (heads_per_session, d, PLANES, CELLS) or levels.dtype != np.float32:
            raise ValueError(f"levels must be float32 [{heads_per_session}, {d}, {PLANES}, {CELLS}], got "
                             f"{levels.dtype} {levels.shape}")
        if not levels.is_c_contiguous():  # read flat: a view's strides would be misread
            raise ValueError("levels must be C-contiguous (scan_levels lays a table out so)")
    resident = resident_ctas(heads, layout.cap, warps)
    warps, per_warp = launch_shape(heads, layout.cap, warps)
    if layout.cap % (warps * per_warp):
        raise ValueError(f"segment capacity {layout.cap} must be a multiple of {warps * per_warp} blocks per CTA")
    parts = layout.segments * (layout.cap // (warps * per_warp))
    if parts > MAX_GRID_Y:
        raise ValueError(f"a stream's {parts} CTAs exceed the grid's {MAX_GRID_Y} (fewer tokens per session, or "
                         "more blocks per CTA)")
    if streams:
        grid = (streams, parts)  # streams fastest: CTAs start segment by segment, the sessions' last ones last
        # the midpoint kernel never reads the table: q stands in for it (no allocation, which a graph capture forbids)
        cells = q if levels is None else levels.reshape(levels.size)
        _scan_kernel(heads, warps, per_warp, levels is not None, resident)[grid, 32 * warps, stream](
            q, depths, lengths, heads_per_session, near, far, layout.segments, layout.cap, layout.scale_words,
            layout.near_record_words, layout.far_record_words, layout.hbm_planes, sink, local, keys, top_hist,
            cells)
