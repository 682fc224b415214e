"""RULER generations through FathomCache, every method on every sample, with no lm-eval import.

This is the half of ``python -m bench ruler`` that runs where lm-eval is not
installed (the GPU machine): it reads the samples JSON written by
``python -m bench ruler samples``, tokenizes each prompt as lm-eval's ``HFLM``
does (the tokenizer's own special tokens, left padding in a batch) and decodes
greedily with the real ``model.generate`` and a fresh
:class:`~fathom.integrations.transformers.FathomCache` per batch and method, up
to the task's ``max_gen_toks`` or the model's end-of-sequence token. The text
is decoded as ``HFLM`` decodes it (special tokens skipped); cutting at stop
sequences and scoring happen in ``python -m bench ruler score``, with lm-eval.

One dense prefill per batch serves every method: :func:`fathom.integrations.prefill.prefill`
runs it once, each method's cache starts from it (``FathomCache(..., prompt=)``)
and ``generate`` continues from the prefill's greedy token — the same tokens as
a cache that prefills by itself (tested), at a sixth of the prefill time for
six methods.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm import tqdm

from bench.cli import UsageError
from bench.decoding import MethodSpec


def read_samples(path: Path) -> dict:
    """The samples JSON; refuses a file that is not one (ValueError names ``--samples``)."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--samples {path}: not a readable samples JSON ({error})") from None
    if not isinstance(payload, dict) or not payload.get("samples") or "model" not in payload:
        raise UsageError(f"--samples {path}: has no samples (write it with python -m bench ruler samples)")
    return payload


def batches(samples: list[dict], size: int) -> list[list[dict]]:
    """Batches of ``size`` samples of the same task, context and generation kwargs, in rounds: the first batch
    of every group, then the second of every group, ... (a run cut short holds every task at every context)."""
    groups: dict[str, list[dict]] = {}
    for s in samples:
        groups.setdefault(json.dumps([s["task"], s["context"], s["gen_kwargs"]], sort_keys=True), []).append(s)
    ordered = [sorted(group, key=lambda s: -len(s["prompt"])) for group in groups.values()]  # as lm-eval batches
    split = [[group[i:i + size] for i in range(0, len(group), size)] for group in ordered]
    return [group[r] for r in range(max(map(len, split))) for group in split if r < len(group)]


def encode(tokenizer, batch: list[dict], device):
    """The batch's prompts as ``HFLM`` tokenizes them: the tokenizer's own special tokens, left padding."""
    tokenizer.padding_side = "left"
    return tokenizer([s["prompt"] for s in batch], padding="longest", return_tensors="pt").to(device)


def generate_batch(model, tokenizer, encoded, prompt, batch: list[dict], spec: MethodSpec, k: int | None,
                   calibration: Path | None, token_graph: bool = False,
                   dense_in_hbm: bool = False) -> tuple[list[dict], int | None]:
    """Greedy generations of one batch with one method, from the batch's shared prefill ``prompt`` -> (per
    sample: text and new tokens, the top-k used; None for a dense cache in HBM). ``token_graph``: decode with the
    whole token as one CUDA graph (``custom_generate=``:func:`fathom.integrations.token_graph.decode`, the offloaded
    backend, full-attention models), which generates what generate's own loop does (tested) at the graph's GPU time
    a token. ``dense_in_hbm``: the dense method on transformers' DynamicCache, the K/V in HBM and sdpa's attention
    (:func:`bench.decoding.hf_cache`), through generate's own loop: the same attention as FathomCache's offloaded
    dense, without reading every K/V row over the link each token."""
    import torch

    from bench.decoding import hf_cache
    from fathom.integrations.token_graph import decode

    n, new_tokens = encoded.input_ids.shape[1], batch[0]["gen_kwargs"]["max_gen_toks"]
    in_hbm = dense_in_hbm and spec.method == "dense"
    # max_tokens: what the offloaded backend reserves per session (pinned host memory), not the model's context
    cache = hf_cache(model, prompt) if in_hbm else \
        spec.cache(model, k=k, calibration=calibration, prompt=prompt, max_tokens=n + new_tokens)
    new = prompt.next_token[:, None]
    if new_tokens > 1:
        ids, mask = prompt.continued(encoded.input_ids, encoded.attention_mask)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens - 1,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 **({"custom_generate": decode} if token_graph and not in_hbm else {}))
        new = out[:, n:]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    results = []
    for tokens in new.tolist():
        length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        results.append({"text": tokenizer.decode(tokens[:length], skip_special_tokens=True), "new_tokens": length})
    if in_hbm:
        return results, None
    top_k = cache.selection.k
    cache.close()
    return results, top_k


