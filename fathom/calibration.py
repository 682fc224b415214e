"""Calibration statistics, once per model, per layer and KV head (design §5, §7).

* ``sigma2_raw``: variance of each key channel (water-filling's σ², raw store);
* ``basis``: eigenbasis of the key covariance, columns ordered by calibration
  score variance ``λ_i · mean_q (q · e_i)²`` — the rotated store (fathom-rotated)
  and Loki's PCA coordinates are the same basis;
* ``sigma2_rotated``: variance of each rotated coordinate (in that order);
* ``ds_rank``: channels by Double Sparsity's ``mean |q_c| · mean |k_c|``, descending;
* ``plane_drops_raw`` / ``plane_drops_rotated``: per channel of each store, the drop of
  its error variance (over calibration tokens) from each bit plane read, made
  non-increasing in the plane (:func:`fathom.waterfill.calibrated_gains`); with
  ``scale2_raw`` / ``scale2_rotated``, the mean squared fp16 block scale on the same
  keys (the store's σ² at calibration), water-filling's calibrated gain table;
* ``levels_raw`` / ``levels_rotated``: per channel of each store, the calibrated reconstruction table (the mean
  of the calibration keys in each t-bit cell, :func:`cell_means`), and ``level_drops_raw`` /
  ``level_drops_rotated`` the plane table measured when the planes are read through it;
* ``preferred_basis``: the basis rule's decision for the model ("raw" or "rotated"),
  made on calibration text and recorded here ("" until decided);
* ``head_basis``: the same rule per (layer, KV head) (None until decided): the
  basis each head of the per-head store (``fathom-mixed``) scans.

Saved and loaded as one small ``.npz`` per model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fathom.capture import Capture
from fathom.methods import BASES, HeadStats
from fathom.quantize import BLOCK, CELLS, MAX_DEPTH, dequantize, midpoint_levels, pack_planes, quantize
from fathom.waterfill import calibrated_gains


LEVEL_PRIOR = 16.0  # pseudo-keys at a cell's midpoint in its calibrated mean (cell_means)
_CELL_EXISTS = np.arange(CELLS) < 2 ** np.arange(1, MAX_DEPTH + 1)[:, None]  # [4, 16]: cell p of a t-bit prefix


@dataclass(frozen=True)
class Calibration:
    sigma2_raw: np.ndarray  # [L, H, d]
    basis: np.ndarray  # [L, H, d, d], columns are the rotated coordinates
    sigma2_rotated: np.ndarray  # [L, H, d]
    ds_rank: np.ndarray  # [L, H, d]
    preferred_basis: str = ""
    meta: dict = field(default_factory=dict)
    plane_drops_raw: np.ndarray | None = None  # [L, H, d, 4]
    plane_drops_rotated: np.ndarray | None = None  # [L, H, d, 4]
    scale2_raw: np.ndarray | None = None  # [L, H, d]
    scale2_rotated: np.ndarray | None = None  # [L, H, d]
    head_basis: np.ndarray | None = None  # [L, H] of "raw" / "rotated"
    levels_raw: np.ndarray | None = None  # [L, H, d, 4, 16]
    levels_rotated: np.ndarray | None = None  # [L, H, d, 4, 16]
    level_drops_raw: np.ndarray | None = None  # [L, H, d, 4]
    level_drops_rotated: np.ndarray | None = None  # [L, H, d, 4]

    def head_stats(self, layer: int, head: int, basis: str, levels: bool = False) -> HeadStats:
        """Calibration stats of one (layer, KV head) in the ``basis`` ("raw" or "rotated") store; ``levels``: its
        planes read through the calibrated reconstruction table (the stats then carry it, and the plane table
        measured through it), refused by a calibration made without one."""
        rotated = basis == "rotated"
        sigma2 = self.sigma2_rotated if rotated else self.sigma2_raw
        drops = self.plane_drops_rotated if rotated else self.plane_drops_raw
        scale2 = self.scale2_rotated if rotated else self.scale2_raw
        table = None
        if levels:
            table = self.levels_rotated if rotated else self.levels_raw
            if table is None:
                raise ValueError("levels=True needs a calibration with reconstruction tables (made by calibrate "
                                 "since the calibrated levels)")
            table = table[layer, head]
            drops = self.level_drops_rotated if rotated else self.level_drops_raw
        return HeadStats(sigma2=sigma2[layer, head], ds_rank=self.ds_rank[layer, head],
                         plane_drops=None if drops is None else drops[layer, head],
                         scale2=None if scale2 is None else scale2[layer, head], levels=table)

    def with_preferred_basis(self, basis: str) -> Calibration:
        if basis not in BASES:
            raise ValueError(f"basis must be 'raw' or 'rotated', got {basis!r}")
        return replace(self, preferred_basis=basis)

    def with_head_basis(self, head_basis: np.ndarray) -> Calibration:
        """The per-head basis rule's decision, ``[L, H]`` of "raw" / "rotated"."""
        head_basis = np.asarray(head_basis)
        if head_basis.shape != self.sigma2_raw.shape[:2] or not np.isin(head_basis, BASES).all():
            raise ValueError(f"head_basis must be {self.sigma2_raw.shape[:2]} of 'raw' / 'rotated', got "
                             f"{head_basis.shape} {np.unique(head_basis).tolist()}")
        return replace(self, head_basis=head_basis.astype("<U7"))

    def of_heads(self, start: int, stop: int) -> Calibration:
        """The statistics of KV heads ``start .. stop - 1`` alone (every array ``[L, stop - start, ...]``): a
        tensor-parallel rank's share of the model's. ``meta["kv_heads"]`` records which heads of the model they are.

        >>> L, H, d = 1, 4, 2
        >>> whole = Calibration(np.ones((L, H, d)), np.zeros((L, H, d, d)), np.ones((L, H, d)),
        ...                     np.zeros((L, H, d), np.int32))
        >>> share = whole.of_heads(2, 4)
        >>> share.basis.shape, share.meta["kv_heads"]
        ((1, 2, 2, 2), [2, 4])
        """
        H = self.sigma2_raw.shape[1]
        if not 0 <= start < stop <= H:
            raise ValueError(f"start, stop must satisfy 0 <= start < stop <= {H}, got {start}, {stop}")
        offset = self.meta.get("kv_heads", [0, H])[0]  # a share of a share counts from the model's first head
        shares = {name: getattr(self, name)[:, start:stop] for name in _PER_HEAD if getattr(self, name) is not None}
        return replace(self, meta={**self.meta, "kv_heads": [offset + start, offset + stop]}, **shares)

    def save(self, path: str | Path) -> None:
        optional = {name: getattr(self, name) for name in _OPTIONAL if getattr(self, name) is not None}
        np.savez_compressed(path, sigma2_raw=self.sigma2_raw, basis=self.basis, sigma2_rotated=self.sigma2_rotated,
                            ds_rank=self.ds_rank, preferred_basis=self.preferred_basis, meta=json.dumps(self.meta),
                            **optional)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A saved calibration; files from before the gain table and the per-head rule load without them."""
        with np.load(path) as f:
            optional = {name: f[name] for name in _OPTIONAL if name in f.files}
            return cls(f["sigma2_raw"], f["basis"], f["sigma2_rotated"], f["ds_rank"],
                       str(f["preferred_basis"]), json.loads(str(f["meta"])), **optional)


_OPTIONAL = ("plane_drops_raw", "plane_drops_rotated", "scale2_raw", "scale2_rotated", "head_basis", "levels_raw",
             "levels_rotated", "level_drops_raw", "level_drops_rotated")
_PER_HEAD = ("sigma2_raw", "basis", "sigma2_rotated", "ds_rank", *_OPTIONAL)  # every array, [L, H, ...]


def _sealed(keys: np.ndarray) -> np.ndarray:
    """``keys float [..., n, d]`` -> float32 ``[heads, n_sealed, d]``: every head's sealed 64-token blocks."""
    keys = np.asarray(keys, np.float32)
    n_sealed = keys.shape[-2] // BLOCK * BLOCK
    if n_sealed == 0:
        raise ValueError(f"keys must hold at least one {BLOCK}-token block, got {keys.shape[-2]} tokens")
    return keys[..., :n_sealed, :].reshape(-1, n_sealed, keys.shape[-1])


