"""python -m bench ruler: samples from lm-eval's own task code at a tiny context (offline, a tokenizer trained
here), lm-eval's metric on a hand-made generations file, the lm-eval path and the samples→generate path giving
the same generations on a tiny random model, and bad arguments refused before any model load."""

import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bench import models  # noqa: E402
from bench.__main__ import main  # noqa: E402
from bench.decoding import MethodSpec  # noqa: E402
from bench.ruler import generate, samples  # noqa: E402
from bench.ruler.score import wilson  # noqa: E402
from tests.cli import refused  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # 5.24 renames generate's past_key_values to cache

CONTEXT = 1024  # the smallest context every task can fill (samples.MIN_CONTEXT)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here on the tasks' sentences and wonderwords' word list (RULER sizes its
    prompts with any tokenizer; ruler_cwe needs one that spends few tokens per word to fit words at 1k)."""
    import wonderwords
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
            "One of the special magic numbers for a key is: 1234567. What are the 10 most common words? "
            "Memorize and track the chain(s) of variable assignment hidden in the following text. VAR ABCDE = 12345")
    words = sorted({w for c in ("nouns", "adjectives", "verbs") for w in wonderwords.RandomWord()._categories[c]})
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text] * 20 + [" ".join(words)], trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>",
                                         unk_token="<unk>").save_pretrained(folder)
    return folder


def check_samples(built, task, limit):
    assert [s["id"] for s in built] == [f"{task}/{CONTEXT}/{i}" for i in range(limit)]
    for s in built:
        assert s["task"] == task and s["context"] == CONTEXT and s["doc"]["max_length"] == CONTEXT
        assert s["gold"] == s["doc"]["outputs"] and s["gold"]
        assert "input" not in s["doc"] and s["prompt"].endswith(s["doc"]["gen_prefix"])
        assert all(answer in s["prompt"] for answer in s["gold"])
        assert s["gen_kwargs"]["do_sample"] is False and s["gen_kwargs"]["max_gen_toks"] > 0


def test_samples_come_from_lm_evals_task_code_and_are_reproducible(tokenizer_dir):
    built = samples.build(["niah_multikey_2", "ruler_cwe"], [CONTEXT], 2, tokenizer_dir)
    check_samples([s for s in built if s["task"] == "niah_multikey_2"], "niah_multikey_2", 2)
    check_samples([s for s in built if s["task"] == "ruler_cwe"], "ruler_cwe", 2)
    cwe = [s for s in built if s["task"] == "ruler_cwe"]
    assert all(len(s["gold"]) == 10 and s["gen_kwargs"]["max_gen_toks"] == 120 for s in cwe)
    again = samples.build(["niah_multikey_2"], [CONTEXT], 2, tokenizer_dir)  # seeded as simple_evaluate
    assert [s["prompt"] for s in again] == [s["prompt"] for s in built if s["task"] == "niah_multikey_2"]


def test_variable_tracking_samples_at_a_tiny_context(tokenizer_dir):
    built = samples.build(["ruler_vt", "niah_single_1", "niah_multikey_3"], [CONTEXT], 1, tokenizer_dir)
    for task in ("ruler_vt", "niah_single_1", "niah_multikey_3"):
        check_samples([s for s in built if s["task"] == task], task, 1)


def hand_made(tmp_path):
    """Samples of three tasks with known answers, and generations whose lm-eval scores are known."""
    def sample(task, i, gold):
        return {"id": f"{task}/4096/{i}", "task": task, "context": 4096, "doc_id": i, "prompt": "…", "gold": gold,
                "gen_kwargs": {"do_sample": False, "temperature": 0.0, "max_gen_toks": 128, "until": []},
                "doc": {"index": i, "outputs": gold, "length": 4000, "max_length": 4096, "gen_prefix": "…"}}

    words = ["apple", "brick", "cloud", "drum", "eagle", "flute", "grape", "harp", "iris", "jade"]
    built = [sample("niah_single_1", 0, ["1234567"]), sample("niah_single_1", 1, ["7654321"]),
             sample("ruler_cwe", 0, words), sample("ruler_vt", 0, ["AAAAA", "BBBBB", "CCCCC", "DDDDD", "EEEEE"])]
    texts = {
        ("niah_single_1/4096/0", "dense"): " 1234567.",
        ("niah_single_1/4096/1", "dense"): " 7654321.",
        ("ruler_cwe/4096/0", "dense"): " " + " ".join(f"{i}. {w}" for i, w in enumerate(words, 1)),
        ("ruler_vt/4096/0", "dense"): " AAAAA, BBBBB, CCCCC, DDDDD, EEEEE",
        ("niah_single_1/4096/0", "fathom@48"): " 1234567.",
        ("niah_single_1/4096/1", "fathom@48"): " 7654320.",  # wrong
        # 7 of 10 words before the end-of-sequence text; lm-eval's post-processing drops what follows it
        ("ruler_cwe/4096/0", "fathom@48"): " " + " ".join(words[:7]) + "<eos> " + " ".join(words[7:]),
        ("ruler_vt/4096/0", "fathom@48"): " aaaaa bbbbb CCCCC",  # RULER's match is case-insensitive: 3 of 5
    }
    (tmp_path / "s.json").write_text(json.dumps({"command": "hand-made", "model": "smollm2-135m", "limit": 2,
                                                 "samples": built}))
    generations = [{"id": i, "method": m, "k": 128, "text": t, "new_tokens": 5} for (i, m), t in texts.items()]
    (tmp_path / "g.json").write_text(json.dumps({
        "command": "hand-made", "samples_file": str(tmp_path / "s.json"), "model": "smollm2-135m",
        "methods": ["dense", "fathom@48"], "device": "cpu", "device_name": "cpu", "eos_text": "<eos>",
        "calibration": None, "generations": generations}))


def test_scoring_a_hand_made_generations_file_through_lm_evals_metric(tmp_path):
    hand_made(tmp_path)
    main(["ruler", "score", "--generations", str(tmp_path / "g.json"), "--out", str(tmp_path), "--name", "r"])
    payload = json.loads((tmp_path / "r.json").read_text())
    rows = {(r["task"], r["method"]): r for r in payload["rows"]}
    expected = {("niah_single_1", "dense"): (1.0, 2), ("niah_single_1", "fathom@48"): (0.5, 2),
                ("ruler_cwe", "dense"): (1.0, 1), ("ruler_cwe", "fathom@48"): (0.7, 1),
                ("ruler_vt", "dense"): (1.0, 1), ("ruler_vt", "fathom@48"): (0.6, 1)}
    for key, (score, n) in expected.items():
        assert rows[key]["score"] == pytest.approx(score) and rows[key]["n"] == n, key
    # Wilson 95% for 1 of 2: centre (0.5 + z²/4) / (1 + z²/2) = 0.5, half-width z/(1 + z²/2)·sqrt(1/8 + z²/16)
    z = 1.959963984540054
    half = z / (1 + z * z / 2) * np.sqrt(0.125 + z * z / 16)
    assert (rows[("niah_single_1", "fathom@48")]["lo"], rows[("niah_single_1", "fathom@48")]["hi"]) == \
        pytest.approx((0.5 - half, 0.5 + half))
    assert wilson(1.0, 2)[1] == 1.0 and wilson(0.0, 2)[0] == 0.0
    assert all(wilson(m, n)[0] <= m <= wilson(m, n)[1] for m in (0.0, 0.1, 1.0) for n in range(1, 300))  # rounding
    scoring = payload["scoring"]
    assert scoring["tasks"]["ruler_cwe"]["process_results"] == "lm_eval.tasks.ruler.common_utils.process_results"
    assert scoring["postprocess"] == "lm_eval.models.utils.postprocess_generated_text"
    table = (tmp_path / "r.md").read_text()
    assert "| niah_single_1 | 4096 | 2 | 1.00 [0.34, 1.00] | 0.50 [0.09, 0.91] |" in table
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_score_finds_the_samples_checks_them_and_says_when_the_generations_are_partial(tmp_path, capsys):
    """The samples file is --samples, else the one generate read, else the same name beside the generations; one
    that is not the generations' (sha256 recorded) or is nowhere is refused in one line; a run with fewer
    generations of a task than samples says it is partial."""
    import hashlib

    hand_made(tmp_path)
    generations = json.loads((tmp_path / "g.json").read_text())
    moved = tmp_path / "moved"
    moved.mkdir()
    (tmp_path / "s.json").rename(moved / "s.json")  # the recorded path is gone: found beside the generations
    generations["samples_sha256"] = hashlib.sha256((moved / "s.json").read_bytes()).hexdigest()
    generations["generations"] = [g for g in generations["generations"] if g["id"] != "niah_single_1/4096/1"]
    (moved / "g.json").write_text(json.dumps(generations))
    main(["ruler", "score", "--generations", str(moved / "g.json"), "--out", str(tmp_path), "--name", "r"])
    assert ", partial: 1 of 2 samples of a task generated" in (tmp_path / "r.md").read_text()
    capsys.readouterr()  # what scoring printed (lm-eval's own messages)
    (tmp_path / "other.json").write_text(json.dumps({"command": "other", "model": "smollm2-135m", "limit": 2,
                                                     "samples": [{"id": "x"}]}))
    assert "sha256 differs" in refused(["ruler", "score", "--generations", str(moved / "g.json"), "--samples",
                                        str(tmp_path / "other.json"), "--out", str(tmp_path)], capsys)
    (moved / "s.json").unlink()
    assert "remake it with python -m bench ruler samples" in refused(
        ["ruler", "score", "--generations", str(moved / "g.json"), "--out", str(tmp_path)], capsys)


def tiny_model(vocab):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config).eval()


def test_lm_eval_path_and_the_split_path_generate_the_same_text(tokenizer_dir, tmp_path):
    """lm-eval's HFLM with FathomCache (registered as "fathom") and the samples -> generate path (one shared
    prefill) see the same documents and produce the same generations; oracle with k over the context equals
    dense."""
    import lm_eval.api.registry

    from bench.ruler import harness

    assert lm_eval.api.registry.get_model("fathom") is harness.FathomLM
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(len(tokenizer))
    specs = [MethodSpec.parse("dense", 16), MethodSpec.parse("oracle", 16)]
    scored, aggregates = harness.evaluate(model, tokenizer, tokenizer_dir, specs, ["niah_multikey_2"], [CONTEXT],
                                          1, k=2 * CONTEXT, calibration=None)
    assert [a["method"] for a in aggregates] == ["dense", "oracle"]
    by_method = {s["method"]: s for s in scored}
    assert by_method["dense"]["text"] == by_method["oracle"]["text"] and by_method["dense"]["text"]

    built = samples.build(["niah_multikey_2"], [CONTEXT], 1, tokenizer_dir)
    assert samples.doc_digest({**built[0]["doc"], "input": None}) != built[0]["doc_digest"]  # input was stripped
    assert built[0]["doc_digest"] == by_method["dense"]["doc_digest"]
    result = generate.run(model, tokenizer, built, specs, tmp_path / "g.json", {"model": "tiny"}, k=2 * CONTEXT)
    assert {g["method"]: g["text"] for g in result["generations"]} == {m: by_method[m]["text"] for m in by_method}
    assert set(result["seconds_by_method"]) == {"prefill", "dense", "oracle"}  # one prefill for both methods
    assert json.loads((tmp_path / "g.json").read_text())["generations"] == result["generations"]


def test_a_resumed_generate_keeps_what_was_done_and_adds_its_times(tokenizer_dir, tmp_path):
    """A run cut after one method and resumed with two redoes nothing, and its seconds and wall time add to the
    first run's (a resumed JSON reports the whole run's time, not the last call's)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(len(tokenizer))
    built = samples.build(["niah_multikey_2"], [CONTEXT], 1, tokenizer_dir)
    dense, oracle = MethodSpec.parse("dense", 16), MethodSpec.parse("oracle", 16)
    first = generate.run(model, tokenizer, built, [dense], tmp_path / "g.json", {"model": "tiny"}, k=2 * CONTEXT)
    assert first["calls"] == 1 and set(first["seconds_by_method"]) == {"prefill", "dense"}
    first = json.loads(json.dumps(first))  # as --resume reads it back
    first.update(seconds_by_method={"prefill": 100.0, "dense": 50.0}, wall_s=200.0)  # a long first call
    second = generate.run(model, tokenizer, built, [dense, oracle], tmp_path / "g.json", {"model": "tiny"},
                          k=2 * CONTEXT, resumed=first)
    assert second["calls"] == 2
    assert [g["method"] for g in second["generations"]] == ["dense", "oracle"]  # dense kept, not redone
    assert second["generations"][0] == first["generations"][0]
    assert second["seconds_by_method"]["dense"] == 50.0
    assert second["seconds_by_method"]["prefill"] >= 100.0 and "oracle" in second["seconds_by_method"]
    assert 200.0 <= second["wall_s"] < 260.0


