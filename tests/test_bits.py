import numpy as np
import pytest

from fathom import methods as M
from fathom import reference as ref
from fathom.bits import fixed_channel_bits, full_key_bits, landmark_bits, row_bytes, scan_bits, tier_scan_bits


def test_bit_accounting_matches_the_spec_table():
    assert fixed_channel_bits(32) == 136 and fixed_channel_bits(16) == 68
    assert M.thumbnail(2).nominal_bits(128) == 288
    assert landmark_bits(128) == 256 == M.landmark().nominal_bits(128)
    assert full_key_bits(128) == 2048 == M.oracle().nominal_bits(128)
    assert row_bytes(128) == 512
    for method, bits in [(M.sparq(32), 136), (M.sparq(16), 68), (M.double_sparsity(32), 136), (M.loki(32), 136)]:
        assert method.nominal_bits(128) == bits
        assert method.label(128) == f"{method.name}@{bits}"
    assert M.fathom(48).nominal_bits(128) == 48


def test_fixed_channel_fractions_scale_with_head_dim():
    bits = {m.label(64) for m in M.baselines(64)}
    assert {"sparq@34", "sparq@68", "double-sparsity@68", "loki@68", "thumbnail-2bit@144"} <= bits


def test_tier_scan_bits_split_the_scan_bits_by_tier():
    """Near: planes below t and the scales (t > 0); far: the planes from t on (and the scales at t = 0)."""
    depths = np.array([[4, 0, 1, 2], [3, 3, 0, 0]])
    assert tier_scan_bits(depths[0], 2) == (2 + 1 + 2 + 0.75, 2.0)
    for t, near, far in [(0, [0, 0], [7.75, 6.5]), (1, [3.75, 2.5], [4, 4]), (4, [7.75, 6.5], [0, 0])]:
        np.testing.assert_array_equal(tier_scan_bits(depths, t), (near, far))
    for t in range(5):
        np.testing.assert_array_equal(np.add(*tier_scan_bits(depths, t)), scan_bits(depths))
    with pytest.raises(ValueError, match="hbm_planes"):
        tier_scan_bits(depths, 5)


def test_scan_bits_counts_planes_plus_a_quarter_bit_per_channel_touched():
    assert ref.scan_bits(np.array([4, 0, 1, 2])) == 7 + 0.75
    np.testing.assert_array_equal(ref.scan_bits(np.array([[4, 4], [0, 0]])), [8.5, 0.0])
    with pytest.raises(ValueError, match="^depths "):
        ref.scan_bits(np.array([5]))
