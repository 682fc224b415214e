"""fathom.prediction: the store's key moments and the predicted queries, against direct computations."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fathom import methods as M
from fathom.decode import HeadIndex, decode_step, method_scores
from fathom.prediction import RIDGE, predicted_queries, store_moments
from fathom.quantize import BLOCK, MAX_DEPTH
from fathom.selection import Selection


def _correlated_keys(rng, n: int, d: int) -> np.ndarray:
    return (rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) + rng.standard_normal(d)).astype(np.float32)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 12), st.integers(1, 5))
def test_store_moments_are_each_contexts_own_covariance_and_read_noise(seed, d, blocks_held):
    rng = np.random.default_rng(seed)
    index = HeadIndex.build(_correlated_keys(rng, blocks_held * BLOCK + 7, d), None)
    khats = [index.scorers["raw"].khat(t) for t in range(1, MAX_DEPTH + 1)]
    blocks = rng.integers(0, blocks_held + 1, size=5)
    moments = store_moments(khats, blocks)
    for p, count in enumerate(blocks):
        cov, noise = moments.cov[moments.which[p]], moments.noise[moments.which[p]]
        if count == 0:
            assert not cov.any() and not noise.any()
            continue
        full = khats[-1][:count * BLOCK].astype(np.float64)
        np.testing.assert_allclose(cov, np.cov(full.T, bias=True).reshape(d, d), rtol=1e-9, atol=1e-9)
        want = [np.var(full - khats[t][:count * BLOCK], axis=0) for t in range(MAX_DEPTH)]
        np.testing.assert_allclose(noise, want, rtol=1e-9, atol=1e-9)
        assert not noise[-1].any()  # depth 4 is the 4-bit key itself


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 10), st.integers(1, 3))
def test_predicted_queries_solve_the_normal_equations_on_the_channels_read(seed, d, group):
    rng = np.random.default_rng(seed)
    keys = _correlated_keys(rng, 4 * BLOCK, d)
    index = HeadIndex.build(keys, None)
    moments = store_moments([index.scorers["raw"].khat(t) for t in range(1, MAX_DEPTH + 1)], np.array([4, 2, 3]))
    q = rng.standard_normal((3, group, d)).astype(np.float32)
    depths = rng.integers(0, MAX_DEPTH + 1, size=(3, d)).astype(np.int8)
    x = predicted_queries(q, depths, moments)
    for p in range(3):
        read = np.nonzero(depths[p])[0]
        assert not x[p][:, depths[p] == 0].any()  # nothing is read there: the scan gets 0
        if read.size == 0:
            continue
        cov, noise = moments.cov[moments.which[p]], moments.noise[moments.which[p]]
        system = cov[np.ix_(read, read)] + np.diag(noise[depths[p, read] - 1, read])
        system += RIDGE * np.trace(system) / read.size * np.eye(read.size)
        # (C_RR + D_R) x = C_R: q, as the module's formula has it, for every head of the group
        np.testing.assert_allclose(system @ x[p][:, read].T, cov[read] @ q[p].T, rtol=2e-4,
                                   atol=2e-4 * np.abs(cov[read] @ q[p].T).max())


def test_at_full_depth_the_prediction_is_the_query_and_scores_are_the_plain_ones():
    rng = np.random.default_rng(3)
    d = 8
    keys = _correlated_keys(rng, 6 * BLOCK, d)
    index = HeadIndex.build(keys, None)
    q = rng.standard_normal((2, 3, d)).astype(np.float32)
    blocks = np.array([6, 5])
    method = M.thumbnail(4)  # every channel at depth 4: no noise and nothing unread
    plain, _ = method_scores(method, q, index, blocks)
    predicted, _ = method_scores(M.predicting(method), q, index, blocks)
    np.testing.assert_allclose(predicted, plain, rtol=1e-3, atol=1e-3 * np.abs(plain).max())


def test_a_prediction_reads_what_the_method_reads_and_decodes_on_the_reference_backend():
    rng = np.random.default_rng(4)
    d = 16
    keys = _correlated_keys(rng, 5 * BLOCK + 10, d)
    values = rng.standard_normal((keys.shape[0], d)).astype(np.float32)
    index = HeadIndex.build(keys, None)
    q = rng.standard_normal((2, d)).astype(np.float32)
    method = M.fathom(24)
    plain = decode_step(q, keys, values, index, method, Selection(k=16))
    predicted = decode_step(q, keys, values, index, M.predicting(method), Selection(k=16))
    np.testing.assert_array_equal(predicted.depths, plain.depths)
    assert predicted.bits == plain.bits and predicted.scan_bytes == plain.scan_bytes
    assert predicted.output.shape == plain.output.shape and np.isfinite(predicted.output).all()
    # before a block is sealed there is nothing to scan and no statistic: the step still decodes
    short = HeadIndex.build(keys[:40], None)
    step = decode_step(q, keys[:40], values[:40], short, M.predicting(method), Selection(k=16))
    assert step.mask.all()


def test_predicting_names_and_refusals():
    assert M.predicting(M.fathom_mixed(48, "calibrated", pooled=True)).name == "fathom-mixed[gains,pooled,lmmse]"
    assert M.predicting(M.sparq(16)).label(128) == "sparq[lmmse]@68"
    for method in (M.oracle(), M.dense(), M.landmark(), M.predicting(M.fathom(48))):
        with pytest.raises(ValueError, match="only a plane method that does not predict yet"):
            M.predicting(method)
    with pytest.raises(ValueError, match="predicts is a plane method's estimator"):
        M.Method("oracle", scorer="exact", predicts=True)


def test_bad_moments_input_is_refused():
    khats = [np.zeros((2 * BLOCK, 4), np.float32)] * MAX_DEPTH
    with pytest.raises(ValueError, match="blocks must lie in 0..2"):
        store_moments(khats, np.array([3]))
    with pytest.raises(ValueError, match="khats must hold the keys at depths 1..4"):
        store_moments(khats[:3], np.array([1]))
    moments = store_moments(khats, np.array([1, 2]))
    q = np.ones((2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="depths must have shape"):
        predicted_queries(q, np.ones((3, 4), np.int8), moments)
    with pytest.raises(ValueError, match="moments must be taken at the 3 positions"):
        predicted_queries(np.ones((3, 1, 4), np.float32), np.ones((3, 4), np.int8), moments)
    # constant keys: a singular covariance, and the ridge keeps the solve finite
    assert np.isfinite(predicted_queries(q, np.full((2, 4), 2, np.int8), moments)).all()
