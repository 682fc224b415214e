"""``python -m bench generate``: bad arguments refused before any model is built or CUDA is asked for; the table,
the README section and the plot made from a result; a result --replot cannot read refused in one line; the compile
probe's sentence and warm-up command."""

import pytest

from bench import generate
from tests.cli import refused

PROBE = {"process_cold_s": 9.0, "process_warm_s": 2.0, "cold_kernels_compiled": 23,
         "warmup_command": "python -m fathom.integrations.warmup --head-dim 128 --group-size 4", "warmup_s": 30.5,
         "process_after_warmup_s": 2.1, "after_warmup_kernels_compiled": 0}


@pytest.mark.parametrize("argv, message", [
    (["--models", "gpt2"], "--models: 'gpt2' is not one of"),
    (["--contexts", "100"], "--contexts must be >= 256"),
    (["--batches", "0"], "--batches in 1..64"),
    (["--new-tokens", "4"], "--new-tokens must exceed --warmup"),
    (["--systems", "sparq"], "--systems: method 'sparq': sparq takes a budget"),
    (["--systems", "fathom@48,fathom@48"], "names a system twice"),
    (["--name", "../x"], "--name"),
])
def test_bad_arguments_are_refused_before_any_work(capsys, tmp_path, argv, message):
    assert message in refused(["generate", "--out", str(tmp_path), *argv], capsys)


TOP = '"command": "c", "device": "d", "weights": "random", "new_tokens": 24, "warmup": 3'
RECORD = '"model": "m", "context": 32768, "batch": 1, "system": "dense"'


@pytest.mark.parametrize("contents, message", [
    (None, "cannot read it (No such file or directory)"),
    ("nope", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", "not a generate result (not a JSON object)"),
    ('{"command": "c"}', "not a generate result (it lacks device, weights, new_tokens, warmup, records)"),
    ("{" + TOP + ', "records": {}}', "(its records are not a list of objects)"),
    ("{" + TOP + ', "records": [{"system": "x"}]}', "(record 0 lacks model, context, batch)"),
    ("{" + TOP + ', "records": [{' + RECORD + '}]}', "(record 0 has neither steady_ms nor error)"),
], ids=["missing", "not-json", "not-an-object", "no-fields", "records-not-a-list", "record-fields", "unmeasured"])
def test_replot_refuses_a_file_it_cannot_plot_naming_it(tmp_path, capsys, contents, message):
    path = tmp_path / "run.json"
    if contents is not None:
        path.write_text(contents)
    out = tmp_path / "out"
    err = refused(["generate", "--replot", str(path), "--out", str(out), "--name", "x"], capsys)
    assert err.startswith(f"error: --replot {path}: ") and message in err, err
    assert not list(out.glob("generate-x.*"))


def test_the_table_and_the_readme_section_come_from_the_records(tmp_path):
    record = {"system": "fathom@48+graph", "model": "qwen3-8b", "context": 131072, "batch": 1, "weights": "random",
              "prefill_s": 14.0, "prefill_vs_hf": 1.06, "pooled_prefill_s": 13.1, "first_step_ms": 410.0, "pooled_first_step_ms": 31.0,
              "setup_s": 1.2, "steady_ms": 27.5, "tokens_per_s": 36.4, "attention_gpu_ms": 24.1, "gpu_busy_ms": 26.0,
              "host_ms_per_token": 1.5, "hbm_gb": 17.9, "pinned_gb": 23.1}
    payload = {"command": "python -m bench generate", "device": "H200", "weights": "random", "new_tokens": 24,
               "warmup": 3, "compile_probe": PROBE,
               "records": [record, {**record, "system": "hf-sdpa", "error": "out of GPU memory"}]}
    text = generate.markdown(payload)
    assert "| qwen3-8b | 131072 | 1 | fathom@48+graph | 14.00 | 1.06 | 13.10 | 410 | 31 |" in text
    assert "Not measured: qwen3-8b 131072 x1 hf-sdpa (out of GPU memory)" in text
    assert generate.probe_sentence(PROBE) in text
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- generate:start -->\nold\n<!-- generate:end -->\nafter\n")
    generate.update_readme(readme, payload, tmp_path / "generate-x.json")
    updated = readme.read_text()
    assert updated.startswith("before\n<!-- generate:start -->\nFrom `generate-x.json`") and "old" not in updated
    assert updated.endswith("<!-- generate:end -->\nafter\n")
    generate.plot(payload, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def test_the_probe_sentence_says_all_three_measurements_and_reads_a_probe_from_before_the_warm_up():
    assert generate.probe_sentence(PROBE) == (
        "A fresh process's first offloaded decode: 9.0 s with Numba's kernel cache empty, 2.0 s with it filled (23 "
        "kernel signatures compiled when empty); after the warm-up command `python -m fathom.integrations.warmup "
        "--head-dim 128 --group-size 4` (30.5 s in a fresh process, its cache empty) 2.1 s, compiling 0.")
    committed = {"process_cold_s": 11.4, "process_warm_s": 5.9}  # docs/results.md's run: the keys it kept
    assert generate.probe_sentence(committed) == ("A fresh process's first offloaded decode: 11.4 s with Numba's "
                                                  "kernel cache empty, 5.9 s with it filled.")


def test_the_probe_runs_a_warm_up_command_the_warm_up_accepts():
    from fathom.integrations import warmup

    args = warmup.argument_parser().parse_args(generate.WARMUP)
    assert warmup.shapes_of(args) == [(128, 4)] and args.methods is None  # every method, PROBE's shape
    assert "python -m fathom.integrations.warmup " + " ".join(generate.WARMUP) == PROBE["warmup_command"]
