"""``python -m bench generate``: bad arguments refused before any model is built or CUDA is asked for; a result
--replot cannot read refused in one line; the steady median of each call; the compile probe's warm-up command; a
shared prefill and the store's tiers reaching the caches. The table, plot and sentences: test_generate_report.py."""

import pytest

from bench import generate, generate_report
from tests.cli import refused

WARMUP_COMMAND = "python -m fathom.integrations.warmup --head-dim 128 --group-size 4"


@pytest.mark.parametrize("argv, message", [
    (["--models", "gpt2"], "--models: 'gpt2' is not one of"),
    (["--contexts", "100"], "--contexts must be in 256..131072 (the models' context)"),
    (["--models", "smollm2-135m", "--contexts", "100000"], "--contexts must be in 256..8192"),
    (["--models", "smollm2-135m", "--contexts", "4096", "--systems", "sparq@544"], "integer r in 1..64"),
    (["--batches", "0"], "--batches must be in 1..64"),
    (["--new-tokens", "4"], "--new-tokens must exceed --warmup"),
    (["--new-tokens", "10", "--warmup", "3", "--profile", "4"], "and --warmup + --profile + 3 when profiling"),
    (["--systems", "sparq"], "--systems: method 'sparq': sparq takes a budget"),
    (["--systems", "fathom@48,fathom@48"], "names a system twice"),
    (["--name", "../x"], "--name"),
    (["--layers", "0"], "--layers must be in 1..36"),
    (["--models", "qwen3-8b,llama3.1-8b", "--layers", "33"], "--layers must be in 1..32"),
    (["--models", "smollm2-135m", "--contexts", "4096", "--layers", "4"], "--layers applies to the shapes"),
    (["--readme", "README.md"], "--readme README.md: no <!-- generate:start -->"),
    (["--prefill-rows", "0"], "--prefill-rows must be >= 1"),
    (["--hbm-gb", "-1"], "--hbm-gb must be a finite number of GB >= 0"),
    (["--hbm-gb", "nan"], "--hbm-gb must be a finite number of GB >= 0"),
    (["--row-cache-rows", "-1"], "--row-cache-rows must be in 0..1073741823"),
    (["--systems", "hf-sdpa,hf-offloaded", "--row-cache-rows", "64"], "--hbm-gb and --row-cache-rows set FathomCaches"),
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
    ("{" + TOP + ', "records": [{' + RECORD + ', "steady_ms": 30.0}]}',
     "record 0 has no first_steady_ms: made before steady_ms became the lower of the two calls' medians"),
], ids=["missing", "not-json", "not-an-object", "no-fields", "records-not-a-list", "record-fields", "unmeasured",
        "first-call-steady"])
def test_replot_refuses_a_file_it_cannot_plot_naming_it(tmp_path, capsys, contents, message):
    path = tmp_path / "run.json"
    if contents is not None:
        path.write_text(contents)
    out = tmp_path / "out"
    err = refused(["generate", "--replot", str(path), "--out", str(out), "--name", "x"], capsys)
    assert err.startswith(f"error: --replot {path}: ") and message in err, err
    assert not list(out.glob("generate-x.*"))


def test_a_profiled_call_reads_its_steady_median_after_the_profiled_steps():
    steps = [9.0, 5.0, 5.0, 3.0, 8.0, 8.0, 8.0, 8.0, 3.0, 3.0, 3.0]  # steps 4-7 profiled and slower
    assert generate.steady_steps(steps, warmup=3, profile=0) == steps[3:]
    assert generate.steady_steps(steps, warmup=3, profile=4) == [3.0, 3.0, 3.0]


def test_steady_is_the_better_of_the_two_calls_for_every_system():
    """A first call that paid allocator growth inside its steady steps (HF's caches) is not its system's steady
    state; the pooled call's median is taken where it is lower, and the first call's where that is."""
    first = {"prefill_s": 14.0, "first_step_ms": 400.0, "steady_ms": 75.0}
    pooled = {"prefill_s": 13.0, "first_step_ms": 30.0, "steady_ms": 36.0, "gpu_busy_ms": 35.0}
    figures = generate.summarise(first, pooled, batch=8)
    assert figures["steady_ms"] == 36.0 and figures["first_steady_ms"] == 75.0 and figures["pooled_steady_ms"] == 36.0
    assert figures["tokens_per_s"] == pytest.approx(8e3 / 36.0)
    assert figures["host_ms_per_token"] == pytest.approx(1.0) and figures["setup_s"] == pytest.approx(1.37)
    assert figures["prefill_s"] == 14.0 and figures["first_step_ms"] == 400.0
    slower_second = generate.summarise({**first, "steady_ms": 30.0}, {**pooled, "gpu_busy_ms": None}, batch=1)
    assert slower_second["steady_ms"] == 30.0 and slower_second["host_ms_per_token"] is None


