"""The growing bit-plane store of one (layer, KV head) (design §3).

Sealed 64-token blocks live in fixed-capacity **segments**, each channel-major
``planes uint64 [d, 4, capacity]`` + ``scales float16 [d, capacity]``; a sealed
block is written once into the open segment and never rewritten, and a full
segment is followed by a new one, so an append costs O(1) amortised. The
not-yet-full tail block is kept exact and is always selected.

The first ``t`` planes of channel ``c`` in a segment are one :class:`Run`:
``t`` rows of ``blocks`` words spaced ``capacity`` words apart — one
contiguous run of ``t · capacity · 8`` bytes once the segment is full.

Example (the store of appended tokens equals the store built in one go)::

    >>> import numpy as np
    >>> from fathom.store import PlaneStore
    >>> k = np.random.default_rng(0).standard_normal((200, 16)).astype(np.float32)
    >>> grown = PlaneStore(16, segment_blocks=2)
    >>> for row in k:
    ...     grown.append(row[None])
    >>> whole = PlaneStore.from_keys(k, segment_blocks=2)
    >>> bool((grown.planes() == whole.planes()).all()), grown.n_sealed, grown.tail.shape
    (True, 192, (8, 16))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fathom import _checks
from fathom.quantize import BLOCK, PLANES, pack_planes, quantize

DEFAULT_SEGMENT_BLOCKS = 128  # 8k tokens: a depth-t run of one channel is (2 + 8 t) · 128 bytes, long enough for PCIe


@dataclass(frozen=True)
class Run:
    """The first ``planes`` planes of ``channel`` in ``segment``: ``planes`` rows of ``blocks``
    words, ``stride`` words apart (contiguous when ``blocks == stride`` or ``planes == 1``),
    plus the channel's ``blocks`` fp16 scales."""

    segment: int
    channel: int
    planes: int
    blocks: int
    stride: int

    @property
    def contiguous(self) -> bool:
        return self.blocks == self.stride or self.planes == 1

    @property
    def nbytes(self) -> int:
        return self.planes * self.blocks * 8 + self.blocks * 2


class Segment:
    """``capacity`` blocks of channel-major planes and scales, filled front to back."""

    def __init__(self, d: int, capacity: int):
        self.planes = np.zeros((d, PLANES, capacity), np.uint64)
        self.scales = np.zeros((d, capacity), np.float16)
        self.blocks = 0

    @property
    def capacity(self) -> int:
        return self.planes.shape[2]


