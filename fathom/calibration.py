"""Calibration statistics, once per model, per layer and KV head (design §5, §7).

* ``sigma2_raw``: variance of each key channel (water-filling's σ², raw store);
* ``basis``: eigenbasis of the key covariance, columns ordered by calibration
  score variance ``λ_i · mean_q (q · e_i)²`` — the rotated store (fathom-rotated)
  and Loki's PCA coordinates are the same basis;
* ``sigma2_rotated``: variance of each rotated coordinate (in that order);
* ``ds_rank``: channels by Double Sparsity's ``mean |q_c| · mean |k_c|``, descending;
* ``preferred_basis``: the basis rule's decision for the model ("raw" or "rotated"),
  made on calibration text and recorded here ("" until decided).

Saved and loaded as one small ``.npz`` per model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from fathom.capture import Capture
from fathom.methods import HeadStats


@dataclass(frozen=True)
class Calibration:
    sigma2_raw: np.ndarray  # [L, H, d]
    basis: np.ndarray  # [L, H, d, d], columns are the rotated coordinates
    sigma2_rotated: np.ndarray  # [L, H, d]
    ds_rank: np.ndarray  # [L, H, d]
    preferred_basis: str = ""
    meta: dict = field(default_factory=dict)

    def head_stats(self, layer: int, head: int, basis: str) -> HeadStats:
        """Calibration stats of one (layer, KV head) in the ``basis`` ("raw" or "rotated") store."""
        sigma2 = self.sigma2_rotated if basis == "rotated" else self.sigma2_raw
        return HeadStats(sigma2=sigma2[layer, head], ds_rank=self.ds_rank[layer, head])

    def with_preferred_basis(self, basis: str) -> Calibration:
        if basis not in ("raw", "rotated"):
            raise ValueError(f"basis must be 'raw' or 'rotated', got {basis!r}")
        return replace(self, preferred_basis=basis)

    def save(self, path: str | Path) -> None:
        np.savez(path, sigma2_raw=self.sigma2_raw, basis=self.basis, sigma2_rotated=self.sigma2_rotated,
                 ds_rank=self.ds_rank, preferred_basis=self.preferred_basis, meta=json.dumps(self.meta))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        with np.load(path) as f:
            return cls(f["sigma2_raw"], f["basis"], f["sigma2_rotated"], f["ds_rank"],
                       str(f["preferred_basis"]), json.loads(str(f["meta"])))


def calibrate(capture: Capture) -> Calibration:
    """All statistics from a calibration capture (keys and decode queries of calibration text)."""
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
    return Calibration(sigma2_raw.astype(np.float32), basis.astype(np.float32), sigma2_rotated.astype(np.float32),
                       ds_rank.astype(np.int32), meta=dict(capture.meta))
