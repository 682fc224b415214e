"""The whole offloaded ``Decoder.run`` against the reference decode (``fathom.decode.decode_step``) for every
method, S = 1 and S = 3 sessions, with appends in pieces across 64-token block and segment boundaries; the
cache's store and landmarks against the reference's; and bad input rejected before any kernel runs.

Rows are bf16 in the cache, so the reference runs on bf16-rounded keys and values. Selected sets must be
equal except where the reference's scores tie at the k-th within float32 tolerance (the scan sums in
another order); the attention output must match within float32 tolerance.
"""

import numpy as np
import pytest
import torch

from fathom import methods
from fathom.attention import attention
from fathom.cuda.interop import DEVICE, SIMULATED
from fathom.decode import HeadIndex, decode_step, method_scores
from fathom.host.cache import (
    CacheShape,
    OffloadedCache,
    sealed_landmarks,
    sealed_planes,
)
from fathom.host.decoder import Decoder, DecoderSettings
from fathom.scoring import landmarks
from fathom.selection import Selection
from fathom.store import PlaneStore

LAYER = 1  # layer 0 stays empty
GROUP = 2
D = 8
PIECES = (1, 70, 40, 29)  # 140 tokens: blocks sealed inside appends and from the tail, 2 segments, 12 in the tail
SEL = Selection(k=6, sink=4, local=16)
SHAPES = {1: CacheShape(sessions=1, layers=2, kv_heads=2, head_dim=D, max_tokens=160, segment_blocks=1),
          3: CacheShape(sessions=3, layers=2, kv_heads=1, head_dim=D, max_tokens=160, segment_blocks=1)}
METHODS = [methods.fathom(12.0), methods.fathom(12.0, variance="calibration"), methods.fathom_rotated(12.0),
           methods.fathom_plan((8.0, 14.0), 11.0), methods.sparq(2), methods.double_sparsity(2), methods.loki(2),
           methods.thumbnail(2), methods.landmark(), methods.oracle(), methods.dense()]


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _setup(shape: CacheShape, seed: int = 0):
    """bf16-exact keys/values [S, H, n, d] with spread channel scales, queries [S, H·G, d], calibration stats."""
    rng = np.random.default_rng(seed)
    n = sum(PIECES)
    k = _bf16((rng.standard_normal((shape.sessions, shape.kv_heads, n, D)) * np.exp(rng.uniform(-1, 1, D)))
              .astype(np.float32))
    v = _bf16(rng.standard_normal(k.shape).astype(np.float32))
    q = rng.standard_normal((shape.sessions, shape.kv_heads * GROUP, D)).astype(np.float32)
    basis = np.stack([[np.linalg.qr(rng.standard_normal((D, D)))[0] for _ in range(shape.kv_heads)]
                      for _ in range(shape.layers)])
    sigma2 = np.exp(rng.uniform(-1, 1, (shape.layers, shape.kv_heads, D)))
    ds_rank = np.stack([[rng.permutation(D) for _ in range(shape.kv_heads)] for _ in range(shape.layers)])
    return k, v, q, basis, sigma2, ds_rank


def _append(cache: OffloadedCache, k: np.ndarray, v: np.ndarray, start: int, stop: int) -> None:
    cache.append(LAYER, torch.from_numpy(k[:, :, start:stop]).to(DEVICE),
                 torch.from_numpy(v[:, :, start:stop]).to(DEVICE))


@pytest.fixture(scope="module")
def filled():
    """``filled(sessions, rotated)``: a cache holding every piece of ``PIECES``, made once per module, and its data."""
    made = {}

    def get(sessions: int, rotated: bool):
        if (sessions, rotated) not in made:
            shape = SHAPES[sessions]
            data = _setup(shape)
            cache = OffloadedCache(shape, basis=data[3] if rotated else None)
            for start, stop in zip(np.cumsum((0,) + PIECES[:-1]), np.cumsum(PIECES)):
                _append(cache, data[0], data[1], start, stop)
            made[sessions, rotated] = cache, data
        return made[sessions, rotated]

    yield get
    for cache, _ in made.values():
        cache.close()


