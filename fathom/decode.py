"""The reference decode step of one (layer, KV head): scan, select, attend (design §6, §8).

:class:`HeadIndex` is everything a method may scan for one (layer, KV head)
— the raw and rotated plane stores, landmarks, exact keys — and
:func:`method_scores` is the one place that turns a method into scores.
:func:`decode_step` is one query group's step; :mod:`fathom.fidelity`
evaluates many positions at once through the same two pieces.

Example (oracle top-k at k >= n is dense attention)::

    >>> import numpy as np
    >>> from fathom import methods
    >>> from fathom.decode import HeadIndex, decode_step
    >>> from fathom.selection import Selection
    >>> rng = np.random.default_rng(0)
    >>> k, v = rng.standard_normal((2, 300, 16)).astype(np.float32)
    >>> q = rng.standard_normal((4, 16)).astype(np.float32)
    >>> index = HeadIndex.build(k, calibration=None)
    >>> sparse = decode_step(q, k, v, index, methods.oracle(), Selection(k=300))
    >>> dense = decode_step(q, k, v, index, methods.dense(), Selection(k=0))
    >>> bool(np.allclose(sparse.output, dense.output))
    True
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fathom import _checks
from fathom.attention import attention
from fathom.bits import row_bytes, scan_bits
from fathom.growing import GrowingRows
from fathom import methods as M
from fathom.methods import HeadStats, LayerWaterfill, Method, pooled_depths
from fathom.prediction import StoreMoments, predicted_queries, store_moments
from fathom.quantize import BLOCK, MAX_DEPTH
from fathom.scoring import DepthScorer, exact_scores, landmark_scores, landmarks
from fathom.selection import Selection, select, union_rows
from fathom.store import PlaneStore


class HeadIndex:
    """What the scan methods read for one (layer, KV head), grown token by token.

    ``stores["raw"]`` holds planes of k; ``stores["rotated"]`` (if a basis is
    given) planes of ``k @ basis``; ``stats[basis]`` the calibration stats.
    Scores cover the sealed tokens; a query at context ``m <= n`` uses the
    first ``m // 64`` blocks, exactly what a store grown to ``m`` tokens holds.
    :meth:`append` adds tokens without touching what is sealed (only newly
    sealed blocks are dequantized and landmarked), so an index grown one
    token at a time equals one :meth:`build` over all its keys.

    Args:
        d: head dim.
        calibration: stats per basis (None: unit σ², identity DS rank); a basis' stats that carry a
            reconstruction table (``HeadStats.levels``) have its planes scored through it.
        basis: optional orthonormal ``[d, d]``: also keep the rotated store.
    """

    def __init__(self, d: int, calibration: dict[str, HeadStats] | None, basis: np.ndarray | None = None):
        self.stores = {"raw": PlaneStore(d)}
        if basis is not None:
            self.stores["rotated"] = PlaneStore(d, basis=basis)
        self.stats = unit_stats(d, tuple(self.stores)) if calibration is None else calibration
        self.scorers = {b: DepthScorer(s.planes(), s.scales(), self.stats[b].levels) for b, s in self.stores.items()}
        self._keys = GrowingRows(d)
        self._landmarks = GrowingRows(d, np.float16)
        self._moments: dict[tuple[str, bytes], StoreMoments] = {}

    @classmethod
    def build(cls, keys: np.ndarray, calibration: dict[str, HeadStats] | None,
              basis: np.ndarray | None = None) -> HeadIndex:
        """The index of ``keys float32 [n, d]`` in one go; ``calibration``: stats per basis (None: unit σ², identity
        DS rank); ``basis``: orthonormal ``[d, d]`` (``RᵀR = I`` within 1e-4, checked by the store) for the rotated
        store."""
        keys = _checks.array("keys", keys, ndim=2, dtype=np.float32)
        index = cls(keys.shape[1], calibration, basis)
        index.append(keys)
        return index

    @property
    def keys(self) -> np.ndarray:
        """The exact keys ``float32 [n, d]`` (a view: valid until the next append)."""
        return self._keys.array

    @property
    def landmarks(self) -> np.ndarray:
        """fp16 mean key of each 8-token block of the sealed tokens, ``[n_sealed // 8, d]``."""
        return self._landmarks.array

    def append(self, keys: np.ndarray) -> None:
        """Append ``keys float32 [m, d]`` (m >= 0)."""
        keys = _checks.array("keys", keys, ndim=2, dtype=np.float32)
        for store in self.stores.values():  # every store takes them, or none does
            store.checked(keys)
        sealed = self.stores["raw"].n_blocks
        self._moments.clear()
        for store in self.stores.values():
            store.append(keys)
        self._keys.append(keys)
        if self.stores["raw"].n_blocks > sealed:
            for basis, store in self.stores.items():
                self.scorers[basis].extend(store.planes(sealed), store.scales(sealed))
            self._landmarks.append(landmarks(self.keys[sealed * BLOCK:self.stores["raw"].n_sealed]))

    def store_variance(self, basis: str, blocks: np.ndarray) -> np.ndarray:
        """σ² from the store at each context: mean squared scale over the first ``blocks[p]`` blocks -> ``[P, d]``."""
        return running_scale_variance(self.stores[basis].scales(), blocks)

    def store_moments(self, basis: str, blocks: np.ndarray) -> StoreMoments:
        """The ``basis`` store's key covariance and read noise at the contexts of ``blocks [P]`` sealed blocks
        (:func:`fathom.prediction.store_moments`); kept until the next append, for the next method that asks."""
        key = (basis, np.asarray(blocks).tobytes())
        if key not in self._moments:
            scorer = self.scorers[basis]
            self._moments[key] = store_moments([scorer.khat(t) for t in range(1, MAX_DEPTH + 1)], blocks)
        return self._moments[key]


def unit_stats(d: int, bases: tuple[str, ...]) -> dict[str, HeadStats]:
    """What the policies know of a head without calibration: unit σ², Double Sparsity's rank the identity."""
    return {b: HeadStats(sigma2=np.ones(d), ds_rank=np.arange(d)) for b in bases}


def running_scale_variance(scales: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """The store's σ² at each context: the mean squared fp16 scale over the first ``blocks[p]`` blocks of
    ``scales float16 [d, nb]`` -> float64 ``[P, d]`` (what :attr:`PlaneStore.scale_variance` is at that size)."""
    scales_sq = np.square(scales.astype(np.float64))
    cumulative = np.concatenate([np.zeros((scales_sq.shape[0], 1)), np.cumsum(scales_sq, axis=1)], axis=1)
    return (cumulative[:, blocks] / np.maximum(blocks, 1)).T


def plane_depths(method: Method, q_store: np.ndarray, stats: HeadStats, sigma2_store: np.ndarray,
                 layer: int | None) -> np.ndarray:
    """Depths ``int8 [P, d]`` a plane method reads for query groups ``q_store [P, G, d]`` (in its store's basis),
    given the head's calibration ``stats``, the store's σ² ``[P, d]`` and the ``layer`` (per-layer plans)."""
    if isinstance(method.policy, LayerWaterfill) and layer is None:
        raise ValueError(f"layer must be given for the per-layer plan {method.name!r} (its budget depends on it)")
    return method.policy.depths(q_store, replace(stats, sigma2_store=sigma2_store, layer=layer))


def pooled_layer_depths(methods: list[Method], q: np.ndarray, indexes: list[HeadIndex], blocks: np.ndarray
                        ) -> np.ndarray:
    """The depths ``int8 [H, P, d]`` of a pooled method (:func:`fathom.methods.pooled_depths`) for the KV heads of
    one layer: ``methods[h]`` the method head ``h`` runs (a per-head method resolved on its basis), ``q [H, P, G,
    d]`` their query groups (raw basis), ``indexes[h]`` their indexes, at contexts of ``blocks [P]`` sealed
    blocks."""
    if len(methods) != len(indexes) or len(q) != len(indexes):
        raise ValueError(f"methods, q and indexes must hold one entry per KV head, got {len(methods)}, {len(q)} "
                         f"and {len(indexes)}")
    q_stores, stats = [], []
    for method, q_head, index in zip(methods, q, indexes):
        store = index.stores[method.basis]
        q_stores.append(q_head @ store.basis if store.basis is not None else q_head)
        stats.append(replace(index.stats[method.basis], sigma2_store=index.store_variance(method.basis, blocks)))
    return pooled_depths([m.policy for m in methods], q_stores, stats)


def method_scores(method: Method, q: np.ndarray, index: HeadIndex, blocks: np.ndarray, layer: int | None = None,
                  depths: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Scores of the sealed tokens for query groups ``q [P, G, d]`` (raw basis) at contexts of
    ``blocks [P]`` sealed blocks -> (scores ``[P, G, n_sealed]`` or None for dense, depths ``[P, d]`` or None).
    ``layer``: the layer the index belongs to (required by per-layer plans). ``depths``: the head's part of a
    pooled plan (:func:`pooled_layer_depths`), which a pooled method requires and no other takes.

    Scores past a position's sealed blocks are computed but never used by selection.
    """
    if (depths is not None) != method.pooled:
        raise ValueError(f"depths must be given exactly for a pooled method (planned for every KV head of a layer "
                         f"by pooled_layer_depths); {method.name} is {'' if method.pooled else 'not '}pooled")
    if method.scorer == "dense":
        return None, None
    n_sealed = index.stores["raw"].n_sealed
    if method.scorer == "exact":
        return exact_scores(q, index.keys[:n_sealed]), None
    if method.scorer == "landmark":
        return landmark_scores(q, index.landmarks), None
    if method.basis == M.PER_HEAD:
        raise ValueError(f"{method.name} picks its basis per head: pass method.on_basis(the head's basis)")
    if method.basis not in index.stores:
        raise ValueError(f"method {method.name} needs the {method.basis} store; build HeadIndex with a basis")
    store = index.stores[method.basis]
    q_store = q @ store.basis if store.basis is not None else q
    if depths is None:
        depths = plane_depths(method, q_store, index.stats[method.basis],
                              index.store_variance(method.basis, blocks), layer)
    if method.predicts:
        q_store = predicted_queries(q_store, depths, index.store_moments(method.basis, blocks))
    return index.scorers[method.basis](q_store, depths), depths


@dataclass(frozen=True)
class DecodeStep:
    """One query group's step: ``output [G, dv]``, selected ``mask [G, m]``, ``depths [d]`` (plane methods),
    scan bits per token and the union of rows fetched."""

    output: np.ndarray
    mask: np.ndarray
    depths: np.ndarray | None
    bits: float
    rows: int
    scan_bytes: float
    row_bytes: float


def step_bits(method: Method, depths: np.ndarray | None, d: int) -> np.ndarray | float:
    """Scan bits per token actually read, per query group of ``depths [..., d]`` (design §4); the nominal bits
    of a method without depths."""
    return scan_bits(depths) if depths is not None else method.nominal_bits(d)


def decode_step(q: np.ndarray, keys: np.ndarray, values: np.ndarray, index: HeadIndex, method: Method,
                sel: Selection, scale: float | None = None, layer: int | None = None,
                depths: np.ndarray | None = None) -> DecodeStep:
    """Decode one query group ``q [G, d]`` over the context ``keys [m, d]``, ``values [m, dv]``.

    ``index`` must have been built over at least the first ``m`` keys (it may hold more). ``layer``: the
    layer of this (layer, KV head); a per-layer plan reads its budget there and is refused without it.
    ``depths [d]``: this head's part of a pooled plan (:func:`pooled_layer_depths`), given exactly for a pooled
    method.
    """
    q = _checks.array("q", q, ndim=2, kind="f")
    keys = _checks.array("keys", keys, ndim=2, kind="f")
    values = _checks.array("values", values, ndim=2, kind="f")
    m, d = keys.shape
    if q.shape[0] < 1 or q.shape[1] != d:
        raise ValueError(f"q must have shape (G >= 1, {d}) to match keys, got {q.shape}")
    if values.shape[0] != m:
        raise ValueError(f"values must have {m} rows (one per key), got shape {values.shape}")
    if m > index.keys.shape[0]:
        raise ValueError(f"keys has {m} tokens but the index holds only {index.keys.shape[0]}")
    blocks = np.array([m // 64])
    scores, depths = method_scores(method, q[None], index, blocks, layer, None if depths is None else depths[None])
    if scores is None:
        mask = np.ones((q.shape[0], m), bool)
    else:
        mask = select(scores[0, :, :blocks[0] * 64], m, sel)
    out = attention(q, keys, values, mask, scale)
    bits = float(step_bits(method, None if depths is None else depths[0], d))
    rows = union_rows(mask)
    return DecodeStep(out, mask, None if depths is None else depths[0], bits, rows,
                      bits * blocks[0] * 64 / 8, rows * row_bytes(d))
