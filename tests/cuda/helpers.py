"""Shared test helpers for the GPU path."""

import numpy as np

from fathom.layout import StoreLayout, plane_word, scale_index
from fathom.quantize import PLANES


def write_store(planes: np.ndarray, scales: np.ndarray, layout: StoreLayout, group: int, records: np.ndarray) -> None:
    """The inverse of ``StoreLayout.read``: one group's reference planes and scales into host ``records``."""
    for c in range(layout.d):
        for block in range(planes.shape[2]):
            seg, b = divmod(block, layout.cap)
            record = layout.record(group, seg, c)
            for p in range(PLANES):
                records[plane_word(record, p, b, layout.scale_words, layout.cap)] = planes[c, p, block]
            records.view(np.uint16)[scale_index(record, b)] = scales.view(np.uint16)[c, block]


def top_byte_histogram(scores: np.ndarray) -> np.ndarray:
    """Per head of ``scores float32 [G, n]``, counts of the top byte of the order-preserving key -> int32 [G, 256]."""
    bits = np.ascontiguousarray(scores, np.float32).view(np.uint32)
    bits = np.where(bits == 0x80000000, np.uint32(0), bits)  # −0 counts as +0
    keys = np.where(bits >> 31, ~bits, bits | np.uint32(0x80000000))
    return np.stack([np.bincount(row >> 24, minlength=256) for row in keys]).astype(np.int32)
