"""Matrix products over a stack of leading dimensions as one GEMM (numpy's batched matmul is far slower)."""

from __future__ import annotations

import numpy as np


def stacked_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a [..., m] @ b [m, k]`` -> ``[..., k]``, computed as one 2-D product."""
    return (a.reshape(-1, a.shape[-1]) @ b).reshape(a.shape[:-1] + (b.shape[-1],))
