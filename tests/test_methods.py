import numpy as np
import pytest
from hypothesis import given, strategies as st

from fathom import methods as M
from fathom.bits import scan_bits
from fathom.decode import HeadIndex, decode_step, method_scores
from fathom.methods import HeadStats
from fathom.scoring import DepthScorer, approx_scores
from fathom.selection import Selection
from fathom.store import PlaneStore


def head(seed, n=256, d=8, G=3):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((n, d)) * np.exp(rng.normal(0, 1, d))).astype(np.float32)
    v = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((G, d)).astype(np.float32)
    return k, v, q


@given(st.integers(0, 2 ** 32 - 1), st.lists(st.integers(0, 4), min_size=8, max_size=8))
def test_depth_scorer_equals_approx_scores(seed, depths):
    k, _, q = head(seed)
    store = PlaneStore.from_keys(k)
    depths = np.array(depths)
    np.testing.assert_allclose(DepthScorer(store.planes(), store.scales())(q, depths),
                               approx_scores(q, store.planes(), store.scales(), depths), rtol=1e-5, atol=1e-4)


def test_thumbnail_is_the_depth_two_everywhere_policy():
    k, _, q = head(0)
    index = HeadIndex.build(k, None)
    scores, depths = method_scores(M.thumbnail(2), q[None], index, np.array([4]))
    assert (depths == 2).all()
    store = index.stores["raw"]
    np.testing.assert_allclose(scores[0], approx_scores(q, store.planes(), store.scales(), np.full(8, 2)),
                               rtol=1e-5, atol=1e-4)


def test_sparq_with_all_channels_is_the_full_four_bit_scan():
    k, _, q = head(1)
    index = HeadIndex.build(k, None)
    sparq, _ = method_scores(M.sparq(8), q[None], index, np.array([4]))
    full, _ = method_scores(M.thumbnail(4), q[None], index, np.array([4]))
    np.testing.assert_array_equal(sparq, full)


def test_sparq_picks_the_channels_with_the_largest_summed_query_magnitude():
    q = np.zeros((2, 6))
    q[0, [1, 4]] = 5.0
    q[1, [4, 2]] = -3.0
    depths = M.sparq(3).policy.depths(q, HeadStats(np.ones(6), np.arange(6)))
    np.testing.assert_array_equal(depths, [0, 4, 4, 0, 4, 0])


def test_double_sparsity_and_loki_read_fixed_channels():
    stats = HeadStats(np.ones(6), np.array([5, 0, 3, 1, 2, 4]))
    q = np.random.default_rng(0).standard_normal((2, 6))
    np.testing.assert_array_equal(M.double_sparsity(2).policy.depths(q, stats), [4, 0, 0, 0, 0, 4])
    np.testing.assert_array_equal(M.loki(2).policy.depths(q, stats), [4, 4, 0, 0, 0, 0])
    assert M.loki(2).basis == "rotated"


def test_fathom_spends_its_budget_where_variance_times_query_energy_is():
    q = np.array([[1.0, 1.0, 1.0, 0.0]])
    stats = HeadStats(sigma2=np.array([100.0, 1.0, 0.0, 50.0]), ds_rank=np.arange(4),
                      sigma2_store=np.array([1.0, 100.0, 0.0, 50.0]))
    by_calibration = M.fathom(6, "calibration").policy.depths(q, stats)
    by_store = M.fathom(6, "store").policy.depths(q, stats)
    assert by_calibration[0] > by_calibration[1] and by_store[1] > by_store[0]
    assert by_calibration[2:].sum() == by_store[2:].sum() == 0