class _Quantized(NamedTuple):
    """A store's keys ``float [..., n, d]`` quantized once, head by head (the sealed 64-token blocks), for the cell
    means and each plane table to read: ``keys float32 [heads, n, d]``, ``codes uint8 [heads, n, d]``, ``scales
    float16 [heads, d, n // 64]``, ``planes uint64 [heads, d, 4, n // 64]``; ``heads`` the keys' leading axes."""

    keys: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    planes: np.ndarray
    heads: tuple[int, ...]


def _quantized(keys: np.ndarray) -> _Quantized:
    """The store of ``keys float [..., n, d]`` as :class:`_Quantized`."""
    flat = _sealed(keys)
    codes, scales = zip(*(quantize(k) for k in flat))
    return _Quantized(flat, np.array(codes), np.array(scales), np.array([pack_planes(c) for c in codes]),
                      np.shape(keys)[:-2])


def cell_means(keys: np.ndarray, prior: float = LEVEL_PRIOR) -> np.ndarray:
    """A reconstruction table per head: the mean, in units of its block's Δ, of the keys ``float [..., n, d]`` (one
    store's basis; the sealed 64-token blocks) that fall in each t-bit cell of each channel, with ``prior``
    pseudo-keys at the cell's midpoint -> float32 ``[..., d, 4, 16]`` (:func:`fathom.quantize.dequantize`'s
    ``levels``; cells past ``2^t`` hold 0).

    A cell's midpoint is its mean only for keys spread evenly over it; a block's keys are not (its scale is their
    largest magnitude, so most lie well inside it), and the midpoint of a 1-bit cell, ±s/2, is farther from them
    than their mean. The prior keeps a cell that calibration keys seldom reach near its midpoint. Blocks whose
    scale is 0 (every key 0, read as 0 at any depth) are left out."""
    return _cell_means(_quantized(keys), prior)


