"""fathom.cuda.row_cache against fathom.row_cache: every map, stamp, counter and row source bit-exact over steps of
drifting row lists (sizes read on the device), a CTA a stream and the slab in parts alike."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.row_cache import age_layout, assign_slots, parts, parts_pay, scratch_shapes
from fathom.row_cache import RowCache
from tests.test_row_cache import _past_the_age_cap, _steps


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), slots=st.integers(1, 70), rows=st.integers(1, 48),
       threads=st.sampled_from([32, 64]))
def test_assign_slots_matches_reference(seed, streams, slots, rows, threads):
    _check_against_reference(seed, streams, slots, rows, threads)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), slots=st.integers(1, 48), rows=st.integers(1, 48),
       part_slots=st.sampled_from([16, 2048]))
def test_assign_slots_in_parts_matches_reference(seed, streams, slots, rows, part_slots):
    """The slab in parts (one of up to 3, the last partial), each part's CTA of 32 threads: the victims ranked across
    parts."""
    _check_against_reference(seed, streams, slots, rows, 32, part_slots=part_slots)


def test_parts_cover_the_slab_and_pay_where_streams_leave_the_gpu_idle():
    assert [parts(s, 2048) for s in (1, 2048, 2049, 32768)] == [1, 1, 2, 16]
    assert scratch_shapes(3, 4097)["victims"] == ((3, 3), np.int64)
    assert parts_pay(8, 132) and parts_pay(32, 132) and not parts_pay(128, 132)  # 128k x 1, x 4, x 16 ragged


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31), slots=st.integers(100, 250), rows=st.integers(100, 250))
def test_assign_slots_runs_of_several_trips(seed, slots, rows):
    """Runs of many rows and slots per thread: several trips of ``CHUNK`` items, the last one partial."""
    _check_against_reference(seed, 1, slots, rows, 32)
    _check_against_reference(seed, 1, slots, rows, 32, part_slots=160)  # parts of 5 slots a thread, the last partial


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


def _scratch(streams, slots, part_slots):
    """The parts' scratch, filled with garbage: a step must not read what it did not write."""
    return [cuda.to_device(np.full(shape, 977, dtype)) for shape, dtype in
            scratch_shapes(streams, slots, part_slots).values()]


def _check_against_reference(seed, streams, slots, rows, threads, steps=6, part_slots=None):
    """``part_slots``: the slab in parts of that many slots, CTAs of 32 threads (None: a CTA a stream)."""
    rng = np.random.default_rng(seed)
    tokens = 300
    ref = RowCache(streams, slots, tokens)
    lists = [_steps(rng, tokens, steps, rows) for _ in range(streams)]
    d = {name: cuda.to_device(getattr(ref, name)) for name in ("slot_of", "position", "stamp", "clock")}
    counters = cuda.to_device(np.zeros((streams, 3), np.int64))
    miss_rows = cuda.to_device(np.zeros((streams, rows), np.int32))
    source = cuda.to_device(np.zeros((streams, rows), np.int32))
    parts_args = {} if part_slots is None else {"scratch": _scratch(streams, slots, part_slots),
                                                "part_slots": part_slots, "part_threads": 32}
    for step in range(steps):
        row_index = np.zeros((streams, rows), np.int32)
        n_rows = np.zeros(streams, np.int32)
        want = np.zeros((streams, rows), np.int32)
        for g in range(streams):
            listed = lists[g][step]
            row_index[g, :len(listed)], n_rows[g] = listed, len(listed)
            want[g, :len(listed)] = ref.assign(g, listed)
        assign_slots(cuda.to_device(row_index), cuda.to_device(n_rows), d["slot_of"], d["position"], d["stamp"],
                     d["clock"], counters, miss_rows, source, threads, **parts_args)
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


@pytest.mark.parametrize("part_slots", [None, 1])
def test_assign_slots_ties_slots_past_the_age_cap_as_the_reference(part_slots):
    """Two slots older than AGE_CAP (steps of the reference, copied to the device): the kernel's capped age
    histogram ties them and takes the lower slot, as the reference does (in parts: each slot a part of its own)."""
    ref = _past_the_age_cap()
    d = {name: cuda.to_device(getattr(ref, name)) for name in ("slot_of", "position", "stamp", "clock")}
    rows = np.array([[9, 10]], np.int32)
    counters = cuda.to_device(np.zeros((1, 3), np.int64))
    source = cuda.to_device(np.zeros((1, 2), np.int32))
    assign_slots(cuda.to_device(rows), cuda.to_device(np.array([2], np.int32)), d["slot_of"], d["position"],
                 d["stamp"], d["clock"], counters, cuda.to_device(np.zeros((1, 2), np.int32)), source, 32,
                 **({} if part_slots is None else {"scratch": _scratch(1, 3, 1), "part_slots": 1, "part_threads": 32}))
    want = ref.assign(0, rows[0])
    assert want.tolist() == [2, 3]  # slot 0, not the older slot 1
    np.testing.assert_array_equal(source.copy_to_host()[0], want)
    for name in ("slot_of", "position", "stamp", "clock"):
        np.testing.assert_array_equal(d[name].copy_to_host(), getattr(ref, name), err_msg=name)