def test_a_per_layer_plan_reads_the_budget_of_the_layer_it_is_given_and_needs_one():
    k, v, q = head(3, n=512, d=16)
    index = HeadIndex.build(k, calibration=None)  # no calibration: nothing else knows the layer
    plan, sel = M.fathom_plan((8, 40), 24), Selection(k=32)
    with pytest.raises(ValueError, match="^layer must be given"):
        decode_step(q, k, v, index, plan, sel)
    with pytest.raises(ValueError, match="^layer must lie in 0..1"):
        decode_step(q, k, v, index, plan, sel, layer=2)
    for layer, budget in enumerate((8, 40)):
        step = decode_step(q, k, v, index, plan, sel, layer=layer)
        flat = decode_step(q, k, v, index, M.fathom(budget), sel)
        assert step.bits == flat.bits <= budget
        np.testing.assert_array_equal(step.depths, flat.depths)
        np.testing.assert_array_equal(step.output, flat.output)
    assert decode_step(q, k, v, index, plan, sel, layer=1).bits > 24


def test_each_basis_reads_its_own_default_variance_and_names_the_other():
    assert (M.fathom(48).name, M.fathom(48).policy.variance) == ("fathom", "store")
    assert (M.fathom_rotated(48).name, M.fathom_rotated(48).policy.variance) == ("fathom-rotated", "calibration")
    assert M.fathom(48, "calibration").label(64) == "fathom[calibration]@48"
    assert M.fathom_rotated(48, "store").label(64) == "fathom-rotated[store]@48"
    assert M.fathom_rotated(48, "calibration").name == "fathom-rotated"
    assert M.fathom_plan((48,), 48, "rotated").policy.variance == "calibration"
    assert M.fathom_plan((48,), 48, "rotated", "store").name == "fathom-rotated-plan[store]"
    mixed = M.fathom_plan((48,), 48, M.PER_HEAD, gains="calibrated")  # each head on its basis' default σ²
    assert (mixed.name, mixed.policy.variance, mixed.on_basis("rotated").policy.variance) == \
        ("fathom-mixed-plan[gains]", M.PER_BASIS, "calibration")
    with pytest.raises(ValueError, match="^the per-head store reads each basis' default σ²: variance must be None"):
        M.fathom_plan((48,), 48, M.PER_HEAD, "store")
    with pytest.raises(ValueError, match="^variance"):
        M.fathom(48, "window")


def test_oracle_at_k_at_least_n_is_dense():
    k, v, q = head(2, n=300)
    index = HeadIndex.build(k, None)
    dense = decode_step(q, k, v, index, M.dense(), Selection(k=0))
    oracle = decode_step(q, k, v, index, M.oracle(), Selection(k=300))
    np.testing.assert_allclose(oracle.output, dense.output, rtol=1e-12)
    assert oracle.rows == dense.rows == 300


def test_method_settings_are_checked():
    with pytest.raises(ValueError, match="^variance "):
        M.fathom(48, "nope")
    with pytest.raises(ValueError, match="^budget "):
        M.fathom(-1)
    with pytest.raises(ValueError, match="^scorer "):
        M.Method("x", scorer="magic")
    with pytest.raises(ValueError, match="^policy "):
        M.Method("x", scorer="exact", policy=M.UniformDepth(2))
    k, v, q = head(3)
    with pytest.raises(ValueError, match="rotated store"):
        decode_step(q, k, v, HeadIndex.build(k, None), M.loki(2), Selection(k=8))


def test_the_catalog_parses_every_spec_to_the_factory_method_and_the_label_of_today():
    d = 128
    assert M.parse("fathom@48", d) == M.fathom(48)
    assert M.parse("fathom-rotated@64", d) == M.fathom_rotated(64)
    assert M.parse("sparq@68", d) == M.sparq(16)
    assert M.parse("double-sparsity@136", d) == M.double_sparsity(32)
    assert M.parse("loki@68", d) == M.loki(16)
    assert M.parse("fathom-mixed@48", d) == M.fathom_mixed(48)
    for name, factory in (("dense", M.dense), ("oracle", M.oracle), ("landmark", M.landmark)):
        assert M.parse(name, d) == factory()
    # the decoding benches' "thumbnail" and Method.name's "thumbnail-2bit" are one method
    assert M.parse("thumbnail", d) == M.parse("thumbnail-2bit", d) == M.thumbnail(2)
    assert [M.parse(s, d).label(d) for s in ("sparq@68", "thumbnail", "dense")] == \
        ["sparq@68", "thumbnail-2bit@288", "dense"]


