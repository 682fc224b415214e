"""fathom.cuda.scan against fathom.scoring.approx_scores (float32 tolerance), straight from the store's records,
with ragged sessions (lengths read on the device) and the candidates' top-byte histogram, at every tier of the store
(the first ``t`` planes in the near array), through the cells' midpoints and through a reconstruction table per KV
head; and the tiered scans equal to the all-host one exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fathom.cuda.interop import SIMULATED
from fathom.cuda.scan import launch_shape, scan_levels, scan_planes
from fathom.layout import StoreLayout
from fathom.quantize import midpoint_levels
from fathom.scoring import approx_scores
from fathom.store import PlaneStore
from tests.cuda.helpers import read_scores, top_byte_histogram, unwritten_keys, write_store


def _store(rng, tokens: np.ndarray, kv_heads: int, d: int, cap: int) -> list[PlaneStore]:
    """Reference stores of random keys, ``tokens[s]`` per stream of session ``s``."""
    stores = []
    for g in range(len(tokens) * kv_heads):
        n = int(tokens[g // kv_heads])
        keys = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-2, 2, d))).astype(np.float32)
        stores.append(PlaneStore.from_keys(keys, segment_blocks=cap))
    return stores


def _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, sink, local, warps, max_tokens, levels=None):
    """The stores written into a store layout of tier ``hbm_planes`` and scanned (through ``levels [kv_heads, d, 4,
    16]``, the reference's tables, if given) -> (scores, top_hist)."""
    streams, heads, d = q.shape
    layout = StoreLayout(streams, -(-max_tokens // 64 // cap), d, cap, hbm_planes)
    near, far = np.zeros(layout.near_words, np.uint64), np.zeros(layout.far_words, np.uint64)
    for g, store in enumerate(stores):
        write_store(store.planes(), store.scales(), layout, g, near, far)
    keys = unwritten_keys(streams, heads, max_tokens)
    top_hist = cuda.to_device(np.zeros((streams, heads, 256), np.int32))
    scan_planes(cuda.to_device(q), cuda.to_device(depths), cuda.to_device(tokens), kv_heads, cuda.to_device(near),
                cuda.to_device(far), layout, sink, local, keys, top_hist, warps,
                levels=None if levels is None else cuda.to_device(scan_levels(levels)))
    return read_scores(keys, max_tokens), top_hist.copy_to_host()


@pytest.mark.parametrize("hbm_planes", range(5))
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31), sessions=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 3, 8]), d=st.sampled_from([8, 12]), cap=st.sampled_from([1, 2, 4]),
       warps=st.sampled_from([1, 2]), sink=st.integers(0, 4), local=st.integers(0, 40))
def test_scan_matches_reference(hbm_planes, seed, sessions, kv_heads, heads, d, cap, warps, sink, local):
    """G = 8 takes 2 blocks a warp, so 4-block segments get CTAs of two warps (G = 1 and 3: one)."""
    rng = np.random.default_rng(seed)
    max_tokens = 320
    tokens = rng.integers(1, 300, sessions).astype(np.int32)  # ragged: each session its own length
    stores = _store(rng, tokens, kv_heads, d, cap)
    streams = sessions * kv_heads
    depths = rng.integers(0, 5, (streams, d)).astype(np.int8)
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    got, hist = _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, sink, local, warps, max_tokens)
    for g, store in enumerate(stores):
        n, n_sealed = int(tokens[g // kv_heads]), store.n_sealed
        want = approx_scores(q[g], store.planes(), store.scales(), depths[g])
        np.testing.assert_allclose(got[g, :, :n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1))
        assert np.isnan(got[g, :, n_sealed:]).all()  # nothing written past the sealed tokens
        candidates = got[g, :, sink:max(min(n_sealed, n - local), sink)]
        np.testing.assert_array_equal(hist[g], top_byte_histogram(candidates))


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31), hbm_planes=st.integers(0, 4), kv_heads=st.sampled_from([1, 2]),
       heads=st.sampled_from([1, 4]), cap=st.sampled_from([1, 2]), warps=st.sampled_from([1, 2]))
