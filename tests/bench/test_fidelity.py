"""``python -m bench fidelity``: the quick run's files, the equal-error interpolation, and bad arguments refused
before any model, corpus or capture is loaded (``nothing_loads``, tests/bench/conftest.py)."""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import capture as bench_capture
from bench import decoding
from bench import fidelity
from bench.__main__ import main
from bench.report import LOCAL_RESULTS, RESULTS, context_label
from fathom.selection import Selection
from tests.cli import refused

REPO = Path(__file__).resolve().parents[2]


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
    assert summary["fathom48_overlap"] == records[f"{summary['fathom_family']}@48"]["oracle_overlap"]
    assert "fathom-rotated[store]@48" not in records and "fathom[calibration]@48" in records  # raw store chosen
    plans = payload["per_layer_plans"]  # the model's store at 48 and 64 bits; the per-head store's curve
    mixed_plan = fidelity.PLAN_FAMILIES["[gains" in summary["plan_rule"]]  # with the plan rule's pick's gains
    assert list(plans) == [f"fathom-plan@{b}" for b in fidelity.PLAN_MEANS] + \
        [f"{mixed_plan}@{b:g}" for b in fidelity.plan_curve_budgets(128)]
    assert all(len(b) == 4 and sum(b) / 4 <= float(label.split("@")[1]) for label, b in plans.items())
    assert all(f"{label}" in records for label in plans)
    sparse = [r["rel_error"] for r in payload["records"] if r["label"] != "dense"]
    assert records["oracle@2048"]["rel_error"] <= min(sparse)
    assert "synthetic" in (tmp_path / "fidelity-synthetic-quick.md").read_text()
    assert (tmp_path / "fidelity-synthetic-quick.png").read_bytes()[:4] == b"\x89PNG"
    # every store × gain model × plan is reported; the headline is the plan rule's pick of the per-head store
    assert set(summary["families"]) == {f"{store}{tags}" for store in ("fathom", "fathom-rotated", "fathom-mixed")
                                        for tags in ("", "[gains]", "[pooled]", "[gains,pooled]")} | {mixed_plan}
    assert payload["levels"] == "midpoint" and records["fathom[pooled]@48"]["bits_read"] <= 48
    plans = summary["plan_rule_errors"]  # decided on calibration text like the basis rule, recorded, the headline
    assert set(plans) == {"fathom-mixed", "fathom-mixed[gains]", "fathom-mixed[pooled]",
                          "fathom-mixed[gains,pooled]"} and summary["plan_rule"] == min(plans, key=plans.get)
    assert summary["plan_rule"] in summary["families"] and "gains_rule" not in summary
    assert summary["fathom_family"] == summary["plan_rule"] and 0 <= summary["heads_rotated"] <= 8
    assert summary["fathom48_error"] == records[f"{summary['plan_rule']}@48"]["rel_error"]
    assert payload["plan_rule_s"] >= 0
    # --replot remakes the same summary and files from the records alone
    path = tmp_path / "fidelity-synthetic-quick.json"
    (tmp_path / "fidelity-synthetic-quick.md").unlink()
    main(["fidelity", "--replot", str(path)])
    again = json.loads(path.read_text())
    assert again["summary"] == summary and again["records"] == payload["records"]
    assert again["command"] == payload["command"] and again["replotted_by"].startswith("python -m bench fidelity")
    assert "fathom-mixed" in (tmp_path / "fidelity-synthetic-quick.md").read_text()
    # a run made before the plan rule (none recorded) keeps fathom-mixed, design §5's plan, as its headline
    path.write_text(json.dumps({**payload, "summary": {**summary, "plan_rule_errors": None}}))
    main(["fidelity", "--replot", str(path)])
    old = json.loads(path.read_text())["summary"]
    assert old["plan_rule"] is None and old["fathom_family"] == "fathom-mixed"
    assert old["fathom48_error"] == records["fathom-mixed@48"]["rel_error"]


