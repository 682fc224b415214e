"""The scan gather: a fixed-size run list built on the GPU from the depths, and one
kernel that copies the active runs from (mapped, pinned) host memory into a
compact HBM staging buffer (SPEC §8 steps 2).

Store layout (one layer, S streams = (session, KV head) pairs, fixed-capacity
segments, see ``fathom.store``)::

    planes uint64 [S, n_seg, d, 4, cap]     scales uint16 [S, n_seg, d, cap]  (fp16 bits)

Segment ``i`` holds blocks ``i·cap ..``; with ``n_blocks`` sealed blocks it is
filled to ``clip(n_blocks − i·cap, 0, cap)``. The run list has one slot per
(stream, channel, segment) — the twin of ``PlaneStore.runs`` with inactive slots
of length zero — so its size is known on the host and no host sync is needed.

Staging layout, compact per stream: the planes read of channel ``c`` are
``depth_c`` rows of ``n_blocks`` words starting at row ``plane_row[g, c]``
(exclusive prefix sum of depths), its scales one row at ``scale_row[g, c]``::

    staged_planes uint64 [S, max_planes, n_blocks]   staged_scales uint16 [S, max_channels, n_blocks]

(flat, row stride ``n_blocks``). ``max_planes`` / ``max_channels`` bound
``Σ_c depth_c`` / ``#{depth_c > 0}`` (for a budget B: ``floor(B)`` and ``floor(B / 1.25)``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from fathom.quantize import PLANES

RUN_FIELDS = 6  # src plane word, dst plane word, planes, blocks, src scale, dst scale
COPY_THREADS = 256
COPY_CHUNKS = 4  # blocks per run: more loads in flight per long run
UNROLL = 4


@cuda.jit
def _build_runs_kernel(depths, n_blocks, cap, n_seg, max_planes, max_channels,
                       runs, plane_row, scale_row, active, n_active):
    """One block per stream: thread 0 takes the prefix sums, all threads fill the slots."""
    g = cuda.blockIdx.x
    t = cuda.threadIdx.x
    d = depths.shape[1]
    if t == 0:
        planes_used = 0
        channels_used = 0
        for c in range(d):
            b = np.int32(depths[g, c])
            # a run that would overflow the staging capacity is dropped (cannot happen within a budget)
            if b > 0 and planes_used + b <= max_planes and channels_used < max_channels:
                plane_row[g, c] = planes_used
                scale_row[g, c] = channels_used
                active[g, channels_used] = c
                planes_used += b
                channels_used += 1
            else:
                plane_row[g, c] = -1
                scale_row[g, c] = -1
        n_active[g] = channels_used
    cuda.syncthreads()
    for slot in range(t, d * n_seg, cuda.blockDim.x):
        c = slot // n_seg
        seg = slot - c * n_seg
        r = (g * d + c) * n_seg + seg
        blocks = min(max(n_blocks - seg * cap, 0), cap)
        depth = np.int64(depths[g, c]) if plane_row[g, c] >= 0 else 0
        src_seg = (g * n_seg + seg) * d + c
        runs[r, 0] = src_seg * PLANES * cap
        runs[r, 1] = (g * max_planes + max(plane_row[g, c], 0)) * n_blocks + seg * cap
        runs[r, 2] = depth if blocks > 0 else 0
        runs[r, 3] = blocks
        runs[r, 4] = src_seg * cap
        runs[r, 5] = (g * max_channels + max(scale_row[g, c], 0)) * n_blocks + seg * cap


@cuda.jit
def _gather_runs_kernel(runs, src_planes, src_scales, cap, n_blocks, dst_planes, dst_scales):
    """Block (run, chunk): consecutive threads copy consecutive 8-byte words of a plane row."""
    r = cuda.blockIdx.x
    n_planes = runs[r, 2]
    if n_planes == 0:
        return
    blocks = runs[r, 3]
    src = runs[r, 0]
    dst = runs[r, 1]
    step = cuda.blockDim.x * cuda.gridDim.y
    first = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    words = n_planes * blocks
    # UNROLL loads issued before their stores: more reads in flight over PCIe per thread
    for i0 in range(first, words, step * UNROLL):
        held = cuda.local.array(UNROLL, np.uint64)
        for u in range(UNROLL):
            i = i0 + u * step
            if i < words:
                p = i // blocks
                held[u] = src_planes[src + p * cap + i - p * blocks]
        for u in range(UNROLL):
            i = i0 + u * step
            if i < words:
                p = i // blocks
                dst_planes[dst + p * n_blocks + i - p * blocks] = held[u]
    for b in range(first, blocks, step):
        dst_scales[runs[r, 5] + b] = src_scales[runs[r, 4] + b]


def build_runs(depths, n_blocks: int, cap: int, n_seg: int, max_planes: int, max_channels: int,
               runs, plane_row, scale_row, active, n_active, threads: int = 128) -> None:
    """Fill the run list and the staging layout from ``depths int8 [S, d]``, on the GPU.

    Outputs: ``runs int64 [S·d·n_seg, 6]``, ``plane_row, scale_row int32 [S, d]`` (−1 = not read),
    ``active int32 [S, d]`` (the read channels, first ``n_active[g]`` entries), ``n_active int32 [S]``.
    """
    n_streams, d = depths.shape
    if n_blocks > cap * n_seg:
        raise ValueError(f"n_blocks = {n_blocks} exceeds the store's {n_seg} segments of {cap} blocks")
    if runs.shape != (n_streams * d * n_seg, RUN_FIELDS):
        raise ValueError(f"runs must have shape {(n_streams * d * n_seg, RUN_FIELDS)}, got {runs.shape}")
    if n_streams:
        _build_runs_kernel[n_streams, min(threads, d * n_seg)](depths, n_blocks, cap, n_seg, max_planes,
                                                               max_channels, runs, plane_row, scale_row, active,
                                                               n_active)


def gather_runs(runs, src_planes, src_scales, cap: int, n_blocks: int, dst_planes, dst_scales,
                threads: int = COPY_THREADS, chunks: int = COPY_CHUNKS) -> None:
    """Copy every active run (1-D views of the store and staging buffers) in one launch."""
    longest = PLANES * min(n_blocks, cap)  # words of the longest run: no CUDA block is left without any
    threads = min(threads, max(longest, 1))
    chunks = min(chunks, math.ceil(longest / threads))
    if runs.shape[0] and chunks:
        _gather_runs_kernel[(runs.shape[0], chunks), threads](runs, src_planes, src_scales, cap, n_blocks,
                                                              dst_planes, dst_scales)


class Staging:
    """Run list and staging buffers of one layer, allocated once and reused every step.

    Args:
        streams, d, n_seg, cap: the store's shape (``cap`` blocks per segment).
        max_planes, max_channels: staging rows per stream (see :func:`budget_capacity`).
    """

    def __init__(self, streams: int, d: int, n_seg: int, cap: int, max_planes: int, max_channels: int,
                 build_threads: int = 128, copy_threads: int = COPY_THREADS, copy_chunks: int = COPY_CHUNKS):
        self.d, self.n_seg, self.cap = d, n_seg, cap
        self.max_planes, self.max_channels = max_planes, max_channels
        self.threads = (build_threads, copy_threads, copy_chunks)
        self.runs = cuda.device_array((streams * d * n_seg, RUN_FIELDS), np.int64)
        self.plane_row = cuda.device_array((streams, d), np.int32)
        self.scale_row = cuda.device_array((streams, d), np.int32)
        self.active = cuda.device_array((streams, d), np.int32)
        self.n_active = cuda.device_array(streams, np.int32)
        self.planes = cuda.device_array(max(streams * max_planes * n_seg * cap, 1), np.uint64)
        self.scales = cuda.device_array(max(streams * max_channels * n_seg * cap, 1), np.uint16)

    def stage(self, depths, src_planes, src_scales, n_blocks: int) -> None:
        """Build the run list of ``depths int8 [S, d]`` and copy its runs from the 1-D store views."""
        build_threads, copy_threads, copy_chunks = self.threads
        build_runs(depths, n_blocks, self.cap, self.n_seg, self.max_planes, self.max_channels, self.runs,
                   self.plane_row, self.scale_row, self.active, self.n_active, build_threads)
        gather_runs(self.runs, src_planes, src_scales, self.cap, n_blocks, self.planes, self.scales,
                    copy_threads, copy_chunks)


def staging_capacity(max_depths_sum: int, max_channels: int, d: int) -> tuple[int, int]:
    """Rows per stream of the staging buffers, ``(max_planes, max_channels)``, clipped to the store's."""
    return min(max_depths_sum, PLANES * d), min(max_channels, d)


def budget_capacity(budget: float, d: int) -> tuple[int, int]:
    """Staging rows for any depth vector of cost <= ``budget``: ``Σ b <= B`` and ``1.25 · #{b > 0} <= B``."""
    return staging_capacity(math.floor(budget), math.floor(budget / 1.25), d)
