"""The offloaded KV cache: K/V rows, landmarks and the bit-plane store of S sessions × L layers × H KV heads in
pinned, device-mapped host memory (design §3, §7, §8).

A **stream** ``g = session · H + head`` is one (session, KV head) pair: the unit every kernel works on.
Per layer::

    kv       uint64 [streams, T, 2, d / 4]   bf16 K and V of each token side by side (4 values per word)
    marks    uint64 [streams, T / 8, 1, d / 4]   fp16 mean key of each sealed 8-token block (landmark's scan)
    near     uint64 [streams · segments · d · near_record_words]   in HBM: the store's scales and first t planes,
    far      uint64 [streams · segments · d · far_record_words]    pinned: its planes t .. 3 — one record per
             (stream, segment, channel) in each (``fathom.layout``); a second pair for the rotated store when the
             cache has a basis
    lengths  int32 [S] on the GPU: tokens held per session — sessions grow independently (ragged)
    rows     the HBM row cache (``row_cache_rows`` > 0): a slab uint64 [streams, slots, 2, d / 4] of recently
             selected K/V rows and its bookkeeping (``fathom.row_cache``): only a step's misses cross the link

Segments hold ``cap`` blocks of 64 tokens; a sealed block is packed once by the GPU and never rewritten; the
not-yet-full tail block stays exact (float32, on the GPU) and is always selected. With a ``basis`` the cache also
holds the rotated store (planes of ``k @ R``, for fathom-rotated and loki); rows and landmarks stay raw.
The store is **tiered by plane** (design §8): every query reads a channel's plane 1 before its plane 2, so the
scales and the first ``t = hbm_planes`` planes of every channel stay in HBM and only the deeper planes are read
over PCIe. ``store="host"`` is ``t = 0`` (all pinned: the target regime), ``store="device"`` ``t = 4`` (all in HBM,
the regime where the method is not expected to be faster); :func:`hbm_planes_for` picks ``t`` for an HBM budget.
The pinned memory for ``max_tokens`` per session is reserved when the cache is made — on a worker thread, layer by
layer, so that a prefill computes while later layers are still being allocated: a layer's first use waits for its
own memory only — and released by :meth:`HostKVCache.close`; :meth:`HostKVCache.reset` empties a session
for reuse without reallocating. A cache larger than the host's available memory is refused when it is made.

Every append and every decode step runs on the caller's current torch stream, and reads each session's length
on the GPU: no host synchronisation, and the same launches serve every step (``fathom.host.graph`` captures
them). The host keeps a mirror of the lengths (it knows what it appended) to refuse what would overflow.
Bad keys or values (what ``fathom.quantize.quantize`` refuses: NaN, inf, beyond the fp16 range) are caught on the
GPU: the append changes nothing and raises a flag in pinned memory, which the next call reads (no sync) and
reports as a ``ValueError``; appends queued after the rejected one are dropped with it.

Example::

    shape = CacheShape(sessions=2, layers=36, kv_heads=8, head_dim=128, max_tokens=131072)
    with HostKVCache(shape) as cache:
        cache.append(layer, k, v)                 # k, v [S, H, m, d] on the GPU: every session gets m tokens
        cache.append(layer, k1, v1, sessions=[1])  # or some sessions only: they grow independently
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from numba import cuda

from fathom import _checks
from fathom.cuda.append import append_rows, finish_append
from fathom.cuda.interop import DEVICE, SIMULATED, as_array
from fathom.cuda.pack import seal_blocks
from fathom.cuda.scan import MAX_D as MAX_HEAD_DIM  # the plane scan's channels
from fathom.host.pinned import MappedBuffer
from fathom.layout import StoreLayout
from fathom.quantize import BLOCK, PLANES
from fathom.row_cache import EMPTY
from fathom.scoring import LANDMARK_TOKENS
from fathom.store import DEFAULT_SEGMENT_BLOCKS

STORES = ("host", "device")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what appends and steps take
BAD_KEY, BAD_VALUE, BAD_QUERY, DRY_RUN = 0, 1, 2, 3  # status flags of a layer (DRY_RUN is no error)
_FLAG_NAMES = {BAD_KEY: "a key that is NaN, inf or beyond the float16 range (|k| >= 65520, in the store's basis)",
               BAD_VALUE: "a value that is NaN or inf", BAD_QUERY: "a query that is NaN or inf"}


@dataclass(frozen=True)
class CacheShape:
    """Sizes of an offloaded cache; ``max_tokens`` per session is reserved up front. ``store``: where the bit
    planes live, ``"host"`` (pinned, mapped: the target regime) or ``"device"`` (HBM); ``hbm_planes``, when given,
    tiers the store instead: the scales and planes ``0 .. hbm_planes-1`` in HBM, the rest pinned (``store`` is then
    not read; ``"host"`` is 0 planes in HBM, ``"device"`` 4). ``row_cache_rows``: HBM slots of the row cache
    per (session, layer, KV head), 0 for none (``fathom.row_cache``; a few times a step's rows:
    ``G · k + sink + local``)."""

    sessions: int
    layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS
    store: str = "host"
    hbm_planes: int | None = None
    row_cache_rows: int = 0

    def __post_init__(self):
        for name in ("sessions", "layers", "kv_heads", "head_dim", "max_tokens", "segment_blocks"):
            value = getattr(self, name)
            if not _checks.is_integer(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim % 4 or self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be a multiple of 4 and at most {MAX_HEAD_DIM} (rows move as 8-byte "
                             f"words), got {self.head_dim}")
        if self.segment_blocks & (self.segment_blocks - 1):
            raise ValueError(f"segment_blocks must be a power of two, got {self.segment_blocks}")
        if self.store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {self.store!r}")
        if self.hbm_planes is not None and not (_checks.is_integer(self.hbm_planes) and 0 <= self.hbm_planes <= PLANES):
            raise ValueError(f"hbm_planes must be None or an integer in 0..{PLANES}, got {self.hbm_planes!r}")
        if not (_checks.is_integer(self.row_cache_rows) and 0 <= self.row_cache_rows < 1 << 30):
            raise ValueError(f"row_cache_rows must be an integer in 0..{(1 << 30) - 1}, got {self.row_cache_rows!r}")

    @property
    def streams(self) -> int:
        """Streams per layer: (session, KV head) pairs."""
        return self.sessions * self.kv_heads

    @property
    def segments(self) -> int:
        return math.ceil(self.max_tokens / BLOCK / self.segment_blocks)

    @property
    def layout(self) -> StoreLayout:
        """The store's layout; its ``hbm_planes`` is the tier this shape resolves to."""
        tier = self.hbm_planes if self.hbm_planes is not None else (0 if self.store == "host" else PLANES)
        return StoreLayout(self.streams, self.segments, self.head_dim, self.segment_blocks, int(tier))


