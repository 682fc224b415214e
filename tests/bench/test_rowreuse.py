"""python -m bench rowreuse: the row-cache simulation against hand-worked sequences, the rows a step records (sink,
local and tail left out), bad arguments refused before any load, and one run end to end on a tiny random Llama
(no download)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bench import corpora, models, rowreuse
from bench.__main__ import main
from bench.row_cache import lru_hits, previous_step_reuse
from fathom.selection import Selection
from tests.cli import refused

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # 5.24 renames generate's past_key_values to cache

STEPS = [np.array([1, 2, 3]), np.array([2, 3, 4]), np.array([1, 4, 5]), np.array([5])]


def test_previous_step_reuse_by_hand():
    # {2,3} of {2,3,4} were fetched by step 0; {4} of {1,4,5} by step 1; {5} of {5} by step 2
    np.testing.assert_allclose(previous_step_reuse(STEPS), [2 / 3, 1 / 3, 1.0])
    assert np.isnan(previous_step_reuse([np.array([1]), np.array([], np.int64)])[0])


def test_lru_by_hand_at_three_sizes():
    # capacity 3: [1 2 3] -> hits 2,3, insert 4, evict 1 -> [2 3 4] -> hit 4, insert 1 5, evict 2 3 -> [4 1 5]
    # -> hit 5
    assert lru_hits(STEPS, 3).tolist() == [2, 1, 1]
    # capacity 4: [1 2 3] -> [1 2 3 4] -> hits 1,4; insert 5, evict 2 -> [3 1 4 5] -> hit 5
    assert lru_hits(STEPS, 4).tolist() == [2, 2, 1]
    # capacity 2, smaller than a step: [1 2 3] keeps [2 3] -> hits 2,3; order 2 3 4, evict 2 -> [3 4]
    # -> hit 4; order 3 4 1 5, evict 3 4 -> [1 5] -> hit 5
    assert lru_hits(STEPS, 2).tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="capacity"):
        lru_hits(STEPS, 0)


def test_lru_evicts_the_least_recently_used_not_the_oldest_inserted():
    steps = [np.array([1]), np.array([2]), np.array([1]), np.array([3]), np.array([1]), np.array([2])]
    # capacity 2: 1 refreshed at step 2, so 3 evicts 2, not 1
    assert lru_hits(steps, 2).tolist() == [0, 1, 0, 1, 0]


def test_the_summary_averages_each_head_over_steps_then_over_heads():
    rows = {(0, 0, 0): [np.array([1, 2]), np.array([1, 2]), np.array([1, 2])],  # reuses everything
            (1, 0, 0): [np.array([1, 2]), np.array([3, 4]), np.array([5, 6])]}  # nothing
    summary = rowreuse.reuse_summary(rows, [1, 4])
    assert summary["heads"] == 2 and summary["steps"] == 3 and summary["mean_rows"] == 2
    for policy in (summary["previous_step"], *summary["lru"]):
        assert policy["hit_mean"] == 0.5 and policy["hit_min_heads"] == 0.0 and policy["link_fraction"] == 0.5
        assert policy["per_layer"] == [1.0, 0.0] and policy["per_step"] == [0.5, 0.5]
    assert [c["rows_held_mean"] for c in summary["lru"]] == [2, 8]


def test_a_step_records_its_fetched_rows_without_sink_local_and_tail():
    recorder = rowreuse.RowRecorder(Selection(k=8, sink=4, local=32))
    mask = np.zeros((2, 200), bool)
    mask[0, :100], mask[1, 150:] = True, True  # n = 200: 192 sealed, the tail 192..199, local 168..199
    recorder(3, 0, 1, SimpleNamespace(mask=mask))
    assert recorder.rows[(3, 0, 1)][0].tolist() == list(range(4, 100)) + list(range(150, 168))


@pytest.mark.parametrize("argv, message", [
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram must be >= 0"),
    (["--capacities", "0,2"], "--capacities must be >= 1"),
    (["--contexts", "256"], "--contexts must lie in 512..8192"),
    (["--contexts", "16384"], "--contexts must lie in 512..8192 (smollm2-135m"),
    (["--contexts", "4096,4096"], "--contexts names a value more than once"),
    (["--models", "nope"], "--models must name models of"),
    (["--methods", "dense"], "dense fetches every row"),
    (["--methods", "oracle@12"], "reads no budget"),
    (["--methods", "sparq@70"], "r·4.25"),
    (["--methods", "fathom-plan@48"], "fathom-plan"),
    (["--corpus", "nope"], "--corpus must be one of"),
    (["-k", "0"], "-k must be >= 1"),
    (["--calibration", "/nonexistent.npz"], "--calibration"),
    (["--name", "../x"], "--name must be a file name stem"),
])
def test_bad_arguments_are_refused_before_anything_loads(nothing_loads, capsys, argv, message):
    assert message in refused(["rowreuse", *argv, "--out", str(nothing_loads)], capsys)


class CharTokenizer:
    """One token per character (ids below the tiny Llama's vocabulary of 97)."""

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[ord(c) % 96 + 1 for c in text])

    def decode(self, ids):
        return "".join(chr(96 + int(i)) for i in ids)


def test_a_tiny_run_end_to_end(monkeypatch, tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.tiny_models import tiny_llama

    tiny = models.ModelInfo(layers=2, q_heads=4, kv_heads=2, head_dim=16, qk_norm=False, rope_theta=100.0,
                            context=4096)
    monkeypatch.setitem(models.MODELS, "tiny", tiny)
    monkeypatch.setattr(models, "load", lambda name, cache=None: (tiny_llama(), CharTokenizer()))
    monkeypatch.setattr(corpora, "load", lambda name, cache=None: "a long text of plain words " * 60)
    main(["rowreuse", "--models", "tiny", "--contexts", "512,640", "--new-tokens", "6", "--methods",
          "oracle,fathom@24", "--capacities", "1,2,8", "-k", "16", "--out", str(tmp_path)])
    stem = "rowreuse-tiny-512-640-T6"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.{ext}" for ext in ("json", "md", "png")]
    result = json.loads((tmp_path / f"{stem}.json").read_text())
    assert result["command"].startswith("python -m bench rowreuse --models tiny") and result["no_repeat_ngram"] == 0
    assert [(r["context"], r["method"]) for r in result["runs"]] == [
        (512, "oracle"), (512, "fathom@24"), (640, "oracle"), (640, "fathom@24")]
    for r in result["runs"]:
        assert r["prompt_tokens"] == r["context"] - 6 and r["k"] == 16 and r["steps"] == 6
        assert r["heads"] == 2 * 2  # layers × KV heads (one session)
        assert 16 <= r["mean_rows"] <= 2 * 16  # the union of G = 2 heads' top-16
        hits = [c["hit_mean"] for c in r["lru"]]
        assert all(0 <= h <= 1 for h in hits) and hits == sorted(hits)  # LRU: more room never hits less
        assert len(r["lru"][0]["per_step"]) == 5
    assert "| tiny | 640 | fathom@24 | 16 |" in (tmp_path / f"{stem}.md").read_text()
    assert f"wrote {tmp_path / stem}.json" in capsys.readouterr().out
