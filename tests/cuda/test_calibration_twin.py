"""The torch twin of the calibration against the NumPy reference (CPU in CI, no GPU needed)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fathom.calibration import Calibration, calibrate
from fathom.capture import Capture
from fathom.cuda import calibration as twin


def random_capture(seed: int, L: int, H: int, n: int, d: int, P: int, G: int) -> Capture:
    """Keys with well separated channel scales (distinct eigenvalues), turned by a random rotation and offset, within
    the float16 range a store quantizes (the reference calibration measures the store's planes too)."""
    rng = np.random.default_rng(seed)
    scales = 2.0 ** (np.arange(d)[::-1] - d // 2)  # variances 4x apart: eigenvectors well defined
    rotation = np.linalg.qr(rng.standard_normal((L, H, d, d)))[0]
    keys = (rng.standard_normal((L, H, n, d)) * scales) @ rotation + rng.normal(0, 3, (L, H, 1, d))
    queries = rng.standard_normal((L, H, P, G, d))
    return Capture(keys.astype(np.float32), np.zeros((L, H, n, 1), np.float32), queries.astype(np.float32),
                   np.arange(P) + n - P, scale=d ** -0.5, meta={"synthetic": True})


def twin_calibrate(cap: Capture, needs=twin.NEEDS) -> Calibration:
    L, H, P, G, d = cap.queries.shape
    queries = cap.queries.reshape(L, H, P * G, d)
    layers = [twin.calibrate_layer(torch.from_numpy(cap.keys[layer]), torch.from_numpy(queries[layer]), needs)
              for layer in range(L)]
    return twin.stack(layers, cap.meta)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), L=st.integers(1, 2), H=st.integers(1, 3), d=st.sampled_from([4, 8, 16]),
       n=st.integers(40, 200), P=st.integers(1, 4), G=st.integers(1, 3))
def test_twin_equals_the_reference(seed, L, H, d, n, P, G):
    cap = random_capture(seed, L, H, n, d, P, G)
    ref, got = calibrate(cap), twin_calibrate(cap)
    assert got.sigma2_raw.dtype == got.basis.dtype == got.sigma2_rotated.dtype == np.float32
    assert got.ds_rank.dtype == np.int32 and got.basis.shape == (L, H, d, d)
    np.testing.assert_allclose(got.sigma2_raw, ref.sigma2_raw, rtol=1e-6)
    np.testing.assert_array_equal(got.ds_rank, ref.ds_rank)
    np.testing.assert_allclose(got.sigma2_rotated, ref.sigma2_rotated, rtol=1e-5)
    column_dots = np.einsum("lhdc,lhdc->lhc", got.basis, ref.basis)  # same column up to sign: |dot| = 1
    np.testing.assert_allclose(np.abs(column_dots), 1.0, atol=1e-5)
    planes = ["plane_drops_raw", "plane_drops_rotated", "scale2_raw", "scale2_rotated"] if n >= 64 else []
    assert got.meta == {**cap.meta, "computed": ["sigma2_raw", "basis", "sigma2_rotated", "ds_rank"] + planes}
    if planes:  # the raw store bit for bit; the rotated one quantizes keys @ basis, a basis equal up to round-off
        np.testing.assert_allclose(got.scale2_raw, ref.scale2_raw, rtol=1e-12)
        np.testing.assert_allclose(got.plane_drops_raw, ref.plane_drops_raw, rtol=1e-9,
                                   atol=1e-12 * ref.plane_drops_raw.max())
        # a block scale is an fp16 max: a rotated key a round-off apart can round it to the next fp16, 2^-10 of it
        # at most, so its square by 2^-9 (seen: 1.2e-3 over a single block, seed 92, L 2, H 3, d 16, n 64)
        np.testing.assert_allclose(got.scale2_rotated, ref.scale2_rotated, rtol=2.0 ** -9 + 1e-6)
        np.testing.assert_allclose(got.plane_drops_rotated, ref.plane_drops_rotated, rtol=5e-2,
                                   atol=1e-3 * ref.plane_drops_rotated.max())
    else:
        assert got.plane_drops_raw is None and ref.plane_drops_raw is None


