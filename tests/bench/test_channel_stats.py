"""python -m bench channel-stats and the statistics timing draws its keys from: a context shorter than the
capture's 128 decode positions is refused before any prefill (it made two and ended in a cache mismatch), the file
records the command as it ran and is never left half written, and a file that is not one, or one of another head
dim than timing's keys, is refused in one line (it failed with a KeyError, or a shape error at the first token)."""

import json

import numpy as np
import pytest

from bench import capture as bench_capture
from bench import channel_stats
from bench.__main__ import main
from bench.cli import UsageError
from fathom.synthetic import SyntheticConfig, generate
from tests.cli import refused


def test_a_context_shorter_than_the_decode_positions_is_refused_before_any_prefill(nothing_loads, capsys):
    for context in ("64", "127"):
        err = refused(["channel-stats", "--model", "smollm2-135m", "--context", context, "--out",
                       str(nothing_loads)], capsys)
        assert err == f"error: --context must lie in 128..8192, got {context}"


def test_a_capture_of_more_positions_than_tokens_is_refused_before_the_text_or_model(monkeypatch, tmp_path):
    def reached(*args, **kwargs):
        raise AssertionError("refused before the text, the model or a prefill")

    monkeypatch.setattr(bench_capture.corpora, "load", reached)
    monkeypatch.setattr(bench_capture.models, "load", reached)
    with pytest.raises(ValueError, match=r"decode positions must lie in 1\.\.64 for a 64-token capture, got 128"):
        bench_capture.load_capture("smollm2-135m", "paul-graham", 64, tmp_path)
    assert list(tmp_path.iterdir()) == []


def _synthetic_capture(head_dim):
    return generate(SyntheticConfig(layers=2, kv_heads=2, group_size=2, head_dim=head_dim, tokens=256, positions=4))


def test_the_file_records_the_command_that_ran_and_loads_back(monkeypatch, tmp_path):
    capture = _synthetic_capture(128)
    monkeypatch.setattr(bench_capture, "load_capture", lambda *args, **kwargs: (capture, 1.0))
    argv = ["channel-stats", "--model", "qwen2.5-coder-1.5b", "--context", "4096", "--out", str(tmp_path / "a b")]
    main(argv)  # sys.argv is pytest's: the command recorded was "python -m bench " and pytest's arguments
    (path,) = (tmp_path / "a b").iterdir()  # and no .partial beside it
    stats = channel_stats.load(path)
    assert stats["meta"]["command"] == f"python -m bench channel-stats --model qwen2.5-coder-1.5b --context 4096 " \
                                      f"--out '{tmp_path / 'a b'}'"
    np.testing.assert_allclose(stats["key_mean"], capture.keys.astype(np.float64).mean(axis=2), rtol=1e-5, atol=1e-6)


def test_a_file_that_is_not_channel_statistics_is_refused_naming_it(tmp_path):
    not_stats = tmp_path / "capture.npz"
    _synthetic_capture(128).save(not_stats)
    with pytest.raises(UsageError, match=r"^--stats .*capture\.npz: not channel statistics"):
        channel_stats.load(not_stats)
    fields = {name: np.ones((2, 2, 128), np.float32) for name in channel_stats.FIELDS}
    for name, value, message in (("query_std", np.ones((2, 3, 128), np.float32), "query_std has shape"),
                                 ("key_std", -fields["key_std"], "negative standard deviation"),
                                 ("key_mean", np.full((2, 2, 128), np.nan, np.float32), "non-finite")):
        path = tmp_path / f"{name}.npz"
        np.savez(path, **{**fields, name: value}, meta=json.dumps({"model": "m"}))
        with pytest.raises(UsageError, match=message):
            channel_stats.load(path)


def test_timing_refuses_statistics_of_another_head_dim(tmp_path):
    from bench.synthetic_decode import Synthetic

    path = tmp_path / "stats.npz"
    stats = channel_stats.statistics(*(x.astype(np.float64) for x in (_synthetic_capture(64).keys,
                                                                      _synthetic_capture(64).queries)))
    np.savez(path, **stats, meta=json.dumps({"model": "smollm2-135m"}))
    with pytest.raises(UsageError, match=r"--stats: channel statistics of a d = 64 model \(smollm2-135m\); the "
                                         r"timing's keys need d = 128"):
        Synthetic(channel_stats.load(path), device="cpu")