def test_token_graph_decodes_through_the_token_graph(tokenizer_dir):
    """ruler generate --token-graph hands generate fathom's token-graph loop (custom_generate=decode, tested equal
    to generate's own loop in tests/integrations/test_token_graph.py): on the CPU's reference backend, which has no
    graph, that loop refuses, where generate's own decodes."""
    from fathom.integrations.prefill import prefill

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(len(tokenizer))
    batch = samples.build(["niah_single_1"], [CONTEXT], 1, tokenizer_dir)
    batch[0]["gen_kwargs"] = {**batch[0]["gen_kwargs"], "max_gen_toks": 3}
    encoded = generate.encode(tokenizer, batch, "cpu")
    prompt = prefill(model, encoded.input_ids, encoded.attention_mask)
    spec = MethodSpec.parse("dense", 16)
    results, _ = generate.generate_batch(model, tokenizer, encoded, prompt, batch, spec, None, None)
    assert results[0]["new_tokens"] >= 1
    with pytest.raises(ValueError, match="custom_generate=decode needs the offloaded backend"):
        generate.generate_batch(model, tokenizer, encoded, prompt, batch, spec, None, None, token_graph=True)


def test_dense_in_hbm_generates_what_the_fathom_dense_cache_does(tokenizer_dir):
    """--dense-in-hbm: the dense method on transformers' DynamicCache seeded with the shared prefill, through
    generate's own loop: the text of FathomCache's dense (here the reference backend), and no top-k to report."""
    from fathom.integrations.prefill import prefill

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(len(tokenizer))
    batch = samples.build(["niah_single_1"], [CONTEXT], 2, tokenizer_dir)
    batch = [{**s, "gen_kwargs": {**s["gen_kwargs"], "max_gen_toks": 6}} for s in batch]
    encoded = generate.encode(tokenizer, batch, "cpu")
    prompt = prefill(model, encoded.input_ids, encoded.attention_mask)
    spec = MethodSpec.parse("dense", 16)
    offloaded, k = generate.generate_batch(model, tokenizer, encoded, prompt, batch, spec, None, None)
    in_hbm, no_k = generate.generate_batch(model, tokenizer, encoded, prompt, batch, spec, None, None,
                                           dense_in_hbm=True)
    assert in_hbm == offloaded and [r["new_tokens"] for r in in_hbm] == [6, 6] and k >= 1 and no_k is None


