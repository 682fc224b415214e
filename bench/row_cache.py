"""An HBM row cache simulated on the rows one (layer, session, KV head) selects step after step (issue 14 item 2).

A decode step fetches the K/V rows its query heads selected (their union). A
cache that keeps recently fetched rows on the GPU sends only its misses over
the link. Two policies, both over a list ``steps`` of the row ids (token
positions) each step selected:

* :func:`previous_step_reuse` — keep exactly the previous step's rows:
  ``|rows_t ∩ rows_{t−1}| / |rows_t|``;
* :func:`lru_hits` — an LRU of ``capacity`` rows: a selected row already held
  is a hit; the step's rows are then the most recently used (hits refreshed,
  misses inserted) and the least recently used rows beyond ``capacity`` are
  evicted (when a step selects more rows than the cache holds, its hits go
  before its misses, each in ascending row order).

Both give one fraction per step from the second on: the first step finds the
cache cold and has no previous step.

What the misses cost depends on where they lie in pinned host memory: a GPU
gathering 512-byte rows at random from 8 GiB of it reads 17 GB/s, and 49 GB/s
(the link's rate) when every 4 KiB page it touches gives it 8 rows (an H200
probe, ``docs/results.md``). :func:`pages_touched` counts the 4 KiB pages one
layer's gather of one session touches, in the host cache's layout (each KV
head's rows contiguous, ``stream-major``) and with a token's rows of every KV
head side by side (``token-major``).

Example (worked by hand in ``tests/bench/test_rowreuse.py``)::

    >>> import numpy as np
    >>> from bench.row_cache import lru_hits, previous_step_reuse
    >>> steps = [np.array([1, 2, 3]), np.array([2, 3, 4]), np.array([1, 4, 5])]
    >>> previous_step_reuse(steps).tolist()
    [0.6666666666666666, 0.3333333333333333]
    >>> lru_hits(steps, capacity=3).tolist(), lru_hits(steps, capacity=4).tolist()
    ([2, 1], [2, 2])
    >>> [m.tolist() for m in lru_misses(steps, capacity=3)]
    [[1, 2, 3], [4], [1, 5]]
    >>> pages_touched([np.array([0, 7, 8]), np.array([7])], row_bytes=512, layout="stream-major")
    3
    >>> pages_touched([np.array([0, 7, 8]), np.array([7])], row_bytes=512, layout="token-major")
    3
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


def previous_step_reuse(steps: list[np.ndarray]) -> np.ndarray:
    """``|rows_t ∩ rows_{t−1}| / |rows_t|`` for t = 1.. (float64 ``[T − 1]``; NaN where step t selects
    nothing)."""
    reuse = np.full(max(len(steps) - 1, 0), np.nan)
    for t in range(1, len(steps)):
        if len(steps[t]):
            reuse[t - 1] = np.isin(steps[t], steps[t - 1]).sum() / len(steps[t])
    return reuse


PAGE = 4096  # bytes: the host page whose translation a GPU read over the link pays for
LAYOUTS = ("stream-major", "token-major")


def lru_misses(steps: list[np.ndarray], capacity: int) -> list[np.ndarray]:
    """The rows an LRU cache of ``capacity`` rows misses at each step t = 0.. (in the step's order; step 0 finds
    the cache empty and misses every row), each step's rows distinct (see the module docstring for the order of
    eviction): :func:`set_associative_misses` with one set."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    return set_associative_misses(steps, capacity, capacity)


def set_associative_misses(steps: list[np.ndarray], capacity: int, ways: int) -> list[np.ndarray]:
    """The rows a set-associative cache of ``capacity`` rows misses at each step t = 0.. (in the step's order):
    ``capacity // ways`` sets of ``ways`` rows, row ``r`` only ever in set ``r % sets``, each set an LRU of its own.
    A GPU finds a row's slot among its set's ``ways`` with no table of every position and no pass over every slot,
    at the price of the rows evicted while other sets hold older ones; one set of ``capacity`` ways is the LRU."""
    if not 1 <= ways <= capacity:
        raise ValueError(f"ways must lie in 1..capacity ({capacity}), got {ways}")
    sets = capacity // ways
    held: dict[int, OrderedDict[int, None]] = {}
    misses = []
    for rows in steps:
        listed = rows.tolist()
        lrus = [held.setdefault(row % sets, OrderedDict()) for row in listed]  # each row's set
        misses.append(np.array([row for row, lru in zip(listed, lrus) if row not in lru], np.int64))
        for row, lru in zip(listed, lrus):  # the hits refreshed, in the step's order
            if row in lru:
                lru.move_to_end(row)
        for row, lru in zip(listed, lrus):  # the misses inserted last, in the step's order
            lru[row] = None
        for lru in lrus:
            while len(lru) > ways:
                lru.popitem(last=False)
    return misses


def step_hits(steps: list[np.ndarray], misses: list[np.ndarray]) -> np.ndarray:
    """Each step's rows less its ``misses`` (:func:`lru_misses`), at steps t = 1.. (int64 ``[T − 1]``)."""
    return np.array([len(rows) - len(missed) for rows, missed in zip(steps, misses)][1:], np.int64)


def lru_hits(steps: list[np.ndarray], capacity: int) -> np.ndarray:
    """Hits of an LRU cache of ``capacity`` rows at each step t = 1.. (int64 ``[T − 1]``), the cache empty before
    step 0: :func:`step_hits` of its :func:`lru_misses`."""
    return step_hits(steps, lru_misses(steps, capacity))


def pages_touched(rows_per_head: list[np.ndarray], row_bytes: int, layout: str) -> int:
    """Distinct 4 KiB pages holding the rows one session's step fetches in one layer: ``rows_per_head[h]`` the
    token positions KV head ``h`` fetches, ``row_bytes`` a token's K and V of one head (4·d in fp16; it divides
    4 KiB). ``stream-major``: each head's rows contiguous, token ``t`` of head ``h`` at ``(h·C + t)·row_bytes``
    (``fathom.host.cache``'s rows, C its capacity, whole pages), so heads never share a page; ``token-major``:
    every head's row of a token side by side, at ``(t·H + h)·row_bytes``."""
    if layout not in LAYOUTS or PAGE % row_bytes:
        raise ValueError(f"layout must be one of {LAYOUTS} and row_bytes divide {PAGE}, got {layout!r}, "
                         f"{row_bytes}")
    if layout == "stream-major":
        return sum(len(np.unique(rows // (PAGE // row_bytes))) for rows in rows_per_head)
    heads = len(rows_per_head)
    offsets = [(rows * heads + h) * row_bytes // PAGE for h, rows in enumerate(rows_per_head)]
    return len(np.unique(np.concatenate(offsets))) if offsets else 0
