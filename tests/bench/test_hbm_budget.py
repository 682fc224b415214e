"""bench.hbm_budget: link bits a token at an HBM budget, by plane tiers (mixed across layers: the lower hull) for
reads the query chooses and by the read set itself for reads fixed offline; where fathom's lead falls; the committed
tier splits summarized; bad arguments exit 2 with one line."""

import json

import numpy as np
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
    assert list(summary["crossings"]) == ["fathom@48"]  # no read shares given: no read-tier curve
    assert set(summary["crossings"]["fathom@48"]) == {"double-sparsity@136", "thumbnail-2bit@288"}
    lines = hb.table(summary)
    assert lines[2] == "| method | tiered | 0 | 136 | 288 |" and lines[6] == \
        "| double-sparsity@136 | its read set whole | 136.0 | 0.0 | 0.0 |"
    assert hb.tokens_at(100.0, 100.0) == pytest.approx(100e9 * 8 / (100 * 36 * 8))


def test_the_committed_tier_splits_summarized(tmp_path, capsys):
    hb.main(["--out", str(tmp_path)])
    payload = json.loads((tmp_path / "hbm-budget.json").read_text())
    assert payload["command"] == f"python -m bench.hbm_budget --out {tmp_path}"
    assert len(payload["summaries"]) == len(list(RESULTS.glob("tier-split-*.json")))
    qwen = next(s for s in payload["summaries"] if s["model"] == "qwen2.5-coder-1.5b")
    at = qwen["crossings"]["fathom@48"]["double-sparsity@136"]
    assert 0 < at["lead_below_2x"] < at["lead_below_1x"] < 136  # fathom@48 reads less only below DS's own bits
    assert (tmp_path / "hbm-budget.png").stat().st_size > 0
    assert "Qwen3-8B's shape" in (tmp_path / "hbm-budget.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "0,-1"], "--budgets must each be >= 0"),
    (["--hbm-gb", "0"], "--hbm-gb must be a finite number > 0"),
    (["--hbm-gb", "inf"], "--hbm-gb must be a finite number > 0"),
    (["--hbm-gb", "nan"], "--hbm-gb must be a finite number > 0"),
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


def test_planes_held_by_their_read_share_on_another_text():
    """Items (layer, head, channel, plane) held most read first on the learning text; the link carries what the
    evaluated text reads of the rest; a plane 0 costs its channel's scale too."""
    learned = np.zeros((1, 2, 2, 4))
    learned[0, 0, 0, :2] = [1.0, 0.5]  # head 0 reads channel 0's planes 0 and 1 (half the time)
    learned[0, 1, 1, 0] = 0.8
    evaluated = learned * 0.5  # the other text reads the same, half as often
    points = hb.read_tier_points(learned, evaluated, step=0.01)
    total = (0.5 * 1.25 + 0.25 + 0.4 * 1.25) / 2  # link bits a token with nothing held, over 2 stores
    assert points[0] == (0.0, pytest.approx(total))
    assert hb.link_bits_at(points, 1.25 / 2) == pytest.approx(total - 0.5 * 1.25 / 2)  # channel 0's plane 0 first
    assert hb.link_bits_at(points, 2.5 / 2) == pytest.approx(total - (0.5 + 0.4) * 1.25 / 2)  # then the 0.8 one
    assert hb.link_bits_at(points, 3.5 / 2) == pytest.approx(0.0)
    ds = np.zeros((1, 1, 8, 4))
    ds[0, 0, :2] = 1.0  # a fixed read set of 2 channels: held first and whole
    assert hb.link_bits_at(hb.read_tier_points(ds, ds), 2 * 4.25) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="of one shape"):
        hb.read_tier_points(learned, evaluated[..., :2])


def test_a_split_with_read_shares_gets_the_read_tier_curve_learned_on_the_other_corpus(tmp_path):
    labels, shape = ["fathom@48", "double-sparsity@136"], (2, 1, 2, 128, 4)
    rng = np.random.default_rng(0)
    for corpus in ("prose", "code"):
        shares = rng.uniform(0, 0.2, shape).astype(np.float32)
        shares[1] = 0.0
        shares[1, :, :, :32] = 1.0
        split = {"model": "qwen2.5-coder-1.5b", "corpus": corpus, "context": 4096, "methods": {
            labels[0]: {"bits": 48.0, "link": [1.0, 0.3, 0.1, 0.03, 0.0]},
            labels[1]: {"bits": 136.0, "link": [1.0, 3 / 4.25, 2 / 4.25, 1 / 4.25, 0.0]}}}
        (tmp_path / f"tier-split-{corpus}.json").write_text(json.dumps(split))
        np.savez_compressed(tmp_path / f"tier-split-{corpus}.reads.npz", labels=np.array(labels), shares=shares)
    hb.main([str(tmp_path / "tier-split-prose.json"), str(tmp_path / "tier-split-code.json"),
             "--out", str(tmp_path / "out")])
    summaries = json.loads((tmp_path / "out" / "hbm-budget.json").read_text())["summaries"]
    prose = summaries[0]
    assert prose["curves"]["fathom@48 by reads"]["learned_on"] == "code"
    assert "double-sparsity@136 by reads" not in prose["curves"]  # a fixed read set is held whole already
    assert set(prose["crossings"]) == {"fathom@48", "fathom@48 by reads"}
    assert "points" not in prose["curves"]["fathom@48"]  # remade from the splits, not stored
    (tmp_path / "tier-split-code.reads.npz").write_bytes(b"not npz")
    with pytest.raises(SystemExit) as exit_:
        hb.main([str(tmp_path / "tier-split-prose.json"), str(tmp_path / "tier-split-code.json"),
                 "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
