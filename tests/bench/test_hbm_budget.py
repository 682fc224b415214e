"""bench.hbm_budget: link bits a token at an HBM budget, by plane tiers (mixed across layers: the lower hull) for
reads the query chooses and by the read set itself for reads fixed offline; where fathom's lead falls; the committed
tier splits summarized; bad arguments exit 2 with one line."""

import json

import pytest

from bench import hbm_budget as hb
from bench.report import RESULTS


def test_plane_tiers_hold_the_scales_and_t_planes_of_every_channel():
    points = hb.plane_tier_points(48.0, [1.0, 0.3, 0.1, 0.03, 0.0], 128)
    assert points == [(0.0, 48.0), (160.0, 48.0 * 0.3), (288.0, 48.0 * 0.1), (416.0, 48.0 * 0.03), (544.0, 0.0)]
    with pytest.raises(ValueError, match="t = 0..4"):
        hb.plane_tier_points(48.0, [1.0, 0.3], 128)


def test_a_budget_between_two_tiers_mixes_them_and_a_point_above_the_hull_is_never_chosen():
    points = [(0.0, 48.0), (160.0, 16.0), (288.0, 4.0), (200.0, 40.0)]  # (200, 40) lies above the chord
    assert hb.link_bits_at(points, 80.0) == pytest.approx(32.0)  # half the layers at t = 1
    assert hb.link_bits_at(points, 224.0) == pytest.approx(10.0)
    assert hb.link_bits_at(points, 1000.0) == pytest.approx(4.0)  # past the last point: its link bits
    with pytest.raises(ValueError, match="budget must be >= 0"):
        hb.link_bits_at(points, -1.0)


def test_a_fixed_read_set_held_in_hbm_reads_nothing_over_the_link():
    ds = hb.read_set_points(136.0)
    assert [hb.link_bits_at(ds, b) for b in (0, 68, 136, 200)] == [136.0, 68.0, 0.0, 0.0]
    fathom = hb.plane_tier_points(48.0, [1.0, 0.3, 0.1, 0.03, 0.0], 128)
    assert hb.budget_where(1, fathom, ds) == 111.5  # 48 - 33.6 b / 160 = 136 - b at b = 111.4, to 0.25 bits
    assert hb.budget_where(2, fathom, ds) == 69.0  # 2 (48 - 0.21 b) = 136 - b at b = 68.97
    assert hb.budget_where(1, fathom, hb.read_set_points(40.0)) == 0.0  # it reads less from the start


def test_the_method_decides_the_policy_double_sparsity_and_the_thumbnail_fixed_fathom_and_sparq_by_query():
    split = {"model": "qwen2.5-coder-1.5b", "corpus": "x", "context": 4096, "methods": {
        "fathom@48": {"bits": 48.0, "link": [1.0, 0.3, 0.1, 0.03, 0.0]},
        "sparq@68": {"bits": 68.0, "link": [1.0, 3 / 4.25, 2 / 4.25, 1 / 4.25, 0.0]},
        "double-sparsity@136": {"bits": 136.0, "link": [1.0, 3 / 4.25, 2 / 4.25, 1 / 4.25, 0.0]},
        "thumbnail-2bit@288": {"bits": 288.0, "link": [1.0, 0.5, 0.0, 0.0, 0.0]}}}
    summary = hb.summarize(split, 128, (0, 136, 288))
    fixed = {label: c["fixed_read_set"] for label, c in summary["curves"].items()}
    assert fixed == {"fathom@48": False, "sparq@68": False, "double-sparsity@136": True, "thumbnail-2bit@288": True}
    assert summary["curves"]["double-sparsity@136"]["link_at"] == [136.0, 0.0, 0.0]
    assert summary["curves"]["sparq@68"]["link_at"][1] == pytest.approx(68 - 136 / 160 * 20)  # between t = 0 and 1
    assert set(summary["crossings"]) == {"double-sparsity@136", "thumbnail-2bit@288"}
    lines = hb.table(summary)
    assert lines[2] == "| method | reads | 0 | 136 | 288 |" and lines[6] == \
        "| double-sparsity@136 | fixed set | 136.0 | 0.0 | 0.0 |"
    assert hb.tokens_at(100.0, 100.0) == pytest.approx(100e9 * 8 / (100 * 36 * 8))


def test_the_committed_tier_splits_summarized(tmp_path, capsys):
    hb.main(["--out", str(tmp_path)])
    payload = json.loads((tmp_path / "hbm-budget.json").read_text())
    assert payload["command"] == f"python -m bench.hbm_budget --out {tmp_path}"
    assert len(payload["summaries"]) == len(list(RESULTS.glob("tier-split-*.json")))
    qwen = next(s for s in payload["summaries"] if s["model"] == "qwen2.5-coder-1.5b")
    at = qwen["crossings"]["double-sparsity@136"]
    assert 0 < at["lead_below_2x"] < at["lead_below_1x"] < 136  # fathom@48 reads less only below DS's own bits
    assert (tmp_path / "hbm-budget.png").stat().st_size > 0
    assert "Qwen3-8B's shape" in (tmp_path / "hbm-budget.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0,-1"], "--budgets must each be >= 0"),
    (["--hbm-gb", "0"], "--hbm-gb must be > 0"),
    (["--name", "a/b"], "--name must be a file name stem"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_:
        hb.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    (json.dumps({"model": "nope", "corpus": "x", "context": 1, "methods": {}}), "model 'nope' is not one of"),
    (json.dumps({"model": "smollm2-135m", "corpus": "x", "context": 1, "methods": {"fathom@48": {"bits": 1}}}),
     "lacks bits or its link shares"),
    (json.dumps({"model": "smollm2-135m", "corpus": "x", "context": 1,
                 "methods": {"nope@48": {"bits": 1, "link": [1, 0, 0, 0, 0]}}}), "method nope@48"),
])
def test_a_bad_tier_split_is_refused_naming_it(capsys, tmp_path, content, message):
    bad = tmp_path / "split.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        hb.main([str(bad), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
