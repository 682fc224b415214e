"""``fathom.integrations.sessions``: where a decoding loop keeps its sessions' K/V. The reference sessions equal the
reference decode step; the offloaded sessions (under the CUDA simulator in CI, on the GPU with FATHOM_GPU=1)
generate the reference's tokens through FathomCache, are pooled and grown; the capacity buckets, the pool's limit
and eviction and a layer's calibration view are checked on their own."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fathom import methods as M
from fathom.calibration import Calibration
from fathom.decode import HeadIndex, decode_step
from fathom.integrations.sessions import (LayerStats, OffloadedSessions, ReferenceSessions, SessionPool, SessionShape,
                                          capacity)
from fathom.integrations.transformers import FathomCache
from fathom.quantize import midpoint_levels
from fathom.selection import Selection
from tests.integrations.test_transformers import _cached, _calibration, batch, generate
from tests.tiny_models import OFFLOAD_SETTINGS, tiny_llama, tiny_offload_llama

pytestmark = pytest.mark.usefixtures("quiet_and_single_threaded")  # tests/integrations/conftest.py


# --- units ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, reserved", [(1, 64), (64, 64), (65, 128), (1000, 1024), (4096, 4096),
                                              (4097, 4608), (131072 + 4096, 147456)])
def test_capacity_rounds_up_to_an_eighth_of_the_power_of_two_and_at_least_a_block(tokens, reserved):
    assert capacity(tokens) == reserved


def test_capacity_holds_its_tokens_and_wastes_at_most_an_eighth():
    for tokens in [*range(1, 3000, 7), 2 ** 20 - 1, 2 ** 20, 2 ** 20 + 1]:
        got = capacity(tokens)
        assert got >= tokens and got % 64 == 0
        assert got - tokens < max(64, 2 ** math.floor(math.log2(tokens)) / 8)


class FakeSessions:
    """What the pool reads of OffloadedSessions: a key, clear() and close()."""

    def __init__(self, key, flagged: bool = False):
        self.key, self.cleared, self.closed, self.flagged = key, 0, False, flagged

    def clear(self):
        if self.flagged:
            raise ValueError("a decode step of layer 0 was refused on the GPU")
        self.cleared += 1

    def close(self):
        self.closed = True


def test_the_pool_keeps_one_idle_sessions_per_key_and_closes_the_oldest_beyond_its_limit():
    pool = SessionPool(limit=2)
    a, b, c, a2 = FakeSessions("a"), FakeSessions("b"), FakeSessions("c"), FakeSessions("a")
    for s in (a, b):
        pool.give(s)
    assert len(pool) == 2 and a.cleared == b.cleared == 1 and not (a.closed or b.closed)
    pool.give(a2)  # the same key again: the idle one is closed, the newest kept
    assert a.closed and len(pool) == 2
    pool.give(c)  # beyond the limit: the least recently returned (b) is closed
    assert b.closed and not (a2.closed or c.closed) and len(pool) == 2
    assert pool.take("b") is None and pool.take("a") is a2 and len(pool) == 1
    assert pool.take("a") is None  # taken once
    pool.clear()
    assert c.closed and len(pool) == 0
    pool.give(a2)
    pool.give(a2)  # given twice: kept, not closed
    assert not a2.closed and pool.take("a") is a2


def test_the_pool_closes_sessions_it_cannot_empty_and_raises():
    """A kernel's flag reported by clear(): the sessions are closed (their pinned memory freed), not kept, not
    leaked, and the pool keeps what it held."""
    pool = SessionPool(limit=2)
    kept, flagged = FakeSessions("a"), FakeSessions("b", flagged=True)
    pool.give(kept)
    with pytest.raises(ValueError, match="refused on the GPU"):
        pool.give(flagged)
    assert flagged.closed and len(pool) == 1 and pool.take("b") is None and not kept.closed


def test_reference_sessions_refuse_bad_tokens_before_any_session_or_head_takes_them():
    """A NaN in head 1, K and V of different lengths or heads, a session out of range, a query of other heads: each
    refused with nothing appended anywhere (the reference appended head by head, session by session)."""
    S, H, d = 2, 2, 8
    sessions = ReferenceSessions(SessionShape(S, 1, H, 1, d), M.dense(), Selection(k=0), scale=d ** -0.5)
    k, v = torch.randn(S, H, 5, d), torch.randn(S, H, 5, d)
    sessions.append(0, 0, k[0], v[0])
    sessions.append(0, 1, k[1], v[1])
    nan_head_1 = k[0].clone()
    nan_head_1[1, 0, 0] = float("nan")
    bad_calls = [(lambda: sessions.append(0, 0, nan_head_1, v[0]), "must be finite"),
                 (lambda: sessions.append(0, 0, k[0], v[0, :, :3]), "with the same m"),
                 (lambda: sessions.append(0, 0, torch.randn(3, 5, d), torch.randn(3, 5, d)), "k must be"),
                 (lambda: sessions.append(0, -1, k[0], v[0]), "session must be an integer in 0..1"),
                 (lambda: sessions.step(0, torch.randn(S, H, d), torch.stack([k[0, :, 0], nan_head_1[:, 0]]),
                                        torch.randn(S, H, d)), "must be finite"),
                 (lambda: sessions.step(0, torch.randn(S, 3, d), k[:, :, 0], v[:, :, 0]), "q must be")]
    for call, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            call()
        assert sessions.lengths(0).tolist() == [5, 5]
        assert [len(index.keys) for row in sessions.indexes[0] for index in row] == [5] * (S * H)


def test_layer_stats_reads_one_layer_of_a_calibration_in_each_store():
    rng = np.random.default_rng(0)
    L, H, d = 3, 2, 8
    calibration = _calibration(rng, L, H, d)
    stats = LayerStats.of(calibration, 1)
    np.testing.assert_array_equal(stats.sigma2("raw"), calibration.sigma2_raw[1])
    np.testing.assert_array_equal(stats.sigma2("rotated"), calibration.sigma2_rotated[1])
    np.testing.assert_array_equal(stats.basis, calibration.basis[1])
    head = stats.head(1, "rotated", layer=1)
    np.testing.assert_array_equal(head.sigma2, calibration.sigma2_rotated[1, 1])
    np.testing.assert_array_equal(head.ds_rank, calibration.ds_rank[1, 1])
    assert head.layer == 1 and head.levels is None and not stats.reads_levels
    with_levels = _with_levels(rng, calibration)
    stats = LayerStats.of(with_levels, 1, levels=True)
    head = stats.head(1, "rotated", layer=1)  # the table, and the plane table measured through it
    np.testing.assert_array_equal(head.levels, with_levels.levels_rotated[1, 1])
    np.testing.assert_array_equal(head.plane_drops, with_levels.level_drops_rotated[1, 1])
    np.testing.assert_array_equal(stats.planner_levels(M.fathom(20.0)), with_levels.levels_raw[1])
    assert LayerStats.of(with_levels, 1).head(1, "raw", layer=1).levels is None  # midpoints unless asked


def _with_levels(rng, calibration: Calibration) -> Calibration:
    """``calibration`` with reconstruction tables of both stores (the midpoints moved by up to half a cell, as
    calibrated means lie) and plane tables measured through them (decreasing drops a plane)."""
    L, H, d = calibration.sigma2_raw.shape
    cell = np.exp2(np.float32(3) - np.arange(4, dtype=np.float32))[:, None]
    tables = [(midpoint_levels(d) + rng.uniform(-1, 1, (L, H, d, 4, 16)) * cell).astype(np.float32) for _ in "ab"]
    drops = [np.sort(rng.uniform(0, 1, (L, H, d, 4)), -1)[..., ::-1] * calibration.sigma2_raw[..., None]
             for _ in "ab"]
    scale2 = calibration.sigma2_raw.copy()
    return replace(calibration, levels_raw=tables[0], levels_rotated=tables[1], level_drops_raw=drops[0],
                   level_drops_rotated=drops[1], plane_drops_raw=drops[1], plane_drops_rotated=drops[0],
                   scale2_raw=scale2, scale2_rotated=scale2)


@pytest.mark.parametrize("field", ["sessions", "layers", "kv_heads", "group_size", "head_dim", "max_tokens"])
def test_a_session_shape_refuses_a_size_that_is_not_positive(field):
    sizes = dict(sessions=1, layers=1, kv_heads=1, group_size=1, head_dim=8, max_tokens=64)
    with pytest.raises(ValueError, match=f"^{field} must be positive, got 0"):
        SessionShape(**{**sizes, field: 0})


# --- the two backends -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [M.fathom(10.0), M.fathom(10.0, "calibration"), M.fathom_rotated(10.0),
                                    M.fathom_plan((8.0, 14.0), 11.0), M.sparq(2), M.double_sparsity(2), M.loki(2),
                                    M.thumbnail(2), M.landmark(), M.oracle(), M.dense()],
                         ids=lambda m: m.name)
def test_reference_sessions_step_equals_the_reference_decode_step(method):
    """Ragged sessions (prompts of 130 and 70 tokens) grown token by token against decode_step over an index
    built at once on the same keys, at every step, for every (layer, session, KV head); the ``on_step`` observer
    sees each of those steps."""
    rng = np.random.default_rng(0)
    S, L, H, G, d, steps, scale = 2, 2, 2, 2, 8, 4, 0.3
    calibration = _calibration(rng, L, H, d)
    sel = Selection(k=6, sink=2, local=8)
    sessions = ReferenceSessions(SessionShape(S, L, H, G, d), method, sel, scale, calibration)
    observed = {}
    sessions.on_step = lambda layer, s, h, step: observed.setdefault((layer, s, h), []).append(step)
    spread = np.exp(rng.uniform(-1, 1, d)).astype(np.float32)
    keys = [[rng.standard_normal((H, n, d)).astype(np.float32) * spread for n in (130, 70)] for _ in range(L)]
    values = [[rng.standard_normal((H, n, d)).astype(np.float32) for n in (130, 70)] for _ in range(L)]
    for layer in range(L):
        for s in range(S):
            sessions.append(layer, s, torch.from_numpy(keys[layer][s]), torch.from_numpy(values[layer][s]))
    for _ in range(steps):
        for layer in range(L):
            q = rng.standard_normal((S, H * G, d)).astype(np.float32)
            k = rng.standard_normal((S, H, d)).astype(np.float32) * spread
            v = rng.standard_normal((S, H, d)).astype(np.float32)
            out = sessions.step(layer, torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)).numpy()
            for s in range(S):
                keys[layer][s] = np.concatenate([keys[layer][s], k[s, :, None]], axis=1)
                values[layer][s] = np.concatenate([values[layer][s], v[s, :, None]], axis=1)
                for h in range(H):
                    stats = {b: calibration.head_stats(layer, h, b) for b in ("raw", "rotated")}
                    index = HeadIndex.build(keys[layer][s][h], stats, calibration.basis[layer, h])
                    step = decode_step(q[s, h * G:(h + 1) * G], keys[layer][s][h], values[layer][s][h], index,
                                       method, sel, scale, layer)
                    np.testing.assert_array_equal(out[s, h * G:(h + 1) * G], step.output.astype(np.float32))
                    np.testing.assert_array_equal(observed[layer, s, h][-1].mask, step.mask)
    np.testing.assert_array_equal(sessions.lengths(0), [130 + steps, 70 + steps])
    assert sorted(observed) == [(layer, s, h) for layer in range(L) for s in range(S) for h in range(H)]
    assert all(len(seen) == steps for seen in observed.values())


@pytest.mark.parametrize("method", ["dense", "fathom", "fathom-rotated", "double-sparsity"])
def test_offloaded_sessions_decode_as_the_reference_does(method):
    """The offloaded backend generates the reference's tokens: under the CUDA simulator (CI) on CPU tensors, with
    FATHOM_GPU=1 on the GPU."""
    from fathom.cuda.interop import DEVICE

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    budget = {"dense": None, "double-sparsity": 17}.get(method, 20)  # dense reads no budget
    settings = dict(budget=budget, k=6, sink=2, local=4, max_tokens=80)
    reference = generate(model, ids, mask, FathomCache(model, method, backend="reference", **settings), new=3)
    offloaded = FathomCache(model, method, backend="offloaded", **settings)
    torch.testing.assert_close(generate(model, ids, mask, offloaded, new=3), reference, rtol=0, atol=0)
    offloaded.close()


def test_the_per_head_store_decodes_each_head_on_the_store_it_chose_on_both_backends():
    """fathom-mixed on the offloaded backend (the rotated store with the identity on raw heads, each stream's σ²
    from its head's basis' default) generates the reference's tokens; over two layers, one raw and one rotated, and
    with every head raw or every head rotated it generates fathom's and fathom-rotated's tokens (the same store
    and σ² per head)."""
    from fathom.cuda.interop import DEVICE

    model = tiny_offload_llama(layers=2)
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    calibration = _calibration(np.random.default_rng(0), 2, 1, 16)
    settings = OFFLOAD_SETTINGS
    for choice, same_as in ((["raw", "rotated"], None), (["raw", "raw"], "fathom"),
                            (["rotated", "rotated"], "fathom-rotated")):
        mixed = calibration.with_head_basis(np.array(choice)[:, None])
        reference = generate(model, ids, mask, FathomCache(model, "fathom-mixed", backend="reference",
                                                           calibration=mixed, **settings), new=3)
        if same_as is None:  # the simulator is slow: the offloaded backend on the mixed choice only
            offloaded = FathomCache(model, "fathom-mixed", backend="offloaded", calibration=mixed, **settings)
            torch.testing.assert_close(generate(model, ids, mask, offloaded, new=3), reference, rtol=0, atol=0)
            offloaded.close()
        else:
            single = FathomCache(model, same_as, backend="reference", calibration=mixed, **settings)
            torch.testing.assert_close(generate(model, ids, mask, single, new=3), reference, rtol=0, atol=0)


def test_calibrated_gains_and_the_pooled_plan_decode_the_same_tokens_on_both_backends():
    """fathom-mixed with the calibrated plane gains and one water line for a layer's two KV heads (the plan rule's
    usual pick, docs/results.md): the offloaded backend generates the reference's tokens, with the plane tables of
    both stores measured on the prompt (fathom-rotated[gains]) and each head's basis chosen apart. One decode step a
    layer (the simulator is slow): a step after an appended token is test_the_per_head_store_...'s."""
    from fathom.cuda.interop import DEVICE

    model = tiny_offload_llama(layers=2, kv_heads=2)
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = dict(OFFLOAD_SETTINGS, gains="calibrated")
    measured = FathomCache(model, "fathom-rotated", backend="reference", **settings)
    generate(model, ids, mask, measured, new=1)
    calibration = measured.calibration.with_head_basis(np.array([["raw", "rotated"], ["rotated", "raw"]]))
    assert calibration.plane_drops_raw is not None and calibration.plane_drops_rotated is not None
    reference = generate(model, ids, mask, FathomCache(model, "fathom-mixed", backend="reference", pooled=True,
                                                       calibration=calibration, **settings), new=2)
    offloaded = FathomCache(model, "fathom-mixed", backend="offloaded", pooled=True, calibration=calibration,
                            **settings)
    torch.testing.assert_close(generate(model, ids, mask, offloaded, new=2), reference, rtol=0, atol=0)
    offloaded.close()


