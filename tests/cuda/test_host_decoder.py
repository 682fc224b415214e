"""The host API end to end against the NumPy reference: cache append (pack on the GPU), plan, gather,
scan, selection and attention of one layer; and bad input rejected before any kernel runs."""

import numpy as np
import pytest
import torch

from fathom import methods
from fathom.attention import attention
from fathom.cuda.interop import DEVICE
from fathom.host.cache import CacheShape, OffloadedCache, sealed_planes
from fathom.host.decoder import Decoder, DecoderSettings
from fathom.scoring import approx_scores
from fathom.selection import Selection, select
from fathom.store import PlaneStore
from fathom.waterfill import importance, waterfill_batched

SHAPE = CacheShape(sessions=2, layers=2, kv_heads=1, head_dim=8, max_tokens=400, segment_blocks=2)
GROUP = 2


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _filled_cache(n: int, seed: int = 0):
    """A cache whose layer 1 holds n tokens appended in uneven chunks; keys are bf16-exact."""
    rng = np.random.default_rng(seed)
    k = _bf16((rng.standard_normal((SHAPE.sessions, SHAPE.kv_heads, n, SHAPE.head_dim))
               * np.exp(rng.uniform(-1, 1, SHAPE.head_dim))).astype(np.float32))
    v = _bf16(rng.standard_normal(k.shape).astype(np.float32))
    cache = OffloadedCache(SHAPE)
    start = 0
    for m in (1, 70, 63, 130, n):  # through the tail, across blocks and segment boundaries
        stop = min(start + m, n)
        cache.append(1, torch.from_numpy(k[:, :, start:stop]).to(DEVICE), torch.from_numpy(v[:, :, start:stop]).to(DEVICE))
        start = stop
    return cache, k, v


@pytest.mark.parametrize("method", [methods.fathom(12.0), methods.double_sparsity(3), methods.thumbnail(2),
                                    methods.sparq(2)], ids=lambda m: m.name)
def test_decode_step_matches_reference(method):
    n = 300
    cache, k, v = _filled_cache(n)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((SHAPE.sessions, SHAPE.kv_heads * GROUP, SHAPE.head_dim)).astype(np.float32)
    sel = Selection(k=20)
    ds_rank = np.stack([rng.permutation(SHAPE.head_dim) for _ in range(SHAPE.layers)])[:, None]
    decoder = Decoder(cache, DecoderSettings(method, sel, threads=32), GROUP, ds_rank=ds_rank)
    out = decoder.run(1, torch.from_numpy(q).to(DEVICE)).cpu().numpy()

    depths = decoder.depths.cpu().numpy()
    scores = decoder.scores.cpu().numpy()
    for s in range(SHAPE.sessions):
        store = PlaneStore.from_keys(k[s, 0], segment_blocks=SHAPE.segment_blocks)
        planes, scales = sealed_planes(cache, 1, s)
        np.testing.assert_array_equal(planes, store.planes())
        np.testing.assert_array_equal(scales, store.scales())
        qs = q[s]
        if isinstance(method.policy, methods.Waterfill):
            np.testing.assert_allclose(cache.store_variance(1).cpu().numpy()[s], store.scale_variance, rtol=1e-12)
            want_depths = waterfill_batched(importance(qs, cache.store_variance(1).cpu().numpy()[s]), 12.0)
        else:
            stats = methods.HeadStats(np.ones(SHAPE.head_dim), ds_rank[1, 0])
            want_depths = method.policy.depths(qs, stats)
        np.testing.assert_array_equal(depths[s], want_depths)
        want_scores = approx_scores(qs, store.planes(), store.scales(), want_depths)
        np.testing.assert_allclose(scores[s, :, :store.n_sealed], want_scores, rtol=1e-5, atol=1e-5)
        mask = select(scores[s, :, :store.n_sealed], n, sel)  # the reference protocol on the kernel's scores
        np.testing.assert_array_equal(decoder.selected(n)[s], mask)
        want = attention(qs, k[s, 0], v[s, 0], mask)
        np.testing.assert_allclose(out[s], want, rtol=2e-3, atol=2e-3)
    cache.close()


def test_bad_input_raises_before_any_kernel():
    cache, *_ = _filled_cache(100)
    decoder = Decoder(cache, DecoderSettings(methods.fathom(12.0), Selection(k=20), threads=32), GROUP)
    q = torch.zeros((SHAPE.sessions, SHAPE.kv_heads * GROUP, SHAPE.head_dim), device=DEVICE)
    for bad_layer in (-1, 2):
        with pytest.raises(ValueError, match="layer"):
            decoder.run(bad_layer, q)
    with pytest.raises(ValueError, match="shape"):
        decoder.run(1, q[:, :1])
    with pytest.raises(ValueError, match="dtype|float32"):
        decoder.run(1, q.to(torch.int32))
    with pytest.raises(ValueError, match="exceeds the context"):
        decoder.run(0, q)  # layer 0 holds no tokens
    with pytest.raises(ValueError, match="torch tensor"):
        decoder.run(1, q.cpu().numpy())
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        cache.append(1, torch.zeros((2, 1, 400, 8), device=DEVICE), torch.zeros((2, 1, 400, 8), device=DEVICE))
    with pytest.raises(ValueError, match="GPU path"):
        DecoderSettings(methods.loki(2))
    with pytest.raises(ValueError, match="ds_rank"):
        Decoder(cache, DecoderSettings(methods.double_sparsity(2)), GROUP)
    cache.close()
