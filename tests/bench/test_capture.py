"""The capture records exactly what attention sees: checked against the model's own attention output
on tiny randomly initialised models (no download), with and without QK-norm and sliding-window layers."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bench.capture import capture, global_layers  # noqa: E402
from fathom.attention import attention  # noqa: E402
from tests.tiny_models import tiny_gemma3, tiny_llama  # noqa: E402


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_captured_queries_keys_values_reproduce_the_models_attention(make):
    torch.manual_seed(0)
    model = make()
    n, P = 70, 5
    ids = torch.randint(0, 97, (1, n))
    outputs = {}
    layers = global_layers(model.config)
    hooks = [model.model.layers[i].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args, i=i: outputs.__setitem__(i, args[0][0].detach().numpy().copy())) for i in layers]
    cap = capture(model, ids, positions=P)
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