def hbm_planes_for(budget_bytes: float, shape: CacheShape, stores: int = 1) -> int:
    """The most planes per channel (0..4) whose near arrays — scales and those planes of every record, over all
    ``shape.layers`` layers and ``stores`` stores per layer (2 with the rotated store) — fit in ``budget_bytes`` of
    HBM. (``shape.store`` and ``shape.hbm_planes`` are not read.) The tier is the same for every layer: a budget
    between two tiers leaves the rest unused."""
    if not budget_bytes >= 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
    if stores not in (1, 2):
        raise ValueError(f"stores must be 1 or 2 (with the rotated store), got {stores!r}")
    fits = [t for t in range(PLANES + 1)
            if 8 * shape.layers * stores * replace(shape.layout, hbm_planes=t).near_words <= budget_bytes]
    return max(fits)


@dataclass
class Store:
    """One basis' bit-plane store of a layer: its two tiers of records, σ² sums, open block."""

    near: torch.Tensor  # uint64 [layout.near_words] in HBM: scales and planes 0 .. t-1
    far: torch.Tensor  # uint64 [layout.far_words] pinned and mapped: planes t .. 3 (and the scales at t = 0)
    scale_sq_sum: torch.Tensor  # float64 [streams, d]
    tail: torch.Tensor  # float32 [streams, 64, d]
    arrays: dict = field(default_factory=dict)  # Numba views, made once: near, far, scales (fp16 bits), ...


