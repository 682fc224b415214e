"""The torch twin of the fidelity evaluation against the NumPy reference (CPU in CI; a CUDA device with ``gpu``)."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from fathom import fidelity
from fathom import methods as M
from fathom.calibration import calibrate, cell_means
from fathom.cuda import fidelity as twin
from fathom.decode import HeadIndex, method_scores
from fathom.quantize import quantize
from fathom.scoring import DepthScorer
from fathom.selection import Selection, protocol_masks, select_many
from fathom.store import PlaneStore
from fathom.synthetic import SyntheticConfig, generate

SMALL = SyntheticConfig(layers=2, kv_heads=2, group_size=3, head_dim=16, tokens=700, positions=6)
GRID = [M.fathom(24), M.fathom(24, "calibration"), M.fathom_rotated(24), M.fathom_rotated(24, "store"),
        M.fathom_plan((16, 32), 24), M.fathom_plan((32, 16), 24, M.PER_HEAD, gains="calibrated"),
        M.fathom(24, gains="calibrated"), M.fathom_rotated(24, gains="calibrated"),
        M.fathom_mixed(24), M.fathom_mixed(24, "calibrated"), M.fathom(24, pooled=True),
        M.fathom_mixed(24, pooled=True), M.fathom_mixed(24, "calibrated", pooled=True), M.sparq(4),
        M.double_sparsity(4), M.loki(4),
        M.thumbnail(2), M.landmark(), M.oracle(), M.dense(),
        M.predicting(M.fathom(24)), M.predicting(M.fathom_mixed(24, "calibrated", pooled=True)),
        M.predicting(M.double_sparsity(4))]


@pytest.fixture(scope="module")
def small():
    calibration_text = SyntheticConfig(**{**SMALL.__dict__, "text_seed": 1})
    head_basis = np.array([["rotated", "raw"], ["raw", "rotated"]])  # the per-head store reads both
    return generate(SMALL), calibrate(generate(calibration_text)).with_head_basis(head_basis)


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 4))
def test_dequantized_copies_are_the_reference_store_at_every_depth(seed, blocks):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((blocks * 64 + 17, 8)) * np.exp(rng.normal(0, 2, 8))).astype(np.float32)
    k[:, 3] = 0.0  # a zero scale
    k[5:9, 1] = k[:64, 1].max() * np.array([1, -1, 0.5, -0.25], np.float32)  # exact cell edges
    copies, scales = twin.dequantized_copies(torch.from_numpy(k))
    store = PlaneStore.from_keys(k)
    scorer = DepthScorer(store.planes(), store.scales())
    np.testing.assert_array_equal(copies.numpy(), np.stack([scorer.khat(t) for t in range(1, 5)]))
    np.testing.assert_array_equal(scales.numpy(), quantize(k[:blocks * 64])[1])
    levels = cell_means(k)  # read through the keys' own cell means
    copies, _ = twin.dequantized_copies(torch.from_numpy(k), levels)
    scorer = DepthScorer(store.planes(), store.scales(), levels)
    np.testing.assert_array_equal(copies.numpy(), np.stack([scorer.khat(t) for t in range(1, 5)]))


def test_dequantized_copies_refuse_keys_past_the_float16_range():
    with pytest.raises(ValueError, match="float16"):
        twin.dequantized_copies(torch.full((64, 4), 1e5))


@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 40))
def test_selection_twin_equals_the_reference_with_ties(seed, k):
    rng = np.random.default_rng(seed)
    P, G, n = 3, 2, 150
    scores = rng.integers(0, 6, (P, G, 128)).astype(np.float32)  # many ties: the earlier token must win
    contexts = np.array([100, 140, 150])
    scored = contexts // 64 * 64
    sel = Selection(k=k, sink=4, local=8)
    keep, candidate = (torch.from_numpy(m) for m in protocol_masks(contexts, scored, sel, n))
    got = twin.select_many(torch.from_numpy(scores), keep, candidate, sel.k)
    np.testing.assert_array_equal(got.numpy(), select_many(scores, contexts, scored, sel, n))


def _assert_equal_results(got, want, rtol):
    for g, w in zip(got, want):
        assert (g.label, g.bits_read, g.scan_bytes, g.channels_touched, g.mean_depth) == \
            (w.label, w.bits_read, w.scan_bytes, w.channels_touched, w.mean_depth)
        np.testing.assert_allclose(g.rel_error_per_head, w.rel_error_per_head, rtol=rtol, atol=1e-12)
        np.testing.assert_allclose(g.rel_error_per_layer, w.rel_error_per_layer, rtol=rtol, atol=1e-12)
        np.testing.assert_allclose([g.rows_per_head, g.oracle_overlap], [w.rows_per_head, w.oracle_overlap],
                                   rtol=rtol)
        np.testing.assert_allclose(g.oracle_overlap_per_head, w.oracle_overlap_per_head, rtol=rtol)


def test_twin_equals_the_numpy_evaluation_for_every_method(small):
    capture, calibration = small
    sel = Selection(k=40)
    want = fidelity.evaluate(capture, calibration, GRID, sel)
    _assert_equal_results(twin.evaluate(capture, calibration, GRID, sel), want, rtol=1e-9)
    # chunks of one method at a time give the same numbers
    _assert_equal_results(twin.evaluate(capture, calibration, GRID, sel, chunk_elements=1), want, rtol=1e-9)
    dense, oracle = want[GRID.index(M.dense())], want[GRID.index(M.oracle())]
    assert dense.rel_error == 0 and dense.oracle_overlap == oracle.oracle_overlap == 1
    assert 0 < want[0].oracle_overlap < 1 and len(want[0].rel_error_per_head) == SMALL.layers


def test_twin_equals_the_numpy_evaluation_through_calibrated_levels(small):
    capture, calibration = small
    sel = Selection(k=48)
    _assert_equal_results(twin.evaluate(capture, calibration, GRID, sel, levels=True),
                          fidelity.evaluate(capture, calibration, GRID, sel, levels=True), rtol=1e-9)
    with pytest.raises(ValueError, match="levels=True reads the planes through calibrated reconstruction"):
        twin.evaluate(capture, None, GRID[:1], sel, levels=True)


def test_twin_without_calibration_and_at_k_beyond_the_context(small):
    capture, _ = small
    grid = [M.fathom(24), M.sparq(4), M.thumbnail(2), M.oracle()]
    for sel in (Selection(k=0), Selection(k=1000)):
        _assert_equal_results(twin.evaluate(capture, None, grid, sel), fidelity.evaluate(capture, None, grid, sel),
                              rtol=1e-9)
    with pytest.raises(ValueError, match="calibration"):
        twin.evaluate(capture, None, [M.fathom_rotated(24)], Selection(k=8))


@pytest.mark.gpu
def test_twin_on_the_gpu_equals_the_reference_except_float_ties():
    """On a CUDA device: the same results within float32 tolerance, and every selection of one head equal to the
    reference's except tokens whose reference score ties the head's k-th within float32 tolerance."""
    config = SyntheticConfig(layers=2, kv_heads=2, group_size=4, head_dim=64, tokens=4096, positions=16)
    capture = generate(config)
    calibration = calibrate(generate(SyntheticConfig(**{**config.__dict__, "text_seed": 1})))
    sel = Selection(k=128)
    grid = [M.fathom(48), M.fathom_rotated(48), M.sparq(16), M.double_sparsity(16), M.loki(16), M.thumbnail(2),
            M.landmark(), M.predicting(M.fathom(48)), M.predicting(M.fathom_rotated(48)), M.oracle(), M.dense()]
    pooled = [M.fathom(48, pooled=True), M.fathom_rotated(48, gains="calibrated", pooled=True)]
    for levels in (False, True):
        _assert_equal_results(twin.evaluate(capture, calibration, grid + pooled, sel, levels=levels, device="cuda"),
                              fidelity.evaluate(capture, calibration, grid + pooled, sel, levels=levels), rtol=2e-3)
    n = capture.keys.shape[2]
    blocks = (capture.positions + 1) // 64
    keep, candidate = protocol_masks(capture.positions + 1, blocks * 64, sel, n)
    causal = np.arange(n)[None, :] <= capture.positions[:, None]
    stats = {b: calibration.head_stats(0, 0, b) for b in ("raw", "rotated")}
    index = HeadIndex.build(capture.keys[0, 0], stats, calibration.basis[0, 0])
    head = twin._Head(capture, 0, 0, calibration, True, sel,
                      *(torch.from_numpy(m).cuda() for m in (keep, candidate, causal)), blocks, torch.device("cuda"))
    for method in grid[:-1]:
        scores, depths = method_scores(method, capture.queries[0, 0], index, blocks, layer=0)
        want = select_many(scores, capture.positions + 1, blocks * 64, sel, n)
        got_scores = head.exact if method.scorer == "exact" else head.landmark_scores() \
            if method.scorer == "landmark" else \
            head.plane_scores(method.basis, depths[None], head.plane_queries(method, depths)[None])[0]
        got = twin.select_many(got_scores, head.keep, head.candidate, sel.k).cpu().numpy()
        differ = got != want
        kth = np.sort(np.where(want[..., :scores.shape[-1]] & candidate[:, None, :scores.shape[-1]], scores,
                               np.inf), axis=-1)[..., :1]  # each head's k-th selected reference score
        near = np.abs(scores - kth) <= 1e-5 * np.abs(scores).max(axis=-1, keepdims=True)
        assert not differ[..., scores.shape[-1]:].any() and not (differ[..., :scores.shape[-1]] & ~near).any(), \
            method.name