def test_scan_through_levels_matches_reference(seed, hbm_planes, kv_heads, heads, cap, warps):
    """Each KV head's table of its own (the midpoints moved by up to half a cell, as calibrated means lie): every
    stream scores as ``approx_scores`` through its head's table."""
    rng = np.random.default_rng(seed)
    d, max_tokens = 12, 320
    tokens = rng.integers(1, 300, 2).astype(np.int32)
    stores = _store(rng, tokens, kv_heads, d, cap)
    streams = 2 * kv_heads
    depths = rng.integers(0, 5, (streams, d)).astype(np.int8)
    q = rng.standard_normal((streams, heads, d)).astype(np.float32)
    cell = np.exp2(np.float32(3) - np.arange(4, dtype=np.float32))[:, None]  # half a cell at depth b, in Δ
    levels = (midpoint_levels(d) + rng.uniform(-1, 1, (kv_heads, d, 4, 16)) * cell).astype(np.float32)
    got, hist = _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, 0, 0, warps, max_tokens, levels)
    for g, store in enumerate(stores):
        want = approx_scores(q[g], store.planes(), store.scales(), depths[g], levels[g % kv_heads])
        np.testing.assert_allclose(got[g, :, :store.n_sealed], want, rtol=1e-5,
                                   atol=1e-5 * np.abs(want).max(initial=1))
        assert np.isnan(got[g, :, store.n_sealed:]).all()
        np.testing.assert_array_equal(hist[g], top_byte_histogram(got[g, :, :store.n_sealed]))


def test_the_midpoint_table_scans_as_the_midpoints_bit_for_bit():
    """Through the midpoints as a table (``fathom.quantize.midpoint_levels``) the levels kernel reads, for every
    token, the value the midpoint kernel computes: ``(P + 0.5) · 2^(4-b) − 8`` over 8 is ``C / 8 + 2^(-b) − 1``,
    exact in float32 both ways."""
    rng = np.random.default_rng(7)
    d, cap, max_tokens = 8, 2, 256
    tokens = np.array([250], np.int32)
    stores = _store(rng, tokens, 1, d, cap)
    depths = rng.integers(0, 5, (1, d)).astype(np.int8)
    q = rng.standard_normal((1, 4, d)).astype(np.float32)
    midpoints, _ = _scan(q, depths, tokens, 1, stores, cap, 2, 0, 0, 1, max_tokens)
    table, _ = _scan(q, depths, tokens, 1, stores, cap, 2, 0, 0, 1, max_tokens, midpoint_levels(d)[None])
    np.testing.assert_array_equal(table, midpoints)


def test_scan_levels_lays_each_depths_levels_out_by_the_code_the_plane_loop_gathers():
    levels = np.random.default_rng(0).standard_normal((3, 4, 16)).astype(np.float32)
    laid = scan_levels(levels)
    for b in range(1, 5):
        for code in range(16):  # the b-bit prefix P sits at bits 3 .. 4 - b of the code C
            assert laid[:, b - 1, code].tolist() == (levels[:, b - 1, code >> (4 - b)] / 8).tolist()
    with pytest.raises(ValueError, match=r"levels must have shape \[..., d, 4, 16\], got \(3, 4, 8\)"):
        scan_levels(levels[..., :8])


def test_scan_levels_lays_a_views_table_out_c_contiguous():
    """The kernel reads the table flat: a broadcast table (bench timing's midpoints) or a transposed one (a
    calibration's) comes out C-contiguous with the same entries (on the GPU a strided one could not be flattened)."""
    table = np.random.default_rng(1).standard_normal((8, 4, 16)).astype(np.float32)
    for view in (np.broadcast_to(table, (3, 2, 8, 4, 16)), np.stack([table, -table], -1).transpose(3, 0, 1, 2)):
        laid = scan_levels(view)
        assert laid.flags.c_contiguous
        np.testing.assert_array_equal(laid, scan_levels(np.ascontiguousarray(view)))