def test_planes_read_through_calibrated_levels_decode_the_same_tokens_on_both_backends():
    """levels='calibrated': fathom-mixed with the calibrated gains reads each head's reconstruction table of its
    store's basis (and the plane table measured through it) on the offloaded backend, generating the reference's
    tokens (one decode step a layer, as the test above); the decoder holds the tables as the scan reads them
    (``fathom.cuda.scan.scan_levels``)."""
    from fathom.cuda.interop import DEVICE
    from fathom.cuda.scan import scan_levels

    model = tiny_offload_llama(layers=2, kv_heads=2)
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = dict(OFFLOAD_SETTINGS, gains="calibrated", levels="calibrated")
    choice = np.array([["raw", "rotated"], ["rotated", "raw"]])
    calibration = _with_levels(np.random.default_rng(3), _calibration(np.random.default_rng(2), 2, 2, 16)) \
        .with_head_basis(choice)
    reference = generate(model, ids, mask, FathomCache(model, "fathom-mixed", backend="reference",
                                                       calibration=calibration, **settings), new=2)
    offloaded = FathomCache(model, "fathom-mixed", backend="offloaded", calibration=calibration, **settings)
    torch.testing.assert_close(generate(model, ids, mask, offloaded, new=2), reference, rtol=0, atol=0)
    held = offloaded.decoding.sessions.decoder.strategy.levels.cpu().numpy()
    for layer in range(2):
        for head, basis in enumerate(choice[layer]):
            want = getattr(calibration, f"levels_{basis}")[layer, head]
            np.testing.assert_array_equal(held[layer, head], scan_levels(want))
    offloaded.close()


