"""What a new user meets first on ``python -m bench``: a bad file or value is one line naming it and what it should
be (exit 2, before any model load), and ``--help`` is plain text that lists the choices and the defaults."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from bench import (agreement, artifacts, channel_stats, cli, corpora, decoding, fidelity, headline, models,
                   rowreuse, ruler, soak, timing)
from bench.__main__ import main
from bench.report import RESULTS
from fathom import methods
from tests.cli import refused

README = Path(__file__).resolve().parents[2] / "README.md"
BENCHES = README.parent / "docs" / "benches.md"  # the fidelity bench's other settings
COMMANDS = [fidelity, headline, ruler, agreement, rowreuse, timing, soak, channel_stats]


def argparse_refused(argv: list[str], capsys) -> str:
    """argparse's own refusal (a bad ``type=`` value): exit 2, the usage, then one ``prog: error: …`` line, no
    traceback. Returns that last line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def help_text(argv: list[str], capsys, monkeypatch) -> str:
    """``python -m bench <argv> --help``, unwrapped (one long line)."""
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps to the terminal: no wrapping, no split words
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def options(parser: argparse.ArgumentParser):
    """Every option of ``parser`` and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from options(sub)
        else:
            yield action


def parser_of(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


# --- timing --replot: a file it cannot plot -------------------------------------------------------------------

TOP = '"command": "c", "device": "d", "link_GBps": 1.0, "keys": "statistics of x"'


@pytest.mark.parametrize("contents, message", [
    (None, "cannot read it (No such file or directory)"),
    (b"\xff\xfe binary", "not UTF-8 text"),
    ("nope", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", "not a timing JSON of python -m bench timing (not a JSON object)"),
    ('{"command": "c"}', "not a timing JSON of python -m bench timing (it lacks device, link_GBps, keys, records)"),
    ("{" + TOP + ', "records": {}}', "(its records are not a list of objects)"),
    ("{" + TOP + ', "records": [{"label": "x"}]}', "(record 0 lacks method, context, sessions,"),
], ids=["missing", "binary", "not-json", "not-an-object", "no-fields", "records-not-a-list", "record-fields"])
def test_timing_replot_refuses_a_file_it_cannot_plot_naming_it(tmp_path, capsys, contents, message):
    path = tmp_path / "run.json"
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    elif contents is not None:
        path.write_text(contents)
    out = tmp_path / "out"
    good = RESULTS / "timing-qwen3-8b-hbm.json"  # a bad file after a good one: nothing is written
    err = refused(["timing", "--replot", str(good), str(path), "--out", str(out), "--name", "x"], capsys)
    assert err.startswith(f"error: --replot {path}: ") and message in err, err
    assert not list(out.glob("timing-x.*"))


def test_timing_replot_of_the_committed_runs_remakes_the_committed_table(tmp_path, capsys):
    runs = [str(RESULTS / f"timing-qwen3-8b-{regime}.json") for regime in ("host", "hbm")]
    main(["timing", "--replot", *runs, "--out", str(tmp_path), "--name", "qwen3-8b"])
    assert (tmp_path / "timing-qwen3-8b.md").read_text() == (RESULTS / "timing-qwen3-8b.md").read_text()
    assert "floor: link bytes at each run's own rate (53.9, 55.4 GB/s)" in (tmp_path / "timing-qwen3-8b.md").read_text()
    assert "--replot names a file twice" in refused(["timing", "--replot", runs[0], runs[0], "--out", str(tmp_path)],
                                                    capsys)
    readme = tmp_path / "half.md"
    readme.write_text("<!-- timing:start -->\n")
    assert "a file with the section" in refused(["timing", "--replot", runs[0], "--readme", str(readme), "--out",
                                                 str(tmp_path)], capsys)


# --- bad list values: argparse names what they should be --------------------------------------------------------

@pytest.mark.parametrize("option, value", [("--contexts", "abc"), ("--sessions", "1,x"), ("--contexts", "")])
def test_timing_says_what_a_list_of_integers_looks_like(capsys, option, value):
    assert argparse_refused(["timing", option, value], capsys) == \
        f"python -m bench timing: error: argument {option}: comma-separated integers, got {value!r}"


@pytest.mark.parametrize("module", COMMANDS, ids=lambda m: m.__name__)
def test_every_option_type_is_a_named_function(module):
    """argparse names a bad value's type by its function's name: a lambda reads 'invalid <lambda> value'."""
    for action in options(parser_of(module)):
        assert getattr(action.type, "__name__", None) != "<lambda>", (module.__name__, action.option_strings)


# --- --out naming a file where a folder is wanted, and the reverse ----------------------------------------------

@pytest.mark.parametrize("command", [["fidelity", "--synthetic", "--quick"], ["agreement"], ["rowreuse"],
                                     ["ruler", "lm-eval"], ["ruler", "score", "--generations", "g"], ["timing"],
                                     ["soak"], ["channel-stats"]], ids=" ".join)
def test_an_out_that_names_an_existing_file_is_refused_as_not_a_folder(nothing_loads, capsys, command):
    file = nothing_loads / "results.txt"
    file.write_text("a file")
    assert refused([*command, "--out", str(file)], capsys) == \
        f"error: --out {file} names an existing file; --out must be a folder"


def test_ruler_samples_and_generate_refuse_an_out_that_is_a_folder(nothing_loads, capsys):
    samples = nothing_loads / "s.json"
    samples.write_text('{"model": "smollm2-135m", "samples": [{"id": "x"}]}')
    for argv in (["samples"], ["generate", "--samples", str(samples)]):
        assert refused(["ruler", *argv, "--out", str(nothing_loads)], capsys) == \
            f"error: --out {nothing_loads} names an existing folder; --out must name the file to write"


def test_writable_folder_and_file_keep_their_other_refusals(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(cli.UsageError, match=r"cannot write there \(Not a directory\)"):
        cli.writable_folder("--out", blocker / "results")
    with pytest.raises(cli.UsageError, match=r"cannot write there \(File exists\)"):
        cli.writable_file("--out", blocker / "out.json")
    assert cli.writable_folder("--out", tmp_path / "new") == tmp_path / "new" and (tmp_path / "new").is_dir()
    assert cli.writable_file("--out", tmp_path / "made" / "out.json") == tmp_path / "made" / "out.json"


# --- method specs: the help and the refusal agree with what parses ----------------------------------------------

@pytest.mark.parametrize("name", decoding.BUDGETED)
def test_a_budgeted_method_written_bare_is_refused_with_a_form_that_parses(nothing_loads, capsys, name):
    err = refused(["ruler", "lm-eval", "--methods", name, "--out", str(nothing_loads)], capsys)
    assert err.startswith(f"error: method {name!r}: {name} takes a budget: write {name}@BITS"), err
    example = re.search(rf"e\.g\. ({re.escape(name)}@\d+)", err).group(1)
    for head_dim in (64, 128, 256):  # the models' head dims
        decoding.MethodSpec.parse(example, head_dim)


def test_the_sparq_refusal_names_sparq_at_68(nothing_loads, capsys):
    assert "sparq@68" in refused(["ruler", "lm-eval", "--methods", "sparq", "--out", str(nothing_loads)], capsys)


def test_the_methods_help_says_which_methods_take_bits_and_it_is_true(capsys, monkeypatch, nothing_loads):
    for argv in (["ruler", "lm-eval"], ["ruler", "generate"]):
        text = help_text(argv, capsys, monkeypatch)
        assert decoding.spec_help() in text and "name or name@bits" not in text
    assert decoding.spec_help(exclude=("fathom-plan",)) in help_text(["agreement"], capsys, monkeypatch)
    assert "fathom-plan" in refused(["agreement", "--methods", "fathom-plan@48", "--out", str(nothing_loads)], capsys)
    for name in decoding.NO_BUDGET:  # bare, as the help says
        decoding.MethodSpec.parse(name, 128)
    for name in decoding.BUDGETED:  # never bare
        with pytest.raises(cli.UsageError, match=f"write {name}@BITS"):
            decoding.MethodSpec.parse(name, 128)
    examples = re.findall(r"e\.g\. ([\w\-\[\],]+@\d+)", decoding.spec_help())
    assert "fathom-mixed[gains,pooled]@48" in examples
    for example in examples:
        decoding.MethodSpec.parse(example, 64)
    assert set(decoding.NO_BUDGET + decoding.BUDGETED) == set(methods.NAMES)


# --- --help: plain text, the choices, the defaults --------------------------------------------------------------

HELPS = [[], ["fidelity"], ["headline"], ["ruler"], ["ruler", "lm-eval"], ["ruler", "samples"], ["ruler", "generate"],
         ["ruler", "score"], ["agreement"], ["rowreuse"], ["timing"], ["generate"], ["soak"], ["channel-stats"],
         ["fetch"]]


@pytest.mark.parametrize("argv", HELPS, ids=lambda argv: " ".join(argv) or "bench")
def test_help_is_plain_text_without_rest_markup(capsys, monkeypatch, argv):
    text = help_text(argv, capsys, monkeypatch)
    assert not re.search(r"``|:(?:mod|func|class|meth|data|attr):`|\*\*", text), text


def test_plain_drops_rest_markup_and_keeps_the_words():
    assert cli.plain("``python -m bench``: :func:`~bench.cli.plain`, :mod:`fathom.cuda` and **this**") == \
        "python -m bench: plain, fathom.cuda and this"


def test_fidelity_help_lists_the_models_and_corpora_and_readmes_figures(capsys, monkeypatch):
    text = help_text(["fidelity"], capsys, monkeypatch)
    for name in [*models.MODELS, *corpora.CORPORA, *corpora.AUSTEN_NOVELS]:
        assert name in text, name
    assert "a few minutes" not in text
    docs = " ".join(" ".join(p.read_text(encoding="utf-8") for p in (README, BENCHES)).split())
    for figure in ("about 2.5 minutes on 2 CPU cores", "about another minute", "~20 s"):  # cited from the docs
        assert figure in text and figure in docs, figure


@pytest.mark.parametrize("module", [fidelity, agreement, rowreuse, ruler, timing], ids=lambda m: m.__name__)
def test_every_option_with_a_default_says_it_in_its_help(module):
    for action in options(parser_of(module)):
        if action.default not in (None, False, argparse.SUPPRESS) and action.help is not None:
            assert "default" in action.help, (module.__name__, action.option_strings, action.help)


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["agreement"], ["rowreuse"], ["ruler", "lm-eval"],
                                     ["ruler", "score", "--generations", "g"], ["timing"], ["soak"]], ids=" ".join)
def test_every_command_refuses_an_unwritable_out_and_a_name_outside_it_first(tmp_path, capsys, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    err = refused([*command, "--out", str(blocker / "results")], capsys)
    assert err.startswith(f"error: --out {blocker / 'results'}: cannot write there")
    if command[0] != "soak":  # soak writes soak.*
        assert "--name must be a file name stem" in refused([*command, "--out", str(tmp_path), "--name", "../x"],
                                                            capsys)


def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(args):
        raise ZeroDivisionError("a real bug")

    monkeypatch.setattr(fidelity, "run", bug)
    with pytest.raises(ZeroDivisionError, match="a real bug"):
        main(["fidelity", "--synthetic"])


def test_a_fetch_failure_is_one_error_line_exit_1(monkeypatch, capsys):
    def offline(args):
        raise artifacts.FetchError("cannot fetch pip package 'x': no network")

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


def test_the_pinned_probe_refuses_in_one_line_and_its_help_is_plain(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from bench import pinned_probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in ((["--gib", "0"], "error: --gib must be >= 1, got 0"), ([], "error: needs a CUDA GPU")):
        with pytest.raises(SystemExit) as exit_info:
            pinned_probe.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err and message in err.strip().splitlines()[-1], err
    with pytest.raises(SystemExit):
        pinned_probe.main(["--help"])
    assert "cuMemHostAlloc" in (out := capsys.readouterr().out) and "``" not in out, out


def test_timing_and_soak_refuse_bad_arguments_before_any_gpu_work(capsys):
    for argv, needle in ((["timing", "--contexts", "100"], "--contexts must be multiples of 64"),
                         (["timing", "--methods", "fathom@47"], "--methods: unknown"),
                         (["timing", "--reps", "0"], "--reps must lie in 1..50"),
                         (["timing", "--regimes", "disk"], "--regimes must be host and/or hbm"),
                         (["timing", "--hbm-planes", "5"], "--hbm-planes must lie in 0..4"),
                         (["timing", "--row-cache-rows", "-1"], "--row-cache-rows must lie in 0..1048576"),
                         (["timing", "--stats", "/nonexistent.npz"], "--stats: no file"),
                         (["soak", "--cycles", "0"], "--cycles must lie in 2..100000"),
                         (["channel-stats", "--context", "10"], "--context must lie in 128.."),
                         (["channel-stats", "--corpus", "nope"], "is not a corpus")):
        assert needle in refused(argv, capsys), argv


def test_main_prints_where_it_wrote_last(tmp_path, capsys):
    (tmp_path / "fidelity-m-16k-t.json").write_text(json.dumps({"synthetic": True}))
    main(["headline", "--results", str(tmp_path)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {tmp_path / 'headline.md'}"
    assert os.path.exists(tmp_path / "headline.md")
