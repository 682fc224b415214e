"""Argument checks shared by the reference and the host side: every failure is a ValueError naming the argument."""

from __future__ import annotations

import numbers

import numpy as np

ORTHONORMAL_ATOL = 1e-4  # RᵀR = I within this, the GPU cache's tolerance too


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


def is_integer(x) -> bool:
    """Whether ``x`` is an integer, Python's or NumPy's (not a bool, nor a float even when whole)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def integer(name: str, x, minimum: int | None = None) -> int:
    """``x`` as an int after checking it is an integer (not a bool, float or string) ``>= minimum``."""
    if not is_integer(x):
        raise ValueError(f"{name} must be an integer, got {x!r}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def is_real(x) -> bool:
    """Whether ``x`` is a finite real number, Python's or NumPy's (not a bool, nor a string)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and bool(np.isfinite(x))


def real(name: str, x) -> float:
    """``x`` as a float after checking it is a finite real number (:func:`is_real`)."""
    if not is_real(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return float(x)


def orthonormal(name: str, basis, d: int) -> np.ndarray:
    """Return ``basis`` after checking it is a finite float ``[d, d]`` with ``RᵀR = I`` (within 1e-4)."""
    basis = array(name, basis, ndim=2, kind="f")
    if basis.shape != (d, d):
        raise ValueError(f"{name} must have shape {(d, d)}, got {basis.shape}")
    finite(name, basis)
    gram = basis.astype(np.float64).T @ basis.astype(np.float64)
    if not np.allclose(gram, np.eye(d), atol=ORTHONORMAL_ATOL):
        raise ValueError(f"{name} must be orthonormal: RᵀR = I within {ORTHONORMAL_ATOL}, "
                         f"off by up to {np.abs(gram - np.eye(d)).max():.3g}")
    return basis


def stream_sessions(streams: int, heads_per_session, lengths) -> None:
    """A kernel's streams and sessions agree: stream ``g`` is session ``g // heads_per_session`` (an integer >= 1
    that divides ``streams``), and ``lengths`` holds one length per session — else a kernel would index past it."""
    if not is_integer(heads_per_session) or heads_per_session < 1 or streams % heads_per_session:
        raise ValueError(f"heads_per_session must be an integer >= 1 dividing the {streams} streams, got "
                         f"{heads_per_session!r}")
    if tuple(lengths.shape) != (streams // heads_per_session,):
        raise ValueError(f"lengths must hold one length per session, [{streams // heads_per_session}], got "
                         f"{list(lengths.shape)}")
