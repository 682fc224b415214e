"""Where a decoding loop keeps its sessions' K/V: the NumPy reference or the offloaded GPU cache.

Both hold S ragged sessions × L layers × H KV heads (every session at its own length), take torch tensors and give
the attention output back as float32 torch:

* :class:`ReferenceSessions` (CPU): per (layer, session, KV head) a growing
  :class:`~fathom.decode.HeadIndex` — raw bit-plane store, the rotated one when
  the method scans it, exact float32 keys — and exact float32 values; a step
  is :func:`~fathom.decode.decode_step` of each (session, KV head) stream, so it
  equals the reference decode by construction. Appends only seal new blocks: nothing
  sealed is re-quantized, and only new blocks are dequantized for the scorer.
* :class:`OffloadedSessions` (GPU): :class:`fathom.host.cache.HostKVCache`
  (bf16 rows and bit planes in pinned host memory) and
  :class:`fathom.host.decoder.Decoder`; full K/V never come back to the GPU, except for the dense attention of a
  continuation chunk (:meth:`~OffloadedSessions.extend`). Each layer's step is one captured CUDA graph; idle
  sessions go back to :data:`POOL` for the next cache of the same key, graphs and pinned memory included.

``calibrate(layer, stats)`` gives a layer its calibration before the layer holds a token (a calibration from the
prompt arrives layer by layer during the prefill); ``append(layer, session, k, v)`` adds ``m`` tokens to one session
(``k, v [H, m, d]``); ``extend(layer, q, k, v)`` adds a chunk of ``m`` tokens to every session, attending densely
over what each holds and causally within the chunk (a conversation's next turn); ``step(layer, q, k, v)`` appends one
token to every session (``k, v [S, H, d]``) and decodes ``q [S, H·G, d] -> [S, H·G, d]``.

Example (the reference at its most faithful: dense is exact attention)::

    >>> import torch
    >>> from fathom import methods
    >>> from fathom.integrations.sessions import ReferenceSessions, SessionShape
    >>> from fathom.selection import Selection
    >>> shape = SessionShape(sessions=1, layers=1, kv_heads=1, group_size=2, head_dim=8)
    >>> sessions = ReferenceSessions(shape, methods.dense(), Selection(k=0), scale=8 ** -0.5)
    >>> k, v = torch.randn(2, 1, 5, 8)
    >>> sessions.append(0, 0, k, v)
    >>> q, k1, v1 = torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    >>> out = sessions.step(0, q, k1, v1)
    >>> keys, values = torch.cat([k[0], k1[0]]), torch.cat([v[0], v1[0]])
    >>> dense = torch.softmax(q[0] @ keys.T * 8 ** -0.5, -1) @ values
    >>> bool(torch.allclose(out[0], dense, atol=1e-6)), sessions.lengths(0).tolist()
    (True, [6])
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fathom import _checks, methods
from fathom.calibration import Calibration
from fathom.decode import DecodeStep, HeadIndex, decode_step, pooled_layer_depths
from fathom.growing import GrowingRows
from fathom.methods import BASES, PER_HEAD, HeadStats, Method
from fathom.quantize import BLOCK, CELLS, MAX_DEPTH, midpoint_levels
from fathom.selection import Selection


@dataclass(frozen=True)
class SessionShape:
    """``sessions`` × ``layers`` × ``kv_heads`` streams of ``head_dim``; ``group_size`` query heads per KV head;
    ``max_tokens`` per session (the offloaded cache reserves it up front and grows it when a session needs more;
    the reference grows as it goes); ``hbm_planes``: the offloaded store's scales and this many planes per channel
    in HBM, the rest pinned (``fathom.layout``; 0: all pinned); ``row_cache_rows``: the offloaded cache's HBM row
    cache slots per (session, layer, KV head) (``fathom.row_cache``; 0: none)."""

    sessions: int
    layers: int
    kv_heads: int
    group_size: int
    head_dim: int
    max_tokens: int | None = None
    hbm_planes: int = 0
    row_cache_rows: int = 0

    def __post_init__(self):
        for name in ("sessions", "layers", "kv_heads", "group_size", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not 0 <= self.hbm_planes <= 4:
            raise ValueError(f"hbm_planes must be in 0..4, got {self.hbm_planes}")
        if self.row_cache_rows < 0:
            raise ValueError(f"row_cache_rows must be >= 0, got {self.row_cache_rows}")

    def cache_shape(self):
        """The offloaded cache's :class:`~fathom.host.cache.CacheShape` of these sessions."""
        from fathom.host.cache import CacheShape

        return CacheShape(sessions=self.sessions, layers=self.layers, kv_heads=self.kv_heads,
                          head_dim=self.head_dim, max_tokens=self.max_tokens, hbm_planes=self.hbm_planes,
                          row_cache_rows=self.row_cache_rows)


