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
    summary = {"basis": "raw", "ds_error": 0.2, "fathom48_error": 0.1, "sparq68_error": 0.3, "oracle_error": 0.05,
               "equal_error_saving": 2.5, "equal_error_how": "interpolated", "ds_label": "double-sparsity@136",
               "equal_error_saving_quarter": None, "equal_error_how_quarter": "not reached",
               "ds_quarter_label": "double-sparsity@136", "channels_touched_48": 31.0}
    real = {"synthetic": False, "model": "m", "evaluation_text": "t", "capture": {"tokens": 16384, "head_dim": 128},
            "summary": summary, "wall_s": 120.0}
    (tmp_path / "fidelity-m-16k-t.json").write_text(json.dumps(real))
    (tmp_path / "fidelity-synthetic.json").write_text(json.dumps({**real, "synthetic": True}))
    main(["headline", "--results", str(tmp_path)])
    table = (tmp_path / "headline.md").read_text()
    assert "| m 16k (t) | 128 | raw | 0.2000 | 0.1000 | 0.3000 | 0.0500 | 2.50× (double-sparsity@136) | not reached" in table
    assert table.count("| m 16k") == 1
