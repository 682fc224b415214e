"""Approximate scores: the one scorer every depth-policy method shares, plus landmark and exact.

``score[h, j] = Σ_c q[h, c] · k̂_{b_c}[j, c]`` over the store's planes read to
per-channel depths ``b`` (design §5). Any basis: the query must be in the
store's basis (``q @ R`` for a rotated store).
"""

from __future__ import annotations

import numpy as np

from fathom import _checks
from fathom._linalg import stacked_matmul
from fathom.quantize import MAX_DEPTH, check_levels, dequantize
from fathom.growing import GrowingRows

LANDMARK_TOKENS = 8  # ShadowKV-style: one fp16 mean key per 8-token block


def approx_scores(q: np.ndarray, planes: np.ndarray, scales: np.ndarray, depths: np.ndarray,
                  levels: np.ndarray | None = None) -> np.ndarray:
    """Scores of ``q float32 [G, d]`` against planes read to ``depths int [d]`` (through ``levels``, see
    :func:`fathom.quantize.dequantize`) -> float32 ``[G, n]``."""
    q = _checks.array("q", q, ndim=2, kind="f")
    khat = dequantize(planes, scales, depths, levels)
    if q.shape[1] != khat.shape[1]:
        raise ValueError(f"q must have {khat.shape[1]} channels, got shape {q.shape}")
    return (q.astype(np.float32) @ khat.T).astype(np.float32)


class DepthScorer:
    """Scores at any depth vector from dequantized copies at depths 1..4, computed once per block.

    Equal to :func:`approx_scores` (tested); for evaluating many queries and
    policies over one store: ``scores = Σ_t (q ⊙ [b == t]) @ k̂_tᵀ``. A growing
    store :meth:`extend` s it with its newly sealed blocks only. ``levels``: the
    reconstruction table the planes are read through (``float32 [d, 4, 16]``,
    :func:`fathom.quantize.dequantize`; None: the midpoints).
    """

    def __init__(self, planes: np.ndarray, scales: np.ndarray, levels: np.ndarray | None = None):
        self.d = planes.shape[0]
        self.levels = None if levels is None else check_levels(levels, self.d)
        self._khat = [GrowingRows(self.d) for _ in range(MAX_DEPTH)]
        self.extend(planes, scales)

    def extend(self, planes: np.ndarray, scales: np.ndarray) -> None:
        """Add the blocks of ``planes uint64 [d, 4, nb]``, ``scales float16 [d, nb]`` after those held."""
        for t in range(1, MAX_DEPTH + 1):
            self._khat[t - 1].append(dequantize(planes, scales, np.full(self.d, t), self.levels))

    def khat(self, t: int) -> np.ndarray:
        """The keys every block holds read to depth ``t`` in 1..4, float32 ``[n, d]``."""
        return self._khat[t - 1].array

    def __call__(self, q: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """``q [..., G, d]`` with ``depths [..., d]`` -> ``[..., G, n]``."""
        return depth_scores([self.khat(t) for t in range(1, MAX_DEPTH + 1)], q,
                            _checks.depths("depths", depths, self.d))


def depth_scores(khats: list[np.ndarray], q: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """``Σ_t (q ⊙ [b == t]) @ k̂_tᵀ``: scores of ``q [..., G, d]`` read at ``depths [..., d]`` (0..4, checked
    by the caller) from the keys at every depth, ``khats[t - 1] float32 [n, d]`` -> ``[..., G, n]``."""
    q = q.astype(np.float32)
    scores = np.zeros(q.shape[:-1] + (khats[0].shape[0],), np.float32)
    for t in range(1, MAX_DEPTH + 1):
        at_t = depths == t
        if at_t.any():
            scores += stacked_matmul(q * at_t[..., None, :], khats[t - 1].T)
    return scores


def landmarks(k: np.ndarray) -> np.ndarray:
    """fp16 mean key of each 8-token block: ``k [n, d]`` (n % 8 == 0) -> float16 ``[n // 8, d]``."""
    k = _checks.array("k", k, ndim=2, kind="f")
    if k.shape[0] % LANDMARK_TOKENS:
        raise ValueError(f"k must have a multiple of {LANDMARK_TOKENS} rows, got {k.shape[0]}")
    return k.reshape(-1, LANDMARK_TOKENS, k.shape[1]).mean(axis=1, dtype=np.float32).astype(np.float16)


def landmark_scores(q: np.ndarray, marks: np.ndarray) -> np.ndarray:
    """Each token's score is its block's: ``q [G, d]``, ``marks float16 [n // 8, d]`` -> ``[G, n]``."""
    block_scores = stacked_matmul(q.astype(np.float32), marks.astype(np.float32).T)
    return np.repeat(block_scores, LANDMARK_TOKENS, axis=-1)


def exact_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The oracle's scores ``q @ kᵀ`` (float32)."""
    return stacked_matmul(q.astype(np.float32), k.astype(np.float32).T)
