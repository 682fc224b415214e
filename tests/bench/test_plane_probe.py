"""bench.plane_probe: its midpoint reconstruction is the store's own (design §2) at every depth, centroids differ
only where a prefix covers several cells, its gains are a valid table, its ``design`` and shared-water-line rows
are the fidelity bench's fathom and fathom[pooled] errors, and bad arguments exit 2 with one line."""

import numpy as np
import pytest

from bench import plane_probe
from fathom import fidelity, methods as M
from fathom.quantize import MAX_DEPTH, midpoint_levels, unpack_planes
from fathom.selection import Selection
from fathom.store import PlaneStore
from fathom.synthetic import SyntheticConfig, generate


def _store(seed=0, n=256, d=6):
    scale = np.array([1, 2, 0.5, 3, 1, 0.1], np.float32)
    keys = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32) * scale
    store = PlaneStore.from_keys(keys)
    return store.planes(), store.scales()


def test_midpoint_levels_read_what_the_store_dequantizes_and_centroids_differ_only_above_one_cell():
    planes, _ = _store()
    counts = plane_probe.code_histogram(unpack_planes(planes))
    assert counts.sum(axis=1).tolist() == [256.0] * 6
    np.testing.assert_array_equal(plane_probe.levels_table(counts, centroid=False), midpoint_levels(6))
    centroid = plane_probe.levels_table(counts, centroid=True)
    for t in range(1, MAX_DEPTH + 1):
        np.testing.assert_array_equal(centroid[:, t - 1, :1 << t],
                                      plane_probe.prefix_levels(counts, t, True).astype(np.float32))
    np.testing.assert_array_equal(plane_probe.prefix_levels(counts, 4, True),
                                  plane_probe.prefix_levels(counts, 4, False))
    assert not np.allclose(plane_probe.prefix_levels(counts, 1, True), plane_probe.prefix_levels(counts, 1, False))
    one_cell = np.zeros((1, 16))
    one_cell[0, 9] = 5  # every code in cell 9: each prefix that holds it reconstructs at its centre, 1.5 Δ
    for t in range(1, MAX_DEPTH + 1):
        assert plane_probe.prefix_levels(one_cell, t, True)[0, 9 >> (4 - t)] == 1.5


def test_histogram_gains_are_a_table_the_water_filling_accepts():
    counts = plane_probe.code_histogram(unpack_planes(_store(1)[0]))
    for centroid in (False, True):
        gains = plane_probe.histogram_gains(counts, centroid)
        assert gains.shape == (6, 4) and (gains >= 0).all() and (np.diff(gains, axis=1) <= 1e-12).all()


def test_depth_2_minimum_never_reads_a_channel_to_depth_1():
    from fathom.waterfill import waterfill_batched

    w = np.random.default_rng(0).gamma(0.5, size=(50, 32))  # importances spread over decades
    gains = np.broadcast_to(plane_probe.depth_2_minimum_gains(), w.shape + (MAX_DEPTH,))
    for budget in (8.0, 20.0, 48.0):
        depths = waterfill_batched(w, budget, gains)
        assert not (depths == 1).any() and (depths >= 2).any()


def test_the_design_and_shared_rows_are_the_fidelity_benchs_fathom_and_pooled_errors():
    capture = generate(SyntheticConfig(layers=1, kv_heads=2, group_size=2, head_dim=16, tokens=512, positions=4))
    sel = Selection(k=32)
    result = plane_probe.evaluate(capture, None, [24.0], sel)
    assert set(result) == set(plane_probe.VARIANTS) - {"calibrated-gains"}  # no calibration: no measured table
    design, pooled = fidelity.evaluate(capture, None, [M.fathom(24.0), M.fathom(24.0, pooled=True)], sel)
    assert result["design"][24.0] == pytest.approx(design.rel_error, rel=1e-9)
    assert result["shared-water-line"][24.0] == pytest.approx(pooled.rel_error, rel=1e-9)


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "--model"),
    (["--context", "64"], "--context must lie in 128"),
    (["--positions", "0"], "--positions must lie in 1.."),
    (["--budgets", "0"], "--budgets must lie in (0,"),
    (["--corpus", "nope"], "--corpus must be one of"),
    # top-k would keep every token the first position chooses from: every variant exact, the table 0 / 0
    (["--context", "128", "--positions", "8"], "--context 128 is too short for k = 128 at 8 decode positions"),
    (["--context", "192", "--positions", "8"], "--context 192 is too short for k = 128 at 8 decode positions"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_:
        plane_probe.main([*argv, "--out", str(tmp_path)])  # a refusal that regressed writes nothing under bench/results
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