def _cell_means(store: _Quantized, prior: float = LEVEL_PRIOR) -> np.ndarray:
    """:func:`cell_means` of a quantized store."""
    d = store.keys.shape[-1]
    midpoints = midpoint_levels(d).astype(np.float64)
    tables = []
    for k, codes, scales in zip(store.keys, store.codes, store.scales):
        delta = np.repeat(scales.astype(np.float32).T / np.float32(8), BLOCK, axis=0)  # [n, d]
        seen = delta > 0
        x = np.where(seen, k / np.where(seen, delta, np.float32(1)), 0).astype(np.float64)
        total, count = np.zeros((d, MAX_DEPTH, CELLS)), np.zeros((d, MAX_DEPTH, CELLS))
        for t in range(1, MAX_DEPTH + 1):
            cell = (codes >> (MAX_DEPTH - t)).astype(np.int64) + CELLS * np.arange(d)  # [n, d]: (channel, cell)
            count[:, t - 1] = np.bincount(cell[seen], minlength=d * CELLS).reshape(d, CELLS)
            total[:, t - 1] = np.bincount(cell[seen], weights=x[seen], minlength=d * CELLS).reshape(d, CELLS)
        tables.append(np.where(_CELL_EXISTS, (total + prior * midpoints) / (count + prior), 0.0))
    return np.array(tables, np.float32).reshape(store.heads + (d, MAX_DEPTH, CELLS))


