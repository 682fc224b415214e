"""The models ``python -m bench generate`` decodes with: the 8B models' shapes with random bf16 weights (speed does
not depend on the values; accuracy comes from the fidelity and RULER benches), built on the GPU in seconds, and
the real models of ``bench.models``."""

from __future__ import annotations

SHAPES = {  # transformers configs of the 8B models' shapes (random weights)
    "qwen3-8b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=131072, rope_theta=1e6)),
    "llama3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, max_position_embeddings=131072, rope_theta=5e5)),
}
REAL = ("smollm2-135m",)


def head_dim(name: str) -> int:
    """The attention head dim of model ``name`` (a shape's or a real model's)."""
    if name in SHAPES:
        return SHAPES[name][1]["head_dim"]
    from bench.models import info

    return info(name).head_dim


def context_of(name: str) -> int:
    """The longest context model ``name`` takes (a shape's ``max_position_embeddings``, a real model's context)."""
    if name in SHAPES:
        return SHAPES[name][1]["max_position_embeddings"]
    from bench.models import info

    return info(name).context


def shape_layers(name: str) -> int | None:
    """The decoder layers of shape ``name``; None for a real model."""
    return SHAPES[name][1]["num_hidden_layers"] if name in SHAPES else None


def build_model(name: str, layers: int | None = None):
    """The real model on the GPU in bf16, or a shape's (``layers`` decoder layers, default its own) with random bf16
    weights."""
    import torch
    import transformers

    if name in REAL:
        from bench.models import load

        model, _ = load(name)
        return model.to("cuda", torch.bfloat16).eval()
    config_class, config = SHAPES[name]
    if layers is not None:
        config = {**config, "num_hidden_layers": layers}
    with torch.device("cuda"):
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**config, attn_implementation="sdpa")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()
