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

Example (worked by hand in ``tests/bench/test_rowreuse.py``)::

    >>> import numpy as np
    >>> from bench.row_cache import lru_hits, previous_step_reuse
    >>> steps = [np.array([1, 2, 3]), np.array([2, 3, 4]), np.array([1, 4, 5])]
    >>> previous_step_reuse(steps).tolist()
    [0.6666666666666666, 0.3333333333333333]
    >>> lru_hits(steps, capacity=3).tolist(), lru_hits(steps, capacity=4).tolist()
    ([2, 1], [2, 2])
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


def lru_hits(steps: list[np.ndarray], capacity: int) -> np.ndarray:
    """Hits of an LRU cache of ``capacity`` rows at each step t = 1.. (int64 ``[T − 1]``), the cache empty before
    step 0 (see the module docstring for the order of eviction)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    cache: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(len(steps), np.int64)
    for t, rows in enumerate(steps):
        held = [row for row in rows.tolist() if row in cache]
        for row in held:
            cache.move_to_end(row)
        for row in rows.tolist():
            cache[row] = None  # a miss is inserted last; a hit keeps its refreshed place
        hits[t] = len(held)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits[1:]