@dataclass(frozen=True)
class LayerStats:
    """One layer's calibration as the sessions read it: NumPy ``[H, d]`` (``basis [H, d, d]``; ``head_basis [H]``:
    the basis each KV head of the per-head store scans, None where the calibration holds no per-head rule;
    ``plane_drops`` / ``scale2``: each store's calibrated plane table ``[H, d, 4]`` and mean squared block scale
    ``[H, d]`` by basis, where the calibration holds them; ``levels``: each store's reconstruction tables ``[H, d, 4,
    16]`` by basis where the planes are read through them (``reads_levels``), the plane tables then the ones
    measured through them)."""

    sigma2_raw: np.ndarray
    basis: np.ndarray
    sigma2_rotated: np.ndarray
    ds_rank: np.ndarray
    head_basis: np.ndarray | None = None
    plane_drops: dict[str, np.ndarray] = field(default_factory=dict)
    scale2: dict[str, np.ndarray] = field(default_factory=dict)
    levels: dict[str, np.ndarray] = field(default_factory=dict)
    reads_levels: bool = False

    @classmethod
    def of(cls, calibration: Calibration, layer: int, levels: bool = False) -> LayerStats:
        """One layer of ``calibration``; ``levels``: its planes read through the calibration's reconstruction
        tables (and its plane tables those measured through them), as ``Calibration.head_stats(levels=True)``."""
        head_basis = None if calibration.head_basis is None else calibration.head_basis[layer]
        drops, scale2, tables = {}, {}, {}
        for basis in BASES:
            measured = getattr(calibration, f"level_drops_{basis}" if levels else f"plane_drops_{basis}")
            if measured is not None:
                drops[basis] = measured[layer]
                scale2[basis] = getattr(calibration, f"scale2_{basis}")[layer]
            if levels and getattr(calibration, f"levels_{basis}") is not None:
                tables[basis] = getattr(calibration, f"levels_{basis}")[layer]
        return cls(calibration.sigma2_raw[layer], calibration.basis[layer], calibration.sigma2_rotated[layer],
                   calibration.ds_rank[layer], head_basis, drops, scale2, tables, levels)

    def sigma2(self, basis: str) -> np.ndarray:
        """σ² ``[H, d]`` in the ``basis`` ("raw" or "rotated") store."""
        return self.sigma2_rotated if basis == "rotated" else self.sigma2_raw

    def check_for(self, method: Method, layer: int) -> None:
        """Refuse a calibration without the per-head rule for the per-head store (fathom-mixed), without the
        reconstruction tables of a store it reads through them, or without the plane table of a store whose heads
        water-fill with the calibrated gains."""
        if method.basis == PER_HEAD and self.head_basis is None:
            raise ValueError(f"layer {layer}'s calibration has no per-head basis: method {method.name!r} scans the "
                             "store each (layer, KV head) chose on calibration text (a .calibration.npz written by "
                             "python -m bench fidelity holds it)")
        if self.reads_levels:
            missing = sorted({b for b in self._head_bases(method) if b not in self.levels})
            if missing:
                raise ValueError(f"layer {layer}'s calibration has no reconstruction tables of the "
                                 f"{' and '.join(missing)} store: levels='calibrated' reads them (a calibration "
                                 "from fathom.calibration.calibrate holds them; one from a prompt does not)")
        if method.calibrated_gains:
            missing = sorted({b for b in self._head_bases(method) if b not in self.plane_drops})
            if missing:
                what = "plane table measured through the levels" if self.reads_levels else "plane table"
                raise ValueError(f"layer {layer}'s calibration has no {what} of the {' and '.join(missing)} "
                                 f"store: method {method.name!r} water-fills with the calibrated plane gains (a "
                                 "calibration from fathom.calibration.calibrate, or from the prompt, holds it)")

    def _head_bases(self, method: Method) -> list[str]:
        """The basis each KV head's store is in for ``method``."""
        if method.basis == PER_HEAD:
            return [str(b) for b in self.head_basis]
        return [method.basis] * len(self.sigma2_raw)

    def planner_gains(self, method: Method) -> np.ndarray | None:
        """The calibrated relative plane gains ``[H, d, 4]`` the GPU planner holds for ``method``
        (:func:`fathom.methods.gain_table` of each head in its store's basis, for the σ² source that head reads);
        None where the method water-fills with design §5's gains."""
        if not method.calibrated_gains:
            return None
        return np.stack([methods.gain_table(self.head(h, basis, None), method.on_basis(basis).policy.variance)
                         for h, basis in enumerate(self._head_bases(method))])

    def planner_levels(self, method: Method) -> np.ndarray | None:
        """The reconstruction tables ``[H, d, 4, 16]`` the scan reads for ``method``, each head's in the basis of its
        store; None where the planes are read at the cells' midpoints."""
        if not self.reads_levels:
            return None
        return np.stack([self.levels[basis][h] for h, basis in enumerate(self._head_bases(method))])

    def store_basis(self, method: Method) -> np.ndarray:
        """The basis ``[H, d, d]`` the rotated store holds for ``method``: on the per-head store the identity on
        the heads that chose the raw basis (their planes are then the raw store's, bit for bit)."""
        if method.basis != PER_HEAD:
            return self.basis
        eye = np.eye(self.basis.shape[-1], dtype=self.basis.dtype)
        return np.where((np.asarray(self.head_basis) == "rotated")[:, None, None], self.basis, eye)

    def planner_sigma2(self, method: Method) -> np.ndarray:
        """The calibration σ² ``[H, d]`` the GPU planner holds for ``method``, in the basis of the store it scans
        (on the per-head store each head's basis; its raw heads read the store's own σ² instead)."""
        if method.basis != PER_HEAD:
            return self.sigma2(method.basis)
        return np.where((np.asarray(self.head_basis) == "rotated")[:, None], self.sigma2_rotated, self.sigma2_raw)

    def head(self, head: int, basis: str, layer: int | None) -> HeadStats:
        """The stats of one KV head in the ``basis`` ("raw" or "rotated") store (its plane table where held)."""
        drops, scale2, table = self.plane_drops.get(basis), self.scale2.get(basis), self.levels.get(basis)
        return HeadStats(sigma2=self.sigma2(basis)[head], ds_rank=self.ds_rank[head], layer=layer,
                         plane_drops=None if drops is None else drops[head],
                         scale2=None if scale2 is None else scale2[head], levels=None if table is None else table[head])


