"""fathom.cuda.row_cache against fathom.row_cache: every map, stamp, counter and row source bit-exact over steps of
drifting row lists (a stream per CTA, sizes read on the device)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.row_cache import age_layout, assign_slots
from fathom.row_cache import RowCache
from tests.test_row_cache import _past_the_age_cap, _steps


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), slots=st.integers(1, 70), rows=st.integers(1, 48),
       threads=st.sampled_from([32, 64]))
def test_assign_slots_matches_reference(seed, streams, slots, rows, threads):
    _check_against_reference(seed, streams, slots, rows, threads)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31), slots=st.integers(100, 250), rows=st.integers(100, 250))
def test_assign_slots_runs_of_several_trips(seed, slots, rows):
    """Runs of many rows and slots per thread: several trips of ``CHUNK`` items, the last one partial."""
    _check_against_reference(seed, 1, slots, rows, 32)


def test_assign_slots_past_the_shared_ages_reads_them_again():
    """The smallest slab whose ages do not fit in shared memory at 32 threads: every pass reads its run of slots
    again from global memory, and agrees with the reference all the same."""
    slots = next(s for s in range(30000, 40000, 4) if not age_layout(s, 32)[2])
    assert age_layout(slots - 4, 32)[2]
    _check_against_reference(7, 1, slots, 40, 32, steps=3)


@pytest.mark.parametrize("slots, threads, per, stride", [(1, 32, 4, 1), (70, 32, 4, 1), (8192, 1024, 8, 3),
                                                         (32768, 1024, 32, 9), (200, 32, 8, 3), (100, 32, 4, 1)])
def test_age_layout_packs_whole_words_an_odd_stride_apart(slots, threads, per, stride):
    assert age_layout(slots, threads)[:2] == (per, stride)


def test_age_layout_keeps_up_to_36864_slots_at_1024_threads():
    assert age_layout(36864, 1024)[2] and not age_layout(36865, 1024)[2]


def _check_against_reference(seed, streams, slots, rows, threads, steps=6):
    rng = np.random.default_rng(seed)
    tokens = 300
    ref = RowCache(streams, slots, tokens)
    lists = [_steps(rng, tokens, steps, rows) for _ in range(streams)]
    d = {name: cuda.to_device(getattr(ref, name)) for name in ("slot_of", "position", "stamp", "clock")}
    counters = cuda.to_device(np.zeros((streams, 3), np.int64))
    miss_rows = cuda.to_device(np.zeros((streams, rows), np.int32))
    source = cuda.to_device(np.zeros((streams, rows), np.int32))
    for step in range(steps):
        row_index = np.zeros((streams, rows), np.int32)
        n_rows = np.zeros(streams, np.int32)
        want = np.zeros((streams, rows), np.int32)
        for g in range(streams):
            listed = lists[g][step]
            row_index[g, :len(listed)], n_rows[g] = listed, len(listed)
            want[g, :len(listed)] = ref.assign(g, listed)
        assign_slots(cuda.to_device(row_index), cuda.to_device(n_rows), d["slot_of"], d["position"], d["stamp"],
                     d["clock"], counters, miss_rows, source, threads)
        got = source.copy_to_host()
        for g in range(streams):
            assert got[g, :n_rows[g]].tolist() == want[g, :n_rows[g]].tolist(), (step, g)
        for name in ("slot_of", "position", "stamp", "clock"):
            np.testing.assert_array_equal(d[name].copy_to_host(), getattr(ref, name), err_msg=name)
        c = counters.copy_to_host()
        np.testing.assert_array_equal(c[:, 1], ref.hits)
        np.testing.assert_array_equal(c[:, 2], ref.lookups)
        step_hits = [int(((want[g, :n_rows[g]] >= 0) & (want[g, :n_rows[g]] < slots)).sum()) for g in range(streams)]
        assert c[:, 0].tolist() == step_hits


def test_assign_slots_ties_slots_past_the_age_cap_as_the_reference():
    """Two slots older than AGE_CAP (steps of the reference, copied to the device): the kernel's capped age
    histogram ties them and takes the lower slot, as the reference does."""
    ref = _past_the_age_cap()
    d = {name: cuda.to_device(getattr(ref, name)) for name in ("slot_of", "position", "stamp", "clock")}
    rows = np.array([[9, 10]], np.int32)
    counters = cuda.to_device(np.zeros((1, 3), np.int64))
    source = cuda.to_device(np.zeros((1, 2), np.int32))
    assign_slots(cuda.to_device(rows), cuda.to_device(np.array([2], np.int32)), d["slot_of"], d["position"],
                 d["stamp"], d["clock"], counters, cuda.to_device(np.zeros((1, 2), np.int32)), source, 32)
    want = ref.assign(0, rows[0])
    assert want.tolist() == [2, 3]  # slot 0, not the older slot 1
    np.testing.assert_array_equal(source.copy_to_host()[0], want)
    for name in ("slot_of", "position", "stamp", "clock"):
        np.testing.assert_array_equal(d[name].copy_to_host(), getattr(ref, name), err_msg=name)