def test_bf16_inputs_give_the_result_of_their_float32_upcast():
    g = torch.Generator().manual_seed(1)
    keys = (torch.randn(2, 100, 8, generator=g) * torch.arange(1.0, 9.0)).bfloat16()
    queries = torch.randn(2, 6, 8, generator=g).bfloat16()
    got, upcast = twin.calibrate_layer(keys, queries), twin.calibrate_layer(keys.float(), queries.float())
    for name in twin.FIELDS:  # both upcast exactly to the same float64: bit for bit
        assert torch.equal(getattr(got, name), getattr(upcast, name)), name


@pytest.mark.parametrize("needs, computed", [
    ((), ("sigma2_raw",)),
    ({"sigma2"}, ("sigma2_raw",)),
    ({"ds_rank"}, ("sigma2_raw", "ds_rank")),
    ({"basis"}, ("sigma2_raw", "basis", "sigma2_rotated")),
    ({"plane_drops"}, ("sigma2_raw", "plane_drops_raw", "scale2_raw")),
    (twin.NEEDS, twin.FIELDS),
])
def test_only_the_asked_fields_are_computed_and_the_rest_filled_neutral(needs, computed, tmp_path):
    cap = random_capture(0, L=2, H=2, n=64, d=8, P=2, G=2)
    ref, got = calibrate(cap), twin_calibrate(cap, needs)
    layer = twin.calibrate_layer(torch.from_numpy(cap.keys[0]), torch.from_numpy(cap.queries[0].reshape(2, 4, 8)),
                                 needs)
    assert layer.computed == computed
    assert all(getattr(layer, name) is None for name in twin.FIELDS if name not in computed)
    assert got.meta["computed"] == list(computed)
    np.testing.assert_allclose(got.sigma2_raw, ref.sigma2_raw, rtol=1e-6)
    if "ds_rank" not in computed:
        np.testing.assert_array_equal(got.ds_rank, np.broadcast_to(np.arange(8), (2, 2, 8)))
    if "basis" not in computed:
        np.testing.assert_array_equal(got.basis, np.broadcast_to(np.eye(8), (2, 2, 8, 8)))
        np.testing.assert_array_equal(got.sigma2_rotated, got.sigma2_raw)
    got.save(tmp_path / "cal.npz")  # the record of what is real survives a round trip
    assert Calibration.load(tmp_path / "cal.npz").meta["computed"] == list(computed)


def test_stack_leaves_the_callers_meta_alone():
    meta = {"model": "toy"}
    twin.stack([twin.calibrate_layer(torch.randn(1, 4, 2), torch.randn(1, 3, 2), ())], meta)
    assert meta == {"model": "toy"}


K, Q = torch.randn(2, 10, 4), torch.randn(2, 3, 4)


@pytest.mark.parametrize("keys, queries, needs, match", [
    (K[0], Q, (), "keys must be a float torch tensor of rank 3"),
    (K, Q[None], (), "queries must be a float torch tensor of rank 3"),
    (K.numpy(), Q, (), "keys must be a float torch tensor"),
    (K.int(), Q, (), "keys must be a float torch tensor"),
    (K, Q[:1], (), r"queries must have shape \[2, m, 4\]"),
    (K, Q[..., :3], (), r"queries must have shape \[2, m, 4\]"),
    (K[:, :1], Q, (), "keys must have at least 2 tokens"),
    (K, Q[:, :0], (), "queries must have at least 1 row"),
    (K, Q, {"basis", "pca"}, r"needs must be names from .* unknown \['pca'\]"),
    (K, Q, "basis", "needs must be an iterable of names"),
])
def test_calibrate_layer_refuses_at_the_boundary(keys, queries, needs, match):
    with pytest.raises(ValueError, match=match):
        twin.calibrate_layer(keys, queries, needs)


def test_stack_refuses_no_layers_mixed_fields_and_mixed_shapes():
    full, bare = twin.calibrate_layer(K, Q), twin.calibrate_layer(K, Q, ())
    with pytest.raises(ValueError, match="layers must hold at least one"):
        twin.stack([], {})
    with pytest.raises(ValueError, match="layers must all have the same fields computed"):
        twin.stack([full, bare], {})
    with pytest.raises(ValueError, match=r"layers must all have \[H, d\]"):
        twin.stack([bare, twin.calibrate_layer(K[:1], Q[:1], ())], {})