def test_fidelity_levels_reads_every_plane_through_the_calibrated_levels(tmp_path, capsys, monkeypatch):
    """--levels: the run's name, JSON and table say so, and every plane method's error is the evaluation's through
    the calibration's tables (checked on one method against the evaluation itself). On a smaller synthetic shape
    than --quick's (the quick run itself is checked above): the same stages, methods and files, a quarter of the
    tokens and half the decode positions. With --predict (in the same run): the plan rule's pick and the
    comparators through the prediction, summarised beside the headline, which stays the pick's own."""
    from fathom.calibration import calibrate
    from fathom.fidelity import evaluate
    from fathom.selection import Selection
    from fathom.synthetic import SyntheticConfig, generate
    from fathom import methods as M

    small = dataclasses.replace(fidelity.SYNTHETIC_QUICK, tokens=1024, positions=8)
    monkeypatch.setattr(fidelity, "SYNTHETIC_QUICK", small)
    main(["fidelity", "--synthetic", "--quick", "--levels", "--predict", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "fidelity-synthetic-quick-levels.json").read_text())
    assert payload["levels"] == "calibrated" and "--levels" in payload["command"]
    assert payload["capture"]["tokens"] == 1024  # the small shape ran
    assert "calibrated levels" in (tmp_path / "fidelity-synthetic-quick-levels.md").read_text()
    calibration_text = SyntheticConfig(**{**small.__dict__, "text_seed": small.text_seed + 1})
    (want,) = evaluate(generate(small), calibrate(generate(calibration_text)), [M.sparq(16)],
                       Selection(**payload["selection"]), levels=True)
    got = next(r for r in payload["records"] if r["label"] == "sparq@68")
    assert got["rel_error"] == pytest.approx(want.rel_error, rel=1e-12)
    summary, records = payload["summary"], {r["label"]: r for r in payload["records"]}
    predicted = summary["predicted"]
    assert predicted["family"] == M.predicting_name(summary["plan_rule"]) and summary["fathom_family"] == \
        summary["plan_rule"]  # beside the headline, not it
    curve = [r for r in payload["records"] if r["method"] == predicted["family"]]
    assert [r["bits"] for r in curve] == [r["bits"] for r in payload["records"] if r["method"] == summary["plan_rule"]]
    for label in ("sparq[lmmse]@68", "double-sparsity[lmmse]@136"):
        assert label in records
    assert predicted["fathom48_error"] == records[f"{predicted['family']}@48"]["rel_error"]
    assert predicted["ds_lmmse_error"] == records["double-sparsity[lmmse]@136"]["rel_error"]
    (want,) = evaluate(generate(small), calibrate(generate(calibration_text)), [M.predicting(M.sparq(16))],
                       Selection(**payload["selection"]), levels=True)
    assert records["sparq[lmmse]@68"]["rel_error"] == pytest.approx(want.rel_error, rel=1e-12)
    assert "Scored through the prediction" in (tmp_path / "fidelity-synthetic-quick-levels.md").read_text()


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


def test_fidelity_refuses_a_device_it_cannot_use(capsys, monkeypatch):
    from bench.fidelity import evaluator
    from fathom.fidelity import evaluate

    for levels in (False, True):  # the NumPy evaluation on the CPU, through the levels or not
        assert evaluator("cpu", levels).func is evaluate and evaluator("cpu", levels).keywords == {"levels": levels}
    for argv, message in ((["--device", "tpu"], "error: --device must be one of cpu, cuda, got 'tpu'"),
                          (["--device", "cuda"], "error: python -m bench fidelity --device cuda needs a CUDA GPU")):
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(SystemExit) as exit_info:
            main(["fidelity", "--synthetic", "--quick", *argv])
        assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(message)


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    # false headlines
    (["-k", "0"], "-k must be >= 1, got 0"),
    (["-k", "100000"], "-k must lie in 1..4027 for a 4096-token context at 32 decode positions"),
    (["--context", "100"], "--context 100 is too short for k = 128 at 32 decode positions: it must be >= 223"),
    # unbounded runs
    (["--context", "-5"], "--context must lie in 1..8192 tokens (smollm2-135m's context), got -5"),
    (["--positions", "-3"], "--positions must lie in 1..4095 (below --context), got -3"),
    (["--context", "0"], "--context must lie in 1..8192 tokens"),
    (["--context", "10"], "--context 10 is too short for k = 128"),
    (["--context", "16384"], "--context must lie in 1..8192 tokens (smollm2-135m's context), got 16384"),
    (["--positions", "4096"], "--positions must lie in 1..4095"),
    (["--context", "4096", "--positions", "4000"], "it must be >= 4191"),
    # names
    (["--model", "llama-3"], "--model must be one of smollm2-135m, gemma3-270m"),
    (["--corpus", "austen"], "--corpus and --calibration-corpus must differ"),
    (["--corpus", "wikitext"], "--corpus must be one of austen, kjv, paul-graham"),
    (["--calibration-corpus", "pg19"], "--calibration-corpus must be one of"),
    (["--corpus", "kjv", "--text", "README.md"], "give --text or --corpus, not both"),
    (["--name", "../elsewhere"], "--name must be a file name stem"),
    (["--calibrate-on", "corpus"], "--calibrate-on must be one of text, prompt, got 'corpus'"),
    (["--calibrate-on", "prompt", "--calibration-corpus", "kjv"],
     "give --calibration-corpus or --calibrate-on prompt, not both"),
    (["--calibrate-on", "prompt", "--positions", "2049"], "--positions must lie in 1..2048 with --calibrate-on prompt"),
])
def test_fidelity_refuses_bad_arguments_before_loading_anything(nothing_loads, capsys, argv, message):
    err = refused(["fidelity", "--quick", "--out", str(nothing_loads / "out"), *argv], capsys)
    assert message in err
    assert not (nothing_loads / "cache").exists()


