"""The capture records exactly what attention sees: checked against the model's own attention output
on tiny randomly initialised models (no download), with and without QK-norm and sliding-window layers."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bench import capture as bench_capture  # noqa: E402
from bench import artifacts, corpora, models  # noqa: E402
from bench.capture import capture, global_layers  # noqa: E402
from fathom.attention import attention  # noqa: E402
from tests.tiny_models import tiny_gemma3, tiny_llama  # noqa: E402


@pytest.mark.parametrize("query_chunk", [None, 16])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_captured_queries_keys_values_reproduce_the_models_attention(make, query_chunk):
    """Also with the attention in chunks of query rows (as on a GPU): each output row is exact causal attention."""
    torch.manual_seed(0)
    model = make()
    n, P = 70, 5
    ids = torch.randint(0, 97, (1, n))
    outputs = {}
    layers = global_layers(model.config)
    hooks = [model.model.layers[i].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args, i=i: outputs.__setitem__(i, args[0][0].detach().numpy().copy())) for i in layers]
    cap = capture(model, ids, positions=P, query_chunk=query_chunk)
    for hook in hooks:
        hook.remove()
    L, H, _, d = cap.keys.shape
    G = cap.queries.shape[3]
    assert L == len(layers) and cap.meta["layers"] == layers and cap.scale == model.model.layers[0].self_attn.scaling
    np.testing.assert_array_equal(cap.positions, np.arange(n - P, n))
    for li, layer in enumerate(layers):
        model_out = outputs[layer].reshape(n, H * G, d)  # attention output before o_proj
        for p, pos in enumerate(cap.positions):
            causal = np.arange(n) <= pos
            for kv in range(H):
                ours = attention(cap.queries[li, kv, p], cap.keys[li, kv][causal], cap.values[li, kv][causal],
                                 scale=cap.scale)
                np.testing.assert_allclose(ours, model_out[pos, kv * G:(kv + 1) * G], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_a_capture_in_chunks_of_query_rows_equals_the_whole_one(make):
    """Every layer's attention in chunks (11 rows: the last chunk short) changes no key, value or query, Gemma-3's
    sliding-window layers (whose mask the chunks slice) included: their outputs feed the global layer."""
    torch.manual_seed(0)
    model = make()
    ids = torch.randint(0, 97, (1, 70))
    whole, chunked = capture(model, ids, positions=5), capture(model, ids, positions=5, query_chunk=11)
    for name in ("keys", "values", "queries"):
        np.testing.assert_allclose(getattr(chunked, name), getattr(whole, name), rtol=1e-5, atol=1e-6)


def test_global_layers_skip_sliding_window_layers():
    assert global_layers(tiny_gemma3().config) == [1]
    assert global_layers(tiny_llama().config) == [0, 1]


@pytest.mark.gpu
def test_a_capture_on_the_gpu_matches_the_cpu_capture():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 70))
    on_cpu = capture(model, ids, positions=5)
    on_gpu = capture(model.to("cuda"), ids, positions=5)
    for name in ("keys", "values", "queries"):
        np.testing.assert_allclose(getattr(on_gpu, name), getattr(on_cpu, name), rtol=1e-4, atol=1e-5)


# --- bad input ------------------------------------------------------------------------------------------------


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
    monkeypatch.setattr(artifacts, "_VERIFIED", {})  # a new process: nothing hashed yet
    again, _ = capture()
    np.testing.assert_array_equal(again.keys, first.keys)
    assert fake.calls == 2 and f"cache: {path} has" in capsys.readouterr().err

    builds["m"] = "model-build-2"  # the weights were rebuilt differently
    assert capture()[0].meta["model_sha256"] == "model-build-2" and fake.calls == 3
    assert "made from another build of smollm2-135m or another text" in capsys.readouterr().err

    texts["paul-graham"] = "other " * 40  # the corpus changed
    assert capture()[0].meta["text_sha256"] != first.meta["text_sha256"] and fake.calls == 4


def test_the_prefill_shows_its_progress_per_layer(capsys):
    fake = CountingModel()
    model, tokenizer = fake()
    bench_capture.capture(model, tokenizer("some text " * 8).input_ids, positions=4)
    err = capsys.readouterr().err
    assert "prefill 80 tokens: 100%" in err and "2/2 [" in err  # one tick per layer of the 2-layer model
