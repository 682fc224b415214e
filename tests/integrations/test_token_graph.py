"""The whole decode token as one CUDA graph (``custom_generate=decode``) generates what ``generate``'s own loop
does over the same FathomCache (under the CUDA simulator: the captured work run eagerly per token; on the GPU with
FATHOM_GPU=1: the graph), and what it cannot hold is refused before the prefill."""

import re
import warnings
from pathlib import Path

import pytest
import torch

from fathom.cuda.interop import DEVICE
from fathom.integrations.token_graph import decode
from fathom.integrations.transformers import FathomCache
from tests.integrations.test_transformers import batch
from tests.tiny_models import OFFLOAD_SETTINGS, tiny_gemma3, tiny_offload_llama


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _generate(model, ids, mask, cache, new, **kwargs):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                          pad_token_id=0, **kwargs)


def test_the_token_graph_generates_what_generates_own_loop_does_and_continues_a_conversation():
    """Turn 1 captures the token graph; turn 2 (a chunk, then decoding) replays the same graph, kept with the
    sessions, bound to the cache's new state. Turn 1 runs under ``torch.inference_mode`` and turn 2 outside it:
    what turn 1 made (the sessions, the graph's buffers) must be ordinary tensors that turn 2 may write."""
    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=70, pad=9))
    settings = OFFLOAD_SETTINGS
    eager = FathomCache(model, "fathom", backend="offloaded", **settings)
    expected = _generate(model, ids, mask, eager, new=2)
    cache = FathomCache(model, "fathom", backend="offloaded", **settings)
    with torch.inference_mode():
        torch.testing.assert_close(_generate(model, ids, mask, cache, new=2, custom_generate=decode), expected,
                                   rtol=0, atol=0)
    assert cache.lengths().tolist() == [71, 62]  # the prompts' real tokens and one decoded, the last not yet held
    kept = dict(cache.decoding.sessions.token_graphs)
    assert len(kept) == 1
    said = torch.tensor([[5, 9], [7, 3]], device=DEVICE)
    ids2, mask2 = torch.cat([expected, said], 1), torch.cat([mask, torch.ones_like(expected[:, 70:]),
                                                             torch.ones_like(said)], 1)
    torch.testing.assert_close(_generate(model, ids2, mask2, cache, new=2, custom_generate=decode),
                               _generate(model, ids2, mask2, eager, new=2), rtol=0, atol=0)
    assert cache.decoding.sessions.token_graphs == kept  # replayed again, not captured anew
    cache.close()
    eager.close()


@pytest.mark.gpu  # 35 s under the simulator (its threads, not the work): CI runs the pieces in the tests above
def test_the_token_graph_continues_a_cache_made_from_a_shared_prefill_in_row_groups():
    """A cache holding a shared prompt prefilled a row at a time (``bench generate --prefill-rows``) decodes on the
    token graph what generate's own loop does from the same prompt."""
    from fathom.integrations.prefill import prefill

    model = tiny_offload_llama()
    ids, mask = (x.to(DEVICE) for x in batch(n=24, pad=5))
    prompt = prefill(model, ids, mask, rows_per_forward=1)
    grown = torch.cat([ids, prompt.next_token[:, None]], 1), torch.cat([mask, mask[:, -1:]], 1)
    caches = [FathomCache(model, "fathom", backend="offloaded", prompt=prompt, **OFFLOAD_SETTINGS) for _ in "ab"]
    torch.testing.assert_close(_generate(model, *grown, caches[0], new=2, custom_generate=decode),
                               _generate(model, *grown, caches[1], new=2), rtol=0, atol=0)
    for cache in caches:
        cache.close()


