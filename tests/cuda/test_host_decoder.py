"""The whole offloaded ``Decoder.run`` against the reference decode (``fathom.decode.decode_step``) for every
method, S = 1 and S = 3 sessions, ragged sessions appended independently, appends in pieces across 64-token block
and segment boundaries; the cache's store and landmarks against the reference's; the CUDA-graph replay against the
eager step; and bad input refused (or flagged and reported) without changing the cache.

Rows are bf16 in the cache, so the reference runs on bf16-rounded keys and values. Selected sets must be equal
except where the reference's scores tie at the k-th within float32 tolerance (the scan sums in another order); the
attention output must match within float32 tolerance.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from fathom import methods
from fathom.attention import attention
from fathom.cuda.interop import DEVICE, SIMULATED
from fathom.decode import HeadIndex, decode_step, method_scores, pooled_layer_depths, step_bits
from fathom.host.cache import STATE, CacheShape, HostKVCache, RowSlab
from fathom.host.decoder import Decoder, DecoderSettings
from fathom.host.graph import StepGraph
from fathom.host.launch import run_launches
from fathom.quantize import midpoint_levels
from fathom.scoring import landmarks
from fathom.selection import Selection, select
from fathom.store import PlaneStore
from fathom.waterfill import calibrated_gains
from tests.cuda.helpers import sealed_landmarks, sealed_planes, selected

LAYER = 1  # layer 0 stays empty
GROUP_SIZE = 2
D = 8
PIECES = (1, 70, 40, 29)  # 140 tokens: blocks sealed inside appends and from the tail, 2 segments, 12 in the tail
SEL = Selection(k=6, sink=4, local=16)
SHAPES = {1: CacheShape(sessions=1, layers=2, kv_heads=2, head_dim=D, max_tokens=200, segment_blocks=1),
          3: CacheShape(sessions=3, layers=2, kv_heads=1, head_dim=D, max_tokens=200, segment_blocks=1)}
METHODS = [methods.fathom(12.0), methods.fathom(12.0, variance="calibration"), methods.fathom_rotated(12.0),
           methods.fathom_plan((8.0, 14.0), 11.0), methods.sparq(2), methods.double_sparsity(2), methods.loki(2),
           methods.thumbnail(2), methods.landmark(), methods.oracle(), methods.dense()]


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _setup(shape: CacheShape, seed: int = 0, n: int = sum(PIECES)):
    """bf16-exact keys/values [S, H, n, d] with spread channel scales, queries [S, H·G, d], calibration stats."""
    rng = np.random.default_rng(seed)
    k = _bf16((rng.standard_normal((shape.sessions, shape.kv_heads, n, D)) * np.exp(rng.uniform(-1, 1, D)))
              .astype(np.float32))
    v = _bf16(rng.standard_normal(k.shape).astype(np.float32))
    q = rng.standard_normal((shape.sessions, shape.kv_heads * GROUP_SIZE, D)).astype(np.float32)
    basis = np.stack([[np.linalg.qr(rng.standard_normal((D, D)))[0] for _ in range(shape.kv_heads)]
                      for _ in range(shape.layers)])
    sigma2 = np.exp(rng.uniform(-1, 1, (shape.layers, shape.kv_heads, D)))
    ds_rank = np.stack([[rng.permutation(D) for _ in range(shape.kv_heads)] for _ in range(shape.layers)])
    return k, v, q, basis, sigma2, ds_rank


def _append(cache: HostKVCache, k: np.ndarray, v: np.ndarray, start: int, stop: int, sessions=None) -> None:
    rows = slice(None) if sessions is None else sessions
    cache.append(LAYER, torch.from_numpy(k[rows, :, start:stop]).to(DEVICE),
                 torch.from_numpy(v[rows, :, start:stop]).to(DEVICE), sessions)


def _fill(cache: HostKVCache, k, v) -> None:
    for start, stop in zip(np.cumsum((0,) + PIECES[:-1]), np.cumsum(PIECES)):
        _append(cache, k, v, start, stop)


@pytest.fixture(scope="module")
def filled():
    """``filled(sessions, rotated)``: a cache holding every piece of ``PIECES``, made once per module, and its data."""
    made = {}

    def get(sessions: int, rotated: bool):
        if (sessions, rotated) not in made:
            shape = SHAPES[sessions]
            data = _setup(shape)
            cache = HostKVCache(shape, basis=data[3] if rotated else None)
            _fill(cache, data[0], data[1])
            made[sessions, rotated] = cache, data
        return made[sessions, rotated]

    yield get
    for cache, _ in made.values():
        cache.close()


def _decoder(cache, method, data, sel=SEL) -> Decoder:
    return Decoder(cache, DecoderSettings(method, sel), GROUP_SIZE, sigma2=data[4], ds_rank=data[5])


def _reference_index(keys: np.ndarray, basis, sigma2, ds_rank, head: int, drops=None, scale2=None, levels=None
                     ) -> HeadIndex:
    """The reference's index of one session's KV head ``head`` of :data:`LAYER` (its ``keys [n, d]``), both bases'
    statistics from the calibration arrays (see :func:`_assert_matches_reference`)."""
    return HeadIndex.build(keys, {b: _head_stats(sigma2, ds_rank, LAYER, head, drops, scale2, levels)
                                  for b in ("raw", "rotated")}, basis=basis[LAYER, head])


def _assert_matches_reference(decoder: Decoder, out: np.ndarray, k, v, q, basis, sigma2, ds_rank,
                              lengths: np.ndarray, sel=SEL, drops=None, scale2=None, levels=None):
    """Every (session, KV head) of a step against ``decode_step`` on that session's first ``lengths[s]`` tokens
    (``drops [L, H, d, 4]``, ``scale2 [L, H, d]``: the calibration's plane drops, for calibrated gains; ``levels
    [L, H, d, 4, 16]``: the reconstruction tables the planes are read through)."""
    method, shape = decoder.settings.method, decoder.cache.shape
    got_masks = selected(decoder, LAYER)
    want_scan_bytes = 0.0
    for s in range(shape.sessions):
        n = int(lengths[s])
        blocks = np.array([n // 64])
        indexes = [_reference_index(k[s, h, :n], basis, sigma2, ds_rank, h, drops, scale2, levels)
                   for h in range(shape.kv_heads)]
        groups = q[s].reshape(shape.kv_heads, GROUP_SIZE, -1)
        # a pooled method: the session's KV heads planned on one water line, each head's part decoded as its own
        pooled = pooled_layer_depths([method] * len(indexes), groups[:, None], indexes, blocks)[:, 0] \
            if method.pooled else None
        for h, index in enumerate(indexes):
            g, heads = s * shape.kv_heads + h, slice(h * GROUP_SIZE, (h + 1) * GROUP_SIZE)
            keys, values, qg = k[s, h, :n], v[s, h, :n], q[s, heads]
            head_depths = None if pooled is None else pooled[h][None]
            scores, depths = method_scores(method, qg[None], index, blocks, LAYER, head_depths)
            if pooled is None:
                want = decode_step(qg, keys, values, index, method, sel, layer=LAYER)
                want_mask, want_output, want_bytes = want.mask, want.output, want.scan_bytes
            else:
                want_mask = select(scores[0, :, :blocks[0] * 64], n, sel)
                want_output = attention(qg, keys, values, want_mask)
                want_bytes = step_bits(method, pooled[h], qg.shape[1]) * blocks[0] * 64 / 8
            want_scan_bytes += want_bytes
            if depths is not None:
                np.testing.assert_array_equal(decoder.depths.cpu().numpy()[g], depths[0])
            got = got_masks[g, :, :n]
            assert not got_masks[g, :, n:].any()
            _assert_same_selection(got, want_mask, None if scores is None else scores[0])
            np.testing.assert_allclose(out[s, heads], attention(qg, keys, values, got), rtol=1e-4, atol=1e-5)
            if (got == want_mask).all():
                np.testing.assert_allclose(out[s, heads], want_output, rtol=1e-4, atol=1e-5)
    assert decoder.scan_nbytes(LAYER) == want_scan_bytes  # the same bit accounting as the reference


def _head_stats(sigma2, ds_rank, layer: int, head: int, drops=None, scale2=None, levels=None) -> methods.HeadStats:
    return methods.HeadStats(sigma2[layer, head], ds_rank[layer, head], layer=layer,
                             plane_drops=None if drops is None else drops[layer, head],
                             scale2=None if scale2 is None else scale2[layer, head],
                             levels=None if levels is None else levels[layer, head])


def _assert_same_selection(got: np.ndarray, want: np.ndarray, scores: np.ndarray | None):
    """Equal masks ``[G, n]``, except sealed tokens whose reference score ties the head's k-th within float32
    tolerance (the kernels sum in another order)."""
    differ = got != want
    if not differ.any():
        return
    assert scores is not None, "dense selects every row"
    n_scored = scores.shape[1]
    assert not differ[:, n_scored:].any(), "the unsealed tail is always selected"
    for h in np.flatnonzero(differ.any(axis=1)):
        candidates = want[h, :n_scored] != got[h, :n_scored]
        kth = np.sort(scores[h, want[h, :n_scored] & got[h, :n_scored]])[:1]
        near = np.abs(scores[h, candidates] - (kth[0] if len(kth) else scores[h, candidates].max()))
        assert np.all(near <= 1e-5 * np.abs(scores[h]).max()), f"head {h}: selection differs beyond a tie"


# Every method over three sessions; one session for a method of each kind of step (scan and select, landmark
# blocks, dense): the simulator's ~10 s per case is what CI can afford.
RUN_CASES = [pytest.param(m, s, id=f"{m.name}-{s}") for s in (1, 3) for m in METHODS
             if s == 3 or m.name in ("fathom", "landmark", "dense")]


@pytest.mark.parametrize("method, sessions", RUN_CASES)
def test_run_matches_reference_decode(filled, method, sessions):
    cache, data = filled(sessions, method.basis == "rotated" and method.scorer == "planes")
    decoder = _decoder(cache, method, data)
    out = decoder.run(LAYER, torch.from_numpy(data[2]).to(DEVICE)).cpu().numpy()
    _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER))


@pytest.mark.parametrize("method", [methods.fathom(12.0, pooled=True), methods.fathom_rotated(10.0, pooled=True)],
                         ids=lambda m: m.name)
def test_a_pooled_plan_puts_a_sessions_kv_heads_on_one_water_line(filled, method):
    """fathom[pooled]: the GPU planner plans a session's KV heads together (``fathom.decode.pooled_layer_depths``),
    each head's part scanned and selected as the reference's."""
    cache, data = filled(1, method.basis == "rotated")
    assert cache.shape.kv_heads == 2
    decoder = _decoder(cache, method, data)
    out = decoder.run(LAYER, torch.from_numpy(data[2]).to(DEVICE)).cpu().numpy()
    _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER))


@pytest.mark.parametrize("variance", ["store", "calibration"])
def test_calibrated_plane_gains_plan_as_the_reference(filled, variance):
    """fathom[gains]: the GPU planner reads each head's table (``fathom.methods.gain_table``: the drops over the
    calibration's mean squared scale for the store's σ², over the calibration σ² for its own), with the reference's
    depths and selection; a table set later (``set_calibration``) is the one the next step reads."""
    cache, data = filled(3, False)
    sigma2, ds_rank = data[4], data[5]
    rng = np.random.default_rng(9)
    tables = []
    for _ in range(2):
        drops = calibrated_gains(rng.uniform(0, 1, sigma2.shape + (4,)) * sigma2[..., None])
        scale2 = sigma2 * np.exp(rng.uniform(-0.5, 0.5, sigma2.shape))
        table = np.array([[methods.gain_table(_head_stats(sigma2, ds_rank, layer, h, drops, scale2), variance)
                           for h in range(sigma2.shape[1])] for layer in range(sigma2.shape[0])])
        tables.append((drops, scale2, table))
    method = methods.fathom(12.0, variance, gains="calibrated")
    drops, scale2, table = tables[0]
    decoder = Decoder(cache, DecoderSettings(method, SEL), GROUP_SIZE, sigma2=sigma2, ds_rank=ds_rank, gains=table)
    q = torch.from_numpy(data[2]).to(DEVICE)
    _assert_matches_reference(decoder, decoder.run(LAYER, q).cpu().numpy(), *data, cache.lengths(LAYER),
                              drops=drops, scale2=scale2)
    drops, scale2, table = tables[1]
    decoder.set_calibration(LAYER, gains=table[LAYER])
    _assert_matches_reference(decoder, decoder.run(LAYER, q).cpu().numpy(), *data, cache.lengths(LAYER),
                              drops=drops, scale2=scale2)
    with pytest.raises(ValueError, match="non-increasing in the plane"):
        decoder.set_calibration(LAYER, gains=table[LAYER][..., ::-1] + np.arange(4))


def _moved_levels(rng, shape: CacheShape) -> np.ndarray:
    """Reconstruction tables ``[L, H, d, 4, 16]``: the midpoints moved by up to half a cell, as calibrated cell
    means lie."""
    cell = np.exp2(np.float32(3) - np.arange(4, dtype=np.float32))[:, None]  # half a cell at depth b, in units of Δ
    moved = rng.uniform(-1, 1, (shape.layers, shape.kv_heads, D, 4, 16)) * cell
    return (midpoint_levels(D) + moved).astype(np.float32)


@pytest.mark.parametrize("method", [methods.fathom(12.0), methods.double_sparsity(2)], ids=lambda m: m.name)
def test_planes_read_through_levels_as_the_reference(filled, method):
    """Every plane method scans through each (layer, KV head)'s reconstruction table as the reference reads it
    (``HeadStats.levels``), selecting what the midpoints would not (the reference's selection through the midpoints:
    a midpoint decoder's, test_run_matches_reference_decode); a table set later (``set_calibration``) is the one the
    next step reads."""
    cache, data = filled(3, False)
    rng = np.random.default_rng(5)
    q = torch.from_numpy(data[2]).to(DEVICE)
    first, second = _moved_levels(rng, cache.shape), _moved_levels(rng, cache.shape)
    decoder = Decoder(cache, DecoderSettings(method, SEL), GROUP_SIZE, sigma2=data[4], ds_rank=data[5], levels=first)
    out = decoder.run(LAYER, q).cpu().numpy()
    _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER), levels=first)
    assert (selected(decoder, LAYER) != _reference_masks(method, data, cache.lengths(LAYER))).any()  # tables matter
    decoder.set_calibration(LAYER, levels=second[LAYER])
    out = decoder.run(LAYER, q).cpu().numpy()
    _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER), levels=second)


def _reference_masks(method, data, lengths: np.ndarray) -> np.ndarray:
    """The reference decode's selection through the cells' midpoints as bool ``[S·H, G, max n]`` (``selected``'s
    layout), for a method that scans and selects."""
    k, v, q, basis, sigma2, ds_rank = data
    heads = k.shape[1]
    masks = np.zeros((k.shape[0] * heads, GROUP_SIZE, int(lengths.max())), bool)
    for s, n in enumerate(lengths):
        for h in range(heads):
            index = _reference_index(k[s, h, :n], basis, sigma2, ds_rank, h)
            masks[s * heads + h, :, :n] = decode_step(q[s, h * GROUP_SIZE:(h + 1) * GROUP_SIZE], k[s, h, :n],
                                                      v[s, h, :n], index, method, SEL, layer=LAYER).mask
    return masks


def test_levels_are_refused_where_no_plane_scan_reads_them(filled):
    """A table for a method that reads no planes, of another shape or not finite, or given later to a decoder made
    for the midpoints (its kernel reads none), is refused in one line, before anything is written."""
    cache, data = filled(3, False)
    levels = _moved_levels(np.random.default_rng(0), cache.shape)
    settings = DecoderSettings(methods.fathom(12.0), SEL)
    for method in (methods.oracle(), methods.dense()):
        with pytest.raises(ValueError, match="levels are read by plane scans only"):
            Decoder(cache, DecoderSettings(method, SEL), GROUP_SIZE, levels=levels)
        with pytest.raises(ValueError, match="levels are read by plane scans only"):
            _decoder(cache, method, data).set_calibration(LAYER, levels=levels[LAYER])
    with pytest.raises(ValueError, match=r"levels must have shape \(2, 1, 8, 4, 16\)"):
        Decoder(cache, settings, GROUP_SIZE, levels=levels[:, :, :4])
    with pytest.raises(ValueError, match="levels must be finite"):
        Decoder(cache, settings, GROUP_SIZE, levels=np.where(levels > 0, np.inf, levels))
    decoder = Decoder(cache, DecoderSettings(methods.fathom(12.0, variance="calibration"), SEL), GROUP_SIZE,
                      sigma2=data[4], levels=levels)
    before = decoder.strategy.depth_plan.sigma2.clone()
    with pytest.raises(ValueError, match="levels must be finite"):  # the σ² beside it stays as it was
        decoder.set_calibration(LAYER, sigma2=data[4][LAYER] * 2, levels=np.full_like(levels[LAYER], np.nan))
    assert torch.equal(decoder.strategy.depth_plan.sigma2, before)
    with pytest.raises(ValueError, match="this decoder reads the cells' midpoints"):
        Decoder(cache, settings, GROUP_SIZE).set_calibration(LAYER, levels=levels[LAYER])


@pytest.mark.parametrize("method", [methods.fathom(12.0), methods.oracle(), methods.dense()], ids=lambda m: m.name)
def test_ragged_sessions_appended_independently(method):
    """Three sessions of 140, 67 and 200 tokens, appended in different pieces, decoded in one call."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape, seed=2, n=200)
    with HostKVCache(shape) as cache:
        _append(cache, k, v, 0, 67)  # every session
        _append(cache, k, v, 67, 140, sessions=[0, 2])
        _append(cache, k, v, 140, 200, sessions=[2])
        lengths = cache.lengths(LAYER)
        assert lengths.tolist() == [140, 67, 200]
        decoder = _decoder(cache, method, data)
        out = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
        _assert_matches_reference(decoder, out, *data, lengths)


@pytest.mark.parametrize("method", [methods.fathom(12.0), methods.landmark()], ids=lambda m: m.name)
def test_steps_between_appends(method):
    """A step, then an append that seals a block, then a step: each step sees exactly the tokens appended before
    it (the launches were built once, at construction)."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape, seed=1)
    with HostKVCache(shape) as cache:
        decoder = None
        for start, stop in ((0, 111), (111, 140)):
            _append(cache, k, v, start, stop)
            decoder = decoder or _decoder(cache, method, data)
            out = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
            _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER))


def test_graph_replay_equals_eager():
    """A captured token (append of one token per session + step) replayed, against appending and running eagerly on
    a twin cache; the second token seals a block. On a GPU it is a CUDA graph; under the simulator the recorded
    launches."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape, seed=4, n=192)
    method = methods.fathom(12.0)
    with HostKVCache(shape) as eager_cache, HostKVCache(shape) as graph_cache:
        for cache in (eager_cache, graph_cache):
            _append(cache, k, v, 0, 190)
        eager = _decoder(eager_cache, method, data)
        token = StepGraph(_decoder(graph_cache, method, data), layers=[LAYER], append=True)
        for t in range(190, 192):
            q_t = torch.from_numpy(q * (1 + t % 3)).to(DEVICE)
            k_t, v_t = (torch.from_numpy(x[:, :, t:t + 1]).to(DEVICE) for x in (k, v))
            eager_cache.append(LAYER, k_t, v_t)
            want = eager.run(LAYER, q_t).cpu().numpy()
            got = token(q_t, k_t, v_t).cpu().numpy()
            np.testing.assert_array_equal(got, want)
            assert (graph_cache.lengths(LAYER) == eager_cache.lengths(LAYER)).all()
        for g in range(shape.streams):
            np.testing.assert_array_equal(sealed_planes(graph_cache, LAYER, g)[0],
                                          sealed_planes(eager_cache, LAYER, g)[0])


def test_a_step_built_on_other_buffers_reads_and_writes_them_only():
    """``launches_on`` (what a token graph replays: no copy in or out a layer) gives the eager step's output in the
    buffer it was given, leaves the decoder's own output buffer alone, and refuses a buffer it could not read."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape, seed=5, n=150)
    with HostKVCache(shape) as cache:
        _append(cache, k, v, 0, 150)
        decoder = _decoder(cache, methods.fathom(12.0), data)
        q_t = torch.from_numpy(q).to(DEVICE)
        want = decoder.run(LAYER, q_t).cpu().numpy().copy()  # the decoder's buffer (shared memory on the CPU)
        decoder.out[LAYER].zero_()
        q_own, out_own = q_t.float().clone(), torch.full_like(q_t, float("nan"), dtype=torch.float32)
        run_launches(decoder.launches_on(LAYER, q_own, out_own), cache.stream())
        np.testing.assert_array_equal(out_own.cpu().numpy(), want)
        assert not decoder.out[LAYER].any()
        for bad in (q_own.double(), q_own[:, :-1], q_own.transpose(0, 1).contiguous().transpose(0, 1), q_own.cpu()):
            if tuple(bad.shape) == tuple(q_own.shape) and bad.is_contiguous() and bad.dtype == torch.float32 \
                    and bad.device == q_own.device:
                continue  # a transpose that stays contiguous (one session): nothing to refuse
            for args in ((bad, out_own), (q_own, bad)):
                with pytest.raises(ValueError, match="must be a contiguous float32 tensor"):
                    decoder.launches_on(LAYER, *args)


@pytest.mark.parametrize("method", [methods.double_sparsity(2), methods.fathom(12.0, variance="calibration")],
                         ids=lambda m: m.name)
def test_a_new_calibration_reaches_a_captured_step(filled, method):
    """``set_calibration`` rewrites what a captured step reads (staged in a pinned mirror, copied without a sync),
    twice in a row on one layer (the second write waits for the first copy): the replayed step then equals the
    reference with the last calibration."""
    cache, data = filled(1, False)
    k, v, q, basis, sigma2, ds_rank = data
    rng = np.random.default_rng(5)
    first, last = (_another_calibration(data, rng) for _ in range(2))
    graph = StepGraph(_decoder(cache, method, data), layers=[LAYER])
    q_gpu = torch.from_numpy(q).to(DEVICE)
    graph(q_gpu)  # captured with the calibration it was made with
    for calibration in (first, last):
        graph.decoder.set_calibration(LAYER, calibration[4][LAYER], calibration[5][LAYER])
    out = graph(q_gpu).cpu().numpy()
    _assert_matches_reference(graph.decoder, out, *last, cache.lengths(LAYER))


def _another_calibration(data, rng):
    """``data`` with another σ² and other channel ranks."""
    k, v, q, basis, sigma2, ds_rank = data
    new_sigma2 = np.exp(rng.uniform(-2, 2, sigma2.shape))
    new_rank = np.stack([[rng.permutation(D) for _ in range(ds_rank.shape[1])] for _ in range(ds_rank.shape[0])])
    return k, v, q, basis, new_sigma2, new_rank


def test_cache_store_and_landmarks_match_reference():
    """Planes, scales, σ² statistic and landmarks of a raw and a rotated cache equal the reference's."""
    shape = SHAPES[3]
    k, v, _, basis, *_ = _setup(shape, seed=3)
    for rotation in (None, basis):
        with HostKVCache(shape, basis=rotation) as cache:
            _fill(cache, k, v)
            for s in range(shape.sessions):
                for name, store in [("raw", PlaneStore.from_keys(k[s, 0], segment_blocks=shape.segment_blocks))] + (
                        [] if rotation is None else [("rotated", PlaneStore.from_keys(
                            k[s, 0], segment_blocks=shape.segment_blocks, basis=rotation[LAYER, 0]))]):
                    planes, scales = sealed_planes(cache, LAYER, s, name)
                    np.testing.assert_array_equal(planes, store.planes())
                    np.testing.assert_array_equal(scales, store.scales())
                    np.testing.assert_allclose(cache.store_variance(LAYER, name).cpu().numpy()[s],
                                               store.scale_variance, rtol=1e-12)
                np.testing.assert_array_equal(sealed_landmarks(cache, LAYER, s).view(np.uint16),
                                              landmarks(k[s, 0, :store.n_sealed]).view(np.uint16))


@pytest.mark.parametrize("hbm_planes", [0, 2, 4])
def test_a_grown_cache_keeps_both_tiers_of_its_store(hbm_planes):
    """``grown`` copies each tier's records segment by segment (an empty tier: nothing), at every kind of tier."""
    shape = replace(SHAPES[3], hbm_planes=hbm_planes)
    k, v, *_ = _setup(shape, seed=3)
    cache = HostKVCache(shape)
    _fill(cache, k, v)
    before = [sealed_planes(cache, LAYER, g) for g in range(shape.streams)]
    grown = cache.grown(2 * shape.max_tokens)
    with grown:
        assert grown.shape.layout.hbm_planes == hbm_planes and grown.shape.segments > shape.segments
        for g, (planes, scales) in enumerate(before):
            got_planes, got_scales = sealed_planes(grown, LAYER, g)
            np.testing.assert_array_equal(got_planes, planes)
            np.testing.assert_array_equal(got_scales.view(np.uint16), scales.view(np.uint16))


def test_oracle_with_k_beyond_the_context_is_dense(filled):
    """Dense: the reference's attention over every token (what the dense decoder's step gives on this cache,
    test_run_matches_reference_decode[dense-3]; the simulator is slow)."""
    cache, data = filled(3, False)
    k, v, q = data[:3]
    decoder = _decoder(cache, methods.oracle(), data, Selection(k=500))
    sparse = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
    for s, n in enumerate(cache.lengths(LAYER)):
        for h in range(cache.shape.kv_heads):
            heads = slice(h * GROUP_SIZE, (h + 1) * GROUP_SIZE)
            np.testing.assert_allclose(sparse[s, heads], attention(q[s, heads], k[s, h, :n], v[s, h, :n]),
                                       rtol=1e-5, atol=1e-6)


def test_reset_empties_a_session_for_reuse():
    shape = SHAPES[3]
    k, v, q, *rest = data = _setup(shape, seed=5)
    k_new, v_new, *_ = _setup(shape, seed=7)
    with HostKVCache(shape) as cache:
        _fill(cache, k, v)
        cache.reset(1)
        assert cache.lengths(LAYER).tolist() == [140, 0, 140]
        _append(cache, k_new, v_new, 0, 100, sessions=[1])  # session 1 reused with other keys, no reallocation
        decoder = _decoder(cache, methods.fathom(12.0), data)
        out = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
        k[1], v[1] = k_new[1], v_new[1]
        _assert_matches_reference(decoder, out, k, v, q, *rest, cache.lengths(LAYER))


def test_a_dry_run_changes_neither_the_cache_nor_its_host_mirror():
    """Inside ``dry_run`` an append and a replayed token change nothing, the host's mirror of the lengths included
    (else it would claim tokens the GPU never took), a nested dry run leaves the outer one dry (on a GPU the token's
    first replay captures its graph inside a dry run of its own: its exit had ended the test's), and a ``clear``
    there leaves the run dry."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape)
    with HostKVCache(shape) as cache:
        _append(cache, k, v, 0, 100)
        token = StepGraph(_decoder(cache, methods.fathom(12.0), data), layers=[LAYER], append=True)
        with cache.dry_run():
            with cache.dry_run():  # nested, as a graph's first replay captures: the outer run stays dry
                pass
            _append(cache, k, v, 100, 110)
            token(*(torch.from_numpy(x).to(DEVICE) for x in (q, k[:, :, 110:111], v[:, :, 110:111])))
            assert cache.lengths(LAYER).tolist() == cache.layer(LAYER).lengths.tolist() == [100, 100, 100]
            cache.clear()
            _append(cache, k, v, 0, 10)
        assert cache.lengths(LAYER).tolist() == cache.layer(LAYER).lengths.tolist() == [0, 0, 0]


@pytest.mark.gpu
def test_an_append_still_queued_when_a_dry_run_begins_lands():
    """A kernel reads the dry-run flag when it runs: an append launched before a dry run but not yet reached by the
    GPU (a prefill's last layers when the first decode step captures its graph, with no host sync between) must
    land, as the host's mirror counts it. A spin kernel holds the GPU back so the append is surely still queued
    when the flag would go up: the dry run's entry sync is what lets it land (else the GPU keeps 100 tokens)."""
    shape = SHAPES[3]
    k, v, *_ = _setup(shape)
    with HostKVCache(shape) as cache:
        _append(cache, k, v, 0, 100)
        k_new, v_new = (torch.from_numpy(x[:, :, 100:110]).to(DEVICE) for x in (k, v))
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)  # about half a second of spinning on the stream, ahead of the append
        cache.append(LAYER, k_new, v_new)
        with cache.dry_run():
            pass
        assert cache.lengths(LAYER).tolist() == cache.layer(LAYER).lengths.tolist() == [110, 110, 110]


def test_bad_keys_are_refused_and_leave_the_cache_unchanged():
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape, seed=6)
    with HostKVCache(shape) as cache:
        _append(cache, k, v, 0, 100)
        before = sealed_planes(cache, LAYER, 0), cache.store_variance(LAYER).cpu().numpy().copy()
        for bad_k, bad_v in ((np.nan, 0.0), (np.inf, 0.0), (70000.0, 0.0), (0.0, np.nan)):
            k_bad, v_bad = k[:, :, 100:130].copy(), v[:, :, 100:130].copy()
            k_bad[0, 0, 5, 3], v_bad[1, 0, 7, 2] = bad_k or k_bad[0, 0, 5, 3], bad_v or v_bad[1, 0, 7, 2]
            cache.append(LAYER, torch.from_numpy(k_bad).to(DEVICE), torch.from_numpy(v_bad).to(DEVICE))
            with pytest.raises(ValueError, match="refused on the GPU"):
                cache.append(LAYER, torch.from_numpy(k[:, :, 100:101]).to(DEVICE),
                             torch.from_numpy(v[:, :, 100:101]).to(DEVICE))
            assert cache.lengths(LAYER).tolist() == [100, 100, 100]
            np.testing.assert_array_equal(sealed_planes(cache, LAYER, 0)[0], before[0][0])
            np.testing.assert_array_equal(cache.store_variance(LAYER).cpu().numpy(), before[1])
        _append(cache, k, v, 100, 140)  # the cache works on, exactly as if nothing had happened
        decoder = _decoder(cache, methods.fathom(12.0), data)
        out = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
        _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # a NaN query: NaN out, flagged
