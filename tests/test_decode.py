import numpy as np
import pytest
from hypothesis import given, strategies as st

from fathom import methods as M
from fathom.decode import HeadIndex, decode_step
from fathom.methods import HeadStats
from fathom.selection import Selection


@given(st.lists(st.integers(0, 90), min_size=1, max_size=8), st.integers(0, 2 ** 32 - 1))
def test_an_index_grown_in_pieces_equals_one_built_in_one_go(pieces, seed):
    rng = np.random.default_rng(seed)
    d = 8
    k = (rng.standard_normal((sum(pieces), d)) * np.exp(rng.normal(0, 1, d))).astype(np.float32)
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    grown, start = HeadIndex(d, None, basis), 0
    for m in pieces:
        grown.append(k[start:start + m])
        start += m
    whole = HeadIndex.build(k, None, basis)
    np.testing.assert_array_equal(grown.keys, whole.keys)
    np.testing.assert_array_equal(grown.landmarks, whole.landmarks)
    for b in ("raw", "rotated"):
        np.testing.assert_array_equal(grown.stores[b].planes(), whole.stores[b].planes())
        for t in range(1, 5):
            np.testing.assert_array_equal(grown.scorers[b].khat(t), whole.scorers[b].khat(t))


def test_decode_steps_over_a_growing_index_equal_steps_over_indexes_built_at_each_length():
    rng = np.random.default_rng(5)
    d, G, n0, steps = 8, 3, 120, 12
    k = (rng.standard_normal((n0 + steps, d)) * np.exp(rng.normal(0, 1, d))).astype(np.float32)
    v = rng.standard_normal((n0 + steps, d)).astype(np.float32)
    stats = {"raw": HeadStats(np.exp(rng.normal(0, 1, d)), rng.permutation(d))}
    index = HeadIndex.build(k[:n0], stats)
    for m in range(n0 + 1, n0 + steps + 1):
        index.append(k[m - 1:m])
        q = rng.standard_normal((G, d)).astype(np.float32)
        for method in (M.fathom(10.0), M.sparq(2), M.double_sparsity(2), M.landmark(), M.oracle()):
            grown = decode_step(q, index.keys, v[:m], index, method, Selection(k=5, sink=2, local=8))
            built = decode_step(q, k[:m], v[:m], HeadIndex.build(k[:m], stats), method,
                                Selection(k=5, sink=2, local=8))
            np.testing.assert_array_equal(grown.mask, built.mask)
            np.testing.assert_array_equal(grown.output, built.output)


# --- bad input ------------------------------------------------------------------------------------------------


def test_head_index_refuses_a_basis_that_is_not_orthonormal_or_not_d_by_d():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((128, 8)).astype(np.float32)
    rotation, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    HeadIndex.build(keys, None, rotation)  # orthonormal: accepted
    with pytest.raises(ValueError, match=r"^basis must be orthonormal: RᵀR = I within 0.0001"):
        HeadIndex.build(keys, None, 2 * rotation)
    with pytest.raises(ValueError, match=r"^basis must be orthonormal"):
        HeadIndex.build(keys, None, rotation + 1e-3)
    with pytest.raises(ValueError, match=r"^basis must have shape \(8, 8\)"):
        HeadIndex.build(keys, None, rotation[:4, :4])
    with pytest.raises(ValueError, match=r"^basis must be finite"):
        HeadIndex.build(keys, None, np.full((8, 8), np.nan))


def test_decode_step_checks_its_shapes_at_the_boundary():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 256, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    index = HeadIndex.build(k, None)
    sel = Selection(k=32)
    with pytest.raises(ValueError, match=r"^values must have 256 rows"):
        decode_step(q, k, v[:200], index, M.fathom(48), sel)
    with pytest.raises(ValueError, match=r"^q must have shape \(G >= 1, 16\)"):
        decode_step(q[:, :8], k, v, index, M.fathom(48), sel)
    with pytest.raises(ValueError, match=r"^q must have shape \(G >= 1, 16\)"):
        decode_step(q[:0], k, v, index, M.fathom(48), sel)


def test_head_index_appends_to_every_store_or_to_none():
    """Keys the raw store holds but the rotated one cannot (a value past float16's range once rotated) are refused
    before either store, or the exact keys, takes them."""
    rng = np.random.default_rng(1)
    rotation, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    index = HeadIndex.build(np.zeros((0, 8), np.float32), None, rotation)
    keys = np.zeros((64, 8), np.float32)
    keys[0] = 60000.0  # in float16's range raw; some rotated coordinate exceeds it
    assert np.abs(keys @ rotation).max() > 65504
    with pytest.raises(ValueError, match="beyond the float16 range"):
        index.append(keys)
    assert [store.n_tokens for store in index.stores.values()] == [0, 0] and len(index.keys) == 0
