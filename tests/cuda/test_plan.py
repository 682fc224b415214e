"""fathom.cuda.plan against fathom.waterfill.waterfill_batched and SparQ's policy: depths equal bit for bit."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom import methods
from fathom.cuda.plan import top_channels, waterfill
from fathom.waterfill import calibrated_gains, importance, waterfill_batched


def _gaps_ok(w: np.ndarray) -> bool:
    """No two distinct plane gains of a stream within 1e-6 relative (the bisection cannot split those)."""
    for row in w:
        gains = np.unique(np.concatenate([0.75 * row[row > 0] * 4.0 ** -t for t in range(4)]))
        if len(gains) > 1 and np.min(np.diff(np.log(gains))) < 1e-6:
            return False
    return True


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([8, 16, 40]), budget=st.floats(0, 80), zeros=st.integers(0, 3),
       launch=st.sampled_from([(32, 1), (8, 3), (64, 5), (32, 2)]))
def test_waterfill_matches_reference(seed, streams, heads, d, budget, zeros, launch):
    """Every launch shape (threads, bisection steps per round) reaches the reference's depths: the rounds take the
    sequential steps exactly."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((streams, heads, d)) * np.exp(rng.uniform(-3, 3, d))).astype(np.float32)
    q[:, :, :zeros] = 0  # channels of zero importance are never read
    sigma2 = np.exp(rng.uniform(-4, 4, (streams, d)))
    w = importance(q, sigma2)
    assume(_gaps_ok(w))
    depths = cuda.to_device(np.full((streams, d), -1, np.int8))
    sigma2_gpu = cuda.to_device(sigma2)
    threads, split_bits = launch
    waterfill(cuda.to_device(q), sigma2_gpu, sigma2_gpu, _sources(streams, 0), budget, depths, _lengths(streams),
              threads=threads, split_bits=split_bits)
    np.testing.assert_array_equal(depths.copy_to_host(), waterfill_batched(w, budget))


def _table_gaps_ok(w: np.ndarray, gamma: np.ndarray) -> bool:
    """No two plane gains ``w · γ`` of a stream between 1e-12 and 1e-9 apart, relative: planes the majorant merged
    share a slope to the last ulps (a θ between them, as near as a last-ulp difference of log / exp, is as likely
    as never), other gains are far enough apart for the bisection to split them."""
    for row, table in zip(w, gamma):
        gains = row[:, None] * table
        gaps = np.diff(np.log(np.unique(gains[gains > 0])))
        if np.any((gaps >= 1e-12) & (gaps < 1e-9)):
            return False
    return True


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), d=st.sampled_from([8, 16, 40]),
       budget=st.floats(0, 80), zeros=st.integers(0, 3), flat=st.integers(0, 3),
       launch=st.sampled_from([(32, 1), (8, 3), (64, 5)]))
