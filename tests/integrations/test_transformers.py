"""FathomCache inside transformers' own generate(): dense reproduces HF greedy decoding token for token (tiny
random Llama and Gemma-3 configs, batch 2 with left padding; SmolLM2 real weights when cached), oracle and a
budget that reads everything equal dense, a later plain generate is unchanged, and bad arguments are refused.
The sessions behind the cache (reference and offloaded backends, the pool): test_sessions.py."""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from bench.capture import capture
from fathom.calibration import Calibration, calibrate
from fathom.integrations.transformers import ATTENTION, CALIBRATION_QUERIES, FathomCache, Prompt, prefill
from tests.tiny_models import tiny_gemma3, tiny_llama

PROMPT, NEW, PAD = 150, 12, 37  # row 1 is left-padded by PAD positions
pytestmark = pytest.mark.usefixtures("quiet_and_single_threaded")  # tests/integrations/conftest.py


def batch(vocab: int = 97, n: int = PROMPT, pad: int = PAD):
    ids = torch.randint(1, vocab, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def generate(model, ids, mask, cache=None, new=NEW):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                          pad_token_id=0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_dense_reproduces_hf_greedy_generation_and_a_later_plain_generate_is_unchanged(make):
    model = make()
    ids, mask = batch()
    expected = generate(model, ids, mask)
    cache = FathomCache(model, method="dense")
    torch.testing.assert_close(generate(model, ids, mask, cache), expected, rtol=0, atol=0)
    assert model.config._attn_implementation == ATTENTION
    np.testing.assert_array_equal(cache.lengths(), [PROMPT + NEW - 1, PROMPT - PAD + NEW - 1])  # no pads held
    torch.testing.assert_close(generate(model, ids, mask), expected, rtol=0, atol=0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_oracle_with_k_over_the_context_and_fathom_reading_everything_equal_dense(make):
    model = make()
    ids, mask = batch()
    expected = generate(model, ids, mask)
    d = model.config.head_dim
    for cache in (FathomCache(model, "oracle", k=PROMPT + NEW), FathomCache(model, "fathom", budget=4.25 * d,
                                                                             k=PROMPT + NEW)):
        torch.testing.assert_close(generate(model, ids, mask, cache), expected, rtol=0, atol=0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_one_shared_prefill_generates_what_each_cache_prefilling_itself_does(make):
    """prefill() once, then a cache per method holding it and generate from the prefill's next token: the same
    tokens as a fresh cache that runs the prefill itself (left padding, sliding layers, a calibration and a
    per-layer plan computed from the prompt)."""
    model = make()
    ids, mask = batch()
    prompt = prefill(model, ids, mask)
    torch.testing.assert_close(prompt.next_token, generate(model, ids, mask, new=1)[:, -1], rtol=0, atol=0)
    grown_ids, grown_mask = prompt.continued(ids, mask)
    torch.testing.assert_close(grown_ids, torch.cat([ids, prompt.next_token[:, None]], 1), rtol=0, atol=0)
    torch.testing.assert_close(grown_mask, torch.cat([mask, torch.ones_like(mask[:, :1])], 1), rtol=0, atol=0)
    for method, settings in [("dense", {}), ("oracle", {"k": 8}), ("fathom", {"budget": 12, "k": 8}),
                             ("fathom-rotated", {"budget": 12, "k": 8}), ("fathom-plan", {"budget": 24, "k": 8}),
                             ("sparq", {"r": 2, "k": 8}), ("landmark", {"k": 8})]:
        fresh, shared = FathomCache(model, method, **settings), FathomCache(model, method, prompt=prompt, **settings)
        expected = generate(model, ids, mask, fresh)
        got = generate(model, grown_ids, grown_mask, shared, new=NEW - 1)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=method)
        assert shared.selection == fresh.selection and shared.method == fresh.method
        np.testing.assert_array_equal(shared.lengths(), fresh.lengths())
    with pytest.raises(ValueError, match="prompt holds"):
        FathomCache(model, "dense", prompt=Prompt(prompt.keys[:1], prompt.values[:1], prompt.queries[:1],
                                                  prompt.valid, prompt.scale, prompt.next_token))
    narrow = tuple(k[..., :8] for k in prompt.keys)
    with pytest.raises(ValueError, match="prompt layer"):
        FathomCache(model, "dense", prompt=Prompt(narrow, narrow, prompt.queries, prompt.valid, prompt.scale,
                                                  prompt.next_token))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_a_prefill_in_row_groups_holds_what_the_one_forward_prefill_does(make):
    """rows_per_forward runs a ragged batch a few rows at a time (no padded mask for a group that needs none): the
    same valid positions, keys, values and calibration queries, the same next tokens, and a cache holding it
    generates the one-forward prompt's tokens. Four rows, two of them padded, in groups of 1, 2 and 3."""
    model = make()
    ids = torch.randint(1, 97, (4, PROMPT), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    for row, pad in ((1, PAD), (2, 2 * PAD)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    whole = prefill(model, ids, mask)
    grown_ids, grown_mask = torch.cat([ids, whole.next_token[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
    expected = generate(model, grown_ids, grown_mask, FathomCache(model, "fathom", budget=12, k=8, prompt=whole),
                        new=NEW - 1)
    for rows in (1, 2, 3):
        grouped = prefill(model, ids, mask, rows_per_forward=rows)
        torch.testing.assert_close(grouped.valid, whole.valid, rtol=0, atol=0)
        torch.testing.assert_close(grouped.next_token, whole.next_token, rtol=0, atol=0)
        assert grouped.scale == whole.scale
        for layer in range(len(whole.keys)):
            for got, want in ((grouped.keys[layer], whole.keys[layer]), (grouped.values[layer], whole.values[layer])):
                assert got.shape == want.shape
                torch.testing.assert_close(got.transpose(1, 2)[whole.valid], want.transpose(1, 2)[whole.valid],
                                           rtol=1e-4, atol=1e-5)
                if rows == 1:  # each row ran without its padding: zeros there
                    assert not got.transpose(1, 2)[~whole.valid].any()
            if whole.queries[layer] is not None:
                torch.testing.assert_close(grouped.queries[layer], whole.queries[layer], rtol=1e-4, atol=1e-5)
        got = generate(model, grown_ids, grown_mask, FathomCache(model, "fathom", budget=12, k=8, prompt=grouped),
                       new=NEW - 1)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"rows_per_forward={rows}")
    for bad in (0, 1.0, True):
        with pytest.raises(ValueError, match="rows_per_forward"):
            prefill(model, ids, mask, rows_per_forward=bad)


def test_a_float32_gqa_prompt_attends_as_sdpa_does_with_its_kv_repeated():
    """A prompt without padding reaches the prompt's attention without a mask; in float32 with grouped K/V heads it
    repeats K/V rather than letting sdpa take ``enable_gqa`` (on a GPU only its math kernel serves that in float32,
    n² scores a head). The output equals transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from fathom.integrations.attention import prompt_sdpa

    model = tiny_llama()
    module = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, 33, 16, generator=generator)
    key, value = torch.randn(2, 2, 33, 16, generator=generator), torch.randn(2, 2, 33, 16, generator=generator)
    want, _ = sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=module.scaling)
    got, _ = prompt_sdpa(module, query, key, value, None, dropout=0.0, scaling=module.scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("method, settings", [("dense", {}), ("fathom", {"budget": 12, "k": 2 * PROMPT})])
def test_a_second_generate_continues_the_conversation_as_a_fresh_cache_over_all_of_it(make, method, settings):
    """Turn 2 (the turn-1 output and new tokens) continues the same cache: its tokens equal a fresh cache's over
    the whole conversation where the method reads everything (dense; top-k over the whole context), and the
    sessions hold every real token once."""
    model = make()
    ids, mask = batch()
    cache = FathomCache(model, method, **settings)
    first = generate(model, ids, mask, cache)
    said = torch.tensor([[5, 9, 11], [7, 3, 2]])
    ids2 = torch.cat([first, said], 1)
    mask2 = torch.cat([mask, torch.ones_like(first[:, PROMPT:]), torch.ones_like(said)], 1)
    second = generate(model, ids2, mask2, cache)
    fresh = FathomCache(model, method, **settings)
    torch.testing.assert_close(second, generate(model, ids2, mask2, fresh), rtol=0, atol=0)
    np.testing.assert_array_equal(cache.lengths(), fresh.lengths())
    np.testing.assert_array_equal(cache.lengths(), mask2.sum(1).numpy() + NEW - 1)


def _calibration(rng, L: int, H: int, d: int) -> Calibration:
    basis = np.stack([[np.linalg.qr(rng.standard_normal((d, d)))[0] for _ in range(H)] for _ in range(L)])
    return Calibration(np.exp(rng.uniform(-1, 1, (L, H, d))), basis.astype(np.float32),
                       np.exp(rng.uniform(-1, 1, (L, H, d))), np.stack([[rng.permutation(d) for _ in range(H)]
                                                                        for _ in range(L)]))


def test_sparse_methods_decode_over_the_store_and_differ_from_dense():
    """At a small k the sparse methods really select (their tokens leave dense's path), and every one runs."""
    model = tiny_gemma3()
    ids, mask = batch()
    dense = generate(model, ids, mask)
    differ = 0
    for method, settings in [("fathom", {}), ("fathom-rotated", {}), ("fathom-plan", {}), ("sparq", {"r": 4}),
                             ("double-sparsity", {"r": 4}), ("loki", {"r": 4}), ("thumbnail", {}),
                             ("landmark", {}), ("oracle", {})]:
        # the fixed-channel methods: r channels, not a bit budget; thumbnail, landmark and oracle read none
        budget = 16 if method.startswith("fathom") else None
        cache = FathomCache(model, method, budget=budget, k=4, sink=2, local=4, **settings)
        out = generate(model, ids, mask, cache)
        assert out.shape == dense.shape and cache.method is not None
        differ += int((out != dense).any())
    assert differ >= 5


@pytest.mark.parametrize("method, variants, computed", [
    ("fathom-rotated", {}, ["sigma2_raw", "basis", "sigma2_rotated"]),
    ("double-sparsity", {}, ["sigma2_raw", "ds_rank"]),
    ("fathom", {"gains": "calibrated", "pooled": True}, ["sigma2_raw", "plane_drops_raw", "scale2_raw"])])
def test_calibration_from_the_prompt_is_the_prompts_calibration_of_what_the_method_reads(method, variants, computed):
    """Computed layer by layer during the prefill (the torch twin): the reference calibration of the prompt's
    capture, for the fields the method reads (the basis up to the sign of each column; the plane gain table of the
    calibrated gains); decoding with it given generates the same tokens."""
    model = tiny_llama()
    ids, mask = batch()
    ids, mask = ids[:1], mask[:1]
    prompt = calibrate(capture(model, ids, positions=CALIBRATION_QUERIES))
    cache = FathomCache(model, method, budget=17, k=8, **variants)
    ours = generate(model, ids, mask, cache)
    ours_calibration = cache.calibration
    assert ours_calibration.meta["computed"] == computed
    np.testing.assert_allclose(ours_calibration.sigma2_raw, prompt.sigma2_raw, rtol=1e-5)
    if "ds_rank" in computed:
        np.testing.assert_array_equal(ours_calibration.ds_rank, prompt.ds_rank)
    if "basis" in computed:
        np.testing.assert_allclose(ours_calibration.sigma2_rotated, prompt.sigma2_rotated, rtol=1e-4, atol=1e-6)
        cosines = np.abs(np.einsum("lhdc,lhdc->lhc", ours_calibration.basis, prompt.basis))
        np.testing.assert_allclose(cosines, 1, atol=1e-3)
    if "plane_drops_raw" in computed:  # the model's bf16 keys, quantized as the reference quantizes its capture's
        np.testing.assert_allclose(ours_calibration.scale2_raw, prompt.scale2_raw, rtol=1e-2)
        np.testing.assert_allclose(ours_calibration.plane_drops_raw, prompt.plane_drops_raw, rtol=5e-2,
                                   atol=1e-3 * prompt.plane_drops_raw.max())
    given = generate(model, ids, mask, FathomCache(model, method, budget=17, k=8, calibration=ours_calibration,
                                                   **variants))
    torch.testing.assert_close(ours, given, rtol=0, atol=0)


def test_calibration_file_and_plan_are_read(tmp_path):
    model = tiny_llama()
    ids, mask = batch()
    calibration = _calibration(np.random.default_rng(2), 2, 2, 16)
    calibration.save(tmp_path / "tiny.calibration.npz")
    from_file = FathomCache(model, "double-sparsity", budget=17, k=8, calibration=tmp_path / "tiny.calibration.npz")
    generate(model, ids, mask, from_file)
    np.testing.assert_array_equal(from_file.calibration.ds_rank, calibration.ds_rank)
    planned = FathomCache(model, "fathom-plan", budget=12, k=8, plan=[8, 16])
    generate(model, ids, mask, planned)
    assert planned.method.policy.budgets == (8.0, 16.0)
    from_prompt = FathomCache(model, "fathom-plan", budget=20, k=8)
    generate(model, ids, mask, from_prompt)
    assert np.mean(from_prompt.method.policy.budgets) <= 20 and len(from_prompt.method.policy.budgets) == 2


def test_every_update_call_form_of_transformers_5_is_accepted():
    model = tiny_llama()
    cache = FathomCache(model, "dense")
    k = v = torch.zeros(1, 2, 3, 16)
    layer = cache.layers[0]
    for call in (lambda: layer.update(k, v), lambda: cache.update(k, v, 0, {"cache_position": None}),
                 lambda: cache.update(k, v, 0, kwargs={})):
        layer.length = 0
        assert call() == (k, v)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "quest"}, "method must be one of"),
    ({"budget": -1}, "budget must be a finite number"),
    ({"method": "sparq", "budget": 50}, r"budget must be r·4.25 bits for an integer r in 1..16"),
    ({"method": "double-sparsity"}, r"budget must be given for double-sparsity: r·4.25 bits"),
    ({"method": "sparq", "r": "16"}, "r must be None or an integer >= 1"),
    ({"method": "loki", "r": 17}, r"integer r in 1..16"),
    ({"r": 4}, "r is read by sparq, double-sparsity, loki only"),
    ({"k": -1}, "k must be None or an integer >= 0"),
    ({"sink": -2}, "sink must be an integer >= 0"),
    ({"variance": "prompt"}, "variance must be None or one of"),
    ({"backend": "gpu"}, "backend must be one of"),
    ({"plan": (8, 16)}, "plan is fathom-plan's per-layer budgets"),
    ({"method": "fathom-plan", "plan": (8, 16, 8)}, "plan must have one budget per full-attention layer"),
    ({"method": "fathom-plan", "budget": 10, "plan": (8, 16)}, "plan must average at most budget = 10"),
    ({"method": "fathom-plan", "budget": 10}, r"budget must lie in 16..136 bits to plan fathom-plan"),
    ({"calibration": "missing.calibration.npz"}, "calibration must be a .calibration.npz file"),
    ({"calibration": 3}, "calibration must be a path or a fathom.calibration.Calibration"),
    ({"window": 3}, "unknown settings window"),
    ({"method": ["fathom"]}, "method must be a method name"),
    ({"method": "sparq", "budget": 68, "r": 4}, "budget and r disagree for sparq: budget = 68 bits is r = 16"),
    ({"method": "dense", "variance": "calibration"}, "variance is read by the water-filled methods only"),
    ({"method": "oracle", "budget": 48}, "oracle reads no budget: leave budget None"),
    ({"method": "sparq", "budget": 68, "variance": "store"}, "variance is read by the water-filled methods only"),
    ({"method": "fathom-plan", "plan": (True, 16)}, "plan must hold finite budgets >= 0"),
    ({"method": "fathom-plan", "plan": 48}, "plan must be a sequence of budgets"),
    ({"prompt": torch.zeros(3)}, "prompt must be a Prompt made by"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FathomCache(tiny_llama(), **kwargs)


def test_bad_model_calibration_and_use_are_refused():
    model = tiny_llama()
    wrong = _calibration(np.random.default_rng(0), 3, 2, 16)
    with pytest.raises(ValueError, match=r"calibration must have \[layers, KV heads, head dim\] = \(2, 2, 16\)"):
        FathomCache(model, "loki", budget=17, calibration=wrong)
    with pytest.raises(ValueError, match="model must use sdpa attention"):
        FathomCache(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            attn_implementation="eager")), "dense")
    ids, mask = batch()
    cache = FathomCache(model, "dense")
    model(ids, attention_mask=mask, past_key_values=cache)
    padded_chunk = torch.cat([mask, torch.tensor([[1, 1], [0, 1]])], 1)
    with pytest.raises(ValueError, match="a continuation chunk must hold no padding"):
        model(ids[:, :2], attention_mask=padded_chunk, past_key_values=cache)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="the model's attention implementation is 'sdpa'"):
        model(ids[:, :1], past_key_values=cache)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_a_refused_forward_leaves_the_whole_cache_as_it_was(make):
    """A continuation chunk refused by the first full-attention layer (padding), after the sliding-window layers
    before it took it (Gemma-3), leaves every layer as before: a retry gives a fresh cache's logits. A batch other
    than the cache's conversations and a closed cache are refused before any layer holds anything."""
    model = make()
    ids, mask = batch(n=20, pad=0)
    said = torch.tensor([[5, 9], [7, 3]])
    grown = torch.cat([mask, torch.ones_like(said)], 1)

    def filled():
        cache = FathomCache(model, "dense")
        model(ids, attention_mask=mask, past_key_values=cache)
        return cache

    clean = model(said, attention_mask=grown, past_key_values=filled()).logits
    cache = filled()
    before = [layer.get_seq_length() for layer in cache.layers]
    with pytest.raises(ValueError, match="a continuation chunk must hold no padding"):
        model(said, attention_mask=torch.cat([mask, torch.tensor([[1, 1], [0, 1]])], 1), past_key_values=cache)
    assert [layer.get_seq_length() for layer in cache.layers] == before
    for rows in (ids[:1], torch.cat([ids, ids[:1]])):
        with pytest.raises(ValueError, match="the input must hold the cache's 2 conversations, one per batch row"):
            model(rows[:, :2], past_key_values=cache)
        assert [layer.get_seq_length() for layer in cache.layers] == before
    torch.testing.assert_close(model(said, attention_mask=grown, past_key_values=cache).logits, clean,
                               rtol=0, atol=0)
    cache.close()
    with pytest.raises(ValueError, match="the FathomCache was closed"):
        model(said[:, :1], past_key_values=cache)


def _poisoned_keys(model, layer: int):
    """A switch that makes ``layer``'s keys NaN while on (the store refuses them), through a forward hook."""
    on = [False]
    model.model.layers[layer].self_attn.k_proj.register_forward_hook(
        lambda module, args, out: out * float("nan") if on[0] else out)
    return on


def test_a_refused_prefill_or_token_leaves_the_cache_as_it_was():
    """A prefill refused at its first full-attention layer (a row of padding only) or at a later one (after the
    first opened the sessions and stored the prompt), and a decode token refused at the first layer, leave the
    cache as before them: a retry gives a fresh cache's logits."""
    model = tiny_llama()
    poisoned = _poisoned_keys(model, 1)
    ids, mask = batch(n=20, pad=3)
    empty = mask.clone()
    empty[0] = 0
    token = torch.tensor([[5], [7]])
    fresh = FathomCache(model, "dense")
    clean_prompt = model(ids, attention_mask=mask, past_key_values=fresh).logits
    clean_token = model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1),
                        past_key_values=fresh).logits
    cache = FathomCache(model, "dense")
    with pytest.raises(ValueError, match="attention_mask row 0 holds no real token"):
        model(ids, attention_mask=empty, past_key_values=cache)
    poisoned[0] = True
    with pytest.raises(ValueError, match="k and v must be finite"):
        model(ids, attention_mask=mask, past_key_values=cache)
    poisoned[0] = False
    assert [layer.get_seq_length() for layer in cache.layers] == [0, 0] and cache.decoding.sessions is None
    torch.testing.assert_close(model(ids, attention_mask=mask, past_key_values=cache).logits, clean_prompt,
                               rtol=0, atol=0)
    first_layer_poisoned = _poisoned_keys(model, 0)
    first_layer_poisoned[0] = True
    with pytest.raises(ValueError, match="k and v must be finite"):
        model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1), past_key_values=cache)
    first_layer_poisoned[0] = False
    assert [layer.get_seq_length() for layer in cache.layers] == [20, 20]
    torch.testing.assert_close(model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1),
                                     past_key_values=cache).logits, clean_token, rtol=0, atol=0)


