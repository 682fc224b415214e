"""Shared test helpers for the GPU path."""

import numpy as np

from fathom.layout import StoreLayout
from fathom.quantize import PLANES


def write_store(planes: np.ndarray, scales: np.ndarray, layout: StoreLayout, group: int, near: np.ndarray,
                far: np.ndarray) -> None:
    """The inverse of ``StoreLayout.read``: one group's reference planes ``uint64 [d, 4, n_blocks]`` and scales
    ``float16 [d, n_blocks]`` into host ``near`` and ``far``."""
    arrays = {True: near, False: far}
    for c in range(layout.d):
        for block in range(planes.shape[2]):
            for p in range(PLANES):
                in_near, index = layout.word(group, block, c, p)
                arrays[in_near][index] = planes[c, p, block]
            in_near, index = layout.scale(group, block, c)
            arrays[in_near].view(np.uint16)[index] = scales.view(np.uint16)[c, block]


def top_byte_histogram(scores: np.ndarray) -> np.ndarray:
    """Per head of ``scores float32 [G, n]``, counts of the top byte of the order-preserving key -> int32 [G, 256]."""
    bits = np.ascontiguousarray(scores, np.float32).view(np.uint32)
    bits = np.where(bits == 0x80000000, np.uint32(0), bits)  # −0 counts as +0
    keys = np.where(bits >> 31, ~bits, bits | np.uint32(0x80000000))
    return np.stack([np.bincount(row >> 24, minlength=256) for row in keys]).astype(np.int32)