def test_a_part_filled_segments_idle_warps_leave_its_sealed_blocks_scored_as_the_reference():
    """Two warps of 2 blocks a CTA (G = 8, 4-block segments): sessions whose last segment holds 1, 2 and 3 sealed
    blocks, so its second warp holds none (it skips the scoring) or one beside an unsealed one."""
    rng = np.random.default_rng(5)
    max_tokens, kv_heads, heads, d, cap, sink, local = 512, 1, 8, 8, 4, 2, 16
    assert launch_shape(heads, cap, 32) == (2, 2)
    tokens = np.array([5 * 64 + 7, 6 * 64, 7 * 64 + 63], np.int32)  # 5, 6, 7 sealed blocks
    stores = _store(rng, tokens, kv_heads, d, cap)
    depths = rng.integers(1, 5, (len(tokens), d)).astype(np.int8)
    q = rng.standard_normal((len(tokens), heads, d)).astype(np.float32)
    got, hist = _scan(q, depths, tokens, kv_heads, stores, cap, 2, sink, local, 32, max_tokens)
    for g, store in enumerate(stores):
        n, n_sealed = int(tokens[g]), store.n_sealed
        want = approx_scores(q[g], store.planes(), store.scales(), depths[g])
        np.testing.assert_allclose(got[g, :, :n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1))
        assert np.isnan(got[g, :, n_sealed:]).all()
        np.testing.assert_array_equal(hist[g], top_byte_histogram(got[g, :, sink:min(n_sealed, n - local)]))


def test_every_tier_scans_exactly_as_the_host_store():
    """The same words read from either tier: scores and histograms bit-identical at t = 0..4."""
    rng = np.random.default_rng(7)
    max_tokens, kv_heads, d, cap = 320, 1, 8, 2
    tokens = np.array([300], np.int32)  # 4 sealed blocks: 2 segments
    stores = _store(rng, tokens, kv_heads, d, cap)
    depths = rng.integers(0, 5, (kv_heads, d)).astype(np.int8)
    depths[0, :4] = [1, 2, 3, 4]  # every depth on either side of every tier
    q = rng.standard_normal((kv_heads, 3, d)).astype(np.float32)
    host = _scan(q, depths, tokens, kv_heads, stores, cap, 0, 2, 16, 2, max_tokens)
    for hbm_planes in range(1, 5):
        tiered = _scan(q, depths, tokens, kv_heads, stores, cap, hbm_planes, 2, 16, 2, max_tokens)
        np.testing.assert_array_equal(tiered[0], host[0])
        np.testing.assert_array_equal(tiered[1], host[1])