class PlaneStore:
    """Bit planes of one (layer, KV head), in the store's basis: planes of ``k @ basis``.

    Args:
        d: head dim.
        segment_blocks: blocks (of 64 tokens) per segment.
        basis: optional orthonormal ``[d, d]`` (the rotated store holds ``Rᵀk``); None = raw channels.
    """

    def __init__(self, d: int, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS, basis: np.ndarray | None = None):
        if d <= 0:
            raise ValueError(f"d must be positive, got {d}")
        if segment_blocks <= 0:
            raise ValueError(f"segment_blocks must be positive, got {segment_blocks}")
        if basis is not None:  # scores in the rotated store equal q·k only for an orthonormal basis
            basis = _checks.orthonormal("basis", basis, d).astype(np.float32)
        self.d = d
        self.segment_blocks = segment_blocks
        self.basis = basis
        self.segments: list[Segment] = []
        self._tail = np.zeros((BLOCK, d), np.float32)
        self._n_tail = 0
        self._scale_sq_sum = np.zeros(d, np.float64)

    @classmethod
    def from_keys(cls, k: np.ndarray, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS,
                  basis: np.ndarray | None = None) -> PlaneStore:
        """Build the store of ``k float32 [n, d]`` in one go (any n; the remainder is the tail)."""
        k = _checks.array("k", k, ndim=2, dtype=np.float32)
        store = cls(k.shape[1], segment_blocks, basis)
        store.append(k)
        return store

    def checked(self, k: np.ndarray) -> np.ndarray:
        """``k float32 [m, d]`` in the store's basis, refused (ValueError) where :meth:`append` could not hold all of
        it: the store is left unchanged by a refused append."""
        k = _checks.array("k", k, ndim=2, dtype=np.float32)
        if k.shape[1] != self.d:
            raise ValueError(f"k must have {self.d} channels, got shape {k.shape}")
        _checks.finite("k", k)
        if self.basis is not None:
            k = k @ self.basis
        with np.errstate(over="ignore"):  # overflow to inf is the refusal
            if len(k) and not np.isfinite(np.abs(k).max().astype(np.float16)):
                raise ValueError("k has a value beyond the float16 range (65504) in the store's basis: its block "
                                 "scale cannot be stored")
        return k

    def append(self, k: np.ndarray) -> None:
        """Append ``k float32 [m, d]`` (m >= 0 new tokens); full blocks are sealed as they complete."""
        k = self.checked(k)
        while len(k):
            take = min(BLOCK - self._n_tail, len(k))
            if self._n_tail == 0 and take == BLOCK:  # whole blocks skip the tail buffer
                whole = len(k) // BLOCK * BLOCK
                self._seal(k[:whole])
                k = k[whole:]
                continue
            self._tail[self._n_tail:self._n_tail + take] = k[:take]
            self._n_tail += take
            k = k[take:]
            if self._n_tail == BLOCK:
                self._seal(self._tail)
                self._n_tail = 0

    def _seal(self, blocks: np.ndarray) -> None:
        codes, scales = quantize(np.ascontiguousarray(blocks, np.float32))
        planes = pack_planes(codes)
        self._scale_sq_sum += np.square(scales.astype(np.float64)).sum(axis=1)
        done = 0
        while done < planes.shape[2]:
            if not self.segments or self.segments[-1].blocks == self.segments[-1].capacity:
                self.segments.append(Segment(self.d, self.segment_blocks))
            seg = self.segments[-1]
            take = min(seg.capacity - seg.blocks, planes.shape[2] - done)
            seg.planes[:, :, seg.blocks:seg.blocks + take] = planes[:, :, done:done + take]
            seg.scales[:, seg.blocks:seg.blocks + take] = scales[:, done:done + take]
            seg.blocks += take
            done += take

    @property
    def n_blocks(self) -> int:
        return sum(seg.blocks for seg in self.segments)

    @property
    def n_sealed(self) -> int:
        """Tokens in sealed blocks (scanned)."""
        return self.n_blocks * BLOCK

    @property
    def n_tokens(self) -> int:
        return self.n_sealed + self._n_tail

    @property
    def tail(self) -> np.ndarray:
        """The exact, unsealed tail ``[n_tokens - n_sealed, d]`` (in the store's basis)."""
        return self._tail[:self._n_tail]

    @property
    def scale_variance(self) -> np.ndarray:
        """σ² from the store itself: the mean over sealed blocks of the squared fp16 scale, ``[d]``."""
        return self._scale_sq_sum / max(self.n_blocks, 1)

    def planes(self, first_block: int = 0) -> np.ndarray:
        """Sealed planes from block ``first_block`` on, ``uint64 [d, 4, n_blocks - first_block]`` (a copy)."""
        return np.concatenate([np.zeros((self.d, PLANES, 0), np.uint64)]
                              + [seg.planes[:, :, lo:hi] for seg, lo, hi in self._segment_blocks(first_block)], axis=2)

    def scales(self, first_block: int = 0) -> np.ndarray:
        """Sealed scales from block ``first_block`` on, ``float16 [d, n_blocks - first_block]`` (a copy)."""
        return np.concatenate([np.zeros((self.d, 0), np.float16)]
                              + [seg.scales[:, lo:hi] for seg, lo, hi in self._segment_blocks(first_block)], axis=1)

    def _segment_blocks(self, first_block: int) -> list[tuple[Segment, int, int]]:
        """(segment, lo, hi): the blocks ``lo..hi`` of each segment at or after sealed block ``first_block``."""
        if not 0 <= first_block <= self.n_blocks:
            raise ValueError(f"first_block must lie in 0..{self.n_blocks}, got {first_block}")
        spans, start = [], 0
        for seg in self.segments:
            lo = min(max(first_block - start, 0), seg.blocks)
            if lo < seg.blocks:
                spans.append((seg, lo, seg.blocks))
            start += seg.blocks
        return spans

    def runs(self, depths: np.ndarray) -> list[Run]:
        """The run list of a depth vector: one :class:`Run` per (active channel, segment)."""
        depths = _checks.depths("depths", depths, self.d)
        return [Run(i, int(c), int(depths[c]), seg.blocks, seg.capacity)
                for c in np.flatnonzero(depths) for i, seg in enumerate(self.segments) if seg.blocks]

    def read(self, run: Run) -> tuple[np.ndarray, np.ndarray]:
        """What a run reads: planes ``uint64 [t, blocks]`` and scales ``float16 [blocks]`` (views)."""
        seg = self.segments[run.segment]
        return seg.planes[run.channel, :run.planes, :run.blocks], seg.scales[run.channel, :run.blocks]

    def scan_nbytes(self, depths: np.ndarray) -> float:
        """Bytes a scan at ``depths`` reads (planes + scales): ``n_sealed · scan_bits(depths) / 8``."""
        return sum(r.nbytes for r in self.runs(depths))