def test_synthetic_refuses_what_it_would_ignore_and_a_k_beyond_its_tokens(nothing_loads, capsys):
    out = ["--out", str(nothing_loads / "out")]
    assert "--context does not apply to --synthetic" in refused(["fidelity", "--synthetic", "--context", "4096", *out],
                                                                  capsys)
    assert "--model does not apply" in refused(["fidelity", "--synthetic", "--model", "gemma3-270m", *out], capsys)
    assert "-k must lie in 1..4027" in refused(["fidelity", "--synthetic", "--quick", "-k", "4096", *out], capsys)
    assert "--calibrate-on prompt does not apply to --synthetic" in refused(
        ["fidelity", "--synthetic", "--calibrate-on", "prompt", *out], capsys)


def test_an_unwritable_out_is_refused_first(nothing_loads, capsys):
    blocker = nothing_loads / "a-file"
    blocker.write_text("not a folder")
    err = refused(["fidelity", "--quick", "-k", "0", "--out", str(blocker / "results")], capsys)
    assert err.startswith(f"error: --out {blocker / 'results'}: cannot write there")  # before -k's own error


@pytest.mark.parametrize("contents, message", [
    (b"\x7fELF\x02\x01\x01\x00\xff\xfe binary", "not UTF-8 text (invalid start byte at byte 8)"),
    (None, "cannot read it (No such file or directory)"),
    ("folder", "cannot read it (Is a directory)"),
])
def test_text_must_be_a_readable_utf8_file_and_the_error_names_it(nothing_loads, capsys, contents, message):
    text = nothing_loads / "eval.txt"
    if contents == "folder":
        text.mkdir()
    elif contents is not None:
        text.write_bytes(contents)
    err = refused(["fidelity", "--quick", "--text", str(text), "--out", str(nothing_loads)], capsys)
    assert err == f"error: --text {text}: {message}"


def test_a_text_shorter_than_the_context_is_refused_before_loading(nothing_loads, capsys):
    text = nothing_loads / "short.txt"
    text.write_text("only a few words\n", encoding="utf-8")
    err = refused(["fidelity", "--quick", "--text", str(text), "--out", str(nothing_loads)], capsys)
    assert err == f"error: --text {text} is too short for --context 4096 tokens"


def test_contexts_below_1024_or_not_whole_k_are_named_by_tokens(monkeypatch, tmp_path):
    assert [context_label(n) for n in (4096, 16384, 1000, 1500, 100)] == ["4k", "16k", "1000", "1500", "100"]
    tiny = SimpleNamespace(meta={})

    monkeypatch.setattr(bench_capture, "load_capture", lambda *a, **k: (tiny, 1.0))
    args = SimpleNamespace(model=None, context=1000, text=None, corpus=None, calibration_corpus="austen",
                           positions=None, synthetic=False, quick=False, cache=tmp_path, out=tmp_path,
                           name=None, k=None, device="cpu", calibrate_on="text")
    fidelity.check_arguments(args)
    assert (args.context, args.positions, args.k) == (1000, 128, 128)
    assert fidelity._real(args)[2] == "fidelity-smollm2-135m-1000-paul-graham"


