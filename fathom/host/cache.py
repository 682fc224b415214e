"""The offloaded KV cache: bit-plane store, landmarks and K/V rows of S sessions × L layers × H KV heads
in pinned, device-mapped host memory (SPEC §3, §7, §8).

Per layer, streams ``s = session · H + head``::

    planes  uint64 [S·H, n_seg, d, 4, cap]     scales uint16 [S·H, n_seg, d, cap]   (fp16 bits)
    marks   uint16 [S·H, max_tokens / 8, d]    (fp16 bits: the mean key of each sealed 8-token block)
    keys, values    bf16 [S·H, max_tokens, d]  (stored as 16-bit words)

Segments are the store's (``fathom.store``): ``cap`` blocks of 64 tokens each,
sealed blocks written once by the GPU packer and never rewritten; the
not-yet-full tail block stays exact (float32, raw basis, on the GPU) and is
always selected. With a ``basis`` (the rotated store of fathom-rotated and loki)
each sealed block is rotated, ``k @ R`` in float32, just before it is packed;
rows and landmarks stay in the raw basis. ``store="device"`` keeps planes and
scales in HBM instead (the regime where the method is not expected to be faster);
rows and landmarks stay in host memory. The pinned memory for ``max_tokens`` is
reserved when the cache is made and released by :meth:`OffloadedCache.close`.
Sessions advance in lockstep (every ``append`` adds the same number of tokens to
each session of a layer).

Appends run on a side CUDA stream: it first waits for the work already queued on
the step's streams (the default stream, where Numba launches, and torch's current
stream), so a step issued before the append, which reads the σ² statistic, is
not raced; it then records an event that :meth:`OffloadedCache.wait` (called by
``Decoder.check``) makes those streams wait for before the layer's next step.
No host sync. An append otherwise writes only past what an earlier step reads
(new rows, blocks and landmarks), and the tail block is touched by appends alone.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from numba import cuda

from fathom.cuda.interop import DEVICE, SIMULATED, as_array
from fathom.cuda.landmark import landmarks
from fathom.cuda.pack import pack
from fathom.cuda.rows import store_rows
from fathom.host.pinned import MappedBuffer
from fathom.quantize import BLOCK, PLANES
from fathom.scoring import LANDMARK_TOKENS
from fathom.store import DEFAULT_SEGMENT_BLOCKS

STORES = ("host", "device")


@dataclass(frozen=True)
class CacheShape:
    """Sizes of an offloaded cache; ``max_tokens`` per session is reserved up front. ``store``: where the bit
    planes live, ``"host"`` (pinned, mapped: the target regime) or ``"device"`` (HBM)."""

    sessions: int
    layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS
    store: str = "host"

    def __post_init__(self):
        for name in ("sessions", "layers", "kv_heads", "head_dim", "max_tokens", "segment_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 (rows move as 8-byte words), got {self.head_dim}")
        if self.store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {self.store!r}")

    @property
    def streams(self) -> int:
        return self.sessions * self.kv_heads

    @property
    def segments(self) -> int:
        return math.ceil(self.max_tokens / BLOCK / self.segment_blocks)


class LayerStore:
    """One layer's store, landmarks and rows, its GPU tail block, running σ² statistic and basis."""

    def __init__(self, shape: CacheShape, basis: torch.Tensor | None):
        streams, d, cap = shape.streams, shape.head_dim, shape.segment_blocks
        self.keys = MappedBuffer((streams, shape.max_tokens, d), np.uint16)
        self.values = MappedBuffer((streams, shape.max_tokens, d), np.uint16)
        self.marks = MappedBuffer((streams, shape.max_tokens // LANDMARK_TOKENS, d), np.uint16)
        planes_shape, scales_shape = (streams, shape.segments, d, PLANES, cap), (streams, shape.segments, d, cap)
        if shape.store == "host":
            self.planes, self.scales = MappedBuffer(planes_shape, np.uint64), MappedBuffer(scales_shape, np.uint16)
            self.planes_dev, self.scales_dev = self.planes.device(), self.scales.device()
        else:  # HBM: no pinned buffers (planes / scales None), torch owns the memory
            self.planes = self.scales = None
            self._hbm = (torch.zeros(planes_shape, dtype=torch.int64, device=DEVICE),
                         torch.zeros(scales_shape, dtype=torch.int16, device=DEVICE))
            self.planes_dev = as_array(self._hbm[0]).view(np.uint64)
            self.scales_dev = as_array(self._hbm[1]).view(np.uint16)
        self.basis = basis  # float32 [S·H, d, d] or None
        self.tail = torch.zeros((streams, BLOCK, d), dtype=torch.float32, device=DEVICE)
        self.means = torch.zeros((streams, cap * BLOCK // LANDMARK_TOKENS, d), dtype=torch.float32, device=DEVICE)
        self.scale_sq_sum = torch.zeros((streams, d), dtype=torch.float64, device=DEVICE)
        self.appended = None if SIMULATED else torch.cuda.Event()
        self.n_tokens = 0
        self.keys_dev = self.keys.device()
        self.values_dev = self.values.device()
        self.marks_dev = self.marks.device()

    @property
    def n_blocks(self) -> int:
        return self.n_tokens // BLOCK

    def close(self) -> None:
        for buffer in (self.keys, self.values, self.marks, self.planes, self.scales):
            if buffer is not None:
                buffer.close()


class OffloadedCache:
    """K/V rows, landmarks and the bit-plane store of every (session, layer, KV head), in pinned host memory.

    Args:
        shape: :class:`CacheShape`.
        basis: optional orthonormal ``[L, H, d, d]`` per (layer, KV head): the store holds planes of ``k @ R``.
    """

    def __init__(self, shape: CacheShape, basis: np.ndarray | None = None):
        self.shape = shape
        s = shape
        if basis is not None:
            basis = np.asarray(basis)
            if basis.shape != (s.layers, s.kv_heads, s.head_dim, s.head_dim) or basis.dtype.kind != "f" \
                    or not np.all(np.isfinite(basis)):
                raise ValueError(f"basis must be finite float {(s.layers, s.kv_heads, s.head_dim, s.head_dim)}, "
                                 f"got {basis.dtype} {basis.shape}")
            gram = np.einsum("lhji,lhjk->lhik", basis.astype(np.float64), basis.astype(np.float64))
            if not np.allclose(gram, np.eye(s.head_dim), atol=1e-4):
                raise ValueError("basis must be orthonormal per (layer, KV head): Rᵀ R = I")
            basis = np.repeat(basis.astype(np.float32)[:, None], s.sessions, 1).reshape(
                s.layers, s.streams, s.head_dim, s.head_dim)
        self.rotated = basis is not None
        self.layers = [LayerStore(shape, None if basis is None else torch.as_tensor(basis[i], device=DEVICE))
                       for i in range(shape.layers)]
        self._side = None if SIMULATED else torch.cuda.Stream()

    def n_tokens(self, layer: int) -> int:
        return self.layer(layer).n_tokens

    def layer(self, layer: int) -> LayerStore:
        if not 0 <= layer < self.shape.layers:
            raise ValueError(f"layer must lie in 0..{self.shape.layers - 1}, got {layer}")
        return self.layers[layer]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``m`` tokens to every session of ``layer``: ``k, v [S, H, m, d]`` (float32/bf16/fp16) on the GPU.

        K and V rows are stored as bf16; full 64-token blocks of K are quantized and packed on the GPU into the
        store (from float32 K, so bf16 keys are quantized exactly as the reference would quantize them), and
        their landmarks written. Queued on the side stream; :meth:`wait` orders a later step after it.
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
        with self._on_side(k, v) as stream:
            n0 = store.n_tokens
            k = k.reshape(s.streams, m, s.head_dim)
            store_rows(_bf16_words(k), store.keys_dev, n0, stream)
            store_rows(_bf16_words(v.reshape(s.streams, m, s.head_dim)), store.values_dev, n0, stream)
            k = k.float()
            done = 0
            while done < m:
                n_tail = store.n_tokens % BLOCK
                if n_tail == 0 and m - done >= BLOCK:  # whole blocks skip the tail, up to the segment's end
                    room = s.segment_blocks - store.n_blocks % s.segment_blocks
                    take = min((m - done) // BLOCK, room) * BLOCK
                    self._seal(store, k[:, done:done + take].contiguous(), stream)
                else:
                    take = min(BLOCK - n_tail, m - done)
                    store.tail[:, n_tail:n_tail + take] = k[:, done:done + take]
                    if n_tail + take == BLOCK:
                        self._seal(store, store.tail, stream)
                store.n_tokens += take
                done += take
            if store.appended is not None:
                store.appended.record()

    @contextlib.contextmanager
    def _on_side(self, *inputs: torch.Tensor):
        """torch work inside, and Numba launches given the yielded stream, run on the side stream after the
        caller's queued work; the inputs are kept alive for it. Under the simulator everything is synchronous."""
        if self._side is None:
            yield 0
            return
        for stream in _step_streams():
            self._side.wait_stream(stream)
        for x in inputs:
            x.record_stream(self._side)
        with torch.cuda.stream(self._side):
            yield cuda.external_stream(self._side.cuda_stream)

    def wait(self, layer: int) -> None:
        """Make the caller's stream wait for the layer's appends (a GPU-side wait: the host does not block)."""
        store = self.layer(layer)
        if store.appended is not None:
            for stream in _step_streams():
                stream.wait_event(store.appended)

    def _seal(self, store: LayerStore, keys: torch.Tensor, stream) -> None:
        """Pack ``keys float32 [S·H, 64·b, d]`` (raw basis, one segment's worth at most) after the sealed blocks,
        rotated first if the store has a basis, and write their landmarks."""
        cap = self.shape.segment_blocks
        seg, block0 = divmod(store.n_blocks, cap)
        landmarks(as_array(keys), store.marks_dev, as_array(store.means), store.n_blocks * BLOCK // LANDMARK_TOKENS,
                  stream)
        in_store = keys if store.basis is None else torch.bmm(keys, store.basis)
        pack(as_array(in_store), store.planes_dev[:, seg], store.scales_dev[:, seg], block0,
             as_array(store.scale_sq_sum), stream)

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


def _step_streams() -> list[torch.cuda.Stream]:
    """Where a step's work runs: the default stream (Numba's launches) and torch's current stream, if another."""
    default, current = torch.cuda.default_stream(), torch.cuda.current_stream()
    return [default] if current == default else [default, current]


def _bf16_words(x: torch.Tensor):
    """``x`` rounded to bf16, as a contiguous 16-bit device array (the rows' storage format)."""
    return as_array(x.to(torch.bfloat16).contiguous().view(torch.int16))


def sealed_planes(cache: OffloadedCache, layer: int, stream: int) -> tuple[np.ndarray, np.ndarray]:
    """One stream's sealed planes ``uint64 [d, 4, n_blocks]`` and scales ``float16 [d, n_blocks]``, read on the host."""
    store = cache.layer(layer)
    cuda.synchronize()
    planes = np.concatenate(list(store.planes_dev[stream].copy_to_host()), axis=-1)[..., :store.n_blocks]
    scales = np.concatenate(list(store.scales_dev[stream].copy_to_host()), axis=-1)[..., :store.n_blocks]
    return planes, scales.view(np.float16)


def sealed_landmarks(cache: OffloadedCache, layer: int, stream: int) -> np.ndarray:
    """One stream's landmarks of the sealed blocks, ``float16 [n_sealed / 8, d]``, read on the host."""
    store = cache.layer(layer)
    cuda.synchronize()
    return store.marks.host[stream, :store.n_blocks * BLOCK // LANDMARK_TOKENS].view(np.float16).copy()
