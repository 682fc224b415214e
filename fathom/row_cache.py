"""The HBM row cache of the offloaded step: the K/V rows a stream selected recently stay on the GPU, so only
the misses cross the link (design §8). The NumPy reference; ``fathom.cuda.row_cache`` is its twin (bit-exact).

Consecutive decode steps of one (session, layer, KV head) select mostly the same rows: on real captures an LRU of
4× one step's rows hits ~90% (``python -m bench rowreuse``). Each stream ``g`` owns ``slots`` rows of a slab;
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

    cache = RowCache(streams=1, slots=4, max_tokens=64)
    cache.assign(0, np.array([3, 9, 12]))   # -> [4, 5, 6]: three fills (slots 0, 1, 2)
    cache.assign(0, np.array([9, 20]))      # -> [1, 7]: a hit (slot 1), a fill of the empty slot 3
"""

from __future__ import annotations

import numpy as np

AGE_CAP = 255  # ages are counted in a 256-bin histogram on the GPU: older slots tie (and go by slot index)
EMPTY = -1  # a slot holding no row; a position held in no slot


class RowCache:
    """Per stream: ``slot_of [streams, max_tokens]`` (a position's slot or -1), ``position [streams, slots]``
    (a slot's position or -1), ``stamp [streams, slots]`` (the step that last used it), ``clock [streams]`` (steps
    run), ``hits`` and ``lookups [streams]`` (cumulative)."""

    def __init__(self, streams: int, slots: int, max_tokens: int):
        if min(streams, slots, max_tokens) <= 0:
            raise ValueError(f"streams, slots and max_tokens must be positive, got {streams}, {slots}, {max_tokens}")
        self.slots = slots
        self.slot_of = np.full((streams, max_tokens), EMPTY, np.int32)
        self.position = np.full((streams, slots), EMPTY, np.int32)
        self.stamp = np.zeros((streams, slots), np.int32)
        self.clock = np.zeros(streams, np.int32)
        self.hits = np.zeros(streams, np.int64)
        self.lookups = np.zeros(streams, np.int64)

    def assign(self, g: int, rows: np.ndarray) -> np.ndarray:
        """One step of stream ``g`` over its ascending, distinct ``rows``: the cache updated, each row's source
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

    def empty(self, streams) -> None:
        """Forget every row of ``streams`` (their session was emptied: its positions will hold new tokens)."""
        self.slot_of[streams] = EMPTY
        self.position[streams] = EMPTY
        self.stamp[streams] = 0
        self.clock[streams] = 0