def test_a_forward_refused_after_an_earlier_layer_stored_it_refuses_to_go_on():
    """A chunk refused at the second full-attention layer has entered the first one's store, which only grows: the
    cache refuses every later forward instead of decoding over layers that hold different tokens."""
    model = tiny_llama()
    poisoned = _poisoned_keys(model, 1)
    ids, mask = batch(n=20, pad=0)
    said = torch.tensor([[5, 9], [7, 3]])
    grown = torch.cat([mask, torch.ones_like(said)], 1)
    cache = FathomCache(model, "dense")
    model(ids, attention_mask=mask, past_key_values=cache)
    poisoned[0] = True
    with pytest.raises(ValueError, match="k and v must be finite"):
        model(said, attention_mask=grown, past_key_values=cache)
    poisoned[0] = False
    with pytest.raises(ValueError, match="a forward refused at full-attention layer 1 left its tokens in the store"):
        model(said, attention_mask=grown, past_key_values=cache)


def test_prefill_refuses_inputs_it_cannot_hold_before_the_model_runs():
    model = tiny_llama()
    ids, mask = batch(n=20, pad=3)
    right = mask.flip(1)
    empty = mask.clone()
    empty[0] = 0
    for bad_ids, bad_mask, message in ((ids[0], None, r"input_ids must be integer token ids \[B, n\]"),
                                       (ids, mask[:, 1:], "attention_mask must have input_ids' shape"),
                                       (ids, 2 * mask, "attention_mask must hold 0"),
                                       (ids, right, "attention_mask row 1 is not left-padded"),
                                       (ids, empty, "attention_mask row 0 holds no real token")):
        with pytest.raises(ValueError, match=message):
            prefill(model, bad_ids, bad_mask)
    cache = FathomCache(model, "dense")
    with pytest.raises(ValueError, match="attention_mask row 0 holds no real token: each batch row is a conversation"):
        model(ids, attention_mask=empty, past_key_values=cache)


def _cached(name: str) -> bool:
    from bench.artifacts import done_marker
    from bench.models import model_dir
    return done_marker(model_dir(name) / "hf").exists()


needs_smollm2 = pytest.mark.skipif(not _cached("smollm2-135m"),
                                   reason="SmolLM2-135M is not in the cache (python -m bench fetch smollm2-135m)")


@needs_smollm2
def test_dense_reproduces_hf_greedy_generation_on_smollm2():
    from bench.models import load

    model, tokenizer = load("smollm2-135m")
    tokenizer.padding_side = "left"
    batch = tokenizer(["The capital of France is", "def fibonacci(n):\n"], return_tensors="pt", padding=True)
    expected = generate(model, batch.input_ids, batch.attention_mask, new=6)
    got = generate(model, batch.input_ids, batch.attention_mask, FathomCache(model, "dense"), new=6)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _readme_example() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Use it with transformers", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


@needs_smollm2
def test_the_readme_example_runs_as_written(monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[2])  # the example names a calibration file under bench/results
    exec(compile(_readme_example(), "README.md", "exec"), {})
