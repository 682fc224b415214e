import numpy as np
import pytest
from hypothesis import given, strategies as st

from fathom.selection import Selection, always_kept, order_keys, select, select_many, union_rows


@given(st.integers(1, 300), st.integers(0, 300), st.integers(0, 150), st.integers(1, 4), st.integers(0, 2 ** 32 - 1))
def test_sink_local_tail_always_in_and_exactly_k_more_per_head(n, n_scored, k, G, seed):
    n_scored = min(n_scored, n)
    rng = np.random.default_rng(seed)
    scores = rng.integers(-5, 5, (G, n_scored)).astype(np.float32)  # many ties on purpose
    sel = Selection(k=k)
    mask = select(scores, n, sel)
    keep = always_kept(n, n_scored, sel)
    assert mask.shape == (G, n) and mask[:, keep].all()
    candidates = np.flatnonzero(~keep)
    assert (mask[:, candidates].sum(axis=1) == min(k, len(candidates))).all()
    for h in range(G):  # every selected candidate scores at least as high as every unselected one
        chosen, left = mask[h, candidates], ~mask[h, candidates]
        if chosen.any() and left.any():
            assert scores[h, candidates[chosen]].min() >= scores[h, candidates[left]].max()
            # ties at the boundary go to the earliest tokens
            boundary = scores[h, candidates[chosen]].min()
            tied = candidates[scores[h, candidates] == boundary]
            taken = mask[h, tied]
            assert not (np.diff(taken.astype(int)) > 0).any()
    assert union_rows(mask) == mask.any(axis=0).sum()


def test_protocol_constants_and_k_by_context():
    assert always_kept(100, 64, Selection(k=1)).sum() == 4 + 36
    assert [Selection.for_context(n).k for n in (4096, 16384, 32768, 10 ** 6)] == [128, 256, 512, 512]
    with pytest.raises(ValueError, match="^k "):
        Selection(k=-1)
    with pytest.raises(ValueError, match="^scores"):
        select(np.zeros((2, 10), np.float32), 5, Selection(k=1))


@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 40))
def test_many_positions_at_once_equal_one_at_a_time(seed, k):
    rng = np.random.default_rng(seed)
    width = 200
    contexts = np.sort(rng.integers(1, width + 1, 4))
    scored = np.array([rng.integers(0, c + 1) for c in contexts])
    scores = rng.integers(-3, 3, (4, 2, width)).astype(np.float32)
    sel = Selection(k=k)
    many = select_many(scores, contexts, scored, sel, width)
    for p in range(4):
        one = select(scores[p, :, :scored[p]], contexts[p], sel)
        np.testing.assert_array_equal(many[p, :, :contexts[p]], one)
        assert not many[p, :, contexts[p]:].any()


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["k", "sink", "local"])
@pytest.mark.parametrize("bad", [1.5, "8", True, None])
def test_selection_takes_integers_only(field, bad):
    with pytest.raises(ValueError, match=f"^{field} must be an integer"):
        Selection(**{"k": 8, field: bad})
    assert Selection(k=np.int64(8)).k == 8 and type(Selection(k=np.int64(8)).k) is int  # JSON-safe


def test_select_refuses_nan_scores_and_a_context_that_is_not_an_integer():
    sel = Selection(k=2)
    scores = np.arange(100, dtype=np.float32)[None]
    scores[0, 50] = np.nan  # would sort above every score and leave fewer than k chosen
    with pytest.raises(ValueError, match="scores must not hold NaN"):
        select(scores, 100, sel)
    with pytest.raises(ValueError, match="n must be an integer"):
        select(np.zeros((1, 64), np.float32), 100.7, sel)


def test_order_keys_order_as_the_floats_do():
    """order_keys (the NumPy twin of the kernels' order_key): keys sort as their floats, −0 and +0 share a key, and
    every sign and magnitude (subnormals, infinities) keeps its place."""
    values = np.array([-np.inf, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 1.5, 3e38, np.inf], np.float32)
    keys = order_keys(values)
    assert keys.dtype == np.uint32
    assert keys[4] == keys[5] == np.uint32(0x80000000)  # −0 and +0
    assert np.all(np.diff(np.delete(keys, 4).astype(np.int64)) > 0)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000)).astype(np.float32)
    np.testing.assert_array_equal(np.argsort(order_keys(x), kind="stable"), np.argsort(x, kind="stable"))
