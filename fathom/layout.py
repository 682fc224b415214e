"""Where the offloaded store keeps each channel's block scales and bit planes: the one place for its addresses.

The GPU store of one layer (``fathom.host.cache``) holds, per query group ``g`` (a (session, KV head) pair),
``n_seg`` segments of ``cap`` blocks of 64 tokens (design §3). Within a segment each channel has one **record** of
``uint64`` words::

    record(g, seg, c) = [ scales: cap fp16, packed 4 per word | plane 0: cap words | plane 1 | plane 2 | plane 3 ]

Records are channel-major within a segment and segments follow each other per group, so the first ``t`` planes of
channel ``c`` in a segment, with its scales in front, are **one contiguous run** of
``(scale_words + t · cap) · 8`` bytes: a scan that reads ``t`` planes of a channel reads exactly that prefix.
(The NumPy reference, ``fathom.store``, keeps planes and scales in separate arrays; both layouts hold the same
words, tested in ``tests/cuda``.)

The functions below are plain integer arithmetic so that the host (tests, byte accounting) and the kernels
(``fathom.cuda.layout`` compiles these same functions as device functions) share them.

Example (a depth-2 read of channel 1 is the run ``[record, record + scale_words + 2 · cap)``)::

    >>> layout = StoreLayout(groups=1, segments=2, d=4, cap=128)
    >>> layout.scale_words, layout.record_words
    (32, 544)
    >>> r = layout.record(group=0, segment=1, channel=1)
    >>> r, plane_word(r, 2, 5, 32, 128) - r
    (2720, 293)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fathom.quantize import PLANES

SCALES_PER_WORD = 4  # fp16 scales per uint64 word


def record_offset(group, segment, channel, n_segments, d, record_words):
    """First word of the record of ``channel`` in ``segment`` of ``group``."""
    return ((group * n_segments + segment) * d + channel) * record_words


def plane_word(record, plane, block, scale_words, cap):
    """Word of ``plane`` (0 = MSB) for ``block`` (within its segment) in the record starting at ``record``."""
    return record + scale_words + plane * cap + block


def scale_index(record, block):
    """Index of ``block``'s fp16 scale in a 16-bit view of the store (4 per word, in order)."""
    return record * SCALES_PER_WORD + block


@dataclass(frozen=True)
class StoreLayout:
    """Sizes of one layer's store: ``groups`` (session, KV head) pairs × ``segments`` × ``d`` records of
    ``cap`` blocks each."""

    groups: int
    segments: int
    d: int
    cap: int

    @property
    def scale_words(self) -> int:
        return -(-self.cap // SCALES_PER_WORD)

    @property
    def record_words(self) -> int:
        return self.scale_words + PLANES * self.cap

    @property
    def words(self) -> int:
        """Words of the whole store."""
        return self.groups * self.segments * self.d * self.record_words

    def record(self, group: int, segment: int, channel: int) -> int:
        return record_offset(group, segment, channel, self.segments, self.d, self.record_words)

    def read(self, records: np.ndarray, group: int, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """One group's first ``n_blocks`` blocks, from a host copy of the store ``uint64 [words]``: planes
        ``uint64 [d, 4, n_blocks]`` and scales ``float16 [d, n_blocks]``, the reference store's arrays."""
        planes = np.zeros((self.d, PLANES, n_blocks), np.uint64)
        scales = np.zeros((self.d, n_blocks), np.uint16)
        halves = records.view(np.uint16)
        for c in range(self.d):
            for block in range(n_blocks):
                seg, b = divmod(block, self.cap)
                record = self.record(group, seg, c)
                planes[c, :, block] = [records[plane_word(record, p, b, self.scale_words, self.cap)]
                                       for p in range(PLANES)]
                scales[c, block] = halves[scale_index(record, b)]
        return planes, scales.view(np.float16)