def test_bad_input_raises_before_any_kernel():
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape)
    cache = HostKVCache(shape)
    _append(cache, k, v, 0, 100)
    decoder = Decoder(cache, DecoderSettings(methods.fathom(12.0), Selection(k=20)), GROUP_SIZE)
    with pytest.raises(ValueError, match="gains must have shape"):  # calibrated plane gains need their table
        Decoder(cache, DecoderSettings(methods.fathom(12.0, gains="calibrated"), Selection(k=20)), GROUP_SIZE)
    q_dev = torch.from_numpy(q).to(DEVICE)
    for bad_layer in (-1, 2, 1.0):
        with pytest.raises(ValueError, match="layer"):
            decoder.run(bad_layer, q_dev)
    with pytest.raises(ValueError, match="shape"):
        decoder.run(LAYER, q_dev[:, :1])
    with pytest.raises(ValueError, match="float32"):
        decoder.run(LAYER, q_dev.to(torch.int32))
    with pytest.raises(ValueError, match="holds no tokens"):
        decoder.run(0, q_dev)  # layer 0 holds no tokens
    with pytest.raises(ValueError, match="torch tensor"):
        decoder.run(LAYER, q)
    q_nan = q_dev.clone()
    q_nan[0, 0, 0] = float("nan")
    decoder.run(LAYER, q_nan)  # flagged on the GPU, reported at the next call after the GPU ran the step
    if not SIMULATED:
        torch.cuda.synchronize()  # the flag is read from mapped memory without a sync: the step must have run
    with pytest.raises(ValueError, match="query that is NaN or inf"):
        decoder.run(LAYER, q_dev)
    out = decoder.run(LAYER, q_dev).cpu().numpy()  # reported once; the cache is fine
    _assert_matches_reference(decoder, out, *data, cache.lengths(LAYER), Selection(k=20))
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        cache.append(LAYER, torch.zeros((3, 1, 101, D), device=DEVICE), torch.zeros((3, 1, 101, D), device=DEVICE))
    with pytest.raises(ValueError, match="sessions must be distinct"):
        cache.append(LAYER, torch.zeros((2, 1, 1, D), device=DEVICE), torch.zeros((2, 1, 1, D), device=DEVICE),
                     sessions=[1, 1])
    with pytest.raises(ValueError, match="shape"):
        cache.append(LAYER, torch.zeros((2, 1, 1, D), device=DEVICE), torch.zeros((2, 1, 1, D), device=DEVICE))
    with pytest.raises(ValueError, match="rotated store"):
        Decoder(cache, DecoderSettings(methods.loki(2)), GROUP_SIZE)
    with pytest.raises(ValueError, match="per-layer budgets"):
        Decoder(cache, DecoderSettings(methods.fathom_plan((8.0,), 8.0)), GROUP_SIZE)
    with pytest.raises(ValueError, match="ds_rank"):
        Decoder(cache, DecoderSettings(methods.double_sparsity(2)), GROUP_SIZE)
    with pytest.raises(ValueError, match="ds_rank"):
        Decoder(cache, DecoderSettings(methods.double_sparsity(2)), GROUP_SIZE, ds_rank=np.zeros((2, 1, D), int))
    with pytest.raises(ValueError, match="sigma2"):
        Decoder(cache, DecoderSettings(methods.fathom(12.0, variance="calibration")), GROUP_SIZE)
    for group_size in (9, 2.0, True):  # an integer in 1..8, not a float or bool
        with pytest.raises(ValueError, match="group_size"):
            Decoder(cache, DecoderSettings(), group_size)
    with pytest.raises(ValueError, match="layer must be an integer"):
        cache.lengths(True)
    with pytest.raises(ValueError, match=r"basis\[0, 0\] must be orthonormal"):
        HostKVCache(shape, basis=np.ones((2, 1, D, D)))
    with pytest.raises(ValueError, match="store must be one of"):
        CacheShape(1, 1, 1, D, 64, store="disk")
    with pytest.raises(ValueError, match="segment_blocks must be a power of two"):
        CacheShape(1, 1, 1, D, 64, segment_blocks=3)
    for settings, message in (({"scan_warps": 1.5}, "scan_warps must be an integer"),
                              ({"threads": 40.5}, "threads must be a multiple of 32"),
                              ({"threads": 48}, "threads must be a multiple of 32 in 32..1024"),
                              ({"ties_threads": 16}, "ties_threads must be an integer in 32..1024"),
                              ({"scale": "2"}, "scale must be finite")):
        with pytest.raises(ValueError, match=message):
            DecoderSettings(methods.fathom(12.0), **settings)
    with pytest.raises(ValueError, match="scores through fathom.prediction, which the offloaded step does not run"):
        DecoderSettings(methods.predicting(methods.fathom(12.0)))
    for layers in ([1.9], [True]):
        with pytest.raises(ValueError, match="layers must be a non-empty list of layers"):
            StepGraph(decoder, layers=layers)
    cache.close()
    for call in (lambda: decoder.run(LAYER, q_dev), lambda: _append(cache, k, v, 100, 101),
                 lambda: cache.lengths(LAYER), lambda: StepGraph(decoder)):
        with pytest.raises(ValueError, match="closed"):
            call()
    with HostKVCache(shape) as empty:
        with pytest.raises(ValueError, match="holds no tokens"):
            Decoder(empty, DecoderSettings(methods.dense()), GROUP_SIZE).run(LAYER, q_dev)


