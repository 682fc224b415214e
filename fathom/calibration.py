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

import numpy as np

from fathom.capture import Capture
from fathom.methods import BASES, HeadStats
from fathom.quantize import BLOCK, MAX_DEPTH, dequantize, pack_planes, quantize
from fathom.waterfill import calibrated_gains


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

    def head_stats(self, layer: int, head: int, basis: str) -> HeadStats:
        """Calibration stats of one (layer, KV head) in the ``basis`` ("raw" or "rotated") store."""
        rotated = basis == "rotated"
        sigma2 = self.sigma2_rotated if rotated else self.sigma2_raw
        drops = self.plane_drops_rotated if rotated else self.plane_drops_raw
        scale2 = self.scale2_rotated if rotated else self.scale2_raw
        return HeadStats(sigma2=sigma2[layer, head], ds_rank=self.ds_rank[layer, head],
                         plane_drops=None if drops is None else drops[layer, head],
                         scale2=None if scale2 is None else scale2[layer, head])

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
        np.savez(path, sigma2_raw=self.sigma2_raw, basis=self.basis, sigma2_rotated=self.sigma2_rotated,
                 ds_rank=self.ds_rank, preferred_basis=self.preferred_basis, meta=json.dumps(self.meta), **optional)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A saved calibration; files from before the gain table and the per-head rule load without them."""
        with np.load(path) as f:
            optional = {name: f[name] for name in _OPTIONAL if name in f.files}
            return cls(f["sigma2_raw"], f["basis"], f["sigma2_rotated"], f["ds_rank"],
                       str(f["preferred_basis"]), json.loads(str(f["meta"])), **optional)


_OPTIONAL = ("plane_drops_raw", "plane_drops_rotated", "scale2_raw", "scale2_rotated", "head_basis")
_PER_HEAD = ("sigma2_raw", "basis", "sigma2_rotated", "ds_rank", *_OPTIONAL)  # every array, [L, H, ...]


def plane_drops(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What each bit plane is worth on ``keys float [..., n, d]`` (one store's basis; the sealed 64-token blocks):
    (gain table ``[..., d, 4]`` by :func:`fathom.waterfill.calibrated_gains` from the drop of each channel's
    error variance over tokens at depth t - 1 -> t (depth 0: the channel unread, its error the key itself),
    mean squared fp16 block scale ``[..., d]``)."""
    keys = np.asarray(keys, np.float32)
    n_sealed = keys.shape[-2] // BLOCK * BLOCK
    if n_sealed == 0:
        raise ValueError(f"keys must hold at least one {BLOCK}-token block, got {keys.shape[-2]} tokens")
    flat = keys[..., :n_sealed, :].reshape(-1, n_sealed, keys.shape[-1])
    drops, scale2 = [], []
    for k in flat:
        codes, scales = quantize(k)  # uint8 [n, d], float16 [d, nb]
        planes = pack_planes(codes)
        k64 = k.astype(np.float64)
        variance = [k64.var(axis=0)]
        for t in range(1, MAX_DEPTH + 1):  # the keys as the scan reads them at depth t
            variance.append((k64 - dequantize(planes, scales, np.full(k.shape[1], t))).var(axis=0))
        drops.append(-np.diff(np.stack(variance, axis=-1), axis=-1))
        scale2.append(np.square(scales.astype(np.float64)).mean(axis=1))
    shape = keys.shape[:-2] + (keys.shape[-1],)
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
    drops_raw = drops_rotated = scale2_raw = scale2_rotated = None  # no sealed block: no plane to measure
    if capture.keys.shape[2] >= BLOCK:
        # each store's planes as the scan reads them: the rotated store quantizes the float32 product k @ basis
        drops_raw, scale2_raw = plane_drops(capture.keys)
        drops_rotated, scale2_rotated = plane_drops(np.einsum("lhnd,lhde->lhne", capture.keys.astype(np.float32),
                                                              basis))
    return Calibration(sigma2_raw.astype(np.float32), basis, sigma2_rotated.astype(np.float32),
                       ds_rank.astype(np.int32), meta=dict(capture.meta),
                       plane_drops_raw=drops_raw, plane_drops_rotated=drops_rotated, scale2_raw=scale2_raw,
                       scale2_rotated=scale2_rotated)
