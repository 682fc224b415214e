import numpy as np
import pytest
from hypothesis import given, strategies as st

from fathom import reference as ref
from fathom.store import PlaneStore


@given(st.integers(0, 400), st.integers(1, 4), st.integers(1, 9), st.integers(0, 2 ** 32 - 1))
def test_appending_in_pieces_equals_building_in_one_go(n, segment_blocks, d, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, d)).astype(np.float32)
    whole = PlaneStore.from_keys(k, segment_blocks=segment_blocks)
    grown = PlaneStore(d, segment_blocks=segment_blocks)
    cuts = np.sort(rng.integers(0, n + 1, 5))
    for piece in np.split(k, cuts):
        grown.append(piece)
    assert grown.n_tokens == whole.n_tokens == n
    assert grown.n_sealed == whole.n_sealed == n // 64 * 64
    np.testing.assert_array_equal(grown.planes(), whole.planes())
    np.testing.assert_array_equal(grown.scales(), whole.scales())
    np.testing.assert_array_equal(grown.tail, k[n // 64 * 64:])
    np.testing.assert_array_equal(grown.scale_variance, whole.scale_variance)
    if n >= 64:
        codes, scales = ref.quantize(k[:n // 64 * 64])
        np.testing.assert_array_equal(whole.planes(), ref.pack_planes(codes))
        np.testing.assert_array_equal(whole.scales(), scales)
        np.testing.assert_allclose(whole.scale_variance, np.square(scales.astype(np.float64)).mean(axis=1))


def test_sealed_segments_are_never_rewritten():
    k = np.random.default_rng(0).standard_normal((64 * 5, 4)).astype(np.float32)
    store = PlaneStore(4, segment_blocks=2)
    store.append(k[:128])
    first = store.segments[0].planes
    snapshot = first.copy()
    store.append(k[128:])
    assert store.segments[0].planes is first
    np.testing.assert_array_equal(first, snapshot)
    assert [s.blocks for s in store.segments] == [2, 2, 1]


def test_runs_read_the_first_planes_of_each_active_channel_per_segment():
    k = np.random.default_rng(1).standard_normal((64 * 5 + 10, 6)).astype(np.float32)
    store = PlaneStore.from_keys(k, segment_blocks=2)
    depths = np.array([0, 4, 1, 0, 2, 3])
    runs = store.runs(depths)
    assert len(runs) == 4 * 3  # active channels x segments
    all_planes, all_scales = store.planes(), store.scales()
    offset = {0: 0, 1: 2, 2: 4}
    for run in runs:
        planes, scales = store.read(run)
        assert planes.shape == (depths[run.channel], run.blocks)
        blocks = slice(offset[run.segment], offset[run.segment] + run.blocks)
        np.testing.assert_array_equal(planes, all_planes[run.channel, :run.planes, blocks])
        np.testing.assert_array_equal(scales, all_scales[run.channel, blocks])
        assert run.contiguous == (run.segment < 2 or run.planes == 1)
        if run.contiguous:  # one contiguous range of the segment's memory
            assert planes.base is not None and np.shares_memory(planes, store.segments[run.segment].planes)
            assert planes.reshape(-1).base is not None or planes.flags.c_contiguous
    assert store.scan_nbytes(depths) == ref.scan_bits(depths) * store.n_sealed / 8


def test_rotated_store_holds_planes_of_the_rotated_keys():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((128, 8)).astype(np.float32)
    basis, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    store = PlaneStore.from_keys(k, basis=basis)
    codes, _ = ref.quantize((k @ basis.astype(np.float32)).astype(np.float32))
    np.testing.assert_array_equal(store.planes(), ref.pack_planes(codes))


def test_store_rejects_bad_input():
    store = PlaneStore(4)
    with pytest.raises(ValueError, match="^k "):
        store.append(np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="^k "):
        store.append(np.full((3, 4), np.inf, np.float32))
    with pytest.raises(ValueError, match="^k "):
        store.append(np.zeros((3, 4), np.float64))
    with pytest.raises(ValueError, match="^depths "):
        store.runs(np.zeros(3, np.int8))
    with pytest.raises(ValueError, match="^basis "):
        PlaneStore(4, basis=np.eye(3))
    with pytest.raises(ValueError, match="^segment_blocks "):
        PlaneStore(4, segment_blocks=0)


def test_planes_and_scales_from_a_block_on_are_the_tail_of_all_blocks():
    k = np.random.default_rng(3).standard_normal((700, 8)).astype(np.float32)
    store = PlaneStore.from_keys(k, segment_blocks=3)  # 10 sealed blocks over 4 segments
    for first in range(store.n_blocks + 1):
        np.testing.assert_array_equal(store.planes(first), store.planes()[:, :, first:])
        np.testing.assert_array_equal(store.scales(first), store.scales()[:, first:])
    with pytest.raises(ValueError, match="first_block must lie in 0..10"):
        store.planes(11)


def test_a_refused_append_leaves_the_store_as_it_was():
    """A value whose block scale float16 cannot hold is refused before anything is sealed: in a later block of the
    append, or in the block that would complete the tail; the store then takes good keys as before."""
    rng = np.random.default_rng(0)
    store = PlaneStore(4)
    store.append(rng.standard_normal((10, 4)).astype(np.float32))
    for bad_row in (150, 20):
        keys = rng.standard_normal((200, 4)).astype(np.float32)
        keys[bad_row, 1] = 1e5
        with pytest.raises(ValueError, match="beyond the float16 range"):
            store.append(keys)
        assert (store.n_tokens, store.n_sealed) == (10, 0)
    store.append(rng.standard_normal((60, 4)).astype(np.float32))
    assert (store.n_tokens, store.n_sealed) == (70, 64)
