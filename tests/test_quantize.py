import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from fathom import reference as ref
from fathom.quantize import dequantize, midpoint_levels, pack_planes, plane_bits, quantize


def mid_rise(k: np.ndarray, s: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The t-bit mid-rise uniform quantizer of [-s, s] (float64), and the distance of k to a cell edge."""
    w = 2 * s / 2 ** t
    x = np.where(w > 0, (k + s) / np.where(w > 0, w, 1), 0.0)
    index = np.clip(np.floor(x), 0, 2 ** t - 1)
    edge_distance = np.abs(x - np.round(x))
    return np.where(s > 0, -s + (index + 0.5) * w, 0.0), edge_distance


@st.composite
def key_blocks(draw, max_blocks=3, max_d=6):
    nb = draw(st.integers(1, max_blocks))
    d = draw(st.integers(1, max_d))
    elements = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
    k = draw(hnp.arrays(np.float32, (nb * 64, d), elements=elements))
    # Blocks of zeros, ties at the max and values that round up in fp16 are all drawn on purpose.
    if draw(st.booleans()):
        k[:64, 0] = 0.0
    if draw(st.booleans()):
        k[1, -1] = -k[:64, -1].max(initial=0) if k[:64, -1].max() > 0 else k[1, -1]
    if draw(st.booleans()):
        k[2, 0] = np.float32(1.0009765)  # rounds to fp16 1.0, below the true max
    return k


@given(key_blocks(), st.integers(1, 4))
def test_prefix_of_planes_is_the_t_bit_mid_rise_quantizer(k, t):
    codes, scales = ref.quantize(k)
    planes = ref.pack_planes(codes)
    khat = ref.dequantize(planes, scales, np.full(k.shape[1], t))
    s = np.repeat(scales.astype(np.float32).astype(np.float64), 64, axis=1).T  # [n, d]
    expected, edge = mid_rise(k.astype(np.float64), s, t)
    away = edge > 1e-4  # away from float rounding at exact cell edges
    np.testing.assert_allclose(khat[away], expected[away], rtol=1e-6, atol=1e-30)


@given(key_blocks())
def test_codes_follow_the_integer_definition(k):
    codes, scales = ref.quantize(k)
    assert codes.dtype == np.uint8 and scales.dtype == np.float16
    assert scales.shape == (k.shape[1], k.shape[0] // 64)
    s = np.abs(k.reshape(-1, 64, k.shape[1])).max(axis=1).astype(np.float16).astype(np.float32)
    for b in range(k.shape[0] // 64):
        for c in range(k.shape[1]):
            delta = np.float32(s[b, c] / np.float32(8))
            for j in range(0, 64, 7):
                x = k[b * 64 + j, c]
                want = 8 if delta == 0 else int(np.clip(np.floor(np.float32(x / delta)) + 8, 0, 15))
                assert codes[b * 64 + j, c] == want


@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 3).map(lambda b: 64 * b), st.integers(1, 5)),
                  elements=st.integers(0, 15)))
def test_pack_unpack_round_trip_and_layout(codes):
    planes = ref.pack_planes(codes)
    n, d = codes.shape
    assert planes.shape == (d, 4, n // 64) and planes.dtype == np.uint64 and planes.flags.c_contiguous
    np.testing.assert_array_equal(ref.unpack_planes(planes), codes)
    # token j of block b is bit j of planes[c, p, b]; plane p holds bit 3 - p
    for c in range(d):
        for p in range(4):
            for j in (0, 1, 63, n - 1):
                assert (int(planes[c, p, j // 64]) >> (j % 64)) & 1 == (codes[j, c] >> (3 - p)) & 1
    # the first t planes of a channel are one contiguous run of t * nb words
    flat = planes.reshape(-1)
    for t in range(1, 5):
        start = 1 * 4 * (n // 64) if d > 1 else 0
        c = 1 if d > 1 else 0
        np.testing.assert_array_equal(flat[start:start + t * (n // 64)], planes[c, :t, :].reshape(-1))


def test_plane_bits_restore_token_order():
    codes = np.arange(128, dtype=np.uint8).reshape(128, 1) % 16
    bits = plane_bits(ref.pack_planes(codes))
    np.testing.assert_array_equal(bits[0, 0], (codes[:, 0] >> 3) & 1)


def test_error_variance_falls_four_fold_per_plane():
    k = np.random.default_rng(0).uniform(-1, 1, (64 * 256, 1)).astype(np.float32)
    codes, scales = ref.quantize(k)
    planes = ref.pack_planes(codes)
    var = [np.var(ref.dequantize(planes, scales, np.array([t])) - k) for t in (1, 2, 3, 4)]
    ratios = np.array(var[:-1]) / np.array(var[1:])
    np.testing.assert_allclose(ratios, 4.0, rtol=0.1)


def test_zero_block_codes_eight_and_depth_zero_is_zero():
    k = np.zeros((64, 3), np.float32)
    codes, scales = ref.quantize(k)
    assert (codes == 8).all() and (scales == 0).all()
    k = np.random.default_rng(1).standard_normal((128, 3)).astype(np.float32)
    codes, scales = ref.quantize(k)
    khat = ref.dequantize(ref.pack_planes(codes), scales, np.array([0, 4, 2]))
    assert (khat[:, 0] == 0).all() and np.abs(khat[:, 1] - k[:, 1]).max() > 0


@pytest.mark.parametrize("bad, name", [
    (np.zeros((64, 4), np.float64), "k"),
    (np.zeros(64, np.float32), "k"),
    (np.zeros((65, 4), np.float32), "k"),
    (np.full((64, 4), np.nan, np.float32), "k"),
    (np.full((64, 4), 1e6, np.float32), "k"),
    ([[0.0] * 4] * 64, "k"),
])
def test_quantize_rejects_bad_keys(bad, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        ref.quantize(bad)


def test_pack_dequantize_reject_bad_input():
    with pytest.raises(ValueError, match="^codes "):
        ref.pack_planes(np.full((64, 2), 16, np.uint8))
    with pytest.raises(ValueError, match="^codes "):
        ref.pack_planes(np.zeros((63, 2), np.uint8))
    with pytest.raises(ValueError, match="^planes "):
        ref.unpack_planes(np.zeros((2, 3, 1), np.uint64))
    codes, scales = ref.quantize(np.ones((64, 2), np.float32))
    planes = ref.pack_planes(codes)
    with pytest.raises(ValueError, match="^depths "):
        ref.dequantize(planes, scales, np.array([5, 0]))
    with pytest.raises(ValueError, match="^depths "):
        ref.dequantize(planes, scales, np.array([-1, 0]))
    with pytest.raises(ValueError, match="^depths "):
        ref.dequantize(planes, scales, np.array([1, 0, 0]))
    with pytest.raises(ValueError, match="^scales "):
        ref.dequantize(planes, scales[:1], np.array([1, 0]))


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.fixture
def store():
    k = np.random.default_rng(0).standard_normal((128, 8)).astype(np.float32)
    codes, scales = quantize(k)
    return pack_planes(codes), scales


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_dequantize_refuses_nan_inf_and_negative_scales(store, bad):
    planes, scales = store
    scales = scales.copy()
    scales[3, 1] = bad
    with pytest.raises(ValueError, match="^scales must be finite and >= 0"):
        dequantize(planes, scales, np.full(8, 4))


@given(st.integers(0, 2 ** 32 - 1), st.lists(st.integers(0, 4), min_size=6, max_size=6))
def test_a_reconstruction_table_reads_each_cell_as_its_level(seed, depths):
    """With ``levels`` a channel read to depth t reads ``levels[c, t - 1, u >> (4 - t)] · Δ`` (0 at depth 0); the
    midpoint table is the design's dequantizer bit for bit."""
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((128, 6)) * np.exp(rng.normal(0, 2, 6))).astype(np.float32)
    k[:64, 2] = 0  # a zero scale: its block reads 0 at every depth
    codes, scales = quantize(k)
    planes, depths = pack_planes(codes), np.array(depths)
    np.testing.assert_array_equal(dequantize(planes, scales, depths, midpoint_levels(6)).view(np.uint32),
                                  dequantize(planes, scales, depths).view(np.uint32))
    levels = rng.normal(0, 8, (6, 4, 16)).astype(np.float32)
    delta = np.repeat(scales.astype(np.float32).T / np.float32(8), 64, axis=0)  # [n, d]
    want = np.zeros_like(k)
    for c, t in enumerate(depths):
        if t:
            want[:, c] = levels[c, t - 1, codes[:, c] >> (4 - t)] * delta[:, c]
    np.testing.assert_array_equal(dequantize(planes, scales, depths, levels), want)


def test_a_reconstruction_table_is_checked():
    codes, scales = quantize(np.ones((64, 4), np.float32))
    planes = pack_planes(codes)
    for bad, message in ((np.zeros((4, 4, 8), np.float32), "levels must have shape"),
                         (np.zeros((3, 4, 16), np.float32), "levels must have shape"),
                         (np.full((4, 4, 16), np.nan, np.float32), "levels"),
                         (np.zeros((4, 4, 16)), "levels")):  # float64: a table is float32, as the scan reads it
        with pytest.raises(ValueError, match=message):
            dequantize(planes, scales, np.full(4, 2), bad)
