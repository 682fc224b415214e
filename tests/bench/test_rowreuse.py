"""python -m bench rowreuse: the row-cache simulation (LRU and set-associative) against hand-worked sequences, the rows a step records (sink,
local and tail left out), bad arguments refused before any load, and one run end to end on a tiny random Llama
(no download)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bench import corpora, models, rowreuse
from bench.__main__ import main
from bench.row_cache import lru_hits, lru_misses, pages_touched, previous_step_reuse, set_associative_misses
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


def test_lru_misses_by_hand_are_each_steps_rows_less_its_hits():
    # capacity 3 as above: step 0 misses all; then 4; then 1 and 5 (4 held); then nothing (5 held)
    assert [m.tolist() for m in lru_misses(STEPS, 3)] == [[1, 2, 3], [4], [1, 5], []]
    assert [m.tolist() for m in lru_misses(STEPS, 2)] == [[1, 2, 3], [4], [1, 5], []]
    # capacity 1 keeps [3], then [4] (its hit 3 goes first), then [5]
    assert [m.tolist() for m in lru_misses(STEPS, 1)] == [[1, 2, 3], [2, 4], [1, 5], []]


def test_set_associative_misses_by_hand():
    # capacity 4 in sets of 2: rows 1, 3, 5 in set 1, rows 2, 4 in set 0. [1 2 3] -> set 1 [1 3], set 0 [2];
    # [2 3 4]: hits 2, 3, miss 4 -> set 0 [2 4]; [1 4 5]: hits 1, 4; 5 evicts set 1's oldest, 3 (the LRU of 4 rows
    # would have evicted 2) -> set 1 [1 5]; [5]: hit
    steps = STEPS
    assert [m.tolist() for m in set_associative_misses(steps, 4, 2)] == [[1, 2, 3], [4], [5], []]
    # one way a set: row r in set r % 4; 1 and 5 share set 1, so step 2's 5 evicts 1 there
    assert [m.tolist() for m in set_associative_misses(steps, 4, 1)] == [[1, 2, 3], [4], [5], []]
    assert [m.tolist() for m in set_associative_misses([np.array([1]), np.array([5]), np.array([1])], 4, 1)] == [
        [1], [5], [1]]
    with pytest.raises(ValueError, match="ways"):
        set_associative_misses(steps, 4, 5)


def test_one_set_of_every_way_is_the_lru():
    rng = np.random.default_rng(7)
    for _ in range(50):
        steps = [np.unique(rng.integers(0, 60, rng.integers(0, 30))) for _ in range(rng.integers(1, 10))]
        capacity = int(rng.integers(1, 40))
        expected = lru_misses(steps, capacity)
        for got, want in zip(set_associative_misses(steps, capacity, capacity), expected, strict=True):
            assert got.tolist() == want.tolist()


def test_pages_touched_by_hand_in_both_layouts():
    # d = 64: a token's K and V of one head are 256 B, 16 of them a 4 KiB page
    rows = [np.array([0, 15, 16, 40]), np.array([15, 16]), np.array([], np.int64)]
    # stream-major: head 0 pages 0, 1, 2 (rows 0-15, 16-31, 32-47); head 1 pages 0, 1 of its own
    assert pages_touched(rows, 256, "stream-major") == 5
    # token-major, 3 heads: token t of head h at (3t + h)·256 B -> page (3t + h) // 16:
    # head 0: 0, 45 // 16 = 2, 48 // 16 = 3, 120 // 16 = 7; head 1: 46 // 16 = 2, 49 // 16 = 3
    assert pages_touched(rows, 256, "token-major") == 4
    with pytest.raises(ValueError, match="layout"):
        pages_touched(rows, 256, "head-major")
    with pytest.raises(ValueError, match="row_bytes"):
        pages_touched(rows, 384, "token-major")


def test_rows_per_page_counts_one_gather_per_layer_session_and_step():
    # two KV heads of layer 0 fetch the same token at step 1 (step 0, the cold one, is left out)
    steps = {(0, 0, 0): [np.array([0]), np.array([5])], (0, 0, 1): [np.array([0]), np.array([5])],
             (1, 0, 0): [np.array([0]), np.array([1, 2, 3, 200])]}
    per_page = rowreuse.rows_per_page(steps, 512)  # 8 rows a page
    # stream-major: layer 0's two rows on two pages, layer 1's four on two (0-7 and 200 // 8): 6 rows / 4 pages;
    # token-major: layer 0's two rows share page (5·2 + h)·512 // 4096 = 1; layer 1 (one head) the same two pages
    assert per_page == {"stream-major": 6 / 4, "token-major": 6 / 3}


def test_lru_evicts_the_least_recently_used_not_the_oldest_inserted():
    steps = [np.array([1]), np.array([2]), np.array([1]), np.array([3]), np.array([1]), np.array([2])]
    # capacity 2: 1 refreshed at step 2, so 3 evicts 2, not 1
    assert lru_hits(steps, 2).tolist() == [0, 1, 0, 1, 0]


def test_the_summary_averages_each_head_over_steps_then_over_heads():
    rows = {(0, 0, 0): [np.array([1, 2]), np.array([1, 2]), np.array([1, 2])],  # reuses everything
            (1, 0, 0): [np.array([1, 2]), np.array([3, 4]), np.array([5, 6])]}  # nothing
    summary = rowreuse.reuse_summary(rows, [1, 4], 512)
    assert summary["heads"] == 2 and summary["steps"] == 3 and summary["mean_rows"] == 2
    for policy in (summary["previous_step"], *summary["lru"]):
        assert policy["hit_mean"] == 0.5 and policy["hit_min_heads"] == 0.0 and policy["link_fraction"] == 0.5
        assert policy["per_layer"] == [1.0, 0.0] and policy["per_step"] == [0.5, 0.5]
    assert [c["rows_held_mean"] for c in summary["lru"]] == [2, 8]
    # rows 1, 2 share a page (8 rows of 512 B a page), rows 3-6 another; one head a layer: both layouts alike
    assert summary["selected_rows_per_page"] == {"stream-major": 2.0, "token-major": 2.0}
    assert summary["lru"][0]["miss_rows_per_page"] == {"stream-major": 2.0, "token-major": 2.0}  # layer 1's misses


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
    (["--ways", "0"], "--ways must be >= 1"),
    (["--ways", "4,4"], "--ways names a value more than once"),
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
          "oracle,fathom@24", "--capacities", "1,2,8", "--ways", "1,4", "-k", "16", "--out", str(tmp_path)])
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
        assert [(c["ways"], c["capacity"]) for c in r["set_associative"]] == [
            (1, 1), (1, 2), (1, 8), (4, 1), (4, 2), (4, 8)]
        # a set-associative cache holds as many rows as the LRU, down to whole sets (at least one)
        for c in r["set_associative"]:
            lru = next(x for x in r["lru"] if x["capacity"] == c["capacity"])
            assert c["rows_held_mean"] <= max(lru["rows_held_mean"], c["ways"]) and 0 <= c["hit_mean"] <= 1
        assert r["row_bytes"] == 4 * 16 and all(v >= 1 for v in r["selected_rows_per_page"].values())
    table = (tmp_path / f"{stem}.md").read_text()
    assert "| tiny | 640 | fathom@24 | 16 |" in table and "4-way 8×: mean (p10)" in table
    assert f"wrote {tmp_path / stem}.json" in capsys.readouterr().out
