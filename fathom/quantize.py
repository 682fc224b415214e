"""The 4-bit block quantizer and its channel-major bit-plane layout (design §2, §3).

Keys are cut into blocks of 64 tokens. Per block and channel the fp16 scale is
``s = float16(max |k|)``, the cell width ``Δ = s / 8`` and the code
``u = clip(floor(k / Δ) + 8, 0, 15)``. Plane ``p`` holds bit ``3 - p`` of the
codes, so plane 0 is the sign and the first ``t`` planes of a channel are its
``t``-bit mid-rise quantizer of ``[-s, s]``: reading deeper only refines.

Example (a prefix of planes is a coarser quantizer of the same keys)::

    >>> import numpy as np
    >>> from fathom import reference as ref
    >>> k = np.random.default_rng(0).standard_normal((128, 8)).astype(np.float32)
    >>> codes, scales = ref.quantize(k)
    >>> planes = ref.pack_planes(codes)
    >>> bool((ref.unpack_planes(planes) == codes).all())
    True
    >>> errs = [float(np.abs(ref.dequantize(planes, scales, np.full(8, t)) - k).max()) for t in (1, 2, 3, 4)]
    >>> all(a > b for a, b in zip(errs, errs[1:]))
    True
"""

from __future__ import annotations

import numpy as np

from fathom import _checks

BLOCK = 64  # tokens per block: one uint64 word per (channel, plane, block)
PLANES = 4  # bits per code
MAX_DEPTH = PLANES
_SHIFTS = np.arange(PLANES - 1, -1, -1, dtype=np.uint8)  # plane p holds bit 3 - p
# _PREFIX[t, i]: weight of plane i in the t-bit prefix code u >> (4 - t)
_PREFIX = np.array([[0, 0, 0, 0], [1, 0, 0, 0], [2, 1, 0, 0], [4, 2, 1, 0], [8, 4, 2, 1]], np.float32)
CELLS = 2 ** PLANES  # cells of the deepest prefix: a reconstruction table's last axis


def midpoint_levels(d: int) -> np.ndarray:
    """The design's reconstruction as a table: each t-bit cell read as its midpoint, float32 ``[d, 4, 16]`` in units
    of Δ, entry ``[c, t - 1, p] = (p + 0.5) · 2^(4-t) − 8`` for ``p < 2^t`` (0 past). :func:`dequantize` with it
    equals :func:`dequantize` without a table, bit for bit (tested)."""
    levels = np.zeros((d, MAX_DEPTH, CELLS), np.float32)
    for t in range(1, MAX_DEPTH + 1):
        levels[:, t - 1, :2 ** t] = (np.arange(2 ** t, dtype=np.float32) + np.float32(0.5)) * np.float32(
            2 ** (MAX_DEPTH - t)) - np.float32(8)
    return levels


def check_levels(levels, d: int) -> np.ndarray:
    """A reconstruction table ``float32 [d, 4, 16]`` (finite), refused in one line otherwise."""
    levels = _checks.array("levels", levels, ndim=3, dtype=np.float32)
    if levels.shape != (d, MAX_DEPTH, CELLS):
        raise ValueError(f"levels must have shape {(d, MAX_DEPTH, CELLS)}, got {levels.shape}")
    _checks.finite("levels", levels)
    return levels


