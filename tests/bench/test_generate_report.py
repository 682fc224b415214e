"""What ``python -m bench generate`` writes: the table, the README section and the plot made from a result, the
compile probe's sentence, and the notes under the table for settings that differ."""

from bench import generate_report

PROBE = {"process_cold_s": 9.0, "process_warm_s": 2.0, "cold_kernels_compiled": 23,
         "warmup_command": "python -m fathom.integrations.warmup --head-dim 128 --group-size 4", "warmup_s": 30.5,
         "process_after_warmup_s": 2.1, "after_warmup_kernels_compiled": 0}


def test_the_table_and_the_readme_section_come_from_the_records(tmp_path):
    record = {"system": "fathom@48+graph", "model": "qwen3-8b", "context": 131072, "batch": 1, "weights": "random",
              "prefill_s": 14.0, "prefill_vs_hf": 1.06, "pooled_prefill_s": 13.1, "first_step_ms": 410.0,
              "pooled_first_step_ms": 31.0,
              "setup_s": 1.2, "first_steady_ms": 27.9, "steady_ms": 27.5, "tokens_per_s": 36.4,
              "attention_gpu_ms": 24.1, "gpu_busy_ms": 26.0,
              "host_ms_per_token": 1.5, "hbm_gb": 17.9, "pinned_gb": 23.1}
    payload = {"command": "python -m bench generate", "device": "H200", "weights": "random", "new_tokens": 24,
               "warmup": 3, "compile_probe": PROBE,
               "records": [record, {**record, "system": "hf-sdpa", "error": "out of GPU memory"}]}
    text = generate_report.markdown(payload)
    assert ("| qwen3-8b | 131072 | 1 | fathom@48+graph | 14.00 | 1.06 | 13.10 | 410 | 31 | 1.20 | — "
            "| 27.9 | 27.5 | 36.4 |") in text
    assert "Not measured: qwen3-8b 131072 x1 hf-sdpa (out of GPU memory)" in text
    assert generate_report.probe_sentence(PROBE) in text
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- generate:start -->\nold\n<!-- generate:end -->\nafter\n")
    generate_report.update_readme(readme, payload, tmp_path / "generate-x.json")
    updated = readme.read_text()
    assert updated.startswith("before\n<!-- generate:start -->\nFrom `generate-x.json`") and "old" not in updated
    assert updated.endswith("<!-- generate:end -->\nafter\n")
    generate_report.plot(payload, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def test_the_probe_sentence_says_all_three_measurements_and_reads_a_probe_from_before_the_warm_up():
    assert generate_report.probe_sentence(PROBE) == (
        "A fresh process's first offloaded decode: 9.0 s with Numba's kernel cache empty, 2.0 s with it filled (23 "
        "kernel signatures compiled when empty); after the warm-up command `python -m fathom.integrations.warmup "
        "--head-dim 128 --group-size 4` (30.5 s in a fresh process, its cache empty) 2.1 s, compiling 0.")
    committed = {"process_cold_s": 11.4, "process_warm_s": 5.9}  # docs/results.md's run: the keys it kept
    assert generate_report.probe_sentence(committed) == ("A fresh process's first offloaded decode: 11.4 s with "
                                                         "Numba's kernel cache empty, 5.9 s with it filled.")


def test_settings_with_fewer_layers_or_a_shared_prefill_say_so_under_the_table():
    record = {"system": "fathom@48+graph", "model": "qwen3-8b", "context": 131072, "batch": 8, "layers": 12,
              "prefill": "shared", "shared_prefill_s": 41.2, "prefill_rows": 1, "prefill_s": 9.0, "steady_ms": 80.0,
              "tokens_per_s": 100.0, "first_step_ms": 500.0, "pooled_first_step_ms": 90.0}
    full = {**record, "context": 32768, "batch": 1, "layers": 36, "prefill": "generate's own"}
    text = generate_report.markdown({"command": "c", "device": "H200", "weights": "random", "new_tokens": 10,
                                     "warmup": 3, "records": [record, full]})
    assert ("qwen3-8b 128k x8: 12 of the shape's 36 layers (host memory). qwen3-8b 128k x8: every cache started from "
            "one shared dense prefill (41.2 s, 1 row(s) at a time)") in text
    assert "32k x1" not in text.split("\n\n", 2)[-1]  # a full, self-prefilled setting needs no note


def test_merged_runs_say_each_setting_as_the_runs_had_it():
    """--replot's header gives every value where the runs differ (their warm-up steps), not the first run's."""
    record = {"system": "dense", "model": "m", "context": 1024, "batch": 1, "steady_ms": 1.0, "tokens_per_s": 1000.0,
              "first_steady_ms": 1.0}
    runs = [{"command": f"c{w}", "device": "H200", "weights": "random", "new_tokens": 8 + w, "warmup": w,
             "records": [{**record, "context": 1024 * w}]} for w in (3, 2)]
    merged = generate_report.merge(runs)
    assert merged["warmup"] == "2 or 3" and merged["device"] == "H200" and merged["new_tokens"] == 10
    assert "medians after 2 or 3 steps" in generate_report.markdown(merged)
