from dataclasses import replace

import numpy as np
import pytest

from fathom import methods as M
from fathom.calibration import Calibration, calibrate, cell_means, plane_drops
from fathom.attention import attention, relative_error
from fathom.bits import scan_bits
from fathom.decode import HeadIndex, decode_step, method_scores, pooled_layer_depths
from fathom.fidelity import evaluate, plan_layers
from fathom.selection import Selection, select
from fathom.synthetic import SyntheticConfig, generate
from fathom.quantize import midpoint_levels, quantize
from fathom.waterfill import DESIGN_GAINS

SMALL = SyntheticConfig(layers=2, kv_heads=2, group_size=2, head_dim=16, tokens=400, positions=5)


@pytest.fixture(scope="module")
def capture_and_calibration():
    return generate(SMALL), calibrate(generate(SyntheticConfig(**{**SMALL.__dict__, "text_seed": 1})))


def test_batched_evaluation_equals_the_decode_step_position_by_position(capture_and_calibration):
    capture, calibration = capture_and_calibration
    methods = [M.fathom(24), M.fathom(24, "calibration"), M.fathom_rotated(24), M.sparq(4), M.double_sparsity(4),
               M.loki(4), M.thumbnail(2), M.landmark(), M.oracle(), M.dense()]
    sel = Selection(k=32)
    results = evaluate(capture, calibration, methods, sel)
    L, H, n, d = capture.keys.shape
    for method, result in zip(methods, results):
        errors = np.zeros(L)
        bits = []
        for layer in range(L):
            for head in range(H):
                stats = {b: calibration.head_stats(layer, head, b) for b in ("raw", "rotated")}
                keys, values = capture.keys[layer, head], capture.values[layer, head]
                index = HeadIndex.build(keys, stats, calibration.basis[layer, head])
                for p, pos in enumerate(capture.positions):
                    m = pos + 1
                    q = capture.queries[layer, head, p]
                    step = decode_step(q, keys[:m], values[:m], index, method, sel, capture.scale)
                    dense = decode_step(q, keys[:m], values[:m], index, M.dense(), sel, capture.scale)
                    err = np.linalg.norm(step.output - dense.output, axis=1) / np.linalg.norm(dense.output, axis=1)
                    errors[layer] += err.mean() / (H * len(capture.positions))
                    bits.append(step.bits)
        np.testing.assert_allclose(result.rel_error_per_layer, errors, rtol=1e-9, atol=1e-12)
        assert result.bits_read == pytest.approx(np.mean(bits))
        if method.name.startswith("fathom"):
            assert result.bits_read <= 24
    assert results[-1].rel_error == 0 and results[-2].rel_error < results[-3].rel_error


def test_a_pooled_method_is_evaluated_on_its_layers_plan_position_by_position(capture_and_calibration):
    """The batched evaluation of a pooled method equals one query group's step at a time on the depths the layer's
    plan gives that head (:func:`pooled_layer_depths`), whose mean over the heads fits the budget."""
    capture, calibration = capture_and_calibration
    sel, pooled = Selection(k=32), M.fathom(24, pooled=True)
    (result,) = evaluate(capture, calibration, [pooled], sel)
    assert result.label == "fathom[pooled]@24"
    L, H, n, d = capture.keys.shape
    blocks = (capture.positions + 1) // 64
    errors, bits = np.zeros((L, H)), []
    for layer in range(L):
        indexes = [HeadIndex.build(capture.keys[layer, h], {b: calibration.head_stats(layer, h, b)
                                                              for b in ("raw", "rotated")}) for h in range(H)]
        depths = pooled_layer_depths([pooled] * H, capture.queries[layer], indexes, blocks)  # [H, P, d]
        assert (scan_bits(depths).mean(axis=0) <= 24).all()
        for h in range(H):
            keys, values = capture.keys[layer, h], capture.values[layer, h]
            for p, pos in enumerate(capture.positions):
                m, q = pos + 1, capture.queries[layer, h, p]
                scores, _ = method_scores(pooled, q[None], indexes[h], blocks[p:p + 1], layer, depths[h, p:p + 1])
                out = attention(q, keys[:m], values[:m], select(scores[0, :, :blocks[p] * 64], m, sel),
                                capture.scale)
                dense = attention(q, keys[:m], values[:m], np.ones((len(q), m), bool), capture.scale)
                errors[layer, h] += relative_error(out, dense).mean() / len(capture.positions)
                bits.append(scan_bits(depths[h, p]))
    np.testing.assert_allclose(result.rel_error_per_head, errors, rtol=1e-9, atol=1e-12)
    assert result.bits_read == pytest.approx(np.mean(bits)) and result.bits_read <= 24


