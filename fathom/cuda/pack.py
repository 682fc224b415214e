"""Seal the 64-token blocks an append completes: quantize, pack into the store's records (each plane into its
tier, ``fathom.layout``), landmarks (design §2, §3, §7).

The twin of ``fathom.quantize.quantize`` + ``pack_planes`` (bit-identical: the block max is taken on the
float32 bit patterns — for non-negative floats the bit order is the value order —, rounded to fp16 with integer
operations, and the code is ``floor(k / Δ) + 8`` with one IEEE float32 division; no fast-math, no multiply-add to
contract) and of ``fathom.scoring.landmarks`` (the fp16 mean key of each 8-token block, summed in token order).

Every size that changes from step to step is read on the GPU: the block ``B`` that an append of ``m`` tokens to a
session completes comes from the session's length ``n0`` (``lengths[s]``, not yet advanced): blocks
``n0 // 64 .. (n0 + m) // 64 - 1``, whose tokens before ``n0`` are in the open block's ``tail`` and the rest in the
appended keys. So one launch, with a grid fixed by ``m``, serves every step (and a CUDA graph's replay).
One thread per (channel, block, appended stream); consecutive threads take consecutive channels.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.append import append_allowed
from fathom.cuda.half import f16_bits_to_f32, f32_abs_bits_to_f16_bits, f32_to_bits, f32_to_f16_bits
from fathom.cuda.layout import plane_in_near, plane_word, record_offset, scale_index, scales_in_near
from fathom.quantize import BLOCK
from fathom.scoring import LANDMARK_TOKENS

THREADS = 128


@cuda.jit(device=True, inline=True)
def _key(tail, new, g, gi, p, n0, c):
    """Token ``p``'s key in channel ``c``: from the open block's tail (``p < n0``) or the appended keys."""
    if p < n0:
        return tail[g, p % BLOCK, c]
    return new[gi, p - n0, c]


@cuda.jit(device=True, inline=True)
def _put_plane(near, far, near_record, far_record, plane, b, scale_words, cap, hbm_planes, word):
    """Write ``plane``'s word of block ``b`` into the tier holding the plane."""
    if plane_in_near(plane, hbm_planes):
        near[plane_word(near_record, plane, b, scale_words, cap, hbm_planes)] = word
    else:
        far[plane_word(far_record, plane, b, scale_words, cap, hbm_planes)] = word


@cuda.jit(cache=True)
def _seal_kernel(new, tail, lengths, sessions, heads, m, status, near, far, scales16, n_seg, cap, scale_words,
                 near_record_words, far_record_words, hbm_planes, scale_sq_sum, marks16, write_marks):
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    gi = cuda.blockIdx.z
    d = new.shape[2]
    if c >= d or not append_allowed(status):  # a rejected append changes nothing
        return
    s = sessions[gi // heads]
    g = s * heads + gi % heads
    n0 = lengths[s]
    block = n0 // BLOCK + cuda.blockIdx.y
    if block >= (n0 + m) // BLOCK:
        return
    first = block * BLOCK
    top = np.uint32(0)
    for j in range(BLOCK):
        top = max(top, f32_to_bits(_key(tail, new, g, gi, first + j, n0, c)) & np.uint32(0x7FFFFFFF))
    h = f32_abs_bits_to_f16_bits(top)
    scale = f16_bits_to_f32(h)
    delta = scale / np.float32(8)
    w0 = np.uint64(0)
    w1 = np.uint64(0)
    w2 = np.uint64(0)
    w3 = np.uint64(0)
    for j in range(BLOCK):
        u = 8
        if delta != np.float32(0):
            u = min(max(np.int64(math.floor(_key(tail, new, g, gi, first + j, n0, c) / delta)) + 8, 0), 15)
        bit = np.uint64(j)
        w0 |= np.uint64((u >> 3) & 1) << bit
        w1 |= np.uint64((u >> 2) & 1) << bit
        w2 |= np.uint64((u >> 1) & 1) << bit
        w3 |= np.uint64(u & 1) << bit
    seg = block // cap
    b = block - seg * cap
    near_record = record_offset(g, seg, c, n_seg, d, near_record_words)
    far_record = record_offset(g, seg, c, n_seg, d, far_record_words)
    _put_plane(near, far, near_record, far_record, 0, b, scale_words, cap, hbm_planes, w0)
    _put_plane(near, far, near_record, far_record, 1, b, scale_words, cap, hbm_planes, w1)
    _put_plane(near, far, near_record, far_record, 2, b, scale_words, cap, hbm_planes, w2)
    _put_plane(near, far, near_record, far_record, 3, b, scale_words, cap, hbm_planes, w3)
    scales16[scale_index(near_record if scales_in_near(hbm_planes) else far_record, b)] = h
    cuda.atomic.add(scale_sq_sum, (g, c), np.float64(scale) * np.float64(scale))  # the store's σ² (design §5)
    if write_marks:  # landmarks: the fp16 mean key of each 8-token block, summed in token order
        for mark in range(BLOCK // LANDMARK_TOKENS):
            p0 = first + mark * LANDMARK_TOKENS
            acc = _key(tail, new, g, gi, p0, n0, c)
            for j in range(1, LANDMARK_TOKENS):
                acc += _key(tail, new, g, gi, p0 + j, n0, c)
            marks16[g, block * (BLOCK // LANDMARK_TOKENS) + mark, c] = f32_to_f16_bits(acc / np.float32(LANDMARK_TOKENS))


def seal_blocks(new, tail, lengths, sessions, heads: int, status, near, far, scales, layout, scale_sq_sum, marks,
                write_marks: bool, stream=0, threads: int = THREADS):
    """Quantize and pack the blocks that appending ``new`` completes; nothing if ``status`` flags the append.

    Args:
        new: float32 ``[S'·H, m, d]``: the appended keys of sessions ``sessions`` (in the store's basis).
        tail: float32 ``[S·H, 64, d]``: each stream's open block (the same basis), rows ``0 .. lengths % 64``.
        lengths: int32 ``[S]`` session lengths before this append (on the GPU).
        sessions: int32 ``[S']`` the appended sessions; heads: KV heads per session (H).
        status: int32 error flags of the layer (``[0]``: bad key, ``[1]``: bad value, set by ``append_rows``).
        near: uint64 ``[layout.near_words]`` the store's near tier (HBM: scales and planes ``0 .. t-1``); far:
            uint64 ``[layout.far_words]`` its far tier (host-mapped: planes ``t .. 3``, and the scales at t = 0);
            scales: the tier holding the scales (near if ``t > 0``, else far) as uint16 (fp16 scale bits);
            layout: :class:`fathom.layout.StoreLayout` (``t = layout.hbm_planes``).
        scale_sq_sum: float64 ``[S·H, d]``: each sealed block's ``s²`` is added (the store's σ² statistic).
        marks: uint16 ``[S·H, T / 8, d]`` fp16 landmark bits, written when ``write_marks`` (the raw store's call).
    """
    streams, m, d = new.shape
    if streams and m:
        blocks = (m + BLOCK - 1) // BLOCK + 1  # at most this many blocks complete
        grid = (math.ceil(d / threads), blocks, streams)
        _seal_kernel[grid, min(threads, d), stream](
            new, tail, lengths, sessions, heads, m, status, near, far, scales, layout.segments, layout.cap,
            layout.scale_words, layout.near_record_words, layout.far_record_words, layout.hbm_planes, scale_sq_sum,
            marks, write_marks)