@pytest.mark.parametrize("argv, message", [
    (["lm-eval", "--limit", "0"], "--limit"),
    (["lm-eval", "--contexts", "512"], "--contexts"),
    (["lm-eval", "--contexts", "4096", "4096"], "more than once"),
    (["lm-eval", "--tasks", "niah_single_2"], "--tasks"),
    (["lm-eval", "--model", "nope"], "--model"),
    (["lm-eval", "--methods", "sparq@70"], "budget"),
    (["lm-eval", "-k", "0"], "-k"),
    (["samples", "--contexts", "40000"], "--contexts"),
    (["generate", "--samples", "/nonexistent.json"], "--samples"),
    (["score", "--generations", "/nonexistent.json"], "--generations"),
])
def test_bad_arguments_are_refused_before_any_model_load(monkeypatch, capsys, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load", no_load)
    monkeypatch.setattr(models, "ensure", no_load)
    assert message in refused(["ruler", *argv], capsys)


def test_generate_refuses_bad_sizes_and_a_resume_of_another_or_a_broken_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("model loaded"))
    hand_made(tmp_path)
    assert "--batch-size" in refused(["ruler", "generate", "--samples", str(tmp_path / "s.json"),
                                              "--batch-size", "0"], capsys)
    assert "--prefill-rows" in refused(["ruler", "generate", "--samples", str(tmp_path / "s.json"),
                                                "--prefill-rows", "0"], capsys)
    assert "--token-graph needs --device cuda" in refused(["ruler", "generate", "--samples", str(tmp_path / "s.json"),
                                                          "--token-graph"], capsys)
    samples_json = str(tmp_path / "s.json")
    assert "--dense-in-hbm runs the dense method in HBM: it needs --device cuda" in refused(
        ["ruler", "generate", "--samples", samples_json, "--dense-in-hbm"], capsys)
    assert "and dense among --methods, got --device cuda, methods oracle" in refused(
        ["ruler", "generate", "--samples", samples_json, "--dense-in-hbm", "--device", "cuda", "--methods", "oracle"],
        capsys)
    (tmp_path / "offloaded.json").write_text(json.dumps({"samples_file": samples_json, "generations": []}))
    assert "--resume: " + str(tmp_path / "offloaded.json") + " ran dense offloaded; resume it the same way" in refused(
        ["ruler", "generate", "--samples", samples_json, "--dense-in-hbm", "--device", "cuda",
         "--out", str(tmp_path / "offloaded.json"), "--resume"], capsys)
    (tmp_path / "other.json").write_text(json.dumps({"samples_file": "elsewhere.json", "generations": []}))
    assert "--resume" in refused(["ruler", "generate", "--samples", str(tmp_path / "s.json"),
                                          "--out", str(tmp_path / "other.json"), "--resume"], capsys)
    (tmp_path / "changed.json").write_text(json.dumps({"samples_file": samples_json, "samples_sha256": "0" * 64,
                                                       "generations": []}))
    assert "was generated from another" in refused(["ruler", "generate", "--samples", samples_json,
                                                    "--out", str(tmp_path / "changed.json"), "--resume"], capsys)
    (tmp_path / "k8.json").write_text(json.dumps({"samples_file": samples_json, "k_requested": 8, "device": "cpu",
                                                  "generations": []}))
    assert "was generated with k_requested 8; resume it with the same (now k_requested 32)" in refused(
        ["ruler", "generate", "--samples", samples_json, "-k", "32", "--out", str(tmp_path / "k8.json"), "--resume"],
        capsys)
    (tmp_path / "broken.json").write_text("{not json")
    assert "not a readable generations JSON" in refused(["ruler", "generate", "--samples", str(tmp_path / "s.json"),
                                                         "--out", str(tmp_path / "broken.json"), "--resume"], capsys)