def capacity(tokens: int) -> int:
    """The per-session capacity reserved for ``tokens``: rounded up to a coarse bucket (1/8 of its power of two, at
    least one 64-token block), so that caches of similar lengths share a pool key and growth is rare."""
    step = max(BLOCK, 2 ** max(0, math.floor(math.log2(max(tokens, 1))) - 3))
    return -(-tokens // step) * step


def dense_chunk_attention(q: torch.Tensor, held_k: torch.Tensor, held_v: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's attention over a session's held tokens (all visible) and the chunk itself (causal).

    ``q [H·G, m, d]``, ``held_k, held_v [H, n, d]``, ``k, v [H, m, d]`` -> ``[H·G, m, d]`` in ``q``'s dtype
    (sdpa with grouped query heads: query head ``h·G + g`` reads KV head ``h``)."""
    m, n = q.shape[1], held_k.shape[1]
    keys, values = torch.cat([held_k.to(q.dtype), k.to(q.dtype)], 1), torch.cat([held_v.to(q.dtype), v.to(q.dtype)], 1)
    visible = torch.ones((m, n + m), dtype=torch.bool, device=q.device)
    visible[:, n:] = torch.ones((m, m), dtype=torch.bool, device=q.device).tril()
    return torch.nn.functional.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=visible,
                                                            scale=scale, enable_gqa=True)[0]


class ReferenceSessions:
    """The NumPy reference: a growing :class:`HeadIndex` and exact values per (layer, session, KV head).

    Args:
        shape: sizes (``max_tokens`` unused: the reference grows).
        method, selection, scale: the decode step (``scale``: the model's softmax scale).
        calibration: per (layer, KV head) stats over the ``shape.layers`` layers; needed by rotated-store
            methods (their basis), double-sparsity (its channels) and ``variance="calibration"``. Without one,
            such a method takes each layer's from :meth:`calibrate` before the layer's first append.

    ``on_step`` (default None) is an observer: when set, :meth:`step` calls ``on_step(layer, session, head,
    decoded)`` after each (session, KV head) with its :class:`~fathom.decode.DecodeStep` (``decoded.mask [G, n]``:
    the rows each query head selected), e.g. to follow which rows successive steps fetch (``python -m bench
    rowreuse``).
    """

    def __init__(self, shape: SessionShape, method: Method, selection: Selection, scale: float,
                 calibration: Calibration | None = None, needs_calibration: bool = False, levels: bool = False):
        self.shape, self.method, self.selection, self.scale = shape, method, selection, scale
        self.stats: list[LayerStats | None] = [None] * shape.layers
        if calibration is not None:
            self.stats = [LayerStats.of(calibration, layer, levels) for layer in range(shape.layers)]
            for layer, stats in enumerate(self.stats):
                stats.check_for(method, layer)
        elif not (needs_calibration or method.scans_rotated):
            self.stats = [_unit_stats(shape) for _ in range(shape.layers)]
        self.indexes: list[list[list[HeadIndex]] | None] = [None] * shape.layers  # made on the layer's first append
        self.values: list[list[list[GrowingRows]] | None] = [None] * shape.layers
        self.on_step: Callable[[int, int, int, DecodeStep], None] | None = None

    def calibrate(self, layer: int, stats: LayerStats) -> None:
        """``layer``'s calibration, before it holds a token."""
        if self.indexes[layer] is not None:
            raise ValueError(f"layer {layer} already holds tokens: its calibration is fixed")
        stats.check_for(self.method, layer)
        self.stats[layer] = stats

    def lengths(self, layer: int) -> np.ndarray:
        """Tokens held by each session of ``layer``, int64 ``[S]``."""
        if self.indexes[layer] is None:
            return np.zeros(self.shape.sessions, np.int64)
        return np.array([len(heads[0].keys) for heads in self.indexes[layer]], np.int64)

    def append(self, layer: int, session: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``m`` tokens to one session: ``k [H, m, d]``, ``v [H, m, dv]`` (kept as float32)."""
        if not _checks.is_integer(session) or not 0 <= session < self.shape.sessions:
            raise ValueError(f"session must be an integer in 0..{self.shape.sessions - 1}, got {session!r}")
        k, v = self._checked(layer, _numpy(k)[None], _numpy(v)[None])
        self._append(layer, session, k[0], v[0])

    def _append(self, layer: int, session: int, k: np.ndarray, v: np.ndarray) -> None:
        for h in range(self.shape.kv_heads):
            self.indexes[layer][session][h].append(k[h])
            self.values[layer][session][h].append(v[h])

    def _checked(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``k [S', H, m, d]``, ``v [S', H, m, dv]`` of ``S'`` sessions, refused (ValueError) before any session
        holds any of them: the shapes, finite values and each store's float16 block-scale range (in its basis)."""
        H, d = self.shape.kv_heads, self.shape.head_dim
        if k.ndim != 4 or k.shape[1] != H or k.shape[3] != d or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"k must be [sessions, {H}, m, {d}] and v [sessions, {H}, m, dv] with the same m, got "
                             f"{list(k.shape)} and {list(v.shape)}")
        if not (np.isfinite(k).all() and np.isfinite(v).all()):
            raise ValueError("k and v must be finite (found NaN or inf)")
        self._open_layer(layer, v.shape[-1])
        for h, index in enumerate(self.indexes[layer][0]):  # every session of a head shares its stores' basis
            for store in index.stores.values():
                store.checked(np.ascontiguousarray(k[:, h].reshape(-1, d)))
        return k, v

    def extend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A chunk of ``m`` tokens for every session: ``q [S, H·G, m, d]``, ``k, v [S, H, m, d]`` -> float32
        ``[S, H·G, m, dv]``, each token attending densely (exact float32) over what its session holds and causally
        within the chunk; then the chunk is appended."""
        if q.shape[0] != self.shape.sessions or k.shape[0] != self.shape.sessions:
            raise ValueError(f"q, k and v must hold the {self.shape.sessions} sessions, got {q.shape[0]}, "
                             f"{k.shape[0]}")
        keys, values = self._checked(layer, _numpy(k), _numpy(v))  # before the first session takes the chunk
        out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float32)
        for s in range(self.shape.sessions):
            held = self.indexes[layer][s] if self.indexes[layer] is not None else None
            held_k = torch.from_numpy(np.stack([index.keys for index in held])) if held \
                else torch.zeros((self.shape.kv_heads, 0, k.shape[-1]))
            held_v = torch.from_numpy(np.stack([rows.array for rows in self.values[layer][s]])) if held \
                else torch.zeros((self.shape.kv_heads, 0, v.shape[-1]))
            out[s] = dense_chunk_attention(q[s].float().cpu(), held_k, held_v, k[s].float().cpu(), v[s].float().cpu(),
                                           self.scale)
            self._append(layer, s, keys[s], values[s])
        return out.to(q.device)

    def step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append ``k, v [S, H, d]`` to every session, then decode ``q [S, H·G, d]`` -> float32 ``[S, H·G, dv]``."""
        G = self.shape.group_size
        S, H, d = self.shape.sessions, self.shape.kv_heads, self.shape.head_dim
        if tuple(q.shape) != (S, H * G, d):
            raise ValueError(f"q must be [{S}, {H * G}, {d}], got {list(q.shape)}")
        keys, values = self._checked(layer, _numpy(k)[:, :, None], _numpy(v)[:, :, None])  # before any appends
        if keys.shape[0] != S:
            raise ValueError(f"k and v must hold the {S} sessions, got {keys.shape[0]}")
        for s in range(S):
            self._append(layer, s, keys[s], values[s])
        queries = _numpy(q)
        out = np.zeros(queries.shape[:2] + (v.shape[-1],), np.float32)
        head_basis = self.stats[layer].head_basis
        on_head = [self.method.on_basis(str(head_basis[h])) if self.method.basis == PER_HEAD else self.method
                   for h in range(self.shape.kv_heads)]  # the per-head store: each head on the basis it chose
        for s in range(self.shape.sessions):
            indexes = self.indexes[layer][s]
            depths = [None] * H
            if self.method.pooled:  # the session's KV heads on one water line
                blocks = np.array([len(indexes[0].keys) // BLOCK])
                depths = pooled_layer_depths(on_head, queries[s].reshape(H, 1, G, d), indexes, blocks)[:, 0]
            for h in range(self.shape.kv_heads):
                index = indexes[h]
                step = decode_step(queries[s, h * G:(h + 1) * G], index.keys, self.values[layer][s][h].array, index,
                                   on_head[h], self.selection, self.scale, layer, depths[h])
                out[s, h * G:(h + 1) * G] = step.output
                if self.on_step is not None:
                    self.on_step(layer, s, h, step)
        return torch.from_numpy(out).to(q.device)

    def close(self) -> None:
        """Nothing to release (host memory is garbage collected)."""

    def _open_layer(self, layer: int, value_dim: int) -> None:
        if self.indexes[layer] is not None:
            return
        stats = self.stats[layer]
        if stats is None:
            raise ValueError(f"layer {layer} has no calibration: method {self.method.name!r} needs one "
                             "(calibrate the layer before its first append)")
        S, H, d = self.shape.sessions, self.shape.kv_heads, self.shape.head_dim
        rotated = self.method.scans_rotated

        def head_index(h: int) -> HeadIndex:
            head_stats = {b: stats.head(h, b, layer) for b in ("raw", "rotated")}
            return HeadIndex(d, head_stats, stats.basis[h] if rotated else None)

        self.indexes[layer] = [[head_index(h) for h in range(H)] for _ in range(S)]
        self.values[layer] = [[GrowingRows(value_dim) for _ in range(H)] for _ in range(S)]


class OffloadedSessions:
    """The GPU path: :class:`fathom.host.cache.HostKVCache` and :class:`fathom.host.decoder.Decoder`, each
    layer's step (with the append of its token) captured once as a :class:`fathom.host.graph.StepGraph`.

    Arguments as :class:`ReferenceSessions`; ``shape.max_tokens`` is required (pinned memory is reserved up front;
    :meth:`reserve` grows it). A step's output is the graph's buffer, valid until the layer's next step.
    :meth:`close` releases the pinned memory; :data:`POOL` keeps idle sessions for reuse instead.
    """

    def __init__(self, shape: SessionShape, method: Method, selection: Selection, scale: float,
                 calibration: Calibration | None = None, needs_calibration: bool = False, levels: bool = False):
        from fathom.host.cache import HostKVCache

        if shape.max_tokens is None:
            raise ValueError("shape.max_tokens is needed: the offloaded cache reserves its memory up front")
        self.shape, self.method, self.selection, self.scale = shape, method, selection, scale
        self.levels = levels  # the scan reads reconstruction tables (its kernel is chosen when the decoder is made)
        self.needs_calibration = needs_calibration or method.scans_rotated or levels
        self.cache = HostKVCache(shape.cache_shape(), rotated=method.scans_rotated)
        self.stats: list[LayerStats | None] = [None] * shape.layers
        self._make_decoder()
        if calibration is not None:
            for layer in range(shape.layers):
                self.calibrate(layer, LayerStats.of(calibration, layer, levels))

    @property
    def key(self) -> tuple:
        """What the captured graphs depend on: sessions with the same key are interchangeable (:data:`POOL`)."""
        return (self.shape, self.method, self.selection, self.scale, self.levels)

    def calibrate(self, layer: int, stats: LayerStats) -> None:
        """``layer``'s calibration, copied into the tensors its step reads. With a rotated store, before the layer
        holds a token (its planes are in the basis); a raw store's planes do not depend on it, so a method that
        reads it only to steer the scan (DS's channels, calibration σ²) may be calibrated after the prefill."""
        if self.cache.rotated and self.cache.lengths(layer).any():
            raise ValueError(f"layer {layer} already holds tokens: its calibration is fixed")
        stats.check_for(self.method, layer)
        if stats.reads_levels != self.levels:  # the scan's kernel was chosen when the sessions were made
            want = "through reconstruction tables" if self.levels else "at the cells' midpoints"
            raise ValueError(f"layer {layer}'s calibration must read the planes {want}, as these sessions do")
        if self.cache.rotated:
            self.cache.set_basis(layer, stats.store_basis(self.method))
        self._calibrate_decoder(layer, stats)
        self.stats[layer] = stats

    def lengths(self, layer: int) -> np.ndarray:
        return self.cache.lengths(layer)

    def append(self, layer: int, session: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_calibrated(layer, appending=True)
        if not _checks.is_integer(session) or not 0 <= session < self.shape.sessions:
            raise ValueError(f"session must be an integer in 0..{self.shape.sessions - 1}, got {session!r}")
        self._check_shapes(k[None], v[None])  # before the store grows for them
        self._room(int(self.cache.lengths(layer)[session]) + k.shape[1])
        self.cache.append(layer, k[None], v[None], sessions=[session])

    def _check_shapes(self, k: torch.Tensor, v: torch.Tensor) -> None:
        H, d = self.shape.kv_heads, self.shape.head_dim
        if k.ndim != 4 or k.shape[1] != H or k.shape[3] != d or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"k and v must be [sessions, {H}, m, {d}], got {list(k.shape)} and {list(v.shape)}")

    def extend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """As :meth:`ReferenceSessions.extend`, in ``q``'s dtype on the GPU: each session's bf16 K/V rows are
        read from pinned memory for the chunk's dense attention, then the chunk is appended."""
        self._check_calibrated(layer, appending=True)
        self._check_shapes(k, v)
        if k.shape[0] != self.shape.sessions:
            raise ValueError(f"k and v must hold the {self.shape.sessions} sessions, got {k.shape[0]}")
        m = k.shape[2]
        self.reserve(m)
        held = self.cache.lengths(layer)
        rows = self.cache.layer(layer).kv.tensor().view(torch.bfloat16)  # [S·H, T, 2, d]
        H = self.shape.kv_heads
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for s in range(self.shape.sessions):
            session_rows = rows[s * H:(s + 1) * H, :int(held[s])]
            out[s] = dense_chunk_attention(q[s], session_rows[:, :, 0], session_rows[:, :, 1], k[s], v[s], self.scale)
        self.cache.append(layer, k, v)
        return out

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more in the fullest session of every layer: the cache grows (to the next
        :func:`capacity` bucket) when it has not; the graphs are captured anew at their next step."""
        self._room(self.cache.most_held() + tokens)

    def _room(self, tokens: int) -> None:
        """A capacity of at least ``tokens`` per session."""
        if tokens <= self.cache.shape.max_tokens:
            return
        self.cache = self.cache.grown(capacity(tokens))
        self.shape = replace(self.shape, max_tokens=self.cache.shape.max_tokens)
        self._make_decoder()
        for layer, stats in enumerate(self.stats):
            if stats is not None:
                self._calibrate_decoder(layer, stats)

    def _calibrate_decoder(self, layer: int, stats: LayerStats) -> None:
        """``stats`` into the decoder's tensors, σ² in the basis of the store the method scans (and, on the per-head
        store, each head's basis)."""
        per_head = self.method.basis == PER_HEAD
        self.decoder.set_calibration(layer, stats.planner_sigma2(self.method), stats.ds_rank,
                                     stats.head_basis if per_head else None, stats.planner_gains(self.method),
                                     stats.planner_levels(self.method))

    def begin_token(self) -> None:
        """Once per decode token, before its first layer's :meth:`step`: a flag raised by any kernel since the last
        token is reported, and every layer has room for the token (grown if not)."""
        self.cache.check()
        self.reserve(1)

    def step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Replay ``layer``'s graph (checked once per token by :meth:`begin_token`, not here)."""
        return self.graph(layer).replay(q, k[:, :, None], v[:, :, None])[0]

    def enqueue_step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``layer``'s step launched on the current stream, for a larger capture (the host mirror is not advanced:
        the caller advances it per replay, :meth:`advance`)."""
        return self.graph(layer).enqueue(q, k[:, :, None], v[:, :, None])[0]

    def advance(self) -> None:
        """Every session of every layer gained one token through replayed work (:meth:`enqueue_step`)."""
        self.cache.advance(np.ones(self.shape.layers, np.int64))

    def graph(self, layer: int):
        if layer not in self.graphs:
            from fathom.host.graph import StepGraph

            self._check_calibrated(layer)
            self.graphs[layer] = StepGraph(self.decoder, layers=[layer], append=True, pool=self._pool)
        return self.graphs[layer]

    def clear(self) -> None:
        """Empty every session (memory, decoder and graphs kept) and forget the calibration: ready for reuse."""
        self.cache.clear()
        self.stats = [None] * self.shape.layers

    def close(self) -> None:
        """Release the pinned host memory."""
        self.graphs.clear()
        self.token_graphs.clear()
        self.cache.close()

    def _make_decoder(self) -> None:
        from fathom.cuda.interop import SIMULATED
        from fathom.host.decoder import Decoder, DecoderSettings

        s = self.shape
        # Neutral until :meth:`calibrate` copies a layer's own in (every layer is calibrated before it holds tokens)
        sigma2 = np.ones((s.layers, s.kv_heads, s.head_dim))
        ds_rank = np.broadcast_to(np.arange(s.head_dim), (s.layers, s.kv_heads, s.head_dim))
        gains = np.ones((s.layers, s.kv_heads, s.head_dim, MAX_DEPTH))
        levels = np.broadcast_to(midpoint_levels(s.head_dim), (s.layers, s.kv_heads, s.head_dim, MAX_DEPTH, CELLS)) \
            if self.levels else None
        self.decoder = Decoder(self.cache, DecoderSettings(self.method, self.selection, scale=self.scale),
                               group_size=s.group_size, sigma2=sigma2, ds_rank=ds_rank, gains=gains, levels=levels)
        self.graphs: dict = {}  # layer -> its captured step (a StepGraph), made on the layer's first step
        # (id(model), batch) -> a whole decode token captured over these sessions (fathom.integrations.token_graph)
        self.token_graphs: dict = {}
        self._pool = None if SIMULATED else torch.cuda.graph_pool_handle()  # the layers replay in capture order

    def _check_calibrated(self, layer: int, appending: bool = False) -> None:
        """A step needs the layer's calibration where the method reads one; an append only for the rotated store."""
        if appending and not self.cache.rotated:
            return
        if self.needs_calibration and self.stats[layer] is None:
            raise ValueError(f"layer {layer} has no calibration: method {self.method.name!r} needs one "
                             "(calibrate the layer before its first append)")


class SessionPool:
    """Idle :class:`OffloadedSessions` by key (:attr:`OffloadedSessions.key`), so that the next cache of the same
    key starts with its pinned memory reserved, its kernels compiled and its graphs captured.

    At most ``limit`` idle sessions are kept (the least recently returned are closed first): each holds its pinned
    memory. :meth:`clear` releases them all.
    """

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._idle: OrderedDict[tuple, OffloadedSessions] = OrderedDict()

    def take(self, key: tuple) -> OffloadedSessions | None:
        """Idle sessions of ``key`` (emptied, uncalibrated), or None."""
        return self._idle.pop(key, None)

    def give(self, sessions: OffloadedSessions) -> None:
        """Keep ``sessions`` for reuse (emptied now); an idle one of the same key, or the oldest beyond the limit,
        is closed. Sessions that cannot be emptied (a kernel flagged its last work) are closed, not kept, and the
        error raised: their pinned memory is never freed by garbage collection."""
        try:
            sessions.clear()
        except BaseException:
            sessions.close()
            raise
        previous = self._idle.pop(sessions.key, None)
        if previous is not None and previous is not sessions:  # given twice: kept once, not closed
            previous.close()
        self._idle[sessions.key] = sessions
        while len(self._idle) > self.limit:
            self._idle.popitem(last=False)[1].close()

    def clear(self) -> None:
        """Close every idle session (their pinned memory is freed)."""
        while self._idle:
            self._idle.popitem()[1].close()

    def __len__(self) -> int:
        return len(self._idle)


POOL = SessionPool()


def _unit_stats(shape: SessionShape) -> LayerStats:
    """Unit σ², identity basis and channel order: what a method that reads no calibration is given."""
    H, d = shape.kv_heads, shape.head_dim
    return LayerStats(np.ones((H, d)), np.broadcast_to(np.eye(d, dtype=np.float32), (H, d, d)), np.ones((H, d)),
                      np.broadcast_to(np.arange(d), (H, d)))


def _numpy(x: torch.Tensor) -> np.ndarray:
    """A torch tensor as a C-contiguous float32 NumPy array on the host."""
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