def plane_drops(keys: np.ndarray, levels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What each bit plane is worth on ``keys float [..., n, d]`` (one store's basis; the sealed 64-token blocks),
    read through ``levels [..., d, 4, 16]`` (None: the midpoints): (gain table ``[..., d, 4]`` by
    :func:`fathom.waterfill.calibrated_gains` from the drop of each channel's error variance over tokens at depth
    t - 1 -> t (depth 0: the channel unread, its error the key itself), mean squared fp16 block scale ``[..., d]``)."""
    return _plane_drops(_quantized(keys), levels)


def _plane_drops(store: _Quantized, levels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`plane_drops` of a quantized store."""
    n_heads = len(store.keys)
    tables = [None] * n_heads if levels is None else \
        np.asarray(levels, np.float32).reshape((n_heads,) + np.shape(levels)[-3:])
    drops, scale2 = [], []
    for k, scales, planes, table in zip(store.keys, store.scales, store.planes, tables):
        k64 = k.astype(np.float64)
        variance = [k64.var(axis=0)]
        for t in range(1, MAX_DEPTH + 1):  # the keys as the scan reads them at depth t
            variance.append((k64 - dequantize(planes, scales, np.full(k.shape[1], t), table)).var(axis=0))
        drops.append(-np.diff(np.stack(variance, axis=-1), axis=-1))
        scale2.append(np.square(scales.astype(np.float64)).mean(axis=1))
    shape = store.heads + store.keys.shape[-1:]
    return calibrated_gains(np.array(drops).reshape(shape + (MAX_DEPTH,))), np.array(scale2).reshape(shape)


def calibrate(capture: Capture) -> Calibration:
    """All statistics from a calibration capture (keys and decode queries of calibration text). The plane table
    quantizes the keys as a store does (so they must fit float16, as a store's must); a capture shorter than one
    64-token block has none."""
    keys = capture.keys.astype(np.float64)  # [L, H, n, d]
    queries = capture.queries.astype(np.float64)  # [L, H, P, G, d]
    L, H, _, d = keys.shape
    q_flat = queries.reshape(L, H, -1, d)
    sigma2_raw = keys.var(axis=2)
    cov = np.einsum("lhni,lhnj->lhij", keys - keys.mean(axis=2, keepdims=True),
                    keys - keys.mean(axis=2, keepdims=True)) / keys.shape[2]
    eigval, eigvec = np.linalg.eigh(cov)  # ascending, [L, H, d], [L, H, d, d]
    score_var = np.clip(eigval, 0, None) * np.square(np.einsum("lhpd,lhde->lhpe", q_flat, eigvec)).mean(axis=2)
    order = np.argsort(-score_var, axis=-1, kind="stable")
    basis = np.take_along_axis(eigvec, order[:, :, None, :], axis=3)
    sigma2_rotated = np.take_along_axis(np.clip(eigval, 0, None), order, axis=2)
    ds_stat = np.abs(q_flat).mean(axis=2) * np.abs(keys).mean(axis=2)
    ds_rank = np.argsort(-ds_stat, axis=-1, kind="stable")
    basis = basis.astype(np.float32)
    planes = {}  # no sealed block: no plane to measure
    if capture.keys.shape[2] >= BLOCK:
        # each store's planes as the scan reads them: the rotated store quantizes the float32 product k @ basis
        stores = {"raw": capture.keys, "rotated": np.einsum("lhnd,lhde->lhne", capture.keys.astype(np.float32),
                                                            basis)}
        for name, store_keys in stores.items():
            store = _quantized(store_keys)  # the cell means and both plane tables read the same codes
            levels = _cell_means(store)
            planes[f"plane_drops_{name}"], planes[f"scale2_{name}"] = _plane_drops(store)
            planes[f"levels_{name}"] = levels
            planes[f"level_drops_{name}"] = _plane_drops(store, levels)[0]
    return Calibration(sigma2_raw.astype(np.float32), basis, sigma2_rotated.astype(np.float32),
                       ds_rank.astype(np.int32), meta=dict(capture.meta), **planes)