def test_a_pooled_method_is_scored_only_with_its_layers_plan(capture_and_calibration):
    capture, calibration = capture_and_calibration
    index = HeadIndex.build(capture.keys[0, 0], None)
    q, blocks = capture.queries[0, 0], (capture.positions + 1) // 64
    with pytest.raises(ValueError, match="depths must be given exactly for a pooled method"):
        method_scores(M.fathom(24, pooled=True), q, index, blocks)
    with pytest.raises(ValueError, match="depths must be given exactly for a pooled method"):
        method_scores(M.fathom(24), q, index, blocks, depths=np.zeros((len(blocks), 16), np.int8))
    with pytest.raises(ValueError, match="depths must be given exactly for a pooled method"):
        decode_step(q[0], capture.keys[0, 0], capture.values[0, 0], index, M.fathom(24, pooled=True),
                    Selection(k=8))


def test_calibration_round_trips_and_orders_the_basis(tmp_path, capture_and_calibration):
    _, calibration = capture_and_calibration
    basis = calibration.basis[0, 0]
    np.testing.assert_allclose(basis.T @ basis, np.eye(basis.shape[0]), atol=1e-5)
    assert sorted(calibration.ds_rank[1, 1].tolist()) == list(range(basis.shape[0]))
    calibration.with_preferred_basis("rotated").save(tmp_path / "c.npz")
    loaded = Calibration.load(tmp_path / "c.npz")
    assert loaded.preferred_basis == "rotated"
    np.testing.assert_array_equal(loaded.basis, calibration.basis)
    with pytest.raises(ValueError, match="^basis "):
        calibration.with_preferred_basis("diagonal")


def test_score_variance_order_puts_the_query_aligned_direction_first():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 1, 2000, 3)) * np.array([1.0, 3.0, 2.0])  # largest key variance on axis 1
    queries = np.zeros((1, 1, 4, 1, 3))
    queries[..., 2] = 1.0  # but queries only look along axis 2
    from fathom.capture import Capture
    cal = calibrate(Capture(keys.astype(np.float32), keys.astype(np.float32), queries.astype(np.float32),
                            np.arange(4), 1.0))
    assert abs(cal.basis[0, 0, 2, 0]) > 0.99  # first rotated coordinate is the query's axis
    np.testing.assert_allclose(cal.sigma2_raw[0, 0], [1.0, 9.0, 4.0], rtol=0.1)


def test_synthetic_texts_share_the_model_and_differ_in_tokens():
    a, b = generate(SMALL), generate(SyntheticConfig(**{**SMALL.__dict__, "text_seed": 1}))
    assert a.meta["synthetic"] and a.keys.shape == (2, 2, 400, 16) and a.queries.shape == (2, 2, 5, 2, 16)
    assert not np.allclose(a.keys, b.keys)
    np.testing.assert_allclose(np.log(a.keys.std(axis=2)), np.log(b.keys.std(axis=2)), atol=0.5)
    np.testing.assert_array_equal(generate(SMALL).keys, a.keys)


def test_per_layer_plan_reads_each_layers_own_budget_and_keeps_the_mean(capture_and_calibration):
    capture, calibration = capture_and_calibration
    calibration_capture = generate(SyntheticConfig(**{**SMALL.__dict__, "text_seed": 1}))
    sel = Selection(k=32)
    (plan,) = plan_layers(calibration_capture, calibration, [32], sel, candidates=(8, 16, 32, 48, 64))
    budgets = plan.policy.budgets
    assert len(budgets) == 2 and np.mean(budgets) <= 32 and plan.label(16) == "fathom-plan@32"
    (result,) = evaluate(capture, calibration, [plan], sel)
    flat = [evaluate(capture, calibration, [M.fathom(b)], sel)[0] for b in budgets]
    for layer, (budget, reference) in enumerate(zip(budgets, flat)):  # layer l reads exactly fathom@budgets[l]
        assert result.rel_error_per_layer[layer] == pytest.approx(reference.rel_error_per_layer[layer])


