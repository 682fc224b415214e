"""The HBM row cache of the offloaded step: the K/V rows a query group selected recently stay on the GPU, so only
the misses cross the link (design §8). The NumPy reference; ``fathom.cuda.row_cache`` is its twin (bit-exact).

Consecutive decode steps of one (session, layer, KV head) select mostly the same rows: on real captures an LRU of
4× one step's rows hits ~90% (``python -m bench rowreuse``). Each query group ``g`` owns ``slots`` rows of a slab;
per step, for its ascending row list (``fathom.selection.union_rows``):

1. a row whose position holds a slot is a **hit**: read from the slab, its slot stamped with the step;
2. the **victims** are the slots not hit this step, least recently used first — by age ``step - stamp`` (capped at
   :data:`AGE_CAP`; an empty slot counts as the oldest), ties by slot index — as many as there are misses;
3. the i-th miss in row order takes the i-th victim in slot order (**fill**: read from host memory, written to the
   slab); misses beyond the victims (a slab smaller than one step's rows) are read from host memory uncached
   (**bypass**).

Each row's source is ``slot`` (hit), ``slot + slots`` (fill) or ``-1`` (bypass). Positions are immutable once
appended, so a cached row never goes stale; emptying a session (``HostKVCache.reset``) empties its slots.

Example::

    cache = RowCache(groups=1, slots=4, max_tokens=64)
    cache.assign(0, np.array([3, 9, 12]))   # -> [4, 5, 6]: three fills (slots 0, 1, 2)
    cache.assign(0, np.array([9, 20]))      # -> [1, 7]: a hit (slot 1), a fill of the empty slot 3
"""

from __future__ import annotations

import numpy as np

AGE_CAP = 255  # ages are counted in a 256-bin histogram on the GPU: older slots tie (and go by slot index)
EMPTY = -1  # a slot holding no row; a position held in no slot


class RowCache:
    """Per query group: ``slot_of [groups, max_tokens]`` (a position's slot or -1), ``position [groups, slots]``
    (a slot's position or -1), ``stamp [groups, slots]`` (the step that last used it), ``clock [groups]`` (steps
    run), ``hits`` and ``lookups [groups]`` (cumulative)."""

    def __init__(self, groups: int, slots: int, max_tokens: int):
        if min(groups, slots, max_tokens) <= 0:
            raise ValueError(f"groups, slots and max_tokens must be positive, got {groups}, {slots}, {max_tokens}")
        self.slots = slots
        self.slot_of = np.full((groups, max_tokens), EMPTY, np.int32)
        self.position = np.full((groups, slots), EMPTY, np.int32)
        self.stamp = np.zeros((groups, slots), np.int32)
        self.clock = np.zeros(groups, np.int32)
        self.hits = np.zeros(groups, np.int64)
        self.lookups = np.zeros(groups, np.int64)

    def assign(self, g: int, rows: np.ndarray) -> np.ndarray:
        """One step of group ``g`` over its ascending, distinct ``rows``: the cache updated, each row's source
        (int32: slot = hit, slot + slots = fill, -1 = bypass)."""
        rows = np.asarray(rows, np.int64)
        step = self.clock[g] + 1
        slots = self.slot_of[g, rows]
        hit = slots >= 0
        self.stamp[g, slots[hit]] = step
        source = np.where(hit, slots, EMPTY).astype(np.int32)
        misses = np.flatnonzero(~hit)
        held = self.position[g] >= 0
        age = np.where(held, np.minimum(step - self.stamp[g], AGE_CAP), AGE_CAP)
        eligible = np.flatnonzero(age >= 1)
        oldest_first = eligible[np.lexsort((eligible, -age[eligible]))]
        victims = np.sort(oldest_first[:len(misses)])
        for slot, miss in zip(victims, misses):
            old = self.position[g, slot]
            if old >= 0:
                self.slot_of[g, old] = EMPTY
            self.slot_of[g, rows[miss]] = slot
            self.position[g, slot] = rows[miss]
            self.stamp[g, slot] = step
            source[miss] = slot + self.slots
        self.clock[g] = step
        self.hits[g] += int(hit.sum())
        self.lookups[g] += len(rows)
        return source

    def empty(self, groups) -> None:
        """Forget every row of ``groups`` (their session was emptied: its positions will hold new tokens)."""
        self.slot_of[groups] = EMPTY
        self.position[groups] = EMPTY
        self.stamp[groups] = 0
        self.clock[groups] = 0
