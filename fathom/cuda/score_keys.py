"""The scores a scan hands the selection: each float32 score as its order key, split into 16-bit halves.

``keys``: uint32 ``[streams, G, 2, C]`` with ``C = key_columns(T)`` (32 a 64-token block): word ``w`` of
``keys[g, h, 0]`` holds the high halves of the order keys (``fathom.cuda.block.order_key``: unsigned order is the
floats' order, −0 counting as +0) of tokens ``64 (w // 32) + w % 32`` (its low 16 bits) and that token ``+ 32``
(its high 16 bits); the same word of ``keys[g, h, 1]`` holds their low halves. Those are the two tokens one lane of
the scan scores in a block (``fathom.cuda.scan``), so the scan writes a lane's two scores as two 32-bit words, as many
stores as two float32 scores took (a 16-bit store a key's half beside each score cost the scan 5%: docs/results.md).
The selection's passes (``fathom.cuda.topk``) compare only the top two key bytes: they read the high words alone,
two tokens a 32-bit load, half the bytes of the float32 scores; the low halves are read only for the candidates in
the k-th largest's bin of the top 16 bits (usually a few hundred a head).

Example (the keys of a float32 ``[streams, G, T]`` array, and back):
    keys = score_keys(scores)                        # uint32 [streams, G, 2, key_columns(T)]
    assert np.array_equal(keys_to_scores(keys)[..., :T], scores + 0)  # + 0: −0 reads back as +0
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fathom.cuda.block import order_key
from fathom.cuda.half import f32_to_bits
from fathom.quantize import BLOCK
from fathom.selection import order_keys

HALVES = 2  # the keys' second-to-last dimension: high halves, low halves
HALF_BLOCK = BLOCK // 2  # a word holds token l and token l + 32 of a block
SIGN = np.uint32(0x80000000)
HIGH = np.uint32(0xFFFF0000)


def key_columns(tokens: int) -> int:
    """The keys' last dimension for ``tokens`` tokens: 32 words a 64-token block (the last one padded)."""
    return -(-tokens // BLOCK) * HALF_BLOCK


def _interleaved(values: np.ndarray) -> np.ndarray:
    """``[..., C, 2]`` from ``[..., 2C]`` in token order: entry ``[w, e]`` is token ``64 (w // 32) + w % 32 + 32 e``."""
    blocks = values.reshape(values.shape[:-1] + (-1, 2, HALF_BLOCK))  # [..., block, e, l]
    return np.swapaxes(blocks, -1, -2).reshape(values.shape[:-1] + (-1, 2))


def score_keys(scores: np.ndarray) -> np.ndarray:
    """uint32 ``[..., 2, key_columns(T)]``: the split order keys of float32 ``scores [..., T]`` (the padding past
    ``T`` holds the key of +0)."""
    scores = np.asarray(scores, np.float32)
    tokens = scores.shape[-1]
    padded = np.zeros(scores.shape[:-1] + (2 * key_columns(tokens),), np.float32)
    padded[..., :tokens] = scores
    pairs = _interleaved(order_keys(padded))  # [..., C, 2]: the two tokens of each word
    high = (pairs[..., 0] >> np.uint32(16)) | (pairs[..., 1] & HIGH)
    low = (pairs[..., 0] & np.uint32(0xFFFF)) | (pairs[..., 1] << np.uint32(16))
    return np.stack([high, low], -2).astype(np.uint32)


def keys_to_scores(keys: np.ndarray) -> np.ndarray:
    """float32 ``[..., 2C]`` in token order: the scores whose split order keys are ``keys`` uint32 ``[..., 2, C]`` (a
    key of all ones, as a buffer filled with 0xFF bytes holds, reads as NaN)."""
    keys = np.asarray(keys)
    if keys.dtype != np.uint32 or keys.ndim < 2 or keys.shape[-2] != HALVES or keys.shape[-1] % HALF_BLOCK:
        raise ValueError(f"keys must be uint32 [..., {HALVES}, C] with C a multiple of {HALF_BLOCK}, got "
                         f"{keys.dtype} {keys.shape}")
    high, low = keys[..., 0, :], keys[..., 1, :]
    first = (high << np.uint32(16)) | (low & np.uint32(0xFFFF))
    second = (high & HIGH) | (low >> np.uint32(16))
    key = np.stack([first, second], -1)  # [..., C, 2]
    blocks = key.reshape(key.shape[:-2] + (-1, HALF_BLOCK, 2))  # [..., block, l, e]
    key = np.swapaxes(blocks, -1, -2).reshape(key.shape[:-2] + (-1,))
    bits = np.where(key >> np.uint32(31) != 0, key & ~SIGN, ~key).astype(np.uint32)
    return bits.view(np.float32)


def check_keys(keys, streams: int, heads: int) -> None:
    """Refuse a keys array that is not uint32 ``[streams, heads, 2, C]`` with ``C`` a multiple of 32."""
    if keys.dtype != np.uint32 or keys.ndim != 4 or keys.shape[:3] != (streams, heads, HALVES) \
            or keys.shape[3] % HALF_BLOCK:
        raise ValueError(f"keys must be uint32 [{streams}, {heads}, {HALVES}, C] with C a multiple of {HALF_BLOCK} "
                         f"(key_columns), got {keys.dtype} {keys.shape}")


@cuda.jit(device=True, inline=True)
def store_pair(keys, g, h, w, first, second):
    """Write the split order keys of the float32 scores ``first`` (token ``64 (w // 32) + w % 32``) and ``second``
    (that token + 32) as word ``w`` of ``keys[g, h]``; returns their keys."""
    key0 = order_key(f32_to_bits(first))
    key1 = order_key(f32_to_bits(second))
    keys[g, h, 0, w] = (key0 >> np.uint32(16)) | (key1 & HIGH)
    keys[g, h, 1, w] = (key0 & np.uint32(0xFFFF)) | (key1 << np.uint32(16))
    return key0, key1


@cuda.jit(device=True, inline=True)
def store_one(halves, g, h, j, value):
    """Write the split order key of token ``j``'s float32 score ``value`` into ``halves``, the keys viewed as uint16
    ``[streams, G, 2, 2C]`` (word ``w``'s low 16 bits are entry ``2w``): one token's halves, so two threads may write
    the two tokens of a word. Returns the key."""
    key = order_key(f32_to_bits(value))
    j = np.uint32(j)
    at = (j & ~np.uint32(BLOCK - 1)) | ((j & np.uint32(HALF_BLOCK - 1)) << np.uint32(1)) \
        | ((j >> np.uint32(5)) & np.uint32(1))
    halves[g, h, 0, at] = np.uint16(key >> np.uint32(16))
    halves[g, h, 1, at] = np.uint16(key & np.uint32(0xFFFF))
    return key
