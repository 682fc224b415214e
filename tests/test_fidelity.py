import numpy as np
import pytest

from fathom import methods as M
from fathom.calibration import Calibration, calibrate, plane_drops
from fathom.decode import HeadIndex, decode_step
from fathom.fidelity import evaluate, plan_layers
from fathom.selection import Selection
from fathom.synthetic import SyntheticConfig, generate
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