def _assert_matches_reference(decoder: Decoder, out: np.ndarray, k, v, q, basis, sigma2, ds_rank, n: int):
    """Every (session, KV head) of a step against ``decode_step`` on the first ``n`` tokens."""
    method, shape = decoder.settings.method, decoder.cache.shape
    got_masks = decoder.selected(n)
    want_scan_bytes = 0.0
    for s in range(shape.sessions):
        for h in range(shape.kv_heads):
            g, heads = s * shape.kv_heads + h, slice(h * GROUP, (h + 1) * GROUP)
            keys, values, qg = k[s, h, :n], v[s, h, :n], q[s, heads]
            stats = {b: methods.HeadStats(sigma2[LAYER, h], ds_rank[LAYER, h], layer=LAYER) for b in ("raw", "rotated")}
            index = HeadIndex.build(keys, stats, basis=basis[LAYER, h])
            want = decode_step(qg, keys, values, index, method, SEL, layer=LAYER)
            want_scan_bytes += want.scan_bytes
            if want.depths is not None:
                np.testing.assert_array_equal(decoder.depths.cpu().numpy()[g], want.depths)
            scores, _ = method_scores(method, qg[None], index, np.array([n // 64]), LAYER)
            _assert_same_selection(got_masks[g], want.mask, None if scores is None else scores[0])
            np.testing.assert_allclose(out[s, heads], attention(qg, keys, values, got_masks[g]), rtol=1e-4, atol=1e-5)
            if (got_masks[g] == want.mask).all():
                np.testing.assert_allclose(out[s, heads], want.output, rtol=1e-4, atol=1e-5)
    assert decoder.scan_nbytes(LAYER) == want_scan_bytes  # the same bit accounting as the reference


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


@pytest.mark.parametrize("sessions", [1, 3])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_run_matches_reference_decode(filled, method, sessions):
    cache, data = filled(sessions, method.basis == "rotated" and method.scorer == "planes")
    q, sigma2, ds_rank = data[2], data[4], data[5]
    decoder = Decoder(cache, DecoderSettings(method, SEL, threads=8), GROUP, sigma2=sigma2, ds_rank=ds_rank)
    out = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
    _assert_matches_reference(decoder, out, *data, sum(PIECES))


@pytest.mark.parametrize("method", [methods.fathom(12.0), methods.landmark()], ids=lambda m: m.name)
def test_steps_between_appends(method):
    """A step, then an append that seals a block (queued on the side stream on a GPU), then a step: each step
    sees exactly the tokens appended before it."""
    shape = SHAPES[3]
    k, v, q, *_ = data = _setup(shape, seed=1)
    with OffloadedCache(shape) as cache:
        decoder = Decoder(cache, DecoderSettings(method, SEL, threads=8), GROUP)
        for start, stop in ((0, 111), (111, 140)):
            _append(cache, k, v, start, stop)
            out = decoder.run(LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy()
            _assert_matches_reference(decoder, out, *data, stop)


def test_cache_store_and_landmarks_match_reference():
    """Planes, scales, σ² statistic and landmarks of a raw and a rotated cache equal the reference's."""
    shape = SHAPES[3]
    k, v, _, basis, *_ = _setup(shape, seed=3)
    for rotation in (None, basis):
        with OffloadedCache(shape, basis=rotation) as cache:
            for start, stop in zip(np.cumsum((0,) + PIECES[:-1]), np.cumsum(PIECES)):
                _append(cache, k, v, start, stop)
            for s in range(shape.sessions):
                store = PlaneStore.from_keys(k[s, 0], segment_blocks=shape.segment_blocks,
                                             basis=None if rotation is None else rotation[LAYER, 0])
                planes, scales = sealed_planes(cache, LAYER, s)
                np.testing.assert_array_equal(planes, store.planes())
                np.testing.assert_array_equal(scales, store.scales())
                np.testing.assert_allclose(cache.store_variance(LAYER).cpu().numpy()[s], store.scale_variance,
                                           rtol=1e-12)
                np.testing.assert_array_equal(sealed_landmarks(cache, LAYER, s).view(np.uint16),
                                              landmarks(k[s, 0, :store.n_sealed]).view(np.uint16))


@pytest.mark.skipif(SIMULATED, reason="HBM-resident store: on the GPU only (the simulator has one memory)")
def test_device_resident_store_runs_the_same_step():
    shape = SHAPES[3]
    k, v, q, *_ = _setup(shape)
    outs = []
    for where in ("host", "device"):
        cache = OffloadedCache(CacheShape(**{**vars(shape), "store": where}))
        cache.append(LAYER, torch.from_numpy(k).to(DEVICE), torch.from_numpy(v).to(DEVICE))
        outs.append(Decoder(cache, DecoderSettings(methods.fathom(12.0), SEL), GROUP).run(
            LAYER, torch.from_numpy(q).to(DEVICE)).cpu().numpy())
        cache.close()
    np.testing.assert_array_equal(*outs)


def test_bad_input_raises_before_any_kernel():
    shape = SHAPES[3]
    k, v, *_ = _setup(shape)
    cache = OffloadedCache(shape)
    cache.append(LAYER, torch.from_numpy(k[:, :, :100]).to(DEVICE), torch.from_numpy(v[:, :, :100]).to(DEVICE))
    decoder = Decoder(cache, DecoderSettings(methods.fathom(12.0), Selection(k=20), threads=32), GROUP)
    q = torch.zeros((shape.sessions, shape.kv_heads * GROUP, D), device=DEVICE)
    for bad_layer in (-1, 2):
        with pytest.raises(ValueError, match="layer"):
            decoder.run(bad_layer, q)
    with pytest.raises(ValueError, match="shape"):
        decoder.run(LAYER, q[:, :1])
    with pytest.raises(ValueError, match="dtype|float32"):
        decoder.run(LAYER, q.to(torch.int32))
    with pytest.raises(ValueError, match="exceeds the context"):
        decoder.run(0, q)  # layer 0 holds no tokens
    with pytest.raises(ValueError, match="torch tensor"):
        decoder.run(LAYER, q.cpu().numpy())
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        cache.append(LAYER, torch.zeros((3, 1, 100, D), device=DEVICE), torch.zeros((3, 1, 100, D), device=DEVICE))
    with pytest.raises(ValueError, match="rotated store but the cache holds the raw store"):
        Decoder(cache, DecoderSettings(methods.loki(2)), GROUP)
    with pytest.raises(ValueError, match="per-layer budgets"):
        Decoder(cache, DecoderSettings(methods.fathom_plan((8.0,), 8.0)), GROUP)
    with pytest.raises(ValueError, match="ds_rank"):
        Decoder(cache, DecoderSettings(methods.double_sparsity(2)), GROUP)
    with pytest.raises(ValueError, match="sigma2"):
        Decoder(cache, DecoderSettings(methods.fathom(12.0, variance="calibration")), GROUP)
    with pytest.raises(ValueError, match="basis must be orthonormal"):
        OffloadedCache(shape, basis=np.ones((2, 1, D, D)))
    with pytest.raises(ValueError, match="store must be one of"):
        CacheShape(1, 1, 1, D, 64, store="disk")
    cache.close()
    rotated = OffloadedCache(shape, basis=np.broadcast_to(np.eye(D), (2, 1, D, D)).copy())
    with pytest.raises(ValueError, match="raw store but the cache holds the rotated store"):
        Decoder(rotated, DecoderSettings(methods.fathom(12.0)), GROUP)
    rotated.close()