def test_waterfill_with_a_gain_table_matches_reference(seed, streams, d, budget, zeros, flat, launch):
    """Per-stream relative gains γ (measured drops made non-increasing by ``calibrated_gains``, some planes of gain
    0, some channels of no gain at all): the reference's depths, its all-fit rule counting only the planes of
    positive gain."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((streams, 2, d)) * np.exp(rng.uniform(-3, 3, d))).astype(np.float32)
    q[:, :, :zeros] = 0
    sigma2 = np.exp(rng.uniform(-4, 4, (streams, d)))
    drops = rng.uniform(0, 1, (streams, d, 4)) * np.exp(rng.uniform(-3, 3, (streams, d, 1)))
    drops[:, :flat, 2:] = 0  # planes that remove nothing more
    drops[:, d - flat:] = 0  # channels whose planes remove nothing
    gamma = calibrated_gains(drops)
    w = importance(q, sigma2)
    assume(_table_gaps_ok(w, gamma))
    depths = cuda.to_device(np.full((streams, d), -1, np.int8))
    sigma2_gpu = cuda.to_device(sigma2)
    threads, split_bits = launch
    waterfill(cuda.to_device(q), sigma2_gpu, sigma2_gpu, _sources(streams, 0), budget, depths, _lengths(streams),
              threads=threads, split_bits=split_bits, gains=cuda.to_device(gamma))
    np.testing.assert_array_equal(depths.copy_to_host(), waterfill_batched(w, budget, gamma))


def _lengths(streams: int, tokens: int = 0) -> object:
    return cuda.to_device(np.full(streams, tokens, np.int32))


def _sources(streams: int, from_store: int) -> object:
    return cuda.to_device(np.full(streams, from_store, np.uint8))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 3), heads_per_session=st.sampled_from([1, 2]),
       budget=st.floats(0, 60))
def test_waterfill_from_the_store_statistic_or_calibration_per_stream(seed, sessions, heads_per_session, budget):
    """A stream marked ``from_store`` reads σ² = the store's sum of squared scales / its session's sealed blocks
    (from the device lengths); the others read the calibration σ² (the per-head store mixes both)."""
    rng = np.random.default_rng(seed)
    streams, d = sessions * heads_per_session, 16
    q = rng.standard_normal((streams, 2, d)).astype(np.float32)
    sums, sigma2 = np.exp(rng.uniform(-4, 4, (2, streams, d)))
    from_store = rng.integers(0, 2, streams).astype(np.uint8)
    tokens = rng.integers(0, 500, sessions).astype(np.int32)
    blocks = np.maximum(np.repeat(tokens // 64, heads_per_session), 1)
    w = importance(q, np.where(from_store[:, None] == 1, sums / blocks[:, None], sigma2))
    assume(_gaps_ok(w))
    depths = cuda.to_device(np.full((streams, d), -1, np.int8))
    waterfill(cuda.to_device(q), cuda.to_device(sigma2), cuda.to_device(sums), cuda.to_device(from_store), budget,
              depths, cuda.to_device(tokens), heads_per_session)
    np.testing.assert_array_equal(depths.copy_to_host(), waterfill_batched(w, budget))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), heads_per_session=st.sampled_from([1, 2, 3]),
       budget=st.floats(0, 60), tabled=st.booleans(), launch=st.sampled_from([(32, 1), (64, 5)]))
def test_pooled_waterfill_is_one_line_for_a_sessions_kv_heads(seed, sessions, heads_per_session, budget, tabled,
                                                              launch):
    """``pooled``: a session's KV heads on one water line, each with its own σ² source and gain table, their mean
    cost within the budget: the reference's ``pooled_depths`` per session, bit for bit."""
    rng = np.random.default_rng(seed)
    streams, d = sessions * heads_per_session, 16
    q = (rng.standard_normal((streams, 2, d)) * np.exp(rng.uniform(-2, 2, (streams, 1, d)))).astype(np.float32)
    sums, sigma2 = np.exp(rng.uniform(-4, 4, (2, streams, d)))
    from_store = rng.integers(0, 2, streams).astype(np.uint8)
    tokens = rng.integers(0, 500, sessions).astype(np.int32)
    blocks = np.maximum(np.repeat(tokens // 64, heads_per_session), 1)
    sigma_read = np.where(from_store[:, None] == 1, sums / blocks[:, None], sigma2)
    gamma = calibrated_gains(rng.exponential(1.0, (streams, d, 4))) if tabled else None
    want = []
    for session in range(sessions):  # pooled_depths: the heads' importances (and tables) on one line
        heads = slice(session * heads_per_session, (session + 1) * heads_per_session)
        w = np.concatenate(list(importance(q[heads], sigma_read[heads])))[None]
        table = None if gamma is None else np.concatenate(list(gamma[heads]))[None]
        assume(_gaps_ok(w) if table is None else _table_gaps_ok(w, table))
        want.append(waterfill_batched(w, heads_per_session * budget, table).reshape(heads_per_session, d))
    if gamma is None:  # the reference's own pooled plan, on the σ² each stream reads
        policy = methods.Waterfill(budget, "calibration", pooled=True)
        stats = [methods.HeadStats(sigma2=sigma_read[g], ds_rank=np.arange(d)) for g in range(heads_per_session)]
        np.testing.assert_array_equal(methods.pooled_depths([policy] * heads_per_session,
                                                            list(q[:heads_per_session]), stats), want[0])
    depths = cuda.to_device(np.full((streams, d), -1, np.int8))
    threads, split_bits = launch
    waterfill(cuda.to_device(q), cuda.to_device(sigma2), cuda.to_device(sums), cuda.to_device(from_store), budget,
              depths, cuda.to_device(tokens), heads_per_session, threads=threads, split_bits=split_bits,
              gains=None if gamma is None else cuda.to_device(gamma), pooled=True)
    np.testing.assert_array_equal(depths.copy_to_host(), np.concatenate(want))


def test_nearly_every_gain_of_the_longest_line_between_the_bounds():
    """A pooled line of the most channels (4 KV heads of 256) whose plane gains take two values 0.01% apart and a
    small one (flat gain tables): after each of the first three rounds both larger values lie between the bounds,
    so the candidate list holds 3,752 of the 4,096 gains (compacted in place over many chunks), until a later
    round splits them. The budget reads the largest value's channels only."""
    heads, d = 4, 256
    channel = np.arange(heads * d).reshape(heads, d)
    sigma2 = np.where(channel % 3 == 0, 1.0001, np.where(channel % 12 == 1, 1e-3, 1.0))
    q = np.ones((heads, 1, d), np.float32)
    gamma = np.full((heads, d, 4), 0.25)
    largest = int((sigma2 > 1).sum())
    budget = (largest * 4.25 + 1.0) / heads  # bits a token and stream: the largest gains' channels (4 planes + scale)
    want = waterfill_batched(sigma2.reshape(1, -1), heads * budget, gamma.reshape(1, -1, 4)).reshape(heads, d)
    assert (want == np.where(sigma2 > 1, 4, 0)).all()
    depths = cuda.to_device(np.full((heads, d), -1, np.int8))
    sigma2_gpu = cuda.to_device(sigma2)
    waterfill(cuda.to_device(q), sigma2_gpu, sigma2_gpu, _sources(heads, 0), budget, depths, _lengths(1), heads,
              threads=32, split_bits=5, gains=cuda.to_device(gamma), pooled=True)
    np.testing.assert_array_equal(depths.copy_to_host(), want)


def test_a_pooled_line_longer_than_the_planner_holds_is_refused():
    q = cuda.to_device(np.ones((8, 1, 256), np.float32))
    sigma2 = cuda.to_device(np.ones((8, 256)))
    with pytest.raises(ValueError, match="water line holds at most 1024 channels, got 8 streams of 256"):
        waterfill(q, sigma2, sigma2, _sources(8, 0), 10.0, cuda.to_device(np.zeros((8, 256), np.int8)),
                  _lengths(1), 8, pooled=True)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 3), r=st.integers(0, 16), levels=st.sampled_from([3, 10**6]))