def test_the_probe_runs_a_warm_up_command_the_warm_up_accepts():
    from fathom.integrations import warmup

    args = warmup.argument_parser().parse_args(generate.WARMUP)
    assert warmup.shapes_of(args) == [(128, 4)] and args.methods is None  # every method, PROBE's shape
    assert "python -m fathom.integrations.warmup " + " ".join(generate.WARMUP) == WARMUP_COMMAND


def test_a_shared_prefill_seeds_hf_and_fathom_caches_that_generate_what_their_own_prefill_does():
    """The prompt of a prefill run a row at a time, given to transformers' DynamicCache by its own update and to a
    FathomCache by prompt=, then generate from the prompt's token: the tokens of generate's own prefill (tiny
    Llama, a left-padded row)."""
    import torch

    from bench.decoding import MethodSpec
    from fathom.integrations.prefill import prefill
    from tests.integrations.test_transformers import batch, generate as hf_generate
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    ids, mask = batch()
    shared = generate.SharedPrefill(prefill(model, ids, mask, rows_per_forward=1), seconds=0.0, rows_per_forward=1)
    grown_ids, grown_mask = shared.prompt.continued(ids, mask)
    for label, spec in (("hf-sdpa", None), ("dense", MethodSpec.parse("dense", 16))):
        expected = hf_generate(model, ids, mask, generate._cache_for(model, label, spec), new=6)
        got = hf_generate(model, grown_ids, grown_mask, shared.cache(model, label, spec), new=5)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=label)


def test_the_store_tiers_reach_the_cache_and_their_figures_the_record():
    """--hbm-gb and --row-cache-rows become the FathomCache's hbm_gb and row_cache_rows (not HF's caches'); the
    record reads back the planes the near tier holds, its HBM and the row cache's hit rate over the call's steps
    (tiny Llama on the offloaded backend: the simulator in CI)."""
    import argparse

    import transformers

    from bench.decoding import MethodSpec
    from fathom.cuda.interop import DEVICE
    from tests.integrations.test_transformers import batch, generate as hf_generate
    from tests.tiny_models import OFFLOAD_SETTINGS, tiny_offload_llama

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    args = argparse.Namespace(hbm_gb=1.0, row_cache_rows=16)
    spec = MethodSpec.parse(f"fathom@{OFFLOAD_SETTINGS['budget']}", 16)
    settings = {name: value for name, value in OFFLOAD_SETTINGS.items() if name != "budget"}
    store = generate.store_settings(args)
    assert isinstance(generate._cache_for(model, "hf-sdpa", None, **store), transformers.DynamicCache)
    cache = spec.cache(model, backend="offloaded", **store, **settings)
    hf_generate(model, ids, mask, cache, new=3)
    held = cache.decoding.sessions.cache
    hits, lookups = held.row_cache_counts()
    figures = generate.store_figures(cache)
    assert figures == {"hbm_planes": 4, "store_hbm_gb": held.hbm_bytes / 1e9, "row_cache_rows": 16,
                       "row_cache_hit": hits / lookups}
    assert lookups > 0 and 0 < figures["row_cache_hit"] <= 1 and figures["store_hbm_gb"] > 0
    cache.close()
    assert generate.store_figures(transformers.DynamicCache(config=model.config)) == {}
    record = {"system": "fathom@48", "model": "m", "context": 4096, "batch": 1, "prefill_s": 1.0,
              "first_step_ms": 9.0, "pooled_first_step_ms": 2.0, "first_steady_ms": 5.0, "steady_ms": 5.0,
              "tokens_per_s": 200.0, **figures}
    text = generate_report.markdown({"command": "c", "device": "d", "weights": "random", "new_tokens": 8, "warmup": 3,
                              "records": [record]})
    assert "| planes in HBM | store HBM GB | row cache hits |" in text
    assert f"| 4 | {figures['store_hbm_gb']:.2f} | {figures['row_cache_hit']:.2f} |" in text