def test_batches_hold_one_task_and_context_and_come_in_rounds():
    def sample(task, context, length):
        return {"id": f"{task}/{context}/{length}", "task": task, "context": context, "prompt": "x" * length,
                "gen_kwargs": {"max_gen_toks": 8}}

    built = [sample(t, c, n) for t in ("a", "b") for c in (1024, 2048) for n in (3, 5, 4)]
    got = generate.batches(built, 2)
    assert [[s["id"] for s in b] for b in got[:4]] == [["a/1024/5", "a/1024/4"], ["a/2048/5", "a/2048/4"],
                                                        ["b/1024/5", "b/1024/4"], ["b/2048/5", "b/2048/4"]]
    assert [[s["id"] for s in b] for b in got[4:]] == [["a/1024/3"], ["a/2048/3"], ["b/1024/3"], ["b/2048/3"]]


# --- bad input ------------------------------------------------------------------------------------------------


def test_ruler_samples_and_generate_refuse_an_unwritable_folder_for_their_json_first(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    (tmp_path / "s.json").write_text('{"model": "smollm2-135m", "samples": [{"id": "x"}]}')
    for argv in (["samples"], ["generate", "--samples", str(tmp_path / "s.json")]):
        err = refused(["ruler", *argv, "--out", str(blocker / "out.json")], capsys)
        assert err.startswith(f"error: --out {blocker}: cannot write there"), err
