import itertools

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st
from hypothesis.extra import numpy as hnp

from fathom import reference as ref
from fathom.waterfill import (DESIGN_GAINS, calibrated_gains, depths_at, depths_closed_form, importance,
                             per_layer_plan, waterfill, waterfill_batched)

weights = hnp.arrays(np.float64, st.integers(1, 6), elements=st.one_of(
    st.just(0.0), st.floats(1e-3, 1e3, allow_subnormal=False)))
budgets = st.floats(0, 30)


def cost(b):
    return b.sum() + 0.25 * (b > 0).sum()


def greedy_by_gain(w, budget):
    """Brute force: take planes in falling gain order, a tie group at a time, while the cost fits."""
    gains = sorted({0.75 * wc * 4.0 ** -(t - 1) for wc in w if wc > 0 for t in range(1, 5)}, reverse=True)
    best = np.zeros(len(w), np.int64)
    for g in gains:
        b = np.array([sum(0.75 * wc * 4.0 ** -(t - 1) >= g for t in range(1, 5)) for wc in w])
        if cost(b) > budget:
            break
        best = b
    return best


def distinct_gains(w):
    gains = np.sort([0.75 * wc * 4.0 ** -(t - 1) for wc in w if wc > 0 for t in range(1, 5)])
    return len(gains) < 2 or np.all(np.diff(gains) > 1e-6 * gains[1:]) or np.any(np.diff(gains) == 0)


@given(weights, budgets)
def test_cost_fits_the_budget_and_equals_the_greedy_optimum(w, budget):
    depths = ref.waterfill(w, budget)
    assert depths.dtype == np.int8 and depths.shape == w.shape
    assert ref.scan_bits(depths) <= budget
    assert ((depths == 0) | (w > 0)).all()
    assume(distinct_gains(w))  # bisection in log θ resolves gains 1e-6 apart, not closer
    np.testing.assert_array_equal(depths, greedy_by_gain(w, budget))


@given(weights, budgets)
def test_depths_minimise_error_among_all_depth_vectors_with_as_few_planes(w, budget):
    depths = ref.waterfill(w, budget).astype(np.int64)
    assume(len(w) <= 5)
    error = lambda b: float(np.sum(w * 4.0 ** -b))
    planes = depths.sum()
    best = min(error(np.array(b)) for b in itertools.product(range(5), repeat=len(w)) if sum(b) <= planes)
    assert error(depths) <= best * (1 + 1e-9) + 1e-12


@given(weights, budgets, budgets)
def test_monotone_in_budget(w, b1, b2):
    lo, hi = sorted((b1, b2))
    assert (ref.waterfill(w, lo) <= ref.waterfill(w, hi)).all()


def test_zero_weights_read_nothing_and_a_large_budget_reads_everything():
    assert (ref.waterfill(np.zeros(7), 100.0) == 0).all()
    w = np.array([3.0, 0.0, 1e-6, 5.0])
    np.testing.assert_array_equal(ref.waterfill(w, 1000.0), [4, 0, 4, 4])
    assert (ref.waterfill(w, 0.0) == 0).all()


@given(hnp.arrays(np.float64, (3, 5), elements=st.floats(0, 100)), budgets)
def test_batched_equals_one_group_at_a_time(w, budget):
    batched = ref.waterfill_batched(w, budget)
    for row, depths in zip(w, batched):
        np.testing.assert_array_equal(ref.waterfill(row, budget), depths)


@given(hnp.arrays(np.float64, 6, elements=st.floats(1e-3, 1e3)), st.floats(1e-4, 1e3))
def test_closed_form_equals_the_count_away_from_ties(w, theta):
    gains = 0.75 * w[:, None] * 4.0 ** -np.arange(4)
    assume(np.all(np.abs(gains / theta - 1) > 1e-9))
    np.testing.assert_array_equal(depths_closed_form(w, theta), depths_at(w, theta))


def test_importance_weights_query_energy_by_variance():
    q = np.array([[1.0, 2.0], [3.0, 0.0]])
    np.testing.assert_allclose(importance(q, np.array([2.0, 0.5])), [20.0, 2.0])


def test_a_read_at_48_bits_on_128_channels_touches_a_subset_at_graded_depths():
    w = np.exp(np.random.default_rng(0).normal(0, 2.5, 128))
    depths = ref.waterfill(w, 48.0)
    assert 47.0 <= ref.scan_bits(depths) <= 48.0
    assert 10 < (depths > 0).sum() < 48 and len(set(depths[depths > 0].tolist())) > 1


def test_per_layer_plan_moves_bits_to_where_they_drop_error_most():
    budgets = np.array([16.0, 32.0, 48.0, 64.0, 80.0])
    errors = np.array([[1.0, 0.5, 0.3, 0.2, 0.15],   # steep
                       [0.1, 0.09, 0.085, 0.08, 0.078]])  # flat
    plan = ref.per_layer_plan(errors, budgets, 48.0)
    assert plan.mean() <= 48.0 and plan[0] > plan[1]
    np.testing.assert_array_equal(plan, [80.0, 16.0])
    np.testing.assert_array_equal(ref.per_layer_plan(errors, budgets, 16.0), [16.0, 16.0])