def test_an_eos_stop_leaves_its_token_in_the_cache_and_the_conversation_continues_as_generates_own():
    """The replay of the next token is launched before the host reads the stop, so an EOS stop appends the last
    returned token too: the next turn starts after it and generates what generate's own loop does."""
    model = tiny_offload_llama()
    ids = torch.randint(3, 97, (1, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    settings = dict(OFFLOAD_SETTINGS, max_tokens=40)
    eager = FathomCache(model, "fathom", backend="offloaded", **settings)
    first = _generate(model, ids, mask, eager, new=2)  # eager holds 25: the second new token is not fed
    eos = int(first[0, -1])
    if eos == int(first[0, -2]):
        pytest.skip("the model repeats its first token: no EOS stop after two tokens to test")
    cache = FathomCache(model, "fathom", backend="offloaded", **settings)
    out = _generate(model, ids, mask, cache, new=4, custom_generate=decode, eos_token_id=eos)
    torch.testing.assert_close(out, first, rtol=0, atol=0)  # stopped by EOS after two tokens
    assert cache.get_seq_length() == 26  # the EOS token is held (a stop by length leaves it out, as above)
    said = torch.tensor([[5, 9, 11]], device=DEVICE)
    ids2 = torch.cat([out, said], 1)
    torch.testing.assert_close(_generate(model, ids2, torch.ones_like(ids2), cache, new=2, custom_generate=decode),
                               _generate(model, ids2, torch.ones_like(ids2), eager, new=2), rtol=0, atol=0)
    cache.close()
    eager.close()


def test_what_the_token_graph_cannot_hold_is_refused():
    ids, mask = batch()
    model = tiny_gemma3()
    with pytest.raises(ValueError, match="needs every layer to be full attention"):
        _generate(model, ids, mask, FathomCache(model, "dense"), new=2, custom_generate=decode)
    llama = tiny_offload_llama()
    with pytest.raises(ValueError, match="needs past_key_values=FathomCache"):
        _generate(llama, ids.to(DEVICE), mask.to(DEVICE), None, new=2, custom_generate=decode)
    with pytest.raises(ValueError, match="return_dict_in_generate=False"):
        _generate(llama, ids.to(DEVICE), mask.to(DEVICE), FathomCache(llama, "dense"), new=2, custom_generate=decode,
                  return_dict_in_generate=True)
    if DEVICE.type == "cpu":  # a model on the CPU decodes on the reference backend, which has no graph
        with pytest.raises(ValueError, match="needs the offloaded backend"):
            _generate(llama, ids, mask, FathomCache(llama, "dense", backend="reference"), new=2,
                      custom_generate=decode)


def test_fathom_plan_planned_on_the_prompt_opens_its_sessions_before_the_graph_and_the_pool_keeps_no_model():
    """fathom-plan without plan= opens its sessions at the first step, which the token graph's decode does before
    it captures (the same tokens as generate's own loop); the graph kept with pooled sessions holds neither the
    cache nor the model, which go when their user drops them."""
    import gc
    import weakref

    from fathom.integrations.sessions import POOL

    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    settings = {**OFFLOAD_SETTINGS, "budget": 20, "pool": True}
    model = tiny_offload_llama()
    expected = _generate(model, ids, None, FathomCache(model, "fathom-plan", backend="offloaded", **settings), new=3)
    cache = FathomCache(model, "fathom-plan", backend="offloaded", **settings)
    torch.testing.assert_close(_generate(model, ids, None, cache, new=3, custom_generate=decode), expected,
                               rtol=0, atol=0)
    cache.close()
    alive = weakref.ref(model), weakref.ref(cache)
    del model, cache
    gc.collect()
    assert len(POOL) > 0 and alive[0]() is None and alive[1]() is None
    POOL.clear()


@pytest.mark.gpu
def test_the_docs_token_graph_example_runs_and_generates_what_generate_does():
    from tests.integrations.test_transformers import _cached

    if not _cached("smollm2-135m"):
        pytest.skip("SmolLM2-135M is not in the cache (python -m bench fetch smollm2-135m)")
    doc = (Path(__file__).parents[2] / "docs" / "transformers.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(# token graph: .*?)```", doc, flags=re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/transformers.md:token-graph", "exec"), scope)
    model, batch = scope["model"], scope["batch"]
    plain = model.generate(**batch, past_key_values=FathomCache(model, method="fathom", budget=48),
                           max_new_tokens=32, do_sample=False)
    torch.testing.assert_close(scope["out"], plain, rtol=0, atol=0)