def test_a_specs_tags_name_the_water_filling_variants_as_the_labels_do():
    d = 128
    for method in (M.fathom(48, pooled=True), M.fathom(64, "calibration", gains="calibrated"),
                   M.fathom_rotated(48, "store", "calibrated", True), M.fathom_mixed(48, "calibrated", True)):
        spec = f"{method.name}@{method.policy.budget:g}"
        assert M.parse(spec, d) == method  # a label's name reads back as the method it names
    assert M.read_spec("fathom-mixed[gains,pooled]@48") == M.Spec("fathom-mixed", 48.0, None, "calibrated", True)
    assert M.parse("fathom[store]@48", d) == M.fathom(48)  # the default σ² source spelled out
    assert M.split_specs("fathom@48,fathom-mixed[gains,pooled]@48,dense") == \
        ["fathom@48", "fathom-mixed[gains,pooled]@48", "dense"]


@pytest.mark.parametrize("spec, message", [("sparq", "sparq takes a budget: write sparq@BITS"),
                                           ("dense@8", "dense reads no budget"),
                                           ("sparq[pooled]@68", "pooled=True is taken by fathom, fathom-rotated, "
                                                                "fathom-mixed only"),
                                           ("fathom-plan[gains]@48", "gains='calibrated' is taken by"),
                                           ("fathom[deep]@48", r"tags must be distinct names from store, "),
                                           ("fathom[gains,gains]@48", "tags must be distinct"),
                                           ("fathom-mixed[store]@48", "a σ² tag"),
                                           ("fathom[store,calibration]@48", "a σ² tag"),
                                           ("sparq@67", "integer r in 1..128"),
                                           ("nope@1", "the name must be one of dense, oracle"),
                                           ("fathom@0", "budget must be a finite number"),
                                           ("fathom-plan@48", "planned on data")])
def test_the_catalog_refuses_a_spec_it_cannot_build_and_says_how_to_write_it(spec, message):
    with pytest.raises(ValueError, match=message):
        M.parse(spec, 128)


def test_what_each_method_reads_comes_from_its_catalog_entry():
    needs = {name: M.entry(name).calibration_needs() for name in M.NAMES}
    assert needs["loki"] == needs["fathom-rotated"] == {"sigma2", "basis"}
    assert needs["double-sparsity"] == {"sigma2", "ds_rank"}
    assert [n for n in M.NAMES if M.entry(n).needs_calibration()] == ["fathom-rotated", "fathom-mixed",
                                                                       "double-sparsity", "loki"]
    assert needs["fathom-mixed"] == {"sigma2", "basis"}  # and the per-head choice, which only a given one holds
    assert M.entry("fathom").needs_calibration("calibration")


def test_a_per_head_method_runs_on_each_heads_basis_and_only_once_resolved():
    mixed = M.fathom_mixed(48)
    assert mixed.scans_rotated and mixed.label(64) == "fathom-mixed@48"
    assert mixed.on_basis("raw").policy == M.fathom(48).policy and mixed.on_basis("raw").basis == "raw"
    assert mixed.on_basis("rotated").policy == M.fathom_rotated(48).policy
    assert M.fathom(48).on_basis("rotated") == M.fathom(48)  # any other method runs as it is
    k, v, q = head(3)
    with pytest.raises(ValueError, match="picks its basis per head"):
        decode_step(q, k, v, HeadIndex.build(k, None), mixed, Selection(k=8))
    with pytest.raises(ValueError, match="per-basis"):
        M.Method("x", basis=M.PER_HEAD, policy=M.Waterfill(48, "store"))
    with pytest.raises(ValueError, match="resolve it with Method.on_basis"):
        mixed.policy.depths(q, M.HeadStats(np.ones(q.shape[-1]), np.arange(q.shape[-1])))


