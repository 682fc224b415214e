"""``python -m bench headline``: one table of the real-model fidelity summaries."""

import json

from bench.__main__ import main
from tests.cli import refused


def test_headline_tables_the_real_settings_only(tmp_path):
    summary = {"basis": "raw", "variance": "store", "ds_error": 0.2, "fathom48_error": 0.1, "sparq68_error": 0.3,
               "oracle_error": 0.05, "equal_error_saving": 2.5, "equal_error_how": "interpolated",
               "ds_label": "double-sparsity@136", "equal_error_saving_quarter": None,
               "equal_error_how_quarter": "not reached", "ds_quarter_label": "double-sparsity@68",
               "ds_quarter_error": 0.25, "channels_touched_48": 31.0, "fathom48_overlap": 0.8,
               "ds_quarter_overlap": 0.7, "sparq68_overlap": 0.75}
    real = {"synthetic": False, "model": "m", "evaluation_text": "t", "capture": {"tokens": 16384, "head_dim": 64},
            "summary": summary, "wall_s": 120.0, "device": "cuda", "prefill_evaluation_s": 30,
            "records": [{"label": "fathom-plan@48", "rel_error": 0.09}],
            "per_layer_plans": {"fathom-plan@48": [48.0], "fathom-plan@64": [64.0]},
            "prefill_calibration_s": 30, "basis_rule_s": 20, "per_layer_plan_s": 20, "evaluation_s": 80}
    (tmp_path / "fidelity-m-16k-t.json").write_text(json.dumps(real))
    (tmp_path / "fidelity-synthetic.json").write_text(json.dumps({**real, "synthetic": True}))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert ("| m 16k (t) | 64 | raw, store | fathom | 0.2500 | 0.1000 | 0.3000 | 0.0900 | 0.0500 | not reached | "
            "2.50× (double-sparsity@136) | 0.800 / 0.700 / 0.750 | 31.0 / 64 | cuda | 1.0 | 2.0 |") in table
    assert table.count("| m 16k") == 1
    assert "| m 16k (t) | 0.2500 (double-sparsity@68)" not in table  # no curves reported: no second-table row
    family = {"fathom48_error": 0.11, "equal_error_saving_quarter": 2.0, "equal_error_how_quarter": "at most"}
    with_curves = {**real, "capture": {"tokens": 32768, "head_dim": 64},
                   "summary": {**summary, "heads_rotated": 3, "heads": 8, "families": {"fathom-mixed": family}}}
    (tmp_path / "fidelity-m-32k-t.json").write_text(json.dumps(with_curves))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert "| m 32k (t) | 64 | per head: 3 of 8 rotated |" in table
    assert "| m 32k (t) | 0.2500 (double-sparsity@68) | 0.3000 | — | — | — | — | 0.1100 / ≥ 2.00× | — |" in table
    # a run at other than the default decode positions says its P in both tables (P = 128 below 64k: unsaid)
    at_512 = {**with_curves, "capture": {**with_curves["capture"], "positions": 512}}
    (tmp_path / "fidelity-m-32k-t-P512.json").write_text(json.dumps(at_512))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert table.count("| m 32k (t, P = 512) | 64 | per head: 3 of 8 rotated |") == 1
    assert table.count("| m 32k (t, P = 512) | 0.2500 (double-sparsity@68) |") == 1
    assert table.count("| m 32k (t) |") == 2
    # a run through calibrated levels is a row of its own; a pooled curve gets a column once a run reports one
    assert "fathom-mixed[pooled]" not in table
    through_levels = {**with_curves, "levels": "calibrated",
                      "summary": {**with_curves["summary"], "families": {"fathom-mixed[pooled]": family}}}
    (tmp_path / "fidelity-m-32k-t-levels.json").write_text(json.dumps(through_levels))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert table.count("| m 32k (t, levels) | 64 | per head: 3 of 8 rotated |") == 1
    assert "| m 32k (t, levels) | 0.2500 (double-sparsity@68) | 0.3000 | — | — | — | — | — | — | 0.1100 / ≥ 2.00× |" \
        in table
    assert "| m 32k (t) | 0.2500 (double-sparsity@68) | 0.3000 | — | — | — | — | 0.1100 / ≥ 2.00× | — | — |" in table
    # the plan rule's pick gets a column (after sparq-68's) once a run records one
    assert "the plan rule's pick |" not in table
    picked = {**with_curves, "evaluation_text": "u", "summary": {**with_curves["summary"], "plan_rule": "fathom-mixed",
                                         "plan_rule_errors": {"fathom-mixed": 0.2, "fathom-mixed[gains]": 0.3}}}
    (tmp_path / "fidelity-m-32k-u.json").write_text(json.dumps(picked))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert "| m 32k (u) | 0.2500 (double-sparsity@68) | 0.3000 | fathom-mixed: 0.1100 / ≥ 2.00× | — |" in table
    assert "| m 32k (t) | 0.2500 (double-sparsity@68) | 0.3000 | — | — |" in table


# --- bad input ------------------------------------------------------------------------------------------------


def test_headline_refuses_a_results_folder_that_is_not_one(tmp_path, capsys):
    assert refused(["headline", "--results", str(tmp_path / "nowhere")], capsys) == \
        f"error: --results {tmp_path / 'nowhere'}: not a folder of fidelity-*.json"


def test_headline_refuses_a_result_it_cannot_read_naming_it(tmp_path, capsys):
    (tmp_path / "fidelity-x-4k-prose.json").write_text(json.dumps({"summary": {}, "capture": {"head_dim": 64}}))
    assert refused(["headline", "--results", str(tmp_path)], capsys).startswith(
        f"error: --results: {tmp_path / 'fidelity-x-4k-prose.json'} is not a fidelity result the headline reads")
    (tmp_path / "fidelity-x-4k-prose.json").write_text("{not json")
    assert "is not a fidelity result the headline reads (JSONDecodeError" in refused(
        ["headline", "--results", str(tmp_path)], capsys)