def test_calibrated_levels_need_a_calibration_with_tables_and_a_plane_scan():
    """Refused when the cache is made: without a calibration (a prompt's has no tables), with one without tables,
    for a method that scans no planes, and a value other than the two."""
    model = tiny_offload_llama()
    with pytest.raises(ValueError, match="^levels='calibrated' reads the reconstruction tables of the calibration"):
        FathomCache(model, "fathom", backend="reference", levels="calibrated")
    for backend in ("reference", "offloaded"):
        with pytest.raises(ValueError, match="^layer 0's calibration has no reconstruction tables of the raw store"):
            FathomCache(model, "fathom", backend=backend, levels="calibrated",
                        calibration=_calibration(np.random.default_rng(0), 1, 1, 16))
    with pytest.raises(ValueError, match="^levels='calibrated' is how a scan reads the bit planes: oracle scans none"):
        FathomCache(model, "oracle", levels="calibrated")
    with pytest.raises(ValueError, match="^levels must be one of"):
        FathomCache(model, "fathom", levels="means")
    sessions = OffloadedSessions(SessionShape(1, 1, 1, 1, 16, 128), M.fathom(20.0), Selection(k=4), 0.25, levels=True)
    with pytest.raises(ValueError, match="^layer 0's calibration must read the planes through reconstruction tables"):
        sessions.calibrate(0, LayerStats.of(_calibration(np.random.default_rng(0), 1, 1, 16), 0))  # at the midpoints
    sessions.close()