def test_scan_reads_subnormal_and_zero_scales():
    """Block scales at every fp16 class the keys make: subnormal (a channel of keys ~1e-7), zero (a block of zero
    keys) and normal, decoded without branches in the scan, against the reference."""
    rng = np.random.default_rng(11)
    max_tokens, kv_heads, d, cap = 320, 1, 8, 2
    tokens = np.array([300], np.int32)
    keys = (rng.standard_normal((300, d)) * np.exp(rng.uniform(-2, 2, d))).astype(np.float32)
    keys[:, 0] *= 1e-7  # fp16 scales below 2^-14
    keys[:128, 1] = 0  # two blocks of scale 0
    store = PlaneStore.from_keys(keys, segment_blocks=cap)
    assert (store.scales()[0] < np.float16(2.0**-14)).all() and (store.scales()[1, :2] == 0).all()
    depths = np.array([[4, 3, 2, 1, 4, 0, 2, 3]], np.int8)
    q = rng.standard_normal((kv_heads, 3, d)).astype(np.float32)
    got, _ = _scan(q, depths, tokens, kv_heads, [store], cap, 1, 0, 0, 2, max_tokens)
    want = approx_scores(q[0], store.planes(), store.scales(), depths[0])
    np.testing.assert_allclose(got[0, :, :store.n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_more_channels_than_threads():
    """d = 40 channels over one warp: the active channels are listed in two rounds (32, then 8: each round's scans
    span its channels only), against the reference."""
    rng = np.random.default_rng(5)
    max_tokens, kv_heads, d, cap = 320, 1, 40, 2
    tokens = np.array([300], np.int32)
    stores = _store(rng, tokens, kv_heads, d, cap)
    depths = rng.integers(0, 5, (kv_heads, d)).astype(np.int8)
    depths[0, 31:34] = [3, 0, 2]  # actives on both sides of the rounds' boundary
    q = rng.standard_normal((kv_heads, 1, d)).astype(np.float32)
    got, _ = _scan(q, depths, tokens, kv_heads, stores, cap, 2, 0, 0, 1, max_tokens)
    want = approx_scores(q[0], stores[0].planes(), stores[0].scales(), depths[0])
    np.testing.assert_allclose(got[0, :, :stores[0].n_sealed], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not SIMULATED, reason="steers the CUDA simulator's thread schedule")
def test_chunks_are_cut_after_every_channel_slot_is_written(monkeypatch):
    """The chunks are cut from every active channel's slot start, those of the last round of channels too: with the
    other threads held back after each block scan (a legal warp order) and shared memory stale (zero), a chunk cut
    by thread 0 from unwritten starts overran the staging buffer (d = 64 over 32 threads: the 3072-word chunk boundary
    falls at channel 46, in the last round)."""
    import inspect
    import sys
    import threading
    import time
    import traceback

    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    from fathom.cuda import scan

    if "_allocations" not in inspect.getsource(FakeCUDAShared):  # the simulator internals steered below
        pytest.skip("this numba-cuda simulator keeps its shared arrays otherwise")
    lock = threading.Lock()

    def stale_shared(self, shape, dtype, alignment=None):
        """The simulator's shared array (one per source line and CTA), zero-filled, and made under a lock: the
        simulator's own get-then-set lets two threads of a CTA make two arrays of one line."""
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with lock:
            if caller not in self._allocations:
                self._allocations[caller] = np.zeros(shape, dtype)  # the kernels pass NumPy dtypes
            return self._allocations[caller]

    monkeypatch.setattr(FakeCUDAShared, "array", stale_shared)
    block_scan = scan.exclusive_scan

    def others_late(counts, t, n_threads):
        result = block_scan(counts, t, n_threads)
        if t != 0:
            time.sleep(0.02)
        return result

    monkeypatch.setattr(scan, "exclusive_scan", others_late)
    rng = np.random.default_rng(3)
    d, cap = 64, 16  # runs of 4 scale words + 4 · 16 plane words: 68 words a channel
    tokens = np.array([64], np.int32)
    stores = _store(rng, tokens, 1, d, cap)
    depths = np.full((1, d), 4, np.int8)
    q = rng.standard_normal((1, 1, d)).astype(np.float32)
    got, _ = _scan(q, depths, tokens, 1, stores, cap, 0, 0, 0, 1, 64)
    want = approx_scores(q[0], stores[0].planes(), stores[0].scales(), depths[0])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_finer_grain_keeps_the_widest_ctas_warps_an_sm_and_their_words_a_thread():
    """CTAs of fewer warps are compiled to fill the multiprocessor as the widest CTA does (so ptxas leaves each thread
    the same registers) and share its staging words (a thread holds as many)."""
    from fathom.cuda.scan import CHUNK_WORDS, MAX_HEADS, WIDEST_WARPS, resident_ctas, staged_words

    for heads in range(1, MAX_HEADS + 1):
        for cap in (1, 8, 128, 1024):
            widest, _ = launch_shape(heads, cap, WIDEST_WARPS)
            assert resident_ctas(heads, cap, WIDEST_WARPS) == 1
            for asked in (1, 2, 4, 8, 16):
                warps, _ = launch_shape(heads, cap, asked)
                resident = resident_ctas(heads, cap, asked)
                assert resident * warps == widest  # the warps are powers of two: the grains divide the widest
                assert staged_words(heads, resident) * widest == staged_words(heads, 1) * warps
    assert [resident_ctas(4, 128, w) for w in (32, 16, 8)] == [1, 2, 4]  # Qwen3-8B's G: the decoder's 8 warps
    assert resident_ctas(1, 128, 8) == 1 and launch_shape(1, 128, 32)[0] == 8  # G = 1's widest CTA has 8 warps
    assert staged_words(4, 1) == CHUNK_WORDS and staged_words(8, 1) == CHUNK_WORDS // 2


def test_every_launch_shape_fits_in_static_shared_memory_and_stages_runs_shorter_than_a_chunk():
    """A CTA may declare 48 KiB of static shared memory (ptxas refuses more): at G = 1 with 32 warps of 16 blocks
    the staging buffer of 512-block runs took 52 KB, so segments of 512 blocks or more could not scan at all. The
    sizes below are the kernel's shared arrays (checked against its PTX). Its longest run is shorter than a chunk, so
    a chunk's first slot is found from its own start (the kernel refuses a shape where it is not)."""
    from fathom.cuda.block import RADIX
    from fathom.cuda.scan import MAX_CTA_BLOCKS, MAX_D, MAX_HEADS, launch_shape, resident_ctas, staged_words

    for heads in range(1, MAX_HEADS + 1):
        for cap in (2**i for i in range(13)):
            for asked in (32, 16, 8, 1):
                warps, per_warp = launch_shape(heads, cap, asked)
                per_cta = warps * per_warp
                assert per_cta <= MAX_CTA_BLOCKS and cap % per_cta == 0
                chunk_words = staged_words(heads, resident_ctas(heads, cap, asked))
                max_run = per_cta // 4 + 2 + 4 * per_cta
                assert max_run < chunk_words, (heads, cap, warps, per_warp, max_run, chunk_words)
                shared = 8 * (chunk_words + max_run) + 4 * (MAX_D + MAX_D + (MAX_D + 1) + (MAX_D + 2) + MAX_D * heads
                                                            + 32 * warps + heads * RADIX)
                assert shared <= 48 * 1024, (heads, cap, warps, per_warp, shared)


def test_the_scan_refuses_a_layout_or_group_it_cannot_address():
    """The records' addresses count ``layout.d`` channels: queries of another d read past the store; no query head
    leaves nothing to score."""
    layout = StoreLayout(1, 1, 8, 1, 0)
    lengths = cuda.to_device(np.array([64], np.int32))
    store = cuda.to_device(np.zeros(layout.far_words, np.uint64))
    for heads, d, message in ((1, 16, "layout.d must equal q's 16 channels, got 8"), (0, 8, "1..8 query heads")):
        keys = unwritten_keys(1, max(heads, 1), 64)
        top_hist = cuda.to_device(np.zeros((1, max(heads, 1), 256), np.int32))
        with pytest.raises(ValueError, match=message):
            scan_planes(cuda.to_device(np.zeros((1, heads, d), np.float32)), cuda.to_device(np.zeros((1, d), np.int8)),
                        lengths, 1, store, store, layout, 0, 0, keys, top_hist)
    keys, top_hist = unwritten_keys(1, 1, 64), cuda.to_device(np.zeros((1, 1, 256), np.int32))
    for levels in (np.zeros((2, 8, 4, 16), np.float32), np.zeros((1, 8, 4, 16), np.float64)):  # a table a KV head
        with pytest.raises(ValueError, match=r"levels must be float32 \[1, 8, 4, 16\]"):
            scan_planes(cuda.to_device(np.zeros((1, 1, 8), np.float32)), cuda.to_device(np.zeros((1, 8), np.int8)),
                        lengths, 1, store, store, layout, 0, 0, keys, top_hist, levels=cuda.to_device(levels))
    bad_keys = (np.zeros((1, 1, 2, 32), np.float32), np.zeros((1, 1, 2, 48), np.uint32),
                np.zeros((1, 2, 2, 32), np.uint32))
    for bad in bad_keys:
        with pytest.raises(ValueError, match=r"keys must be uint32 \[1, 1, 2, C\] with C a multiple of 32"):
            scan_planes(cuda.to_device(np.zeros((1, 1, 8), np.float32)), cuda.to_device(np.zeros((1, 8), np.int8)),
                        lengths, 1, store, store, layout, 0, 0, cuda.to_device(bad), top_hist)
    strided = cuda.to_device(np.zeros((1, 16, 4, 16), np.float32))[:, ::2]  # the right shape, read flat it is not
    with pytest.raises(ValueError, match="levels must be C-contiguous"):
        scan_planes(cuda.to_device(np.zeros((1, 1, 8), np.float32)), cuda.to_device(np.zeros((1, 8), np.int8)),
                    lengths, 1, store, store, layout, 0, 0, keys, top_hist, levels=strided)
