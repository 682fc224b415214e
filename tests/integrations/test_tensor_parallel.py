"""FathomCache under transformers' tensor parallelism, on CPUs: two processes (gloo) load the same tiny Llama with
``DistributedConfig(tp_size=2)`` — transformers shards q/k/v_proj column-wise and o_proj row-wise, so each rank
computes attention for its own KV head and o_proj's all-reduce joins the heads — and each rank decodes through its
own FathomCache over its own KV head on the reference backend. Greedy tokens equal the one-process run's for dense,
fathom@48, double-sparsity (its channels calibrated per rank on the prompt) and fathom-mixed (the whole model's
calibration file, cut to each rank's heads); a model whose KV heads do not split over the ranks is refused; one
rank is the plain model. The same run passes on transformers 5.17 (by hand; CI installs the newest 5.x)."""

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from fathom.calibration import Calibration
from fathom.integrations.transformers import FathomCache
from tests.tiny_models import tiny_llama

RANKS, VOCAB, PROMPT, NEW, PAD, K = 2, 96, 100, 8, 20, 8  # row 1 is left-padded by PAD positions
HEAD_BASIS = np.array([["raw", "rotated"], ["rotated", "raw"]])  # [layer, KV head]: each rank's head its own store
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # 5.24 renames generate's past_key_values to cache


@pytest.fixture(scope="module", autouse=True)
def _single_threaded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend on a shared CPU
    yield
    torch.set_num_threads(threads)


def batch():
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :PAD], mask[1, :PAD] = 0, 0
    return ids, mask


def generate(model, cache=None, new=NEW) -> list[list[int]]:
    ids, mask = batch()
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                          pad_token_id=0).tolist()


def load(folder: Path, ranks: int):
    """The saved model loaded as under ``torchrun``, tensor-parallel over ``ranks`` (1: transformers shards nothing)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", distributed_config=transformers.DistributedConfig(tp_size=ranks)).eval()


def decode(model, calibration: Path) -> dict:
    """Every case's greedy tokens (``hf``: transformers' own generate, no FathomCache), the heads fathom@48's store
    holds and the calibrations the caches used."""
    settings = {"dense": dict(method="dense"),
                "fathom@48": dict(method="fathom", budget=48, k=K),
                "double-sparsity@17": dict(method="double-sparsity", budget=17, k=K),  # r = 4 of d = 16
                "fathom-mixed@48": dict(method="fathom-mixed", budget=48, k=K, calibration=calibration)}
    tokens, caches = {"hf": generate(model)}, {}
    for name, kwargs in settings.items():
        caches[name] = FathomCache(model, **kwargs)
        tokens[name] = generate(model, caches[name])
    store = caches["fathom@48"].decoding.sessions.shape
    return {"tokens": tokens, "heads": (store.kv_heads, store.group_size),
            "prompt_calibration": caches["double-sparsity@17"].calibration,
            "given_calibration": caches["fathom-mixed@48"].calibration}


def refusal(make) -> str | None:
    """The ValueError ``make()`` raises, as text (None: it raised none)."""
    try:
        make()
    except ValueError as error:
        return str(error)
    return None


def rank_main(rank: int, folder: Path) -> None:
    """One rank of the run (``torch.multiprocessing`` spawns it): its decode and refusals, saved for the test."""
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=RANKS,
                            timeout=timedelta(minutes=2))
    try:
        model = load(folder / "llama", RANKS)
        result = decode(model, folder / "llama.calibration.npz")
        other_ranks_share = Calibration.load(folder / "llama.calibration.npz").of_heads(1 - rank, 2 - rank)
        one_kv_head = load(folder / "llama-1-kv-head", RANKS)
        result["refusals"] = [refusal(lambda: FathomCache(model, "fathom-mixed", calibration=other_ranks_share)),
                              refusal(lambda: FathomCache(one_kv_head, "dense"))]
        result["attention_after_refusal"] = one_kv_head.config._attn_implementation
        torch.save(result, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The saved models, the whole model's calibration file (from a prompt, with a per-head store choice) and the
    one-process run."""
    folder = tmp_path_factory.mktemp("tp")
    model = tiny_llama(VOCAB)
    model.save_pretrained(folder / "llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16)).save_pretrained(folder / "llama-1-kv-head")
    rotated = FathomCache(model, "fathom-rotated", budget=24, k=K)
    generate(model, rotated, new=1)  # the prefill computes the calibration
    rotated.calibration.with_head_basis(HEAD_BASIS).save(folder / "llama.calibration.npz")
    return folder, decode(model, folder / "llama.calibration.npz")


def test_two_ranks_each_scanning_its_own_kv_head_generate_the_one_process_tokens(one_process, monkeypatch):
    folder, expected = one_process
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks' mesh on the CPU, on any machine
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    mp.start_processes(rank_main, args=(folder,), nprocs=RANKS, start_method="spawn")
    ranks = [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(RANKS)]
    assert expected["tokens"]["fathom@48"] != expected["tokens"]["dense"]  # k = 8 of ~100 tokens really selects
    whole = Calibration.load(folder / "llama.calibration.npz")
    for rank, got in enumerate(ranks):
        assert got["tokens"] == expected["tokens"], f"rank {rank}"
        assert (got["heads"], expected["heads"]) == ((1, 2), (2, 2))  # (KV heads held, query heads per KV head)
        share = got["given_calibration"]
        assert share.meta["kv_heads"] == [rank, rank + 1]
        np.testing.assert_array_equal(share.head_basis, HEAD_BASIS[:, rank:rank + 1])
        np.testing.assert_array_equal(share.basis, whole.basis[:, rank:rank + 1])
        from_prompt = got["prompt_calibration"]  # the rank's own heads' statistics, computed on its own prompt
        assert from_prompt.meta["kv_heads"] == [rank, rank + 1]
        np.testing.assert_allclose(from_prompt.sigma2_raw, expected["prompt_calibration"].sigma2_raw[:, rank:rank + 1],
                                   rtol=1e-5)
        assert got["refusals"] == [
            f"calibration must cover this rank's KV heads {[rank, rank + 1]} (half-open, of the model's), it covers "
            f"{[1 - rank, 2 - rank]}",
            "model must have KV heads divisible by its tensor-parallel size (model.tp_size = 2), got 1 KV heads"]
        assert got["attention_after_refusal"] == "sdpa"  # the refused cache left the model as it was


def test_one_rank_is_the_plain_model(one_process):
    folder, expected = one_process
    model = load(folder / "llama", 1)
    assert model.tp_size is None
    got = decode(model, folder / "llama.calibration.npz")
    assert got["tokens"] == expected["tokens"] and got["heads"] == (2, 2)


def test_a_layer_computing_other_kv_heads_than_the_cache_was_made_for_is_refused():
    """What a tensor-parallel plan that leaves the attention unsharded would give; here, a cache of another model."""
    model, other = tiny_llama(), transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    cache = FathomCache(model, "dense")
    its_own = FathomCache(other, "dense")  # while open, the other model runs Fathom's attention too
    with pytest.raises(ValueError, match=r"key_states must have the 2 KV heads the cache was made for \(the "
                                         r"model's 2 over 1 tensor-parallel ranks\), got 1"):
        generate(other, cache, new=1)
    assert cache.layers[0].length == 0  # refused before the layer counted the positions
    its_own.close()