def test_the_calibrated_gains_need_a_calibration_with_plane_tables():
    """Refused when the cache is made, on either backend (the offloaded raw store is calibrated at the first step,
    after the prompt entered it: too late to refuse), and a prompt shorter than a block cannot measure them."""
    model = tiny_offload_llama()
    for backend in ("reference", "offloaded"):
        with pytest.raises(ValueError, match="^layer 0's calibration has no plane table of the raw store"):
            FathomCache(model, "fathom", backend=backend, gains="calibrated",
                        calibration=_calibration(np.random.default_rng(0), 1, 1, 16))
    ids, mask = batch(n=40, pad=9)
    with pytest.raises(ValueError, match="^gains='calibrated' measures the plane gains on the prompt's sealed 64-token "
                                         "blocks: row 0's prompt holds 40 tokens"):
        generate(model, ids, mask, FathomCache(model, "fathom", backend="reference", gains="calibrated"))
    with pytest.raises(ValueError, match="^gains='calibrated' is taken by fathom, fathom-rotated, fathom-mixed only"):
        FathomCache(model, "sparq", budget=68, gains="calibrated")
    with pytest.raises(ValueError, match="^pooled=True is taken by fathom, fathom-rotated, fathom-mixed only"):
        FathomCache(model, "fathom-plan", pooled=True)
    with pytest.raises(ValueError, match="^gains must be one of"):
        FathomCache(model, "fathom", gains="measured")
    with pytest.raises(ValueError, match="^pooled must be True or False"):
        FathomCache(model, "fathom", pooled=1)