@pytest.mark.parametrize("make, message", [(lambda: M.thumbnail(5), "depth must be an integer in 1..4"),
                                           (lambda: M.thumbnail(0), "depth must be an integer in 1..4"),
                                           (lambda: M.sparq(-1), "r must be an integer >= 1"),
                                           (lambda: M.double_sparsity(0), "r must be an integer >= 1"),
                                           (lambda: M.loki(2.5), "r must be an integer >= 1"),
                                           (lambda: M.fathom(float("inf")), "budget must be a finite number"),
                                           (lambda: M.fathom_plan((float("nan"), 20.0), 48.0),
                                            "budgets must be a finite number")])
def test_a_depth_policy_refuses_what_its_scan_cannot_read(make, message):
    """A depth past the 4 planes would read past a channel's record; a negative r picks d - 1 channels in the
    reference and none on the GPU; a budget that is not finite plans nothing."""
    with pytest.raises(ValueError, match=message):
        make()


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 4), st.floats(0, 80), st.sampled_from(["design", "calibrated"]))
def test_a_pooled_plan_fits_the_mean_budget_and_equals_the_groups_plan_on_alike_heads(seed, heads, budget, gains):
    """One water line for a layer's heads: their mean cost fits the budget at every position, and heads with the
    same queries and statistics read what each would alone (their summed cost fits ``heads`` budgets exactly when
    one's fits one)."""
    rng = np.random.default_rng(seed)
    d, G, P = 8, 3, 4
    drops = np.sort(rng.uniform(0, 1, (d, 4)), axis=-1)[:, ::-1]
    stats = [HeadStats(sigma2=rng.uniform(0.1, 2, d), ds_rank=np.arange(d), plane_drops=drops,
                       scale2=rng.uniform(0.5, 2, d)) for _ in range(heads)]
    q = [rng.standard_normal((P, G, d)) * rng.uniform(0, 3) for _ in range(heads)]
    policy = M.Waterfill(budget, "calibration", gains, pooled=True)
    depths = M.pooled_depths([policy] * heads, q, stats)
    assert depths.shape == (heads, P, d) and depths.dtype == np.int8
    assert (scan_bits(depths).mean(axis=0) <= budget + 1e-9).all()
    alike = M.pooled_depths([policy] * heads, [q[0]] * heads, [stats[0]] * heads)
    alone = M.Waterfill(budget, "calibration", gains).depths(q[0], stats[0])
    for h in range(heads):
        np.testing.assert_array_equal(alike[h], alone)


def test_a_pooled_plan_is_named_refused_per_head_and_needs_one_policy_a_layer():
    assert M.fathom(48, pooled=True).label(64) == "fathom[pooled]@48"
    assert M.fathom_rotated(48, "store", "calibrated", pooled=True).name == "fathom-rotated[store,gains,pooled]"
    mixed = M.fathom_mixed(48, "calibrated", pooled=True)
    assert mixed.name == "fathom-mixed[gains,pooled]" and mixed.pooled and mixed.on_basis("rotated").pooled
    assert not M.fathom(48).pooled and not M.sparq(16).pooled and not M.oracle().pooled
    stats, q = HeadStats(sigma2=np.ones(8), ds_rank=np.arange(8)), np.ones((3, 8))
    policy = M.Waterfill(48, "calibration", pooled=True)
    with pytest.raises(ValueError, match="use pooled_depths"):
        policy.depths(q, stats)
    with pytest.raises(ValueError, match="one entry per KV head"):
        M.pooled_depths([policy, policy], [q], [stats])
    with pytest.raises(ValueError, match="one entry per KV head"):
        M.pooled_depths([], [], [])
    for other in (M.Waterfill(32, "calibration", pooled=True), M.Waterfill(48, "calibration"),
                  M.Waterfill(48, "calibration", "calibrated", pooled=True)):
        with pytest.raises(ValueError, match="share one pooled policy's budget and gains"):
            M.pooled_depths([policy, other], [q, q], [stats, stats])