def test_per_layer_plan_of_the_per_head_store_reads_each_layers_flat_per_head_store(capture_and_calibration):
    capture, calibration = capture_and_calibration
    calibration = calibration.with_head_basis(np.array([["raw", "rotated"], ["rotated", "raw"]]))
    calibration_capture = generate(SyntheticConfig(**{**SMALL.__dict__, "text_seed": 1}))
    sel = Selection(k=32)
    (plan,) = plan_layers(calibration_capture, calibration, [32], sel, M.PER_HEAD, candidates=(8, 16, 32, 48, 64),
                          gains="calibrated")
    budgets = plan.policy.budgets
    assert len(budgets) == 2 and np.mean(budgets) <= 32 and plan.label(16) == "fathom-mixed-plan[gains]@32"
    (result,) = evaluate(capture, calibration, [plan], sel)
    flat = evaluate(capture, calibration, [M.fathom_mixed(b, "calibrated") for b in budgets], sel)
    for layer, reference in enumerate(flat):  # layer l reads exactly fathom-mixed[gains]@budgets[l], head by head
        np.testing.assert_allclose(result.rel_error_per_head[layer], reference.rel_error_per_head[layer])
    with pytest.raises(ValueError, match="^basis must be one of raw, rotated, per-head, got 'klt'"):
        plan_layers(calibration_capture, calibration, [32], sel, "klt")


def test_plane_drops_of_uniform_keys_are_the_design_model():
    """Keys uniform in every block lose (3/4) 4^-(t-1) of their variance to the t-th plane: design §5's gains."""
    rng = np.random.default_rng(0)
    keys = rng.uniform(-1, 1, (64 * 400, 3)).astype(np.float32) * np.array([1.0, 4.0, 0.25], np.float32)
    drops, scale2 = plane_drops(keys)
    np.testing.assert_allclose(drops / keys.var(axis=0)[:, None], np.tile(DESIGN_GAINS, (3, 1)), rtol=0.03)
    np.testing.assert_allclose(scale2, np.array([1.0, 16.0, 1 / 16]) * 64 / 66, rtol=0.01)  # E max² of 64 |U|


def test_peaked_keys_get_less_from_the_first_plane_than_the_design_credits():
    keys = np.random.default_rng(1).laplace(0, 1, (64 * 200, 4)).astype(np.float32)
    ratio = plane_drops(keys)[0] / keys.var(axis=0)[:, None]
    assert (ratio[:, 0] < 0.5 * DESIGN_GAINS[0]).all()


def test_calibrated_gains_and_the_per_head_store_evaluate_per_head(capture_and_calibration, tmp_path):
    capture, calibration = capture_and_calibration
    assert calibration.plane_drops_raw.shape == capture.keys.shape[:2] + (capture.keys.shape[3], 4)
    head_basis = np.array([["raw", "rotated"], ["rotated", "raw"]])
    mixed = calibration.with_head_basis(head_basis)
    calibration.with_head_basis(head_basis).save(tmp_path / "c.npz")
    loaded = Calibration.load(tmp_path / "c.npz")
    np.testing.assert_array_equal(loaded.head_basis, head_basis)
    np.testing.assert_array_equal(loaded.plane_drops_rotated, calibration.plane_drops_rotated)
    sel = Selection(k=32)
    for gains in M.GAIN_SOURCES:
        raw, rotated, per_head = evaluate(capture, mixed, [M.fathom(24, gains=gains), M.fathom_rotated(24, gains=gains),
                                                           M.fathom_mixed(24, gains)], sel)
        want = np.where(head_basis == "rotated", rotated.rel_error_per_head, raw.rel_error_per_head)
        np.testing.assert_array_equal(per_head.rel_error_per_head, want)
        assert per_head.label == ("fathom-mixed@24" if gains == "design" else "fathom-mixed[gains]@24")
    with pytest.raises(ValueError, match="head_basis"):
        evaluate(capture, calibration, [M.fathom_mixed(24)], sel)
    with pytest.raises(ValueError, match="^head_basis must be"):
        calibration.with_head_basis(np.array([["raw", "diagonal"], ["raw", "raw"]]))


def test_a_calibration_saved_before_the_gain_table_loads_without_it(tmp_path, capture_and_calibration):
    _, c = capture_and_calibration
    np.savez(tmp_path / "old.npz", sigma2_raw=c.sigma2_raw, basis=c.basis, sigma2_rotated=c.sigma2_rotated,
             ds_rank=c.ds_rank, preferred_basis="raw", meta="{}")
    old = Calibration.load(tmp_path / "old.npz")
    assert old.plane_drops_raw is None and old.head_basis is None
    with pytest.raises(ValueError, match="plane drops"):
        evaluate(generate(SMALL), old, [M.fathom(24, gains="calibrated")], Selection(k=32))


