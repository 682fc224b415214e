import json

import pytest

from bench.__main__ import main


def test_fidelity_quick_writes_json_table_and_plot(tmp_path, capsys):
    main(["fidelity", "--synthetic", "--quick", "--out", str(tmp_path)])
    written = ", ".join(str(tmp_path / f"fidelity-synthetic-quick.{ext}") for ext in ("json", "md", "png"))
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {written}"  # where it wrote, last
    payload = json.loads((tmp_path / "fidelity-synthetic-quick.json").read_text())
    assert payload["synthetic"] and payload["command"].startswith("python -m bench fidelity")
    records = {r["label"]: r for r in payload["records"]}
    for label in ("fathom@48", "fathom@68", "fathom@136", "sparq@68", "sparq@136", "double-sparsity@136",
                  "loki@136", "thumbnail-2bit@288", "landmark@256", "oracle@2048", "dense", "fathom-rotated@48",
                  "fathom[calibration]@48"):
        assert label in records, label
    for r in payload["records"]:
        assert {"model", "context", "method", "bits", "scan_bytes", "row_bytes", "rel_error",
                "rel_error_per_layer"} <= r.keys()
        assert r["bits_read"] <= r["bits"] + 1e-9 and len(r["rel_error_per_layer"]) == 4
    assert records["dense"]["rel_error"] == 0
    assert payload["device"] == "cpu" and all(payload[k] >= 0 for k in ("basis_rule_s", "per_layer_plan_s",
                                                                          "evaluation_s"))
    for r in payload["records"]:  # per (layer, KV head) error and oracle top-k hit, averaging to the totals
        assert len(r["rel_error_per_head"]) == 4 and len(r["oracle_overlap_per_head"][0]) == 2
        assert r["rel_error"] == pytest.approx(sum(map(sum, r["rel_error_per_head"])) / 8)
        assert 0 <= r["oracle_overlap"] <= 1
    assert records["oracle@2048"]["oracle_overlap"] == 1
    summary = payload["summary"]
    assert summary["heads"] == 8 and 0 <= summary["heads_fathom48_worse_than_sparq68"] <= 8
    assert summary["fathom48_overlap"] == records["fathom@48"]["oracle_overlap"]
    assert "fathom-rotated[store]@48" not in records and "fathom[calibration]@48" in records  # raw store chosen
    plans = payload["per_layer_plans"]
    assert len(plans) == 2 and all(len(b) == 4 for b in plans.values())
    assert all(f"{label}" in records for label in plans)
    assert records["oracle@2048"]["rel_error"] <= min(r["rel_error"] for r in payload["records"] if r["label"] != "dense")
    assert "synthetic" in (tmp_path / "fidelity-synthetic-quick.md").read_text()
    assert (tmp_path / "fidelity-synthetic-quick.png").read_bytes()[:4] == b"\x89PNG"


def test_equal_error_bits_interpolates_in_log_log_and_says_when_it_cannot():
    from bench.fidelity import equal_error_bits
    from fathom.fidelity import MethodResult

    def point(bits, err):
        return MethodResult("f", "fathom", bits, bits, 0, 0, 0, err, [err], None, None)

    curve = [point(32, 0.4), point(64, 0.1), point(128, 0.05)]
    bits, how = equal_error_bits(curve, 0.2)
    assert how == "interpolated" and bits == pytest.approx(32 * 2 ** 0.5)  # halfway in log error
    assert equal_error_bits(curve, 0.5) == (32, "at most")
    assert equal_error_bits(curve, 0.01) == (None, "not reached")


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
            "prefill_calibration_s": 30, "basis_rule_s": 20, "per_layer_plan_s": 20, "evaluation_s": 80}
    (tmp_path / "fidelity-m-16k-t.json").write_text(json.dumps(real))
    (tmp_path / "fidelity-synthetic.json").write_text(json.dumps({**real, "synthetic": True}))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert ("| m 16k (t) | 64 | raw, store | 0.2500 | 0.1000 | 0.3000 | 0.0900 | 0.0500 | not reached | "
            "2.50× (double-sparsity@136) | 0.800 / 0.700 / 0.750 | 31.0 / 64 | cuda | 1.0 | 2.0 |") in table
    assert table.count("| m 16k") == 1


def test_fidelity_refuses_a_device_it_cannot_use(capsys, monkeypatch):
    from bench.fidelity import evaluator
    from fathom.fidelity import evaluate

    assert evaluator("cpu") is evaluate
    for argv, message in ((["--device", "tpu"], "error: --device must be one of cpu, cuda, got 'tpu'"),
                          (["--device", "cuda"], "error: python -m bench fidelity --device cuda needs a CUDA GPU")):
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(SystemExit) as exit_info:
            main(["fidelity", "--synthetic", "--quick", *argv])
        assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(message)