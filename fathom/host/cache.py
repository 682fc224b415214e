"""The offloaded KV cache: bit-plane store and K/V rows of S sessions × L layers × H KV heads
in pinned, device-mapped host memory (SPEC §3, §8).

Per layer, streams ``s = session · H + head``::

    planes  uint64 [S·H, n_seg, d, 4, cap]     scales uint16 [S·H, n_seg, d, cap]   (fp16 bits)
    keys, values    bf16 [S·H, max_tokens, d]  (stored as 16-bit words)

Segments are the store's (``fathom.store``): ``cap`` blocks of 64 tokens each,
sealed blocks written once by the GPU packer and never rewritten; the
not-yet-full tail block stays exact (float32, on the GPU) and is always
selected. The pinned memory for ``max_tokens`` is reserved when the cache is
made and released by :meth:`OffloadedCache.close`; segments fill as tokens are
appended, and only the filled ones are read. Sessions advance in lockstep
(every ``append`` adds the same number of tokens to each session of a layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda

from fathom.cuda.interop import DEVICE, as_array
from fathom.cuda.pack import pack
from fathom.cuda.rows import store_rows
from fathom.host.pinned import MappedBuffer
from fathom.quantize import BLOCK, PLANES
from fathom.store import DEFAULT_SEGMENT_BLOCKS


@dataclass(frozen=True)
class CacheShape:
    """Sizes of an offloaded cache; ``max_tokens`` per session is reserved up front."""

    sessions: int
    layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS

    def __post_init__(self):
        for name in ("sessions", "layers", "kv_heads", "head_dim", "max_tokens", "segment_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 (rows move as 8-byte words), got {self.head_dim}")

    @property
    def streams(self) -> int:
        return self.sessions * self.kv_heads

    @property
    def segments(self) -> int:
        return math.ceil(self.max_tokens / BLOCK / self.segment_blocks)


class LayerStore:
    """One layer's pinned store and rows, its GPU tail block and running σ² statistic."""

    def __init__(self, shape: CacheShape):
        streams, d, cap = shape.streams, shape.head_dim, shape.segment_blocks
        self.planes = MappedBuffer((streams, shape.segments, d, PLANES, cap), np.uint64)
        self.scales = MappedBuffer((streams, shape.segments, d, cap), np.uint16)
        self.keys = MappedBuffer((streams, shape.max_tokens, d), np.uint16)
        self.values = MappedBuffer((streams, shape.max_tokens, d), np.uint16)
        self.tail = torch.zeros((streams, BLOCK, d), dtype=torch.float32, device=DEVICE)
        self.scale_sq_sum = torch.zeros((streams, d), dtype=torch.float64, device=DEVICE)
        self.n_tokens = 0
        self.planes_dev = self.planes.device()
        self.scales_dev = self.scales.device()
        self.keys_dev = self.keys.device()
        self.values_dev = self.values.device()

    @property
    def n_blocks(self) -> int:
        return self.n_tokens // BLOCK

    def close(self) -> None:
        for buffer in (self.planes, self.scales, self.keys, self.values):
            buffer.close()


class OffloadedCache:
    """K/V rows and the bit-plane store of every (session, layer, KV head), in pinned host memory."""

    def __init__(self, shape: CacheShape):
        self.shape = shape
        self.layers = [LayerStore(shape) for _ in range(shape.layers)]

    def n_tokens(self, layer: int) -> int:
        return self.layer(layer).n_tokens

    def layer(self, layer: int) -> LayerStore:
        if not 0 <= layer < self.shape.layers:
            raise ValueError(f"layer must lie in 0..{self.shape.layers - 1}, got {layer}")
        return self.layers[layer]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``m`` tokens to every session of ``layer``: ``k, v [S, H, m, d]`` (float32/bf16/fp16) on the GPU.

        K and V rows are stored as bf16; full 64-token blocks of K are quantized and packed on the GPU into the
        store (from float32 K, so bf16 keys are quantized exactly as the reference would quantize them).
        """
        store = self.layer(layer)
        s = self.shape
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.device.type != DEVICE.type:
                raise ValueError(f"{name} must be a torch tensor on {DEVICE.type}")
            if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{name} must be float32, bf16 or fp16, got {x.dtype}")
            if x.ndim != 4 or x.shape[:2] != (s.sessions, s.kv_heads) or x.shape[3] != s.head_dim:
                raise ValueError(f"{name} must have shape ({s.sessions}, {s.kv_heads}, m, {s.head_dim}), "
                                 f"got {tuple(x.shape)}")
        m = k.shape[2]
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        if store.n_tokens + m > s.max_tokens:
            raise ValueError(f"appending {m} tokens exceeds max_tokens = {s.max_tokens} "
                             f"({store.n_tokens} held)")
        n0 = store.n_tokens
        k = k.reshape(s.streams, m, s.head_dim)
        store_rows(_bf16_words(k), store.keys_dev, n0)
        store_rows(_bf16_words(v.reshape(s.streams, m, s.head_dim)), store.values_dev, n0)
        k = k.float()
        done = 0
        while done < m:
            n_tail = store.n_tokens % BLOCK
            if n_tail == 0 and m - done >= BLOCK:  # whole blocks skip the tail, up to the segment's end
                room = s.segment_blocks - store.n_blocks % s.segment_blocks
                take = min((m - done) // BLOCK, room) * BLOCK
                self._seal(store, k[:, done:done + take])
            else:
                take = min(BLOCK - n_tail, m - done)
                store.tail[:, n_tail:n_tail + take] = k[:, done:done + take]
                if n_tail + take == BLOCK:
                    self._seal(store, store.tail)
            store.n_tokens += take
            done += take

    def _seal(self, store: LayerStore, keys: torch.Tensor) -> None:
        """Pack ``keys float32 [S·H, 64·b, d]`` (one segment's worth at most) after the sealed blocks."""
        cap = self.shape.segment_blocks
        seg, block0 = divmod(store.n_blocks, cap)
        pack(as_array(keys.contiguous()), store.planes_dev[:, seg], store.scales_dev[:, seg], block0,
             as_array(store.scale_sq_sum))

    def store_variance(self, layer: int) -> torch.Tensor:
        """σ² from the store (SPEC §5): mean squared fp16 block scale, float64 ``[S·H, d]``."""
        store = self.layer(layer)
        return store.scale_sq_sum / max(store.n_blocks, 1)

    def close(self) -> None:
        """Release every pinned buffer (after the GPU is done with them)."""
        for store in self.layers:
            store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bf16_words(x: torch.Tensor):
    """``x`` rounded to bf16, as a contiguous 16-bit device array (the rows' storage format)."""
    return as_array(x.to(torch.bfloat16).contiguous().view(torch.int16))


def sealed_planes(cache: OffloadedCache, layer: int, stream: int) -> tuple[np.ndarray, np.ndarray]:
    """One stream's sealed planes ``uint64 [d, 4, n_blocks]`` and scales ``float16 [d, n_blocks]``, read on the host."""
    store = cache.layer(layer)
    cuda.synchronize()
    planes = np.concatenate(list(store.planes.host[stream]), axis=-1)[..., :store.n_blocks]
    scales = np.concatenate(list(store.scales.host[stream]), axis=-1)[..., :store.n_blocks]
    return planes, scales.view(np.float16)