def test_cell_means_are_the_mean_key_of_each_cell_with_a_prior_at_its_midpoint():
    rng = np.random.default_rng(3)
    keys = (rng.laplace(0, 1, (2, 64 * 20 + 9, 4)) + rng.normal(0, 1, 4)).astype(np.float32)
    keys[1, :64, 0] = 0  # a block of zero scale: left out
    levels = cell_means(keys, prior=3.0)
    assert levels.shape == (2, 4, 4, 16) and levels.dtype == np.float32
    midpoints = midpoint_levels(4)
    for h in range(2):
        k = keys[h, :64 * 20]
        codes, scales = quantize(k)
        delta = np.repeat(scales.astype(np.float32).T / np.float32(8), 64, axis=0)
        for c in range(4):
            for t in range(1, 5):
                cell = codes[:, c] >> (4 - t)
                seen = delta[:, c] > 0
                x = (k[:, c] / np.where(seen, delta[:, c], 1))[seen].astype(np.float64)
                for p in range(16):
                    if p >= 2 ** t:
                        assert levels[h, c, t - 1, p] == 0
                        continue
                    inside = x[cell[seen] == p]
                    want = (inside.sum() + 3.0 * midpoints[c, t - 1, p]) / (len(inside) + 3.0)
                    assert levels[h, c, t - 1, p] == pytest.approx(want, rel=1e-5, abs=1e-5)
    uniform = rng.uniform(-1, 1, (64 * 400, 2)).astype(np.float32)  # evenly spread over each cell: the midpoints
    np.testing.assert_allclose(cell_means(uniform), midpoint_levels(2), atol=0.15)


def test_levels_lower_the_plane_error_and_ride_with_the_calibration(tmp_path, capture_and_calibration):
    """Read through its cell means, a plane leaves less error than through the midpoints (the table is measured
    through them); the tables round-trip; a head's stats carry them only when asked; and an evaluation through
    midpoint tables is the evaluation without tables."""
    capture, calibration = capture_and_calibration
    L, H, n, d = capture.keys.shape
    assert calibration.levels_raw.shape == calibration.levels_rotated.shape == (L, H, d, 4, 16)
    keys = np.random.default_rng(1).laplace(0, 1, (64 * 200, 4)).astype(np.float32)
    removed = plane_drops(keys, cell_means(keys))[0].sum(axis=-1)  # the error removed by all four planes
    assert (removed > plane_drops(keys)[0].sum(axis=-1)).all()
    calibration.save(tmp_path / "c.npz")
    loaded = Calibration.load(tmp_path / "c.npz")
    for name in ("levels_raw", "levels_rotated", "level_drops_raw", "level_drops_rotated"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(calibration, name))
    assert calibration.head_stats(1, 0, "raw").levels is None
    stats = calibration.head_stats(1, 0, "rotated", levels=True)
    np.testing.assert_array_equal(stats.levels, calibration.levels_rotated[1, 0])
    np.testing.assert_array_equal(stats.plane_drops, calibration.level_drops_rotated[1, 0])
    grid, sel = [M.fathom(24), M.fathom_rotated(24, gains="calibrated"), M.thumbnail(2), M.sparq(4)], Selection(k=32)
    midpoints = replace(calibration, levels_raw=np.broadcast_to(midpoint_levels(d), (L, H, d, 4, 16)),
                        levels_rotated=np.broadcast_to(midpoint_levels(d), (L, H, d, 4, 16)),
                        level_drops_raw=calibration.plane_drops_raw,
                        level_drops_rotated=calibration.plane_drops_rotated)
    plain = evaluate(capture, calibration, grid, sel)
    for a, b in zip(evaluate(capture, midpoints, grid, sel, levels=True), plain):
        assert a.rel_error_per_head == b.rel_error_per_head and a.bits_read == b.bits_read
    through = evaluate(capture, calibration, grid, sel, levels=True)
    assert through[0].rel_error != plain[0].rel_error and through[2].rel_error != plain[2].rel_error


def test_levels_are_refused_without_a_calibration_that_holds_them(tmp_path, capture_and_calibration):
    capture, calibration = capture_and_calibration
    old = replace(calibration, levels_raw=None, levels_rotated=None, level_drops_raw=None, level_drops_rotated=None)
    for c in (None, old):
        with pytest.raises(ValueError, match="levels=True reads the planes through calibrated reconstruction"):
            evaluate(capture, c, [M.fathom(24)], Selection(k=32), levels=True)
    with pytest.raises(ValueError, match="levels=True needs a calibration with reconstruction tables"):
        old.head_stats(0, 0, "raw", levels=True)