def test_the_per_head_store_needs_a_calibration_with_its_choice():
    model = tiny_offload_llama()
    with pytest.raises(ValueError, match="^method 'fathom-mixed' scans the store each"):
        FathomCache(model, "fathom-mixed", backend="reference")
    with pytest.raises(ValueError, match="^method 'fathom-mixed' scans the store each"):
        FathomCache(model, "fathom-mixed", backend="reference", calibration=_calibration(np.random.default_rng(0),
                                                                                          1, 1, 16))
    with pytest.raises(ValueError, match="^variance must be None for fathom-mixed"):
        FathomCache(model, "fathom-mixed", variance="store")


def test_an_hbm_budget_tiers_the_offloaded_store_and_decodes_the_same_tokens():
    """hbm_gb puts the scales and the planes that fit in HBM (here 2 of 4) and decodes what the all-pinned store
    does (the reference's tokens, which the all-pinned store generates: the tests above; the simulator is slow); a
    budget on the reference backend is refused when the cache is made."""
    from dataclasses import replace

    from fathom.cuda.interop import DEVICE

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = OFFLOAD_SETTINGS
    layout = SessionShape(2, 1, 1, 2, 16, 80).cache_shape().layout
    two_planes_gb = 1.01 * 8 * replace(layout, hbm_planes=2).near_words / 1e9  # a third plane needs far more
    reference = FathomCache(model, "fathom", backend="reference", **settings)
    tiered = FathomCache(model, "fathom", backend="offloaded", hbm_gb=two_planes_gb, **settings)
    torch.testing.assert_close(generate(model, ids, mask, tiered, new=3),
                               generate(model, ids, mask, reference, new=3), rtol=0, atol=0)
    assert tiered.decoding.sessions.cache.shape.layout.hbm_planes == 2
    assert tiered.decoding.sessions.cache.hbm_bytes > 0
    tiered.close()
    with pytest.raises(ValueError, match="hbm_gb .* reference backend"):
        FathomCache(model, "fathom", backend="reference", hbm_gb=1.0)
    with pytest.raises(ValueError, match="hbm_gb must be a finite number"):
        FathomCache(model, "fathom", hbm_gb=-1)


