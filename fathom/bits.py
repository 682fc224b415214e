"""Bit accounting: one convention for every method (design §4).

Scan bits per token (per KV head, per layer) = planes read + 0.25 per channel
touched (its fp16 block scale spread over 64 tokens). Winner rows cost a bf16
K row plus a bf16 V row, ``4 · d`` bytes each.
"""

from __future__ import annotations

import numpy as np

from fathom import _checks
from fathom.quantize import BLOCK, PLANES

SCALE_BITS = 16 / BLOCK  # fp16 block scale per token: 0.25 bit
BF16_BITS = 16


def scan_bits(depths: np.ndarray) -> np.ndarray | float:
    """``Σ_c b_c + 0.25 · #{c : b_c > 0}`` over the last axis of ``depths`` (int, 0..4)."""
    b = _checks.depths("depths", np.asarray(depths) if not isinstance(depths, np.ndarray) else depths)
    bits = b.sum(axis=-1) + SCALE_BITS * (b > 0).sum(axis=-1)
    return float(bits) if np.ndim(bits) == 0 else bits.astype(np.float64)


def tier_scan_bits(depths: np.ndarray, hbm_planes: int) -> tuple[np.ndarray | float, np.ndarray | float]:
    """:func:`scan_bits` split by the tier of a store whose scales and first ``hbm_planes`` planes are in HBM
    (``fathom.layout``): ``(near, far)`` bits per token, near (HBM) ``Σ_c min(b_c, t)`` plus the scales when
    ``t > 0``, far (over the link) ``Σ_c max(b_c − t, 0)`` plus the scales when ``t = 0``; they sum to
    :func:`scan_bits`."""
    if not 0 <= hbm_planes <= PLANES:
        raise ValueError(f"hbm_planes must be in 0..{PLANES}, got {hbm_planes!r}")
    b = _checks.depths("depths", np.asarray(depths) if not isinstance(depths, np.ndarray) else depths)
    scales = SCALE_BITS * (b > 0).sum(axis=-1)
    near = np.minimum(b, hbm_planes).sum(axis=-1) + (scales if hbm_planes else 0)
    far = np.maximum(b.astype(np.int64) - hbm_planes, 0).sum(axis=-1) + (0 if hbm_planes else scales)
    return tuple(float(x) if np.ndim(x) == 0 else x.astype(np.float64) for x in (near, far))


def fixed_channel_bits(r: int) -> float:
    """r channels read at 4 bits (SparQ, Double Sparsity, Loki): 136 at r = 32."""
    return r * (4 + SCALE_BITS)


def landmark_bits(d: int, tokens_per_landmark: int = 8) -> float:
    """One fp16 mean key per ``tokens_per_landmark`` tokens: 256 at d = 128."""
    return d * BF16_BITS / tokens_per_landmark


def full_key_bits(d: int) -> float:
    """bf16 K, what the exact-score oracle reads: 2048 at d = 128."""
    return d * BF16_BITS


def row_bytes(d: int) -> int:
    """One winner row: bf16 K plus bf16 V."""
    return 4 * d
