"""fathom.row_cache: the LRU-by-step row cache keeps its maps consistent, hits what it holds, evicts the least
recently used first, and bypasses only when a step's misses outnumber the slots it may evict."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fathom.row_cache import AGE_CAP, EMPTY, RowCache


def _steps(rng, tokens, steps, rows):
    """Row lists that drift: each step keeps most of the previous one's rows."""
    current = np.sort(rng.choice(tokens, rows, replace=False))
    out = []
    for _ in range(steps):
        keep = current[rng.random(len(current)) < 0.7]
        fresh = rng.choice(tokens, rows, replace=False)
        current = np.unique(np.concatenate([keep, fresh]))[:rows]
        out.append(np.sort(rng.permutation(current)[:rng.integers(1, rows + 1)]))
    return out


def _consistent(cache: RowCache, g: int) -> None:
    held = np.flatnonzero(cache.position[g] >= 0)
    assert (cache.slot_of[g, cache.position[g, held]] == held).all()
    assert (cache.slot_of[g] >= 0).sum() == len(held)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), slots=st.integers(1, 40), rows=st.integers(1, 30))
def test_sources_and_maps_agree_with_what_is_held(seed, slots, rows):
    rng = np.random.default_rng(seed)
    cache = RowCache(streams=2, slots=slots, max_tokens=200)
    looked_up = 0
    for step, listed in enumerate(_steps(rng, 200, 12, rows), start=1):
        looked_up += len(listed)
        held_before = cache.slot_of[1, listed].copy()
        source = cache.assign(1, listed)
        hits = held_before >= 0
        assert (source[hits] == held_before[hits]).all()  # a held row is a hit from its own slot
        fills = source >= slots
        assert (~hits[fills]).all() and (cache.slot_of[1, listed[fills]] == source[fills] - slots).all()
        assert (source[~hits & ~fills] == EMPTY).all()
        # a bypass only when every slot not hit this step was taken by a fill
        if (source == EMPTY).any():
            assert fills.sum() == slots - hits.sum()
        assert (cache.stamp[1, source[source >= 0] % slots] == step).all()
        _consistent(cache, 1)
        assert (cache.slot_of[0] == EMPTY).all()  # another stream's step leaves it alone
    assert cache.lookups[1] == looked_up and cache.lookups[0] == 0


def test_least_recently_used_goes_first_and_ties_go_by_slot():
    cache = RowCache(streams=1, slots=3, max_tokens=32)
    assert cache.assign(0, np.array([1, 2, 3])).tolist() == [3, 4, 5]  # fills of slots 0, 1, 2
    assert cache.assign(0, np.array([2])).tolist() == [1]  # 2 used at step 2; 1 and 3 at step 1
    assert cache.assign(0, np.array([4, 5])).tolist() == [3, 5]  # the two oldest (1, 3: slots 0, 2) make way
    assert cache.slot_of[0, [1, 2, 3, 4, 5]].tolist() == [EMPTY, 1, EMPTY, 0, 2]
    assert cache.hits.tolist() == [1] and cache.lookups.tolist() == [6]


def test_a_step_larger_than_the_slab_bypasses_the_rest():
    cache = RowCache(streams=1, slots=2, max_tokens=16)
    assert cache.assign(0, np.array([0, 1, 2, 3])).tolist() == [2, 3, EMPTY, EMPTY]
    assert cache.assign(0, np.array([1, 5, 6])).tolist() == [1, 2, EMPTY]  # slot 1 hit: only slot 0 may go


def _past_the_age_cap() -> RowCache:
    """Slot 1 (row 8, last used at step 1) is older than slot 0 (row 7, step 2), both older than AGE_CAP; slot 2
    (row 9) is used every step."""
    cache = RowCache(streams=1, slots=3, max_tokens=16)
    assert cache.assign(0, np.array([7, 8])).tolist() == [3, 4]  # slots 0, 1 at step 1
    assert cache.assign(0, np.array([7, 9])).tolist() == [0, 5]  # slot 0 hit at step 2; the empty slot 2 filled
    for _ in range(AGE_CAP + 5):
        cache.assign(0, np.array([9]))  # slot 2, every step
    return cache


def test_old_slots_tie_at_the_age_cap():
    """Ages are capped: slots 0 and 1, both past the cap, tie and go by slot index, although slot 1 is older."""
    cache = _past_the_age_cap()
    assert cache.assign(0, np.array([9, 10])).tolist() == [2, 3]  # slot 0 (uncapped ages would take slot 1)
    assert cache.slot_of[0, [7, 8, 9, 10]].tolist() == [EMPTY, 1, 2, 0]


def test_emptied_streams_forget_their_rows():
    cache = RowCache(streams=2, slots=4, max_tokens=16)
    cache.assign(0, np.array([1, 2]))
    cache.assign(1, np.array([1, 2]))
    cache.empty([0])
    assert cache.assign(0, np.array([1])).tolist() == [4]  # a fill again
    assert cache.assign(1, np.array([1])).tolist() == [0]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="slots"):
        RowCache(streams=1, slots=0, max_tokens=8)