def quantize(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize keys to 4-bit codes with one fp16 scale per (channel, 64-token block).

    Args:
        k: float32 ``[n, d]``, ``n % 64 == 0``, finite, ``|k| <= 65504`` (fp16 range).
    Returns:
        codes: uint8 ``[n, d]`` in 0..15; scales: float16 ``[d, n // 64]``.
    """
    k = _checks.array("k", k, ndim=2, dtype=np.float32)
    n, d = k.shape
    if n % BLOCK:
        raise ValueError(f"k must have a multiple of {BLOCK} rows (tokens), got {n}")
    _checks.finite("k", k)
    blocks = k.reshape(n // BLOCK, BLOCK, d)
    with np.errstate(over="ignore"):  # overflow to inf is reported just below
        s16 = np.abs(blocks).max(axis=1).astype(np.float16)  # [nb, d]
    if not np.all(np.isfinite(s16)):
        raise ValueError("k has a block maximum beyond the float16 range (65504); its scale cannot be stored")
    delta = s16.astype(np.float32) / np.float32(8)
    zero = delta == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.floor(blocks / np.where(zero, np.float32(1), delta)[:, None, :]) + np.float32(8)
    u = np.where(zero[:, None, :], np.float32(8), u)
    codes = np.clip(u, 0, 15).astype(np.uint8).reshape(n, d)
    return codes, np.ascontiguousarray(s16.T)


def pack_planes(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``uint8 [n, d]`` into channel-major planes ``uint64 [d, 4, n // 64]``.

    Token ``j`` of a block is bit ``j`` of its word; plane 0 holds the MSB.
    """
    codes = _checks.array("codes", codes, ndim=2, dtype=np.uint8)
    n, d = codes.shape
    if n % BLOCK:
        raise ValueError(f"codes must have a multiple of {BLOCK} rows (tokens), got {n}")
    if codes.size and codes.max() > 15:
        raise ValueError(f"codes must lie in 0..15, got max {codes.max()}")
    by_block = codes.T.reshape(d, 1, n // BLOCK, BLOCK)
    bits = (by_block >> _SHIFTS[None, :, None, None]) & 1  # [d, 4, nb, 64]
    packed = np.packbits(bits, axis=-1, bitorder="little")  # [d, 4, nb, 8] bytes, token 0 in the LSB
    return np.ascontiguousarray(packed).view("<u8")[..., 0].astype(np.uint64)


def plane_bits(planes: np.ndarray) -> np.ndarray:
    """The bits of every plane, ``uint8 [d, 4, n]`` (token order restored)."""
    planes = _checks.array("planes", planes, ndim=3, dtype=np.uint64)
    d, p, nb = planes.shape
    if p != PLANES:
        raise ValueError(f"planes must have {PLANES} planes on axis 1, got shape {planes.shape}")
    as_bytes = np.ascontiguousarray(planes).astype("<u8").view(np.uint8).reshape(d, p, nb, 8)
    return np.unpackbits(as_bytes, axis=-1, bitorder="little").reshape(d, p, nb * BLOCK)


def unpack_planes(planes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_planes`: ``uint64 [d, 4, nb]`` -> codes ``uint8 [nb * 64, d]``."""
    bits = plane_bits(planes)
    codes = np.zeros(bits.shape[::2], np.uint8)  # [d, n]
    for p in range(PLANES):
        codes |= bits[:, p] << _SHIFTS[p]
    return np.ascontiguousarray(codes.T)


def dequantize(planes: np.ndarray, scales: np.ndarray, depths: np.ndarray, levels: np.ndarray | None = None
               ) -> np.ndarray:
    """Reconstruct keys from the first ``depths[c]`` planes of each channel ``c``.

    ``k̂_t = ((p + 0.5) · 2^(4-t) − 8) · Δ`` with ``p = u >> (4 - t)``; depth 0 gives 0. With a reconstruction
    table ``levels`` the cell reads as ``levels[c, t - 1, p] · Δ`` instead (the calibrated cell means of
    :func:`fathom.calibration.cell_means`: the same bits, read as the keys that fall in the cell are on average).

    Args:
        planes: uint64 ``[d, 4, nb]``; scales: float16 ``[d, nb]``, finite and >= 0; depths: int ``[d]`` in 0..4;
        levels: float32 ``[d, 4, 16]`` in units of Δ, or None (the midpoints).
    Returns:
        float32 ``[nb * 64, d]``.
    """
    bits = plane_bits(planes)
    d, _, n = bits.shape
    scales = _checks.array("scales", scales, ndim=2, dtype=np.float16)
    if scales.shape != (d, n // BLOCK):
        raise ValueError(f"scales must have shape {(d, n // BLOCK)} to match planes, got {scales.shape}")
    _checks.nonnegative("scales", scales)  # a NaN, infinite or negative scale would give NaN or flipped keys
    t = _checks.depths("depths", depths, d).astype(np.int64)
    if t.ndim != 1:
        raise ValueError(f"depths must have rank 1, got shape {t.shape}")
    prefix = np.einsum("ci,cin->cn", _PREFIX[t], bits.astype(np.float32))  # u >> (4 - t), [d, n]
    delta = np.repeat(scales.astype(np.float32) / np.float32(8), BLOCK, axis=1)
    if levels is not None:
        table = check_levels(levels, d)[np.arange(d), np.maximum(t, 1) - 1]  # [d, 16]: each channel's depth
        read = np.take_along_axis(table, prefix.astype(np.int64), axis=1) * delta
        value = np.where((t > 0)[:, None], read, np.float32(0))
        return np.ascontiguousarray(value.T.astype(np.float32))
    cell = np.where(t > 0, np.exp2(np.float32(4) - t.astype(np.float32)), np.float32(0))[:, None]
    value = ((prefix + np.float32(0.5)) * cell - np.float32(8) * (cell > 0)) * delta
    return np.ascontiguousarray(value.T.astype(np.float32))