def run(model, tokenizer, samples: list[dict], specs: list[MethodSpec], out: Path, header: dict,
        k: int | None = None, calibration: Path | None = None, batch_size: int = 1,
        resumed: dict | None = None, prefill_rows: int | None = None, token_graph: bool = False,
        dense_in_hbm: bool = False) -> dict:
    """Every method on every sample, one dense prefill per batch (``prefill_rows`` rows of it at a time:
    :func:`~fathom.integrations.prefill.prefill`'s ``rows_per_forward``; ``token_graph``, ``dense_in_hbm``:
    :func:`generate_batch`'s);
    the JSON at ``out`` is rewritten after each batch and method. A cut run keeps what it finished: ``resumed`` (its
    JSON) has its generations kept, not redone, and its times added to this run's (``seconds_by_method``,
    ``wall_s``; ``calls`` counts the runs)."""
    from fathom.integrations.prefill import prefill

    resumed = resumed or {}
    generations = list(resumed.get("generations", []))
    finished = {(g["id"], g["method"]) for g in generations}
    todo = [(b, [spec for spec in specs if any((s["id"], spec.label) not in finished for s in b)])
            for b in batches(samples, batch_size)]
    todo = [(b, pending) for b, pending in todo if pending]
    seconds: dict[str, float] = dict(resumed.get("seconds_by_method", {}))
    wall_before = resumed.get("wall_s", 0.0)
    payload = {**header, "generations": generations, "calls": resumed.get("calls", 1 if resumed else 0) + 1}
    started = time.perf_counter()
    with tqdm(total=sum(len(pending) for _, pending in todo), desc="ruler generate", unit="batch") as bar:
        for batch, pending in todo:
            bar.set_postfix_str(f"{batch[0]['task']} {batch[0]['context']} prefill")
            start = time.perf_counter()
            encoded = encode(tokenizer, batch, model.device)
            prompt = prefill(model, encoded.input_ids, encoded.attention_mask, rows_per_forward=prefill_rows)
            prefill_seconds = time.perf_counter() - start
            seconds["prefill"] = seconds.get("prefill", 0.0) + prefill_seconds
            for spec in pending:
                bar.set_postfix_str(f"{batch[0]['task']} {batch[0]['context']} {spec.label}")
                start = time.perf_counter()
                results, top_k = generate_batch(model, tokenizer, encoded, prompt, batch, spec, k, calibration,
                                                token_graph, dense_in_hbm)
                elapsed = time.perf_counter() - start
                seconds[spec.label] = seconds.get(spec.label, 0.0) + elapsed
                for sample, result in zip(batch, results, strict=True):
                    generations.append({"id": sample["id"], "method": spec.label, "k": top_k, **result,
                                        "batch_seconds": round(elapsed, 2),
                                        "prefill_seconds": round(prefill_seconds, 2)})
                payload["seconds_by_method"] = {m: round(t, 1) for m, t in seconds.items()}
                payload["wall_s"] = round(wall_before + time.perf_counter() - started, 1)
                _write_atomically(out, payload)
                bar.update()
            del prompt  # its K/V, before the next batch's prefill
    return payload


def _write_atomically(path: Path, payload: dict) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)
