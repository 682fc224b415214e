"""The selection protocol every method follows (SPEC §6).

Always kept: the first 4 tokens (sink), the last 32 (local) and the unsealed
tail. From the rest, each query head keeps its own top-k by the method's
scores (ties go to the earlier token). The rows fetched for a KV head are the
union of its G heads' selections.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fathom import _checks


@dataclass(frozen=True)
class Selection:
    """``k`` per query head, plus sink, local and tail (SPEC §6)."""

    k: int
    sink: int = 4
    local: int = 32

    def __post_init__(self):
        for name in ("k", "sink", "local"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @staticmethod
    def for_context(n: int) -> Selection:
        """SPEC §6's k by context: 128 at 4k, 256 at 16k, 512 at 32k and beyond."""
        return Selection(k=128 if n <= 8192 else 256 if n <= 16384 else 512)


def always_kept(n: int, n_scored: int, sel: Selection) -> np.ndarray:
    """bool ``[n]``: sink, local and the tail (tokens ``n_scored..n``)."""
    keep = np.zeros(n, bool)
    keep[:sel.sink] = True
    keep[max(n - sel.local, 0):] = True
    keep[n_scored:] = True
    return keep


def select(scores: np.ndarray, n: int, sel: Selection) -> np.ndarray:
    """Each head's selected set as a bool mask ``[G, n]``.

    Args:
        scores: ``[G, n_scored]`` scores of the sealed tokens ``0..n_scored`` (n_scored <= n).
        n: context length; tokens ``n_scored..n`` are the unsealed tail.
        sel: the protocol's settings.
    """
    scores = _checks.array("scores", scores, ndim=2, kind="f")
    n_scored = scores.shape[1]
    if n_scored > n:
        raise ValueError(f"scores cover {n_scored} tokens, more than the context n = {n}")
    keep = always_kept(n, n_scored, sel)
    candidates = np.flatnonzero(~keep[:n_scored])
    mask = np.broadcast_to(keep, (scores.shape[0], n)).copy()
    if len(candidates) <= sel.k or sel.k == 0:
        mask[:, candidates] = sel.k > 0
        return mask
    cand_scores = scores[:, candidates]  # [G, C]
    kth = np.partition(cand_scores, len(candidates) - sel.k, axis=1)[:, len(candidates) - sel.k, None]
    above = cand_scores > kth
    ties = cand_scores == kth  # ties at the k-th score go to the earliest tokens
    take = above | (ties & (np.cumsum(ties, axis=1) <= sel.k - above.sum(axis=1, keepdims=True)))
    mask[:, candidates] = take
    return mask


def union_rows(mask: np.ndarray) -> int:
    """Distinct rows a KV head fetches: ``|∪_h selected_h|``."""
    return int(mask.any(axis=0).sum())
