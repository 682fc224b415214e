"""fathom.cuda.gather against fathom.store: the run list and the staged planes/scales."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.gather import RUN_FIELDS, Staging
from fathom.store import PlaneStore


def store_pool(stores: list[PlaneStore], n_seg: int, cap: int):
    """The layer's pool layout of a list of stores: planes [S, n_seg, d, 4, cap], scales uint16 [S, n_seg, d, cap]."""
    d = stores[0].d
    planes = np.zeros((len(stores), n_seg, d, 4, cap), np.uint64)
    scales = np.zeros((len(stores), n_seg, d, cap), np.uint16)
    for s, store in enumerate(stores):
        for i, seg in enumerate(store.segments):
            planes[s, i] = seg.planes
            scales[s, i] = seg.scales.view(np.uint16)
    return planes, scales


def run_gather(planes, scales, depths, n_blocks, max_planes, max_channels):
    n_streams, n_seg, d, _, cap = planes.shape
    staging = Staging(n_streams, d, n_seg, cap, max_planes, max_channels, 8, 16, 2)
    staging.stage(cuda.to_device(depths), cuda.to_device(planes.reshape(-1)), cuda.to_device(scales.reshape(-1)),
                  n_blocks)
    return (staging.runs.copy_to_host(), staging.plane_row.copy_to_host(), staging.scale_row.copy_to_host(),
            staging.active.copy_to_host(), staging.n_active.copy_to_host(),
            staging.planes.copy_to_host()[:n_streams * max_planes * n_blocks].reshape(n_streams, max_planes, n_blocks),
            staging.scales.copy_to_host()[:n_streams * max_channels * n_blocks].reshape(n_streams, max_channels,
                                                                                       n_blocks))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), streams=st.integers(1, 2), d=st.sampled_from([8, 12]),
       n=st.integers(64, 5 * 64), cap=st.integers(1, 3))
def test_gather_stages_the_reference_runs(seed, streams, d, n, cap):
    rng = np.random.default_rng(seed)
    stores = [PlaneStore.from_keys(rng.standard_normal((n, d)).astype(np.float32), segment_blocks=cap)
              for _ in range(streams)]
    n_blocks = stores[0].n_blocks
    n_seg = -(-n_blocks // cap) + 1  # one spare, empty segment
    depths = rng.integers(0, 5, (streams, d)).astype(np.int8)
    max_planes, max_channels = 4 * d, d
    runs, plane_row, scale_row, active, n_active, staged_planes, staged_scales = run_gather(
        *store_pool(stores, n_seg, cap), depths, n_blocks, max_planes, max_channels)

    runs = runs.reshape(streams, d, n_seg, RUN_FIELDS)
    for g, store in enumerate(stores):
        want_runs = store.runs(depths[g])
        got = runs[g][runs[g, :, :, 2] > 0]
        assert [(r.planes, r.blocks) for r in want_runs] == [(int(p), int(b)) for p, b in got[:, 2:4]]
        read = np.flatnonzero(depths[g])
        assert n_active[g] == len(read) and list(active[g, :len(read)]) == list(read)
        all_planes, all_scales = store.planes(), store.scales().view(np.uint16)
        for c in read:
            rows = staged_planes[g, plane_row[g, c]:plane_row[g, c] + depths[g, c]]
            np.testing.assert_array_equal(rows, all_planes[c, :depths[g, c]])
            np.testing.assert_array_equal(staged_scales[g, scale_row[g, c]], all_scales[c])
        assert plane_row[g, depths[g] == 0].tolist() == [-1] * int((depths[g] == 0).sum())


def test_capacity_overflow_drops_runs_instead_of_writing_out_of_bounds():
    d, cap = 8, 2
    store = PlaneStore.from_keys(np.ones((128, d), np.float32), segment_blocks=cap)
    depths = np.full((1, d), 4, np.int8)
    *_, n_active, staged_planes, _ = run_gather(*store_pool([store], 1, cap), depths, 2, 10, 3)
    assert n_active[0] == 2 and staged_planes.shape == (1, 10, 2)
