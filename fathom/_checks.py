"""Argument checks shared by the reference: every failure is a ValueError naming the argument."""

from __future__ import annotations

import numpy as np


def array(name: str, x, *, ndim: int | None = None, dtype=None, kind: str | None = None) -> np.ndarray:
    """Return ``x`` as an ndarray after checking its rank and dtype (exact ``dtype`` or numpy ``kind`` chars)."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {x.shape}")
    if dtype is not None and x.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {x.dtype}")
    if kind is not None and x.dtype.kind not in kind:
        raise ValueError(f"{name} must have a dtype of kind {kind!r}, got {x.dtype}")
    return x


def finite(name: str, x: np.ndarray) -> None:
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite (found NaN or inf)")


def nonnegative(name: str, x) -> None:
    if np.any(np.asarray(x) < 0) or not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite and >= 0")


def depths(name: str, x, d: int | None = None) -> np.ndarray:
    x = array(name, x, kind="iu")
    if d is not None and x.shape[-1] != d:
        raise ValueError(f"{name} must have {d} entries on its last axis, got shape {x.shape}")
    if x.size and (x.min() < 0 or x.max() > 4):
        raise ValueError(f"{name} must lie in 0..4, got range [{x.min()}, {x.max()}]")
    return x
