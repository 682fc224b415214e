"""Where the offloaded store keeps each channel's block scales and bit planes: the one place for its addresses.

The GPU store of one layer (``fathom.host.cache``) holds, per stream ``g`` (a (session, KV head) pair),
``n_seg`` segments of ``cap`` blocks of 64 tokens (design §3). Within a segment each channel has one **record** of
``uint64`` words::

    record(g, seg, c) = [ scales: cap fp16, packed 4 per word | plane 0: cap words | plane 1 | plane 2 | plane 3 ]

Records are channel-major within a segment and segments follow each other per stream, so the first ``t`` planes of
channel ``c`` in a segment, with its scales in front, are **one contiguous run** of
``(scale_words + t · cap) · 8`` bytes: a scan that reads ``t`` planes of a channel reads exactly that prefix.
(The NumPy reference, ``fathom.store``, keeps planes and scales in separate arrays; both layouts hold the same
words, tested in ``tests/cuda``.)

**Tiers.** Every query reads plane 1 of a channel before plane 2, so the record is cut after its first
``hbm_planes`` planes (the tier ``t``, 0..4) into two arrays laid out alike (same record order, each its own
record size)::

    near (HBM)          [ scales | planes 0 .. t-1 ]        t > 0, else empty
    far  (pinned host)  [ planes t .. 3 ]                   t > 0
                        [ scales | planes 0 .. 3 ]          t = 0: the whole record

The scales stay with plane 0 (a channel read at all reads both), so ``t = 0`` is the all-host store and ``t = 4``
the all-HBM store word for word (far empty). A channel read to depth ``d`` reads the run
``[scales | planes < min(d, t)]`` of its near record and the run ``[planes t .. d-1]`` of its far record.

The functions below are plain integer arithmetic so that the host (tests, byte accounting) and the kernels
(``fathom.cuda.layout`` compiles these same functions as device functions) share them. Each is self-contained
(none calls another): a device function may only call device functions.

Example (t = 2: a depth-3 read of channel 1 is the near run ``[near, near + scale_words + 2 · cap)`` and the far
run ``[far, far + cap)``)::

    >>> layout = StoreLayout(streams=1, segments=2, d=4, cap=128, hbm_planes=2)
    >>> layout.scale_words, layout.near_record_words, layout.far_record_words
    (32, 288, 256)
    >>> near, far = layout.near_record(0, 1, 1), layout.far_record(0, 1, 1)
    >>> near, far, plane_in_near(2, 2), plane_word(far, 2, 5, 32, 128, 2) - far
    (1440, 1280, False, 5)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fathom.quantize import PLANES

SCALES_PER_WORD = 4  # fp16 scales per uint64 word


def record_offset(stream, segment, channel, n_segments, d, record_words):
    """First word of the record of ``channel`` in ``segment`` of ``stream``, in an array of ``record_words``-word
    records (the near or the far array: their records are in the same order)."""
    return ((stream * n_segments + segment) * d + channel) * record_words


def plane_in_near(plane, hbm_planes):
    """Whether ``plane`` lives in the near (HBM) array."""
    return plane < hbm_planes


def scales_in_near(hbm_planes):
    """Whether the scales live in the near array (they go with plane 0)."""
    return hbm_planes > 0


def near_record_words(scale_words, cap, hbm_planes):
    """Words of a near record: ``[scales | planes 0 .. t-1]``, none at ``t = 0``."""
    return (scale_words if hbm_planes > 0 else 0) + hbm_planes * cap


def far_record_words(scale_words, cap, hbm_planes):
    """Words of a far record: ``[planes t .. 3]``, with the scales in front at ``t = 0``."""
    return (scale_words if hbm_planes == 0 else 0) + (PLANES - hbm_planes) * cap


def plane_word(record, plane, block, scale_words, cap, hbm_planes):
    """Word of ``plane`` (0 = MSB) for ``block`` (within its segment) in the record starting at ``record`` of the
    array holding the plane (near if ``plane_in_near(plane, hbm_planes)``, else far)."""
    if plane < hbm_planes or hbm_planes == 0:  # behind the scales: in the near record, or the whole one at t = 0
        return record + scale_words + plane * cap + block
    return record + (plane - hbm_planes) * cap + block


def scale_index(record, block):
    """Index of ``block``'s fp16 scale in a 16-bit view of the array holding the scales (4 per word, in order),
    ``record`` its record there."""
    return record * SCALES_PER_WORD + block


@dataclass(frozen=True)
class StoreLayout:
    """Sizes of one layer's store: ``streams`` (session, KV head) pairs × ``segments`` × ``d`` records of
    ``cap`` blocks each, the first ``hbm_planes`` planes (and the scales, if any) in the near array."""

    streams: int
    segments: int
    d: int
    cap: int
    hbm_planes: int = 0

    def __post_init__(self):
        if not 0 <= self.hbm_planes <= PLANES:
            raise ValueError(f"hbm_planes must be in 0..{PLANES}, got {self.hbm_planes}")

    @property
    def scale_words(self) -> int:
        return -(-self.cap // SCALES_PER_WORD)

    @property
    def record_words(self) -> int:
        """Words of a whole record (both tiers)."""
        return self.scale_words + PLANES * self.cap

    @property
    def near_record_words(self) -> int:
        return near_record_words(self.scale_words, self.cap, self.hbm_planes)

    @property
    def far_record_words(self) -> int:
        return far_record_words(self.scale_words, self.cap, self.hbm_planes)

    @property
    def records(self) -> int:
        """Records of the store: one per (stream, segment, channel)."""
        return self.streams * self.segments * self.d

    @property
    def near_words(self) -> int:
        """Words of the near (HBM) array."""
        return self.records * self.near_record_words

    @property
    def far_words(self) -> int:
        """Words of the far (pinned host) array."""
        return self.records * self.far_record_words

    def near_record(self, stream: int, segment: int, channel: int) -> int:
        return record_offset(stream, segment, channel, self.segments, self.d, self.near_record_words)

    def far_record(self, stream: int, segment: int, channel: int) -> int:
        return record_offset(stream, segment, channel, self.segments, self.d, self.far_record_words)

    def word(self, stream: int, block: int, channel: int, plane: int) -> tuple[bool, int]:
        """``(in_near, index)``: where the word of ``plane`` for ``block`` (counted over the stream's segments) of
        ``channel`` lives."""
        seg, b = divmod(block, self.cap)
        near = plane_in_near(plane, self.hbm_planes)
        record = (self.near_record if near else self.far_record)(stream, seg, channel)
        return near, plane_word(record, plane, b, self.scale_words, self.cap, self.hbm_planes)

    def scale(self, stream: int, block: int, channel: int) -> tuple[bool, int]:
        """``(in_near, index)``: where ``block``'s fp16 scale of ``channel`` lives, in a 16-bit view."""
        seg, b = divmod(block, self.cap)
        near = scales_in_near(self.hbm_planes)
        record = (self.near_record if near else self.far_record)(stream, seg, channel)
        return near, scale_index(record, b)

    def read(self, near: np.ndarray, far: np.ndarray, stream: int, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """One stream's first ``n_blocks`` blocks, from host copies of the store ``uint64 [near_words]`` and
        ``uint64 [far_words]``: planes ``uint64 [d, 4, n_blocks]`` and scales ``float16 [d, n_blocks]``, the
        reference store's arrays."""
        arrays = {True: near, False: far}
        planes = np.zeros((self.d, PLANES, n_blocks), np.uint64)
        scales = np.zeros((self.d, n_blocks), np.uint16)
        for c in range(self.d):
            for block in range(n_blocks):
                for p in range(PLANES):
                    in_near, index = self.word(stream, block, c, p)
                    planes[c, p, block] = arrays[in_near][index]
                in_near, index = self.scale(stream, block, c)
                scales[c, block] = arrays[in_near].view(np.uint16)[index]
        return planes, scales.view(np.float16)
