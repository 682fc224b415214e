"""The selection protocol every method follows (design §6).

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
    """``k`` per query head, plus sink, local and tail (design §6)."""

    k: int
    sink: int = 4
    local: int = 32

    def __post_init__(self):
        for name in ("k", "sink", "local"):
            object.__setattr__(self, name, _checks.integer(name, getattr(self, name), minimum=0))

    @staticmethod
    def for_context(n: int) -> Selection:
        """design §6's k by context: 128 at 4k, 256 at 16k, 512 at 32k and beyond."""
        return Selection(k=128 if n <= 8192 else 256 if n <= 16384 else 512)


def order_keys(scores: np.ndarray) -> np.ndarray:
    """uint32 keys with the order of ``scores`` (float32, any shape; −0 counts as +0): the NumPy twin of the
    selection kernels' ``fathom.cuda.block.order_key``, whose radix passes read them a byte at a time."""
    bits = np.ascontiguousarray(scores, np.float32).view(np.uint32)
    bits = np.where(bits == 0x80000000, np.uint32(0), bits)
    return np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def always_kept(n: int, n_scored: int, sel: Selection) -> np.ndarray:
    """bool ``[n]``: sink, local and the tail (tokens ``n_scored..n``)."""
    return _always_kept(np.array([n]), np.array([n_scored]), sel, n)[0]


def _always_kept(contexts: np.ndarray, scored: np.ndarray, sel: Selection, width: int) -> np.ndarray:
    token = np.arange(width)
    keep = (token < sel.sink) | (token >= contexts[:, None] - sel.local) | (token >= scored[:, None])
    return keep & (token < contexts[:, None])


def protocol_masks(contexts: np.ndarray, scored: np.ndarray, sel: Selection, width: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """What the protocol fixes before any score is read, for many decode positions -> bool ``[P, width]`` each:
    ``keep`` (sink, local and tail: always selected) and ``candidate`` (sealed tokens top-k chooses from)."""
    keep = _always_kept(contexts, scored, sel, width)
    return keep, ~keep & (np.arange(width) < scored[:, None])


def select(scores: np.ndarray, n: int, sel: Selection) -> np.ndarray:
    """Each head's selected set as a bool mask ``[G, n]``.

    Args:
        scores: ``[G, n_scored]`` scores of the sealed tokens ``0..n_scored`` (n_scored <= n).
        n: context length; tokens ``n_scored..n`` are the unsealed tail.
        sel: the protocol's settings.
    """
    scores = _checks.array("scores", scores, ndim=2, kind="f")
    if not _checks.is_integer(n):
        raise ValueError(f"n must be an integer context length, got {n!r}")
    if scores.shape[1] > n:
        raise ValueError(f"scores cover {scores.shape[1]} tokens, more than the context n = {n}")
    return select_many(scores[None], np.array([n]), np.array([scores.shape[1]]), sel, n)[0]


def select_many(scores: np.ndarray, contexts: np.ndarray, scored: np.ndarray, sel: Selection,
                width: int) -> np.ndarray:
    """:func:`select` for many decode positions at once -> bool ``[P, G, width]``.

    Args:
        scores: ``[P, G, S]``; position ``p`` uses the first ``scored[p] <= S`` of them.
        contexts: ``[P]`` context lengths (``scored[p] <= contexts[p] <= width``).
        scored: ``[P]`` sealed (scored) tokens of each position.
    """
    P, G, S = scores.shape
    if np.isnan(scores).any():  # a NaN sorts above every score: the k-th would be NaN and fewer than k kept
        raise ValueError("scores must not hold NaN")
    keep, candidate = protocol_masks(contexts, scored, sel, width)
    candidate = candidate[:, :S]
    mask = np.broadcast_to(keep[:, None, :], (P, G, width)).copy()
    k = min(sel.k, S)
    if k == 0:
        return mask
    masked = np.where(candidate[:, None, :], scores, -np.inf)
    kth = np.partition(masked, S - k, axis=-1)[..., S - k, None]  # k-th largest candidate (-inf if fewer)
    above = masked > kth
    ties = (masked == kth) & candidate[:, None, :]  # ties at the k-th score go to the earliest tokens
    take = above | (ties & (np.cumsum(ties, axis=-1) <= sel.k - above.sum(axis=-1, keepdims=True)))
    mask[..., :S] |= take
    return mask


def union_rows(mask: np.ndarray) -> int:
    """Distinct rows a KV head fetches: ``|∪_h selected_h|``."""
    return int(mask.any(axis=0).sum())