def test_waterfill_rejects_bad_input():
    with pytest.raises(ValueError, match="^w "):
        ref.waterfill(np.array([1.0, -1.0]), 8.0)
    with pytest.raises(ValueError, match="^w "):
        ref.waterfill(np.array([[1.0]]), 8.0)
    with pytest.raises(ValueError, match="^w "):
        ref.waterfill(np.array([np.nan]), 8.0)
    with pytest.raises(ValueError, match="^budget "):
        ref.waterfill(np.ones(3), -1.0)
    with pytest.raises(ValueError, match="^mean_budget "):
        ref.per_layer_plan(np.ones((2, 3)), np.array([1.0, 2.0, 3.0]), 5.0)
    with pytest.raises(ValueError, match="^budgets "):
        ref.per_layer_plan(np.ones((2, 3)), np.array([1.0, 1.0, 3.0]), 2.0)


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["48", None, np.nan, np.inf, True])
def test_waterfill_names_a_budget_that_is_not_a_finite_number(budget):
    with pytest.raises(ValueError, match="^budget"):
        waterfill(np.ones(8), budget)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_per_layer_plan_refuses_nan_and_inf_errors(bad):
    errors = np.array([[0.3, 0.2, 0.1], [0.5, 0.4, 0.3]])
    errors[1, 1] = bad
    with pytest.raises(ValueError, match="^errors must be finite"):
        per_layer_plan(errors, np.array([32.0, 48.0, 64.0]), 48.0)


@given(weights, budgets)
def test_the_design_gains_as_a_table_give_the_design_depths(w, budget):
    np.testing.assert_array_equal(waterfill(w, budget, np.tile(DESIGN_GAINS, (len(w), 1))), waterfill(w, budget))


gain_tables = st.integers(1, 5).flatmap(lambda d: hnp.arrays(np.float64, (d, 4), elements=st.one_of(
    st.just(0.0), st.floats(1e-3, 1e3, allow_subnormal=False))))


@given(gain_tables, budgets)
def test_a_calibrated_table_fits_the_budget_and_equals_the_greedy_by_its_gains(drops, budget):
    gains = calibrated_gains(drops)
    w = np.ones(len(gains))
    depths = waterfill(w, budget, gains)
    assert ref.scan_bits(depths) <= budget
    assert (depths <= (gains > 0).sum(axis=1)).all()  # a plane of no gain is never read
    g = np.unique(gains[gains > 0])[::-1]
    assume(len(g) < 2 or np.all(-np.diff(g) > 1e-6 * g[:-1]))  # bisection resolves gains 1e-6 apart
    best = np.zeros(len(w), np.int64)
    for theta in g:  # brute force: planes in falling gain order, a tie group at a time, while the cost fits
        b = (gains >= theta).sum(axis=1)
        if cost(b) > budget:
            break
        best = b
    np.testing.assert_array_equal(depths, best)


@given(hnp.arrays(np.float64, (3, 4), elements=st.floats(-10, 10)))
def test_calibrated_gains_are_the_falling_slopes_of_the_cumulative_drops_majorant(drops):
    gains = calibrated_gains(drops)
    assert (gains >= 0).all() and (np.diff(gains, axis=-1) <= 0).all()
    cum = np.cumsum(drops, axis=-1)
    assert (np.cumsum(gains, axis=-1) >= np.minimum(cum, np.cumsum(np.clip(drops, 0, None), axis=-1)) - 1e-9).all()
    falling = -np.sort(-np.abs(drops), axis=-1)  # already falling and positive: kept as they are
    np.testing.assert_allclose(calibrated_gains(falling), falling, rtol=1e-12, atol=1e-12 * np.abs(drops).max())


def test_calibrated_gains_pool_a_plane_worth_less_than_the_next_and_drop_one_that_adds_error():
    np.testing.assert_allclose(calibrated_gains(np.array([0.1, 0.5, 0.1, 0.01])), [0.3, 0.3, 0.1, 0.01])
    np.testing.assert_allclose(calibrated_gains(np.array([-0.1, 0.5, 0.1, -0.01])), [0.2, 0.2, 0.1, 0.0])


def test_waterfill_refuses_a_gain_table_that_rises_or_has_the_wrong_shape():
    with pytest.raises(ValueError, match="^gains must be non-increasing"):
        waterfill(np.ones(2), 8.0, np.array([[1, 2, 0, 0], [1, 1, 1, 1.0]]))
    with pytest.raises(ValueError, match=r"^gains must be \[\.\.\., d = 2, 4\]"):
        waterfill_batched(np.ones(2), 8.0, np.ones((3, 4)))
