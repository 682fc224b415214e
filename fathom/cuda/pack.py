"""Quantize keys and pack them into channel-major bit planes on the GPU (SPEC §2, §3).

The twin of ``fathom.quantize.quantize`` followed by ``pack_planes``, bit-identical:
the block max is taken on the float32 bit patterns (for non-negative floats the
bit order is the value order), rounded to fp16 with integer operations, and the
code is ``floor(k / Δ) + 8`` with one IEEE float32 division (the kernel is
compiled without fast-math and has no multiply-add to contract).

One thread per (stream, 64-token block, channel); consecutive threads take
consecutive channels, so the 64 key reads of a warp are 128-byte rows.
Plane writes are scattered (channel-major output), which is acceptable here:
packing runs once per 64 tokens, off the decode step's critical path.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.cuda.half import f16_bits_to_f32, f32_abs_bits_to_f16_bits
from fathom.quantize import BLOCK, PLANES

THREADS = 128


@cuda.jit
def _pack_kernel(keys, key_bits, planes, scales, block0, scale_sq_sum):
    """keys float32 [S, nb*64, d] (key_bits: the same memory as uint32) ->
    planes uint64 [S, d, 4, cap] and scales uint16 [S, d, cap] at blocks block0..block0+nb."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    s = cuda.blockIdx.z
    if c >= keys.shape[2]:
        return
    row0 = b * BLOCK
    top = np.uint32(0)
    for j in range(BLOCK):
        top = max(top, key_bits[s, row0 + j, c] & np.uint32(0x7FFFFFFF))
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
            u = min(max(np.int64(math.floor(keys[s, row0 + j, c] / delta)) + 8, 0), 15)
        bit = np.uint64(j)
        w0 |= np.uint64((u >> 3) & 1) << bit
        w1 |= np.uint64((u >> 2) & 1) << bit
        w2 |= np.uint64((u >> 1) & 1) << bit
        w3 |= np.uint64(u & 1) << bit
    out = block0 + b
    planes[s, c, 0, out] = w0
    planes[s, c, 1, out] = w1
    planes[s, c, 2, out] = w2
    planes[s, c, 3, out] = w3
    scales[s, c, out] = h
    if scale_sq_sum.shape[0] > 0:  # the store's running σ² statistic (SPEC §5), order-free sum
        cuda.atomic.add(scale_sq_sum, (s, c), np.float64(scale) * np.float64(scale))


def pack(keys, planes, scales, block0: int = 0, scale_sq_sum=None, stream=0, threads: int = THREADS) -> None:
    """Quantize ``keys`` and write their planes and fp16 scale bits into a store, on the GPU.

    Args:
        keys: float32 device array ``[S, n, d]`` (S streams, n % 64 == 0), finite and
            within the fp16 range (not checked here: that needs a host sync).
        planes: uint64 ``[S, d, 4, cap]``; blocks ``block0 .. block0 + n/64`` are written.
        scales: uint16 ``[S, d, cap]``: fp16 bit patterns (``.view(np.float16)`` on the host).
        block0: first block (column) written.
        scale_sq_sum: optional float64 ``[S, d]`` to which each new block's ``s²`` is added.
        stream: the CUDA stream of the launch (0: the default stream).
    """
    n_streams, n, d = keys.shape
    if keys.dtype != np.float32 or n % BLOCK:
        raise ValueError(f"keys must be float32 [S, n, d] with n % {BLOCK} == 0, got {keys.dtype} {keys.shape}")
    cap = planes.shape[3]
    if planes.shape != (n_streams, d, PLANES, cap) or planes.dtype != np.uint64:
        raise ValueError(f"planes must be uint64 {(n_streams, d, PLANES, cap)}, got {planes.dtype} {planes.shape}")
    if scales.shape != (n_streams, d, cap) or scales.dtype != np.uint16:
        raise ValueError(f"scales must be uint16 {(n_streams, d, cap)}, got {scales.dtype} {scales.shape}")
    nb = n // BLOCK
    if not 0 <= block0 <= cap - nb:
        raise ValueError(f"block0 = {block0} leaves no room for {nb} blocks in a capacity of {cap}")
    if scale_sq_sum is None:
        scale_sq_sum = cuda.device_array((0, d), np.float64)
    if nb == 0:
        return
    grid = (math.ceil(d / threads), nb, n_streams)
    _pack_kernel[grid, min(threads, d), stream](keys, keys.view(np.uint32), planes, scales, block0, scale_sq_sum)
