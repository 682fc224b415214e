"""Tiny randomly initialised transformers models (no download), seeded: a GQA Llama and a Gemma-3 with QK-norm
and sliding-window layers."""

from types import MappingProxyType

import torch
import transformers


def tiny_llama(vocab: int = 97) -> transformers.LlamaForCausalLM:
    """d = 16, 4 query heads over 2 KV heads, 2 layers, vocabulary ``vocab`` (96 for tensor parallelism over 2 ranks:
    transformers 5.17 shards lm_head's outputs evenly or refuses)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=100.0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_offload_llama(layers: int = 1, kv_heads: int = 1) -> transformers.LlamaForCausalLM:
    """d = 16, 2 query heads over each of ``kv_heads`` KV heads, ``layers`` layers, vocabulary 97, seeded, in bf16 on
    the decode device (the CPU under the simulator): the model the offloaded backend's tests generate with."""
    from fathom.cuda.interop import DEVICE

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=16,
                                      rope_theta=100.0)
    return transformers.LlamaForCausalLM(config).eval().to(DEVICE, torch.bfloat16)


# What the offloaded backend's tests decode tiny_offload_llama with: a small k, so the step really selects, and a
# capacity the tests' 70-token batch outgrows only where a test means it to; unpooled unless a test says otherwise.
OFFLOAD_SETTINGS = MappingProxyType(dict(budget=20, k=6, sink=2, local=4, max_tokens=80, pool=False))


def tiny_gemma3() -> transformers.Gemma3ForCausalLM:
    """d = 32, 4 query heads over 1 KV head, a full-attention layer between two 16-token sliding layers."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                           sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                                                           "sliding_attention"],
                                           query_pre_attn_scalar=32)
    return transformers.Gemma3ForCausalLM(config).eval()
