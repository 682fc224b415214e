"""FathomCache inside transformers' own generate(): dense reproduces HF greedy decoding token for token (tiny
random Llama and Gemma-3 configs, batch 2 with left padding; SmolLM2 real weights when cached), oracle and a
budget that reads everything equal dense, the reference sessions equal the reference decode step, a later
plain generate is unchanged, and bad arguments are refused."""

import warnings

import numpy as np
import pytest
import torch
import transformers

from fathom import methods as M
from fathom.calibration import calibrate
from fathom.decode import HeadIndex, decode_step
from fathom.integrations.sessions import ReferenceSessions, SessionShape
from fathom.integrations.transformers import ATTENTION, FathomCache
from fathom.methods import HeadStats
from fathom.selection import Selection

PROMPT, NEW, PAD = 150, 12, 37  # row 1 is left-padded by PAD positions


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.24 renames generate's past_key_values to cache
        yield


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=100.0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gemma3():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                           sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                                                           "sliding_attention"],
                                           query_pre_attn_scalar=32)
    return transformers.Gemma3ForCausalLM(config).eval()


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