@dataclass
class PinnedLayer:
    """A layer's pinned host buffers: K/V rows, landmarks and the far tier of each basis' store (none when every
    plane is in HBM)."""

    kv: MappedBuffer
    marks: MappedBuffer
    records: dict[str, MappedBuffer]

    @classmethod
    def allocate(cls, shape: CacheShape, store_names: tuple[str, ...]) -> PinnedLayer:
        """Pin the layer's buffers; when one fails, those pinned before it are released before the error goes on."""
        words = shape.head_dim // 4
        sizes = [(shape.streams, shape.max_tokens, 2, words), (shape.streams, shape.max_tokens // LANDMARK_TOKENS, 1,
                                                               words)]
        names = [name for name in store_names if shape.layout.far_words]
        sizes += [(shape.layout.far_words,)] * len(names)
        pinned: list[MappedBuffer] = []
        try:
            for size in sizes:
                pinned.append(MappedBuffer(size, np.uint64))
        except BaseException:
            for buffer in pinned:
                buffer.close()
            raise
        return cls(pinned[0], pinned[1], dict(zip(names, pinned[2:], strict=True)))

    @staticmethod
    def nbytes(shape: CacheShape, store_names: tuple[str, ...]) -> int:
        """Bytes :meth:`allocate` pins for ``shape``, computed without allocating."""
        row_words = shape.streams * shape.max_tokens * 2 * (shape.head_dim // 4)
        mark_words = shape.streams * (shape.max_tokens // LANDMARK_TOKENS) * (shape.head_dim // 4)
        return 8 * (row_words + mark_words + shape.layout.far_words * len(store_names))

    def close(self) -> None:
        for buffer in (self.kv, self.marks, *self.records.values()):
            buffer.close()


STATE = ("slab", "slot_of", "position", "stamp", "clock", "counters")  # what a row cache holds


def store_names(rotated: bool) -> tuple[str, ...]:
    """The stores each layer of a cache holds: the raw one, and the rotated one beside it when ``rotated``."""
    return ("raw", "rotated") if rotated else ("raw",)


class RowSlab:
    """One layer's HBM row cache: the slab and the bookkeeping of ``fathom.row_cache.RowCache`` as torch tensors
    (``slot_of`` -1, ``position`` -1, ``stamp``, ``clock``; ``counters`` int64 ``[streams, 3]``: the last step's
    hits, hits and lookups in all)."""

    def __init__(self, shape: CacheShape):
        streams, slots, words = shape.streams, shape.row_cache_rows, shape.head_dim // 4
        self.slab = torch.zeros((streams, slots, 2, words), dtype=torch.uint64, device=DEVICE)
        self.slot_of = torch.full((streams, shape.max_tokens), EMPTY, dtype=torch.int32, device=DEVICE)
        self.position = torch.full((streams, slots), EMPTY, dtype=torch.int32, device=DEVICE)
        self.stamp = torch.zeros((streams, slots), dtype=torch.int32, device=DEVICE)
        self.clock = torch.zeros(streams, dtype=torch.int32, device=DEVICE)
        self.counters = torch.zeros((streams, 3), dtype=torch.int64, device=DEVICE)
        self.arrays = {name: as_array(getattr(self, name))
                       for name in ("slot_of", "position", "stamp", "clock", "counters")}
        self.arrays["slab"] = as_array(self.slab).view(np.uint64)

    @staticmethod
    def nbytes(shape: CacheShape) -> int:
        """HBM bytes of one layer's row cache."""
        slots = shape.row_cache_rows
        return shape.streams * (slots * (4 * shape.head_dim + 8) + 4 * shape.max_tokens + 4 + 24) if slots else 0

    def empty(self, streams: slice | None = None) -> None:
        """Forget the rows of ``streams`` (all: None), counters included when all."""
        at = slice(None) if streams is None else streams
        self.slot_of[at] = EMPTY
        self.position[at] = EMPTY
        self.stamp[at] = 0
        self.clock[at] = 0
        if streams is None:
            self.counters.zero_()

    def state(self, names: tuple[str, ...] = STATE) -> dict[str, torch.Tensor]:
        """A copy of what the row cache holds, its ``names`` of :data:`STATE` (:meth:`restore` puts it back)."""
        return {name: getattr(self, name).clone() for name in names}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`state` copied (the same cache's)."""
        for name, saved in state.items():
            getattr(self, name).copy_(saved)

    def copy_from(self, old: RowSlab) -> None:
        """What ``old`` (a smaller cache's) holds: rows keep their slots."""
        for name in ("slab", "position", "stamp", "clock", "counters"):
            getattr(self, name).copy_(getattr(old, name))
        self.slot_of[:, :old.slot_of.shape[1]] = old.slot_of


class CacheLayer:
    """One layer of the cache: K/V rows, landmarks, the raw (and rotated) bit-plane store (``stores``), lengths and
    the row cache (``rows``, None without one). The error flags are the cache's (``HostKVCache.status``)."""

    def __init__(self, shape: CacheShape, basis: torch.Tensor | None, pinned: PinnedLayer):
        streams, d = shape.streams, shape.head_dim
        self.pinned = pinned
        self.kv, self.marks = pinned.kv, pinned.marks
        self.basis = basis  # float32 [streams, d, d] or None
        self.stores: dict[str, Store] = {}
        layout = shape.layout
        for name in ("raw",) if basis is None else ("raw", "rotated"):
            near = torch.zeros(layout.near_words, dtype=torch.uint64, device=DEVICE)
            far = pinned.records[name].tensor() if name in pinned.records else \
                torch.zeros(0, dtype=torch.uint64, device=DEVICE)  # every plane in HBM: an empty far tier
            store = Store(near, far, torch.zeros((streams, d), dtype=torch.float64, device=DEVICE),
                          torch.zeros((streams, BLOCK, d), dtype=torch.float32, device=DEVICE))
            with_scales = near if layout.hbm_planes else far
            store.arrays = {"near": as_array(near), "far": as_array(far),
                            "scales": as_array(with_scales.view(torch.int16)).view(np.uint16),
                            "scale_sq_sum": as_array(store.scale_sq_sum), "tail": as_array(store.tail)}
            self.stores[name] = store
        self.lengths = torch.zeros(shape.sessions, dtype=torch.int32, device=DEVICE)
        self.rows = RowSlab(shape) if shape.row_cache_rows else None
        marks16 = self.marks.tensor().view(torch.int16).reshape(streams, shape.max_tokens // LANDMARK_TOKENS, d)
        self.arrays = {"kv": as_array(self.kv.tensor()), "marks": as_array(self.marks.tensor()),
                       "marks16": as_array(marks16).view(np.uint16), "lengths": as_array(self.lengths)}


class HostKVCache:
    """K/V rows, landmarks and the bit-plane store of every (session, layer, KV head), in pinned host memory.

    Args:
        shape: :class:`CacheShape`.
        basis: optional orthonormal ``[L, H, d, d]`` per (layer, KV head): the cache then also holds the rotated
            store, planes of ``k @ R``.
    """

    def __init__(self, shape: CacheShape, basis: np.ndarray | None = None, rotated: bool = False):
        if not isinstance(shape, CacheShape):
            raise ValueError(f"shape must be a CacheShape, got {type(shape).__name__}")
        self.shape = s = shape
        if basis is not None:
            basis = np.asarray(basis)
            if basis.shape != (s.layers, s.kv_heads, s.head_dim, s.head_dim):
                raise ValueError(f"basis must have shape {(s.layers, s.kv_heads, s.head_dim, s.head_dim)}, "
                                 f"got {basis.shape}")
            for layer in range(s.layers):
                self._check_basis(layer, basis[layer])
        self.rotated = basis is not None or bool(rotated)
        self.store_names = store_names(self.rotated)
        _check_host_memory(s.layers * PinnedLayer.nbytes(s, self.store_names), s)
        self.closed = False
        self.status = MappedBuffer((s.layers, 4), np.int32)  # error flags, read by the host without a sync
        self._status = as_array(self.status.tensor())
        identity = torch.eye(s.head_dim, dtype=torch.float32, device=DEVICE).expand(s.streams, -1, -1)
        self._bases = [identity.clone() if self.rotated else None for _ in range(s.layers)]
        # Pinning runs at a few GB/s: layer by layer on a worker thread, so a prefill computes meanwhile
        allocator = ThreadPoolExecutor(1, thread_name_prefix="fathom-pinned")
        self._pinned: list[Future] = [allocator.submit(PinnedLayer.allocate, s, self.store_names)
                                      for _ in range(s.layers)]
        allocator.shutdown(wait=False)  # the queued allocations still run; nothing more is queued
        self._layers: list[CacheLayer | None] = [None] * s.layers  # made at the layer's first use
        if basis is not None:
            for layer in range(s.layers):
                self._set_basis(layer, basis[layer])
        self._lengths = np.zeros((s.layers, s.sessions), np.int64)  # host mirror of every layer's lengths
        self._all_sessions = torch.arange(s.sessions, dtype=torch.int32, device=DEVICE)
        # one index tensor per session, made once: appending to one session then copies nothing to the GPU
        self._one_session = [self._all_sessions[i:i + 1] for i in range(s.sessions)]

    @property
    def layers(self) -> Sequence[CacheLayer]:
        """Every layer's :class:`CacheLayer`; ``layers[l]`` waits for layer ``l``'s pinned memory only."""
        return _CacheLayers(self)

    def _cache_layer(self, layer: int) -> CacheLayer:
        """``layer``'s :class:`CacheLayer`, made at its first use once its pinned memory is there (waits for that layer
        only)."""
        cache_layer = self._layers[layer]
        if cache_layer is None:
            cache_layer = self._layers[layer] = CacheLayer(self.shape, self._bases[layer], self._pinned[layer].result())
        return cache_layer

    # -- what the host knows --------------------------------------------------------------------------------

    def lengths(self, layer: int) -> np.ndarray:
        """Tokens held per session of ``layer``, int64 ``[S]`` (the host's mirror: no sync)."""
        self.check(layer)
        return self._lengths[layer].copy()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory the cache holds (rows, landmarks, the stores' far tiers, flags)."""
        return self.status.nbytes + self.shape.layers * PinnedLayer.nbytes(self.shape, self.store_names)

    @property
    def hbm_bytes(self) -> int:
        """Bytes of HBM the stores' near tiers (scales and the first ``hbm_planes`` planes) and the row caches take;
        the tails, σ² sums and lengths beside them are not counted."""
        near = 8 * len(self.store_names) * self.shape.layout.near_words
        return self.shape.layers * (near + RowSlab.nbytes(self.shape))

    def row_cache_counts(self, layer: int | None = None) -> tuple[int, int]:
        """``(hits, lookups)`` of the row cache since the cache was made or cleared, of ``layer`` or all layers
        (one sync); (0, 0) without a row cache."""
        self.check(layer)
        if not self.shape.row_cache_rows:
            return 0, 0
        layers = range(self.shape.layers) if layer is None else [layer]
        counts = sum(self.layers[i].rows.counters[:, 1:].sum(dim=0) for i in layers).tolist()
        return int(counts[0]), int(counts[1])

    def row_cache_filled(self) -> float:
        """The fraction of the row caches' slots (every layer's) that hold a row: 1.0 once every slot has been
        filled (a full cache stays full: a miss then evicts); 0.0 without a row cache. One sync."""
        self.check()
        if not self.shape.row_cache_rows:
            return 0.0
        held = sum(int((layer.rows.position >= 0).sum()) for layer in self.layers)
        return held / (self.shape.layers * self.shape.streams * self.shape.row_cache_rows)

    def most_held(self) -> int:
        """Tokens of the fullest session of any layer (the host's mirror: no sync)."""
        self.check()
        return int(self._lengths.max())

    def layer(self, layer: int) -> CacheLayer:
        self.check(layer)
        return self._cache_layer(layer)

    def check(self, layer: int | None = None) -> None:
        """Refuse a closed cache or a bad layer index, and report an error a kernel flagged since the last call."""
        if self.closed:
            raise ValueError("this HostKVCache has been closed")
        if layer is not None and not (_checks.is_integer(layer) and 0 <= layer < self.shape.layers):
            raise ValueError(f"layer must be an integer in 0..{self.shape.layers - 1}, got {layer!r}")
        flags = self.status.host[:, :DRY_RUN]
        if flags.any():
            layer_hit, kind = (int(x) for x in np.argwhere(flags)[0])
            cuda.synchronize()
            for i, cache_layer in enumerate(self._layers):  # the GPU's lengths are the truth: appends were dropped
                if cache_layer is not None:
                    self._lengths[i] = cache_layer.lengths.cpu().numpy()
            flags[...] = 0
            what = "an append" if kind != BAD_QUERY else "a decode step"
            raise ValueError(f"{what} of layer {layer_hit} was refused on the GPU: it had {_FLAG_NAMES[kind]}"
                             + ("; the cache is as before that append (later appends to the layer were dropped)"
                                if kind != BAD_QUERY else "; that step's output is invalid"))

    def stream(self):
        """The caller's current torch stream, as Numba launches take it (0 under the simulator)."""
        return 0 if SIMULATED else cuda.external_stream(torch.cuda.current_stream().cuda_stream)

    def status_flags(self, layer: int):
        """The error flags of ``layer`` (int32 ``[4]``, pinned and mapped) that its kernels raise."""
        return self._status[layer]

    def advance(self, tokens: np.ndarray) -> None:
        """Record in the host's mirror that every session of layer ``l`` gained ``tokens[l]`` tokens through GPU
        work enqueued without it (:meth:`enqueue_append` in a replayed CUDA graph); nothing inside a dry run, whose
        appends changed nothing."""
        if not self._dry:
            self._lengths += np.asarray(tokens, np.int64).reshape(-1, 1)

    @property
    def _dry(self) -> bool:
        """Whether a :meth:`dry_run` is under way (its flag is set on every layer)."""
        return bool(self.status.host[0, DRY_RUN])

    # -- the rotated store's basis ---------------------------------------------------------------------------

    def set_basis(self, layer: int, basis: np.ndarray | torch.Tensor) -> None:
        """The rotated store's basis of ``layer``, ``[H, d, d]`` orthonormal per KV head (every session the
        same), copied into place: set it before the layer holds a token (its planes are of ``k @ R``)."""
        self.check(layer)
        if not self.rotated:
            raise ValueError("this cache holds only the raw store: make it with rotated=True to set a basis")
        if self._lengths[layer].any():
            raise ValueError(f"layer {layer} already holds tokens: its basis is fixed")
        self._check_basis(layer, basis)
        self._set_basis(layer, basis)

    def _check_basis(self, layer: int, basis) -> None:
        s = self.shape
        host = basis.detach().cpu().numpy() if isinstance(basis, torch.Tensor) else np.asarray(basis)
        if host.shape != (s.kv_heads, s.head_dim, s.head_dim):
            raise ValueError(f"basis of layer {layer} must have shape {(s.kv_heads, s.head_dim, s.head_dim)}, "
                             f"got {host.shape}")
        for head in range(s.kv_heads):
            _checks.orthonormal(f"basis[{layer}, {head}]", host[head], s.head_dim)

    def _set_basis(self, layer: int, basis) -> None:
        per_head = torch.as_tensor(basis, dtype=torch.float32).to(DEVICE)
        self._bases[layer].copy_(per_head.repeat(self.shape.sessions, 1, 1))

    # -- appends --------------------------------------------------------------------------------------------

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, sessions=None) -> None:
        """Append ``m`` tokens to each of ``sessions`` (default: all) of ``layer``: ``k, v [S', H, m, d]``
        (float32 / bf16 / fp16) on the GPU. Rows are stored as bf16; full 64-token blocks of K are quantized from
        float32 K (so bf16 keys are quantized exactly as the reference would) and packed, with their landmarks.
        Runs on the caller's stream; no sync."""
        self.check(layer)
        s = self.shape
        sessions = self._sessions(sessions)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.device.type != DEVICE.type:
                raise ValueError(f"{name} must be a torch tensor on {DEVICE.type}")
            if x.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be float32, bf16 or fp16, got {x.dtype}")
            if x.ndim != 4 or x.shape[:2] != (len(sessions), s.kv_heads) or x.shape[3] != s.head_dim:
                raise ValueError(f"{name} must have shape ({len(sessions)}, {s.kv_heads}, m, {s.head_dim}), "
                                 f"got {tuple(x.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        m = k.shape[2]
        held = self._lengths[layer, sessions]
        if held.max() + m > s.max_tokens:
            raise ValueError(f"appending {m} tokens to session {int(sessions[held.argmax()])} of layer {layer} "
                             f"exceeds max_tokens = {s.max_tokens} ({int(held.max())} held)")
        if m == 0:
            return
        if len(sessions) == s.sessions and (sessions == np.arange(s.sessions)).all():
            index = None
        elif len(sessions) == 1:
            index = self._one_session[int(sessions[0])]
        else:
            index = torch.as_tensor(sessions.astype(np.int32), device=DEVICE)
        streams = len(sessions) * s.kv_heads
        self.enqueue_append(layer, k.reshape(streams, m, s.head_dim), v.reshape(streams, m, s.head_dim), index,
                            self.stream())
        if not self._dry:  # a dry run's append changes nothing on the GPU: nor in the mirror
            self._lengths[layer, sessions] += m

    def enqueue_append(self, layer: int, k: torch.Tensor, v: torch.Tensor, sessions: torch.Tensor | None,
                       stream) -> None:
        """The GPU work of an append, with no check and no host-side state: ``k, v [S'·H, m, d]`` of sessions
        ``sessions`` (int32 on the GPU; None: every session in order, whose keys take the stored bases as they
        are, with no gather). Every launch reads the lengths on the GPU (what a CUDA graph captures)."""
        cache_layer, heads = self._cache_layer(layer), self.shape.kv_heads
        status = self._status[layer]
        k32 = k.float().contiguous()
        v32 = v.float().contiguous()
        basis = cache_layer.basis
        if basis is not None and sessions is not None:
            basis = basis[_stream_index(sessions, heads)]
        k_store = k32 if basis is None else torch.bmm(k32, basis)
        lengths = cache_layer.arrays["lengths"]
        index = as_array(self._all_sessions if sessions is None else sessions)
        k_arr, v_arr, ks_arr = as_array(k32), as_array(v32), as_array(k_store)
        append_rows(k_arr, ks_arr, v_arr, lengths, index, heads, status, cache_layer.arrays["kv"], stream)
        for name, store in cache_layer.stores.items():
            source = k_arr if name == "raw" else ks_arr
            seal_blocks(source, store.arrays["tail"], lengths, index, heads, status, store.arrays["near"],
                        store.arrays["far"], store.arrays["scales"], self.shape.layout, store.arrays["scale_sq_sum"],
                        cache_layer.arrays["marks16"], name == "raw", stream)
        raw, rotated = cache_layer.stores["raw"], cache_layer.stores.get("rotated", cache_layer.stores["raw"])
        finish_append(k_arr, ks_arr, raw.arrays["tail"], rotated.arrays["tail"], lengths, index, heads, status,
                      stream)

    @contextlib.contextmanager
    def dry_run(self):
        """Inside, every append launch reads a flag and changes nothing (its rows land past the lengths, unseen), nor
        does an append or a replay change the host's mirror of the lengths: for warming up launches — compiling
        kernels, preparing cuBLAS on a stream — before a CUDA graph capture. Nested, the inner one leaves the outer
        one dry (a graph's first replay captures it inside its own dry run).

        Syncs on entry and on exit (an exception's too): a kernel reads the flag when it runs, not when it is
        launched, so an append launched before the run that the GPU had not reached yet (a prefill's last layers,
        the previous layer's step of this token) would be dropped while the host's mirror counted it, and a dry
        launch still queued at the exit would append for real."""
        if not SIMULATED:
            torch.cuda.synchronize()
        self.check()
        outer = self._dry
        self.status.host[:, DRY_RUN] = 1
        try:
            yield
        finally:
            if not SIMULATED:
                torch.cuda.synchronize()
            if not outer:
                self.status.host[:, DRY_RUN] = 0

    def reset(self, session: int) -> None:
        """Empty ``session`` in every layer (its memory is kept and reused)."""
        self.check()
        if not (_checks.is_integer(session) and 0 <= session < self.shape.sessions):
            raise ValueError(f"session must be an integer in 0..{self.shape.sessions - 1}, got {session!r}")
        heads = slice(session * self.shape.kv_heads, (session + 1) * self.shape.kv_heads)
        for cache_layer in self.layers:
            cache_layer.lengths[session] = 0
            for store in cache_layer.stores.values():
                store.scale_sq_sum[heads] = 0
            if cache_layer.rows is not None:  # its positions will hold new tokens
                cache_layer.rows.empty(heads)
        self._lengths[:, session] = 0

    def clear(self) -> None:
        """Empty every session of every layer, flags included (the memory is kept: a pooled cache's reuse). A flag
        that work launched before it raised is reported first (a sync: else a kernel the GPU had not reached yet would
        raise it after the flags were zeroed, for the cache's next user)."""
        if not SIMULATED and not self.closed:
            torch.cuda.synchronize()
        self.check()
        for cache_layer in self.layers:
            cache_layer.lengths.zero_()
            for store in cache_layer.stores.values():
                store.scale_sq_sum.zero_()
            if cache_layer.rows is not None:
                cache_layer.rows.empty()
        self._lengths[...] = 0
        self.status.host[:, :DRY_RUN] = 0  # inside a dry run, the appends that follow stay dry

    def empty_row_cache(self) -> None:
        """Forget every row the row cache holds, and its counters (the rows refill from the next step)."""
        self.check()
        for cache_layer in self.layers:
            if cache_layer.rows is not None:
                cache_layer.rows.empty()

    def grown(self, max_tokens: int) -> HostKVCache:
        """A cache of the same sessions, layers and stores (and tier) holding ``max_tokens`` per session, with
        everything this one holds copied in (rows, landmarks, records of both tiers, tails, σ² sums, lengths, bases);
        this one is closed. The records keep their addresses per (stream, segment): a segment count grown at the
        end."""
        self.check()
        s = self.shape
        if not (_checks.is_integer(max_tokens) and max_tokens >= s.max_tokens):
            raise ValueError(f"max_tokens must be an integer >= the current {s.max_tokens}, got {max_tokens!r}")
        bigger = HostKVCache(replace(s, max_tokens=int(max_tokens)), rotated=self.rotated)
        try:  # a failed copy frees the bigger cache's pinned memory (never freed by garbage collection); this one
            # stays as it was
            if not SIMULATED:
                torch.cuda.synchronize()  # host-side copies below: every kernel writing the old memory is done
            T, segments, layout = s.max_tokens, s.segments, s.layout
            for old, new in zip(self.layers, bigger.layers):
                new.kv.host[:, :T] = old.kv.host
                new.marks.host[:, :old.marks.shape[1]] = old.marks.host
                new.lengths.copy_(old.lengths)
                if old.rows is not None:
                    new.rows.copy_from(old.rows)
                if old.basis is not None:
                    new.basis.copy_(old.basis)
                for name, store in old.stores.items():
                    target = new.stores[name]
                    for old_tier, new_tier, record_words in ((store.near, target.near, layout.near_record_words),
                                                             (store.far, target.far, layout.far_record_words)):
                        if record_words:  # an empty tier has nothing to copy (and no segments to view)
                            per_segment = s.head_dim * record_words
                            new_tier.view(s.streams, -1, per_segment)[:, :segments].copy_(
                                old_tier.view(s.streams, segments, per_segment))
                    target.scale_sq_sum.copy_(store.scale_sq_sum)
                    target.tail.copy_(store.tail)
            bigger.status.host[...] = self.status.host
            bigger._lengths[...] = self._lengths
        except BaseException:
            bigger.close()
            raise
        self.close()
        return bigger

    def _sessions(self, sessions) -> np.ndarray:
        n = self.shape.sessions
        if sessions is None:
            return np.arange(n)
        index = np.asarray(sessions)
        if index.ndim != 1 or index.dtype.kind not in "iu" or len(index) == 0 or len(np.unique(index)) != len(index) \
                or index.min() < 0 or index.max() >= n:
            raise ValueError(f"sessions must be distinct integers in 0..{n - 1}, got {sessions!r}")
        return index.astype(np.int64)

    def store_variance(self, layer: int, basis: str = "raw") -> torch.Tensor:
        """σ² from the store (design §5): mean squared fp16 block scale per stream, float64 ``[streams, d]``."""
        self.check(layer)
        if basis not in self.store_names:
            raise ValueError(f"basis must be one of {self.store_names} (the stores this cache holds), got {basis!r}")
        cache_layer = self._cache_layer(layer)
        blocks = torch.repeat_interleave(cache_layer.lengths.long() // BLOCK, self.shape.kv_heads).clamp(min=1)
        return cache_layer.stores[basis].scale_sq_sum / blocks[:, None]

    def close(self) -> None:
        """Release every pinned buffer (after the GPU is done with them); any later call raises."""
        if self.closed:
            return
        for pending in self._pinned:
            pending.cancel()  # an allocation not started yet never starts
        for pending in self._pinned:
            if not pending.cancelled() and pending.exception() is None:  # waits for the one under way
                pending.result().close()
        self.status.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _CacheLayers(Sequence):
    """The layers of an :class:`HostKVCache` as a sequence that makes each layer at its first use."""

    def __init__(self, cache: HostKVCache):
        self._cache = cache

    def __len__(self) -> int:
        return self._cache.shape.layers

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self)))]
        if not -len(self) <= layer < len(self):
            raise IndexError(f"layer {layer} out of range")
        return self._cache._cache_layer(layer % len(self))


def _check_host_memory(nbytes: int, shape: CacheShape) -> None:
    """Refuse, before anything is allocated, a cache that needs more pinned memory than the host has available."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return  # no Linux meminfo: the allocation itself reports it
    if nbytes > available:
        raise ValueError(f"the cache needs {nbytes / 1e9:.1f} GB of pinned host memory ({shape.sessions} sessions "
                         f"x {shape.layers} layers x max_tokens = {shape.max_tokens}) but the host has "
                         f"{available / 1e9:.1f} GB available: lower max_tokens or the sessions")


def _stream_index(sessions: torch.Tensor, heads: int) -> torch.Tensor:
    """Streams of ``sessions`` (KV head fastest), ``[S'·H]``."""
    return (sessions.long()[:, None] * heads + torch.arange(heads, device=sessions.device)).reshape(-1)