def test_a_row_cache_decodes_the_same_tokens():
    """row_cache_rows keeps recently selected rows in HBM (here fewer slots than a step's rows, so some bypass):
    the same tokens as without (the reference's, which the offloaded backend without a row cache generates: the
    tests above; the simulator is slow), rows served from HBM, and refused where there is nothing offloaded."""
    from fathom.cuda.interop import DEVICE

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = OFFLOAD_SETTINGS
    reference = FathomCache(model, "fathom", backend="reference", **settings)
    cached = FathomCache(model, "fathom", backend="offloaded", row_cache_rows=16, **settings)
    torch.testing.assert_close(generate(model, ids, mask, cached, new=4),
                               generate(model, ids, mask, reference, new=4), rtol=0, atol=0)
    cache = cached.decoding.sessions.cache
    hits, lookups = cache.row_cache_counts()
    assert cache.shape.row_cache_rows == 16 and lookups > 0 and hits > 0
    cached.close()
    with pytest.raises(ValueError, match="row_cache_rows .* reference backend"):
        FathomCache(model, "fathom", backend="reference", row_cache_rows=64)
    with pytest.raises(ValueError, match="row_cache_rows must be an integer"):
        FathomCache(model, "fathom", row_cache_rows=-1)


def test_offloaded_sessions_are_pooled_grown_and_continue_a_conversation_as_the_reference_does():
    """A closed cache's sessions serve the next cache of the same key (same tokens as the reference); a
    conversation's second turn past max_tokens grows the pinned store and still generates the reference's tokens."""
    from fathom.cuda.interop import DEVICE
    from fathom.integrations.sessions import POOL

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = dict(OFFLOAD_SETTINGS, pool=True)
    reference = FathomCache(model, "fathom", backend="reference", **settings)
    expected = generate(model, ids, mask, reference, new=2)
    POOL.clear()
    first = FathomCache(model, "fathom", backend="offloaded", **settings)
    generate(model, ids, mask, first, new=2)
    first.close()
    assert len(POOL) == 1
    pooled = FathomCache(model, "fathom", backend="offloaded", **settings)
    torch.testing.assert_close(generate(model, ids, mask, pooled, new=2), expected, rtol=0, atol=0)
    assert len(POOL) == 0
    said = torch.arange(1, 13, device=DEVICE).repeat(2, 1)  # 12 more tokens: past max_tokens = 80
    ids2, mask2 = torch.cat([expected, said], 1), torch.cat([mask, torch.ones_like(expected[:, 70:]),
                                                             torch.ones_like(said)], 1)
    second = generate(model, ids2, mask2, pooled, new=2)
    torch.testing.assert_close(second, generate(model, ids2, mask2, reference, new=2), rtol=0, atol=0)
    np.testing.assert_array_equal(pooled.lengths(), reference.lengths())
    assert pooled.decoding.sessions.cache.shape.max_tokens > 80
    pooled.close()
    POOL.clear()