def test_bad_input_to_a_graph_or_a_channel_count_beyond_the_head_dim_is_refused():
    """A replay refuses what the eager step refuses (a non-float query, key or value, which the graph's float32 input
    buffers would silently cast), and a decoder refuses a channel method's r beyond d when it is made, before any
    step (not at SparQ's first step, nor by reading only d channels for Double Sparsity)."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape)
    with HostKVCache(shape, basis=data[3]) as cache:
        _append(cache, k, v, 0, 100)
        token = StepGraph(_decoder(cache, methods.fathom(12.0), data), layers=[LAYER], append=True)
        q_t, k_t, v_t = (torch.from_numpy(x).to(DEVICE) for x in (q, k[:, :, 100:101], v[:, :, 100:101]))
        for bad in ((q_t.to(torch.int32), k_t, v_t), (q_t, k_t.to(torch.int64), v_t), (q_t, k_t, v_t.bool())):
            with pytest.raises(ValueError, match="float32, bf16 or fp16"):
                token(*bad)
        assert cache.lengths(LAYER).tolist() == [100, 100, 100]
        for method in (methods.sparq(D + 1), methods.double_sparsity(D + 1), methods.loki(D + 1)):
            with pytest.raises(ValueError, match=f"r must be an integer in 1..{D}"):
                _decoder(cache, method, data)


def test_the_variance_of_a_store_the_cache_does_not_hold_is_refused():
    with HostKVCache(SHAPES[3]) as cache:
        for basis in ("rotated", "bogus"):
            with pytest.raises(ValueError, match=r"basis must be one of \('raw',\)"):
                cache.store_variance(LAYER, basis)


@pytest.mark.parametrize("tier", [
    pytest.param({"hbm_planes": 2}, id="hbm_planes=2"),
    pytest.param({"store": "device"}, id="device", marks=pytest.mark.skipif(
        SIMULATED, reason="HBM-resident store: on the GPU only (the simulator has one memory)"))])
def test_a_store_in_hbm_runs_the_same_step(tier):
    """The scales and first planes (t = 2) or the whole store (device) in HBM: the same planes read back, the same
    step and the same scan bytes as the all-host store, split between HBM and the link by tier."""
    shape = SHAPES[3]
    k, v, q, *_ = _setup(shape)
    outs, planes, split = [], [], []
    for where in ({}, tier):
        with HostKVCache(replace(shape, **where)) as cache:
            cache.append(LAYER, torch.from_numpy(k).to(DEVICE), torch.from_numpy(v).to(DEVICE))
            decoder = Decoder(cache, DecoderSettings(methods.fathom(12.0), SEL), GROUP_SIZE)
            outs.append(decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy())
            planes.append([sealed_planes(cache, LAYER, g) for g in range(shape.streams)])
            split.append(decoder.scan_nbytes_by_tier(LAYER))
            assert sum(split[-1]) == decoder.scan_nbytes(LAYER)
    np.testing.assert_array_equal(*outs)
    for (host_planes, host_scales), (tier_planes, tier_scales) in zip(*planes):
        np.testing.assert_array_equal(tier_planes, host_planes)
        np.testing.assert_array_equal(tier_scales.view(np.uint16), host_scales.view(np.uint16))
    (host_hbm, host_link), (tier_hbm, tier_link) = split
    assert host_hbm == 0 and tier_hbm > 0 and tier_link < host_link


def _assert_sources_hold_the_listed_rows(decoder: Decoder) -> None:
    """Each row the last step listed is read from a source holding its K/V — a hit's slab slot, or host memory — and
    each slot the step filled holds its row afterwards."""
    if not SIMULATED:
        torch.cuda.synchronize()
    kv = decoder.cache.layer(LAYER).kv.host
    slab = decoder.cache.layer(LAYER).rows.slab.view(torch.int64).cpu().numpy().view(np.uint64)
    rows, counts, source = (x.cpu().numpy() for x in (decoder.row_index, decoder.n_rows, decoder.row_source))
    for g, n in enumerate(counts):
        listed, slot = rows[g, :n], source[g, :n]
        hit = (slot >= 0) & (slot < slab.shape[1])
        np.testing.assert_array_equal(slab[g, slot[hit]], kv[g, listed[hit]])
        filled = slot >= slab.shape[1]
        np.testing.assert_array_equal(slab[g, slot[filled] - slab.shape[1]], kv[g, listed[filled]])


def test_the_row_cache_serves_the_listed_rows():
    """With a row cache of 20 slots (fewer than a step's rows: some bypass), through steps with drifting and repeated
    queries, an append that seals a block, a session emptied and refilled with other keys, and a captured token:
    every step reads each listed row's K/V from a source holding it, the output matches the reference, and repeated
    queries are served from the slab."""
    shape = replace(SHAPES[3], row_cache_rows=20)
    k, v, q, *_ = data = _setup(shape, seed=11, n=200)
    k_new, v_new, *_ = _setup(shape, seed=12, n=200)
    with HostKVCache(shape) as cache:
        decoder = _decoder(cache, methods.fathom(12.0), data)
        assert decoder.row_cached and cache.row_cache_filled() == 0.0

        def step(q_step):  # the attention reads each row from its source: the output is the reference's
            q_step = q_step.astype(np.float32)
            out = decoder.run(LAYER, torch.from_numpy(q_step).to(DEVICE)).cpu().numpy()
            _assert_sources_hold_the_listed_rows(decoder)
            _assert_matches_reference(decoder, out, k, v, q_step, *data[3:], cache.lengths(LAYER))

        _append(cache, k, v, 0, 130)
        step(q + 0.3 * np.random.default_rng(3).standard_normal(q.shape))
        held = sum(int((layer.rows.position >= 0).sum()) for layer in cache.layers)
        assert cache.row_cache_filled() == held / (shape.layers * shape.streams * 20) > 0
        step(q)
        hits, lookups = cache.row_cache_counts(LAYER)
        step(q)  # the same rows again: hits
        assert cache.row_cache_counts(LAYER)[0] > hits and cache.row_cache_counts(LAYER)[1] > lookups
        hbm, link = decoder.row_nbytes_by_tier(LAYER)
        assert hbm > 0 and hbm + link == decoder.row_nbytes(LAYER)
        _append(cache, k, v, 130, 192)  # seals a block: the third (at 190 tokens it sealed none)
        assert cache.lengths(LAYER)[0] == 3 * 64
        cache.reset(1)  # session 1 refilled with other keys: the slab must not serve its old rows
        _append(cache, k_new, v_new, 0, 150, sessions=[1])
        k[1], v[1] = k_new[1], v_new[1]
        token = StepGraph(decoder, layers=[LAYER], append=True)
        q_t = torch.from_numpy(q).to(DEVICE)
        k_t, v_t = (torch.from_numpy(x[:, :, 192:193]).to(DEVICE) for x in (k, v))
        out = token(q_t, k_t, v_t).cpu().numpy()
        _assert_sources_hold_the_listed_rows(decoder)
        k[1, :, 150], v[1, :, 150] = k[1, :, 192], v[1, :, 192]  # session 1 held 150 tokens: its new one is 150th
        _assert_matches_reference(decoder, out, k, v, q, *data[3:], cache.lengths(LAYER))


def test_a_grown_cache_keeps_its_row_cache():
    """``grown`` copies the slab and its bookkeeping; the new positions hold no slot."""
    shape = replace(SHAPES[3], row_cache_rows=64)
    k, v, q, *_ = data = _setup(shape, seed=13)
    cache = HostKVCache(shape)
    _fill(cache, k, v)
    _decoder(cache, methods.fathom(12.0), data).run(LAYER, torch.from_numpy(q).to(DEVICE))
    old = {name: getattr(cache.layer(LAYER).rows, name).cpu().numpy()
           for name in ("slab", "slot_of", "position", "stamp", "clock", "counters")}
    counts = cache.row_cache_counts(LAYER)
    with cache.grown(2 * shape.max_tokens) as grown:
        rows = grown.layer(LAYER).rows
        for name, want in old.items():
            got = getattr(rows, name).cpu().numpy()
            np.testing.assert_array_equal(got[:, :want.shape[1]] if name == "slot_of" else got, want, err_msg=name)
        assert (rows.slot_of[:, shape.max_tokens:] == -1).all() and grown.row_cache_counts(LAYER) == counts
        assert counts[1] > 0


# the empty layer's output (nobody reads it) is 0 / 0: the simulator's NumPy says so
@pytest.mark.filterwarnings("ignore:invalid value encountered in scalar divide:RuntimeWarning")
def test_a_warm_up_step_leaves_the_row_cache_as_it_was():
    """A decoder's warm-up runs layer 0's step once (on the GPU): inside ``_row_cache_kept`` a step on a filled cache
    leaves the slab, the slot bookkeeping and the hit counters as they were, while an ordinary step changes them; on
    an empty layer, where only the clock and counters are copied, the whole row cache is as it was too."""
    shape = replace(SHAPES[3], row_cache_rows=64)
    k, v, q, *_ = data = _setup(shape, seed=13)
    with HostKVCache(shape) as cache:
        _fill(cache, k, v)
        decoder = _decoder(cache, methods.fathom(12.0), data)
        q_t = torch.from_numpy(q).to(DEVICE)
        decoder.run(LAYER, q_t)
        rows = cache.layer(LAYER).rows

        def held():
            return {name: getattr(rows, name).cpu().numpy().copy() for name in STATE}

        before = held()
        with decoder._row_cache_kept(LAYER):
            decoder.run(LAYER, q_t)
            assert held()["clock"].tolist() != before["clock"].tolist()  # the step did count
        for name, array in held().items():
            np.testing.assert_array_equal(array, before[name], err_msg=name)
        rows = cache.layer(0).rows  # layer 0 holds no token: only its clock and counters are copied
        before = held()
        with decoder._row_cache_kept(0):
            run_launches(decoder.launches(0), cache.stream())  # what the warm-up runs (run refuses an empty layer)
            assert held()["clock"].tolist() != before["clock"].tolist()
        for name, array in held().items():
            np.testing.assert_array_equal(array, before[name], err_msg=name)


def test_a_failed_grow_frees_the_bigger_cache_and_keeps_this_one(monkeypatch):
    """A copy that fails midway (here the row cache's) closes the bigger cache (its pinned memory is never freed by
    garbage collection) and leaves this one open and as it was."""
    shape = replace(SHAPES[3], row_cache_rows=64)
    k, v, *_ = _setup(shape, seed=13)
    cache = HostKVCache(shape)
    _fill(cache, k, v)
    lengths = cache.lengths(LAYER).copy()
    closed = []
    close = HostKVCache.close

    def tracked_close(self):
        closed.append(self)
        close(self)

    def refuse(self, other):
        raise RuntimeError("copy refused")

    monkeypatch.setattr(HostKVCache, "close", tracked_close)
    monkeypatch.setattr(RowSlab, "copy_from", refuse)
    with pytest.raises(RuntimeError, match="copy refused"):
        cache.grown(2 * shape.max_tokens)
    assert len(closed) == 1 and closed[0] is not cache and closed[0].closed
    assert not cache.closed and np.array_equal(cache.lengths(LAYER), lengths)
    cache.close()


def test_a_refused_calibration_changes_nothing():
    """set_calibration checks every argument before it writes: a bad per-head basis leaves σ² as it was."""
    shape = CacheShape(sessions=1, layers=2, kv_heads=2, head_dim=D, max_tokens=128, segment_blocks=1)
    with HostKVCache(shape, rotated=True) as cache:
        decoder = Decoder(cache, DecoderSettings(methods.fathom_mixed(12.0), Selection(k=4)), GROUP_SIZE,
                          sigma2=np.ones((2, 2, D)))
        before = decoder.strategy.depth_plan.sigma2[1].clone()
        with pytest.raises(ValueError, match="head_basis must be"):
            decoder.set_calibration(1, np.full((2, D), 7.0), None, head_basis=np.array(["raw", "bogus"]))
        torch.testing.assert_close(decoder.strategy.depth_plan.sigma2[1], before, rtol=0, atol=0)