def test_calibrating_on_the_prompt_captures_the_evaluation_texts_first_n_minus_p_tokens(monkeypatch, tmp_path):
    """--calibrate-on prompt: the calibration capture is the evaluation window's prefix up to the evaluated
    positions (a window is a text's first tokens), its queries the P positions just before them."""
    calls = []
    monkeypatch.setattr(bench_capture, "load_capture", lambda model, text, n, cache, positions, **k: (
        calls.append((text, n, positions)) or SimpleNamespace(meta={}), 1.0))
    args = SimpleNamespace(model=None, context=4096, text=None, corpus="cpython", calibration_corpus=None,
                           positions=None, synthetic=False, quick=False, cache=tmp_path, out=tmp_path,
                           name=None, k=None, device="cpu", calibrate_on="prompt")
    fidelity.check_arguments(args)
    assert args.calibration_corpus is None and args.positions == 128
    _, _, name, info = fidelity._real(args)
    assert calls == [("cpython", 4096, 128), ("cpython", 3968, 128)]
    assert name == "fidelity-smollm2-135m-4k-cpython-prompt" and info["calibrated_on"] == "prompt"
    assert info["calibration_text"] == "the prompt (cpython's first 3968 tokens)"


def test_quick_results_go_to_a_folder_git_ignores(tmp_path):
    args = SimpleNamespace(model=None, context=None, text=None, corpus=None, calibration_corpus=None,
                           positions=None, synthetic=True, quick=True, cache=None, out=None, name=None, k=None,
                           device="cpu", calibrate_on="text")
    fidelity.check_arguments(args)
    assert args.out == LOCAL_RESULTS and LOCAL_RESULTS.parent == RESULTS
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(LOCAL_RESULTS / "fidelity-x-quick.json")], cwd=REPO)
    assert ignored.returncode == 0  # the README's first command leaves the checkout clean


def test_min_context_is_exactly_where_top_k_starts_to_select():
    for k, positions in ((1, 1), (128, 32), (128, 128), (256, 128), (60, 5)):
        sel = Selection(k=k)
        n = decoding.min_context(positions, sel)
        assert decoding.choosable_tokens(n, positions, sel) > k >= decoding.choosable_tokens(n - 1, positions, sel)


def test_replot_refuses_a_file_that_is_not_a_fidelity_result(tmp_path, capsys):
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text('{"records": []}')
    assert refused(["fidelity", "--replot", str(tmp_path / "a.json")], capsys).startswith(
        f"error: --replot {tmp_path / 'a.json'}: not JSON (")
    assert refused(["fidelity", "--replot", str(tmp_path / "b.json")], capsys) == (
        f"error: --replot {tmp_path / 'b.json'}: not a fidelity result (it lacks command, synthetic, capture, "
        "selection, summary)")
    (tmp_path / "c.json").write_text("[1, 2]")
    assert refused(["fidelity", "--replot", str(tmp_path / "c.json")], capsys) == (
        f"error: --replot {tmp_path / 'c.json'}: not a fidelity result (not a JSON object)")


def test_replot_refuses_a_result_it_cannot_remake_in_one_line(tmp_path, capsys):
    """A record without a figure the table reads, a summary without the basis rule, and a run without a method the
    summary compares are each refused naming the file, not a traceback after part of the work."""
    from tests.cli import refused

    source = json.loads((RESULTS / "fidelity-smollm2-135m-4k-paul-graham.json").read_text())
    cases = {"no-error": {**source, "records": [{k: v for k, v in r.items() if k != "rel_error"}
                                                 for r in source["records"]]},
             "no-basis": {**source, "summary": {}},
             "no-sparq": {**source, "records": [r for r in source["records"] if r["label"] != "sparq@68"]}}
    messages = {"no-error": "record 0 lacks rel_error", "no-basis": "its summary lacks basis",
                "no-sparq": "its records lack 'sparq@68'"}
    for name, payload in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(payload))
        assert messages[name] in refused(["fidelity", "--replot", str(path)], capsys)


def test_the_plan_rules_cache_call_names_the_levels_a_run_read_through():
    from bench.fidelity import _cache_call

    calibration = "calibration=<this run's .calibration.npz>)`"
    assert _cache_call("fathom-mixed[gains]") == \
        f"`FathomCache(model, 'fathom-mixed', budget=48.0, gains='calibrated', {calibration}"
    assert _cache_call("fathom-mixed[gains]", levels=True) == \
        f"`FathomCache(model, 'fathom-mixed', budget=48.0, gains='calibrated', levels='calibrated', {calibration}"