def test_top_channels_matches_sparq(seed, streams, r, levels):
    """Ties (few distinct |q| levels) go to the lower channel, like the reference's stable argsort; r = 0 (which
    no method is built with) reads no channel."""
    rng = np.random.default_rng(seed)
    q = (rng.integers(-levels, levels + 1, (streams, 3, 16)) / 7).astype(np.float32)
    depths = cuda.to_device(np.full((streams, 16), -1, np.int8))
    top_channels(cuda.to_device(q), r, depths)
    stats = methods.HeadStats(sigma2=np.ones(16), ds_rank=np.arange(16))
    want = methods.sparq(r).policy.depths(q, stats) if r else np.zeros((streams, 16), np.int8)
    np.testing.assert_array_equal(depths.copy_to_host(), want)


def test_all_zero_and_all_fit():
    q = np.zeros((2, 2, 8), np.float32)
    q[1] = 1.0
    sigma2 = np.ones((2, 8))
    depths = cuda.to_device(np.full((2, 8), -1, np.int8))
    sigma2_gpu = cuda.to_device(sigma2)
    waterfill(cuda.to_device(q), sigma2_gpu, sigma2_gpu, _sources(2, 0), 1000.0, depths, _lengths(2))
    np.testing.assert_array_equal(depths.copy_to_host(), [[0] * 8, [4] * 8])


def test_waterfill_refuses_launch_shapes_it_cannot_split():
    q = cuda.to_device(np.ones((1, 1, 8), np.float32))
    sigma2 = cuda.to_device(np.ones((1, 8)))
    depths = cuda.to_device(np.zeros((1, 8), np.int8))
    for threads, split_bits in ((40, 1), (512, 1), (32, 4), (32, 6), (32, 0)):
        with pytest.raises(ValueError, match="threads|split_bits"):
            waterfill(q, sigma2, sigma2, _sources(1, 0), 10.0, depths, _lengths(1), threads=threads,
                      split_bits=split_bits)


def test_waterfill_refuses_a_gain_table_of_another_shape():
    q = cuda.to_device(np.ones((1, 1, 8), np.float32))
    sigma2 = cuda.to_device(np.ones((1, 8)))
    depths = cuda.to_device(np.zeros((1, 8), np.int8))
    for table in (np.ones((1, 8, 3)), np.ones((2, 8, 4)), np.ones((1, 8, 4), np.float32)):
        with pytest.raises(ValueError, match=r"gains must be float64 \[1, 8, 4\]"):
            waterfill(q, sigma2, sigma2, _sources(1, 0), 10.0, depths, _lengths(1), gains=cuda.to_device(table))


def test_top_channels_refuses_an_r_or_depths_it_cannot_write():
    q = cuda.to_device(np.ones((1, 2, 8), np.float32))
    for r, depths, message in ((-3, np.zeros((1, 8), np.int8), "r must be an integer in 0..8"),
                               (9, np.zeros((1, 8), np.int8), "r must be an integer in 0..8"),
                               (2, np.zeros((1, 8), np.float32), "depths int8")):
        with pytest.raises(ValueError, match=message):
            top_channels(q, r, cuda.to_device(depths))
