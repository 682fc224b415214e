"""Exact softmax attention over a selected set, and the fidelity metric (design §6)."""

from __future__ import annotations

import numpy as np

from fathom._linalg import stacked_matmul


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None,
              scale: float | None = None) -> np.ndarray:
    """``softmax(q kᵀ · scale) v`` per head over its selected keys.

    Args:
        q: ``[G, d]``; k: ``[n, d]``; v: ``[n, dv]``; mask: bool ``[G, n]`` (None = dense);
        scale: softmax scale, default ``1 / sqrt(d)``.
    Returns:
        float64 ``[G, dv]``.
    """
    return attend(logits(q, k, scale), v, mask)


def logits(q: np.ndarray, k: np.ndarray, scale: float | None = None) -> np.ndarray:
    """``q kᵀ · scale`` in float64, ``[..., G, n]``; scale defaults to ``1 / sqrt(d)``."""
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    return stacked_matmul(q.astype(np.float64), k.astype(np.float64).T) * scale


def attend(logits: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Softmax of ``logits [..., G, n]`` over the keys in ``mask``, applied to ``v [n, dv]``."""
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return stacked_matmul(p, v.astype(np.float64))


def relative_error(o_sparse: np.ndarray, o_dense: np.ndarray) -> np.ndarray:
    """``‖o_sparse − o_dense‖ / ‖o_dense‖`` over the last axis."""
    return np.linalg.norm(o_sparse - o_dense, axis=-1) / np.linalg.norm(o_dense, axis=-1)