def test_offloaded_sessions_made_under_inference_mode_are_written_outside_it():
    """A cache prefilled under ``torch.inference_mode`` continues under generate's ``no_grad``, and its pooled
    sessions serve the next cache outside inference mode: the sessions' tensors are ordinary ones (inference
    tensors refused every later write: a RuntimeError at the first step, and at close, in the pool's clear)."""
    from fathom.cuda.interop import DEVICE
    from fathom.integrations.sessions import POOL

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = dict(OFFLOAD_SETTINGS, pool=True)
    reference = FathomCache(model, "fathom", backend="reference", **settings)
    model(ids[:, :60], attention_mask=mask[:, :60], past_key_values=reference, use_cache=True)
    expected = generate(model, ids, mask, reference, new=2)  # the first 60 as a prefill, 10 as a chunk, 2 steps
    fresh = generate(model, ids, mask, FathomCache(model, "fathom", backend="reference", **settings), new=2)
    POOL.clear()
    first = FathomCache(model, "fathom", backend="offloaded", **settings)
    with torch.inference_mode():
        model(ids[:, :60], attention_mask=mask[:, :60], past_key_values=first, use_cache=True)
    torch.testing.assert_close(generate(model, ids, mask, first, new=2), expected, rtol=0, atol=0)
    first.close()  # its sessions, opened under inference mode, emptied into the pool outside it
    assert len(POOL) == 1
    pooled = FathomCache(model, "fathom", backend="offloaded", **settings)
    with torch.inference_mode():
        torch.testing.assert_close(generate(model, ids, mask, pooled, new=2), fresh, rtol=0, atol=0)
    pooled.close()
    POOL.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dense", "oracle", "fathom", "fathom-rotated", "sparq", "double-sparsity"])
def test_on_a_gpu_the_offloaded_path_generates_the_reference_paths_tokens(method):
    """On a CUDA device (FATHOM_GPU=1): the model in bf16 on the GPU, K/V rows bf16 in the offloaded cache and
    float32 copies of the same bf16 values in the reference; SmolLM2 if cached, else a tiny random Llama."""
    if _cached("smollm2-135m"):
        from bench.models import load

        model, tokenizer = load("smollm2-135m")
        tokenizer.padding_side = "left"
        prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
        encoded = tokenizer([p * 12 for p in prompts], return_tensors="pt", padding=True)
        ids, mask = encoded.input_ids, encoded.attention_mask
    else:
        model = tiny_llama()
        ids, mask = batch()
    model = model.to("cuda", torch.bfloat16)
    ids, mask = ids.cuda(), mask.cuda()
    budget = None if method in ("dense", "oracle") else 68 if method in ("sparq", "double-sparsity") else 48
    settings = dict(budget=budget, k=16, max_tokens=ids.shape[1] + 16)
    reference = generate(model, ids, mask, FathomCache(model, method, backend="reference", **settings), new=8)
    offloaded = FathomCache(model, method, backend="offloaded", **settings)
    torch.testing.assert_close(generate(model, ids, mask, offloaded, new=8), reference, rtol=0, atol=0)
    offloaded.close()
