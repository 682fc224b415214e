"""The scores a scan hands the selection: each float32 score as its order key, split into 16-bit halves.

``keys``: uint16 ``[streams, G, 2, W]`` with ``W = key_width(T)`` (``T`` rounded up to even): ``keys[g, h, 0, j]``
is the high half of token ``j``'s order key (``fathom.cuda.block.order_key``: unsigned order is the floats' order,
−0 counting as +0) and ``keys[g, h, 1, j]`` its low half. The scans (``fathom.cuda.scan``, ``fathom.cuda.exact``)
write them through :func:`store_score`; the selection (``fathom.cuda.topk``) reads them.

Why split: the selection's two passes over every candidate compare only the top two key bytes, so they read the
high halves alone, two tokens a 32-bit load: half the bytes of the float32 scores they read before, in as many
loads. The low halves are read only for the candidates in the k-th largest's bin of the top 16 bits (usually a
few hundred a head). The scan writes the same 4 bytes a score as before.

Example (the keys of a float32 ``[streams, G, T]`` array, and back):
    keys = score_keys(scores)                        # uint16 [streams, G, 2, key_width(T)]
    assert np.array_equal(keys_to_scores(keys)[..., :T], scores + 0)  # + 0: −0 reads back as +0
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fathom.cuda.block import order_key
from fathom.cuda.half import f32_to_bits
from fathom.selection import order_keys

HALVES = 2  # the keys' second-to-last dimension: high half, low half
SIGN = np.uint32(0x80000000)


def key_width(tokens: int) -> int:
    """The keys' last dimension for ``tokens`` tokens: even, so the high halves read as pairs in 32-bit words."""
    return tokens + tokens % 2


def score_keys(scores: np.ndarray) -> np.ndarray:
    """uint16 ``[..., 2, key_width(T)]``: the split order keys of float32 ``scores [..., T]`` (a padding column,
    where ``T`` is odd, holds the key of +0)."""
    scores = np.asarray(scores, np.float32)
    tokens = scores.shape[-1]
    padded = np.zeros(scores.shape[:-1] + (key_width(tokens),), np.float32)
    padded[..., :tokens] = scores
    keys = order_keys(padded)
    return np.stack([(keys >> np.uint32(16)).astype(np.uint16), (keys & np.uint32(0xFFFF)).astype(np.uint16)], -2)


def keys_to_scores(keys: np.ndarray) -> np.ndarray:
    """float32 ``[..., W]``: the scores whose split order keys are ``keys`` uint16 ``[..., 2, W]`` (a key of all ones,
    as a buffer filled with 0xFFFF holds, reads as NaN)."""
    keys = np.asarray(keys)
    if keys.dtype != np.uint16 or keys.ndim < 2 or keys.shape[-2] != HALVES:
        raise ValueError(f"keys must be uint16 [..., {HALVES}, W], got {keys.dtype} {keys.shape}")
    key = (keys[..., 0, :].astype(np.uint32) << np.uint32(16)) | keys[..., 1, :].astype(np.uint32)
    bits = np.where(key >> np.uint32(31) != 0, key & ~SIGN, ~key).astype(np.uint32)
    return bits.view(np.float32)


def check_keys(keys, streams: int, heads: int) -> None:
    """Refuse a keys array that is not uint16 ``[streams, heads, 2, W]`` with ``W`` even."""
    if keys.dtype != np.uint16 or keys.ndim != 4 or keys.shape[:3] != (streams, heads, HALVES) or keys.shape[3] % 2:
        raise ValueError(f"keys must be uint16 [{streams}, {heads}, {HALVES}, W] with W even (key_width), got "
                         f"{keys.dtype} {keys.shape}")


@cuda.jit(device=True, inline=True)
def store_score(keys, g, h, j, value):
    """Write the float32 ``value``'s split order key at token ``j`` of ``keys[g, h]``; returns the key."""
    key = order_key(f32_to_bits(value))
    keys[g, h, 0, j] = np.uint16(key >> np.uint32(16))
    keys[g, h, 1, j] = np.uint16(key & np.uint32(0xFFFF))
    return key
