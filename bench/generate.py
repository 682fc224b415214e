"""``python -m bench generate``: a model decoding through transformers' ``generate``, every system side by side.

Systems, each run in the same process on the same prompts: ``hf-sdpa`` (transformers' DynamicCache, K/V in HBM;
skipped where it does not fit), ``hf-offloaded`` (transformers' own offloaded DynamicCache, K/V in host memory),
and FathomCache specs (``dense``, ``fathom@48``, ``sparq@68``, ``double-sparsity@136``, ...: bench.decoding's
specs) through ``generate``'s own loop, or with ``+graph`` (``fathom@48+graph``) through
``custom_generate=fathom.integrations.token_graph.decode``, the whole decode token as one CUDA graph.

Models: ``qwen3-8b`` and ``llama3.1-8b`` are those models' **shapes with random bf16 weights** (speed does not
depend on the values; accuracy comes from the fidelity and RULER benches), built on the GPU in seconds;
``smollm2-135m`` is the real model (``bench.models``). Prompts are random token ids; with a batch the rows are
ragged: row ``i`` holds ``context · (i + 1) / B`` real tokens, less ``(B − 1 − i) · 64 / B`` so that the rows
complete their 64-token blocks on different tokens, as a server's sessions do (``bench.timing_settings.staggered``),
left-padded.

Times are CUDA events recorded where each forward's logits are ready (on the GPU's timeline, no sync per token:
a loop that overlaps the host with the GPU keeps doing so, and one that leaves the GPU waiting shows it).
Per record: ``prefill_s`` (the prefill forward; for a FathomCache it includes reserving pinned memory,
the calibration from the prompt and the appends), ``first_step_ms`` (the first decode step: graph captures,
kernel warm-up), ``first_steady_ms`` (median per-token wall time after ``--warmup`` steps), the same three for a
second cache of the same key made right after (``pooled_*``: pinned memory, graphs and kernels reused; when it is
profiled, its median leaves out the profiled steps too, which CUPTI slows: runs before 2026-12-02 kept them),
``steady_ms`` (the lower of the two steady medians: the system's steady state in a serving process, see
:func:`summarise`), ``tokens_per_s`` (batch / steady), ``turn_first_token_ms`` (a conversation's second turn on
the pooled call's cache: its output and ``--turn-tokens`` more tokens fed back, time to the turn's first token —
the chunk's forward, no rebuild),
``setup_s`` (what the first cache of a key pays once: its prefill + first step minus the
pooled cache's), ``gpu_busy_ms`` (kernel and copy time per steady token, torch.profiler over ``--profile`` steps
of the pooled run, copies that overlap kernels counted twice; for ``+graph`` systems the token graph replayed
alone behind a sleep, CUDA events, median — a profiler window cannot be cut per token there, since the next
token is launched before the host reads the last) and
``host_ms_per_token`` (steady − GPU busy, at least 0: time per token the GPU waits on the host),
``attention_gpu_ms`` (every layer's Fathom step of one token, replayed on the cache the run left, CUDA events,
GPU queued behind a sleep so the host is not timed), ``hbm_gb`` (peak torch allocation, weights included),
``pinned_gb`` (the Fathom store's pinned host memory), ``prefill_vs_hf`` (prefill / hf-sdpa's; none after a
shared prefill); with ``--hbm-gb`` / ``--row-cache-rows`` (FathomCache's tiers: the store's top planes and recently
selected rows in HBM) also ``hbm_planes``, ``store_hbm_gb``, ``row_cache_rows`` and ``row_cache_hit``
(:func:`store_figures`), shown in the table when set.
``--layers N`` builds the 8B shapes with N decoder layers (a batch of long sessions that does not fit the host's
memory with all of them: 8 × 128k would pin ~190 GB for Fathom's store and hold 154 GB for HF's offloaded cache;
the table says so). ``--prefill-rows N`` starts every system's cache from one shared dense prefill per setting
(:func:`fathom.integrations.prefill.prefill` N rows at a time: a left-padded batch's own prefill materialises a
``B × n × n`` attention mask, 137 GB at 8 × 128k): FathomCaches take it by ``prompt=``, HF's caches by their own
``update``, and generate continues from the prompt's greedy token, so ``prefill_s`` is the time to take the prompt
in, ``shared_prefill_s`` the prefill's, and the first step decodes the prompt's token (tested to generate the
tokens of each cache's own prefill).
``--compile-probe`` also times, in fresh processes, the first offloaded decode (:data:`PROBE`) with Numba's kernel
cache empty (``process_cold_s``) and then filled by that run (``process_warm_s``), the warm-up command a deployment
runs first (:data:`WARMUP`, ``warmup_s``, its own cache empty) and the first offloaded decode after it
(``process_after_warmup_s``), with the kernel signatures each probe compiled (``cold_kernels_compiled``,
``after_warmup_kernels_compiled``: 0 when the warm-up covers the decode). Each cache is a temporary
``NUMBA_CACHE_DIR``: the package's own kernel cache is left as it is.

Writes ``generate-<name>.json``, ``.md`` and ``.png`` (the table and plot: ``bench.generate_report``; the models:
``bench.shapes``); ``--readme docs/results.md`` rewrites the table there.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cli import UsageError, file_stem, int_list, name_list, require_cuda, result_json, writable_folder
from bench.generate_report import (RECORD_FIELDS, REPLOT_FIELDS, check_readme, line, merge, probe_sentence,
                                   publish)
from bench.report import RESULTS, write_json
from bench.shapes import REAL, SHAPES, build_model, context_of, head_dim, shape_layers
from bench.timing_settings import staggered

HF_SYSTEMS = ("hf-sdpa", "hf-offloaded")
GRAPH = "+graph"
PROBE = """
import time, torch
t = time.perf_counter()
from fathom import methods
from fathom.host.cache import CacheShape, HostKVCache
from fathom.host.decoder import Decoder, DecoderSettings
from fathom.host.graph import StepGraph
from fathom.selection import Selection
with HostKVCache(CacheShape(sessions=1, layers=1, kv_heads=8, head_dim=128, max_tokens=8192)) as cache:
    k = torch.randn(1, 8, 4096, 128, device="cuda")
    cache.append(0, k, k)
    decoder = Decoder(cache, DecoderSettings(methods.fathom(48), Selection(k=256)), group_size=4)
    StepGraph(decoder, append=True)(torch.randn(1, 32, 128, device="cuda"), k[:, :, :1], k[:, :, :1])
    torch.cuda.synchronize()
seconds = time.perf_counter() - t
from fathom.cuda import kernel_cache
print(seconds, sum(use.compiled for use in kernel_cache.use().values()))
"""
WARMUP = ("--head-dim", "128", "--group-size", "4")  # python -m fathom.integrations.warmup: PROBE's shape, every method


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--models", type=name_list, default=["qwen3-8b"],
                        help=f"comma-separated: {', '.join(SHAPES)} (shapes, random weights), {', '.join(REAL)}")
    parser.add_argument("--contexts", type=int_list, default=[32768, 131072], help="prompt tokens (the longest row)")
    parser.add_argument("--batches", type=int_list, default=[1], help="sessions per generate call (ragged when > 1)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of the 8B shapes (default the model's: 36 / 32); fewer where a batch of "
                             "long sessions does not fit the host's memory (every record says how many)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="start every system's cache from one shared dense prefill per setting, run this many "
                             "rows at a time (no padded attention mask: 137 GB at 8 x 128k), instead of generate's "
                             "own prefill; prefill_s is then the system's time to take the prompt in")
    parser.add_argument("--systems", type=name_list,
                        default=["hf-sdpa", "hf-offloaded", "dense", "fathom@48", "fathom@48+graph", "sparq@68",
                                 "double-sparsity@136"],
                        help="hf-sdpa, hf-offloaded, and FathomCache method specs (bench.decoding), each optionally "
                             "with +graph (custom_generate=decode)")
    parser.add_argument("--hbm-gb", type=float, default=0.0,
                        help="FathomCache's hbm_gb: HBM for the offloaded store's scales and top bit planes, GB "
                             "(0: every plane in pinned host memory); FathomCache systems only")
    parser.add_argument("--row-cache-rows", type=int, default=0,
                        help="FathomCache's row_cache_rows: HBM slots per session, layer and KV head for recently "
                             "selected K/V rows (0: none); FathomCache systems only")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens generated per call (> --warmup + 2)")
    parser.add_argument("--warmup", type=int, default=3, help="decode steps left out of steady_ms")
    parser.add_argument("--profile", type=int, default=4, help="steady steps profiled for gpu_busy_ms (0: none)")
    parser.add_argument("--turn-tokens", type=int, default=256,
                        help="tokens of a conversation's second turn, fed to the pooled call's cache (0: no turn)")
    parser.add_argument("--compile-probe", action="store_true", help="time a fresh process's first offloaded "
                        "decode with the kernel cache empty, filled, and filled by the warm-up command (timed too)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--name", default="run", help="results are generate-<name>.{json,md,png}")
    parser.add_argument("--readme", type=Path, default=None, help="rewrite this file's table (docs/results.md)")
    parser.add_argument("--replot", type=Path, nargs="+", default=None,
                        help="merge these generate JSONs into generate-<name>.md/.png (and --readme); no GPU")


def validate(args) -> list[tuple[str, object]]:
    """Every argument checked before any model is built; returns the systems as (label, spec or None)."""
    for model in args.models:
        if model not in SHAPES and model not in REAL:
            raise UsageError(f"--models: {model!r} is not one of {', '.join(list(SHAPES) + list(REAL))}")
    if any(b < 1 or b > 64 for b in args.batches):
        raise UsageError(f"--batches must be in 1..64, got {args.batches}")
    longest = min(context_of(model) for model in args.models)
    if any(not 256 <= c <= longest for c in args.contexts):
        raise UsageError(f"--contexts must be in 256..{longest} (the models' context), got {args.contexts}")
    if args.layers is not None:
        real = [m for m in args.models if m in REAL]
        fewest = min((shape_layers(m) for m in args.models if m in SHAPES), default=0)
        if real:
            raise UsageError(f"--layers applies to the shapes ({', '.join(SHAPES)}), not {', '.join(real)}")
        if not 1 <= args.layers <= fewest:
            raise UsageError(f"--layers must be in 1..{fewest} (the shapes' layers), got {args.layers}")
    if not (math.isfinite(args.hbm_gb) and args.hbm_gb >= 0):
        raise UsageError(f"--hbm-gb must be a finite number of GB >= 0, got {args.hbm_gb}")
    if not 0 <= args.row_cache_rows < 1 << 30:
        raise UsageError(f"--row-cache-rows must be in 0..{(1 << 30) - 1}, got {args.row_cache_rows}")
    if args.prefill_rows is not None and args.prefill_rows < 1:
        raise UsageError(f"--prefill-rows must be >= 1, got {args.prefill_rows}")
    if not 0 <= args.turn_tokens <= 8192:
        raise UsageError(f"--turn-tokens must be in 0..8192, got {args.turn_tokens}")
    if not 0 <= args.warmup or args.new_tokens < args.warmup + 3 or args.profile < 0 \
            or (args.profile and args.new_tokens < args.warmup + args.profile + 4):
        raise UsageError(f"--new-tokens must exceed --warmup + 2, and --warmup + --profile + 3 when profiling (the "
                         f"profiled steps are not steady ones), got {args.new_tokens}, {args.warmup}, {args.profile}")
    from bench.decoding import MethodSpec

    systems = []
    for text in args.systems:
        if text in HF_SYSTEMS:
            systems.append((text, None))
            continue
        spec_text = text.removesuffix(GRAPH)
        try:
            specs = [MethodSpec.parse(spec_text, head_dim(model)) for model in args.models]  # each model's d
        except UsageError as error:
            raise UsageError(f"--systems: {error}") from None
        systems.append((text, specs[0]))
    if len({label for label, _ in systems}) != len(systems):
        raise UsageError(f"--systems names a system twice: {args.systems}")
    if (args.hbm_gb or args.row_cache_rows) and all(spec is None for _, spec in systems):
        raise UsageError(f"--hbm-gb and --row-cache-rows set FathomCaches; --systems has none: {args.systems}")
    writable_folder("--out", args.out)
    file_stem("--name", args.name)
    if args.readme is not None:
        check_readme(args.readme)
    return systems


def run(args: argparse.Namespace) -> Path:
    systems = validate(args)
    if args.replot is not None:
        return replot(args)
    require_cuda("generate")
    import torch

    records, probe = [], None
    if args.compile_probe:
        probe = compile_probe()
        print(probe_sentence(probe))
    for model_name in args.models:
        model = build_model(model_name, args.layers)
        for context in args.contexts:
            for batch in args.batches:
                ids, mask = prompts(model, context, batch)
                shared = shared_prefill(model, ids, mask, args.prefill_rows) if args.prefill_rows else None
                hf_prefill = None
                for label, spec in systems:
                    record = measure(model, model_name, label, spec, ids, mask, args, shared)
                    if label == "hf-sdpa" and record.get("prefill_s") is not None:
                        hf_prefill = record["prefill_s"]
                    # after a shared prefill each system's prefill s is taking the prompt in (for HF a reference to
                    # it): no prefill is compared
                    record["prefill_vs_hf"] = None if shared is not None or hf_prefill is None \
                        or record.get("prefill_s") is None else record["prefill_s"] / hf_prefill
                    records.append(record)
                    print(line(record), flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                del shared
        del model
        gc.collect()
        torch.cuda.empty_cache()
    payload = {"command": args.command_line, "device": torch.cuda.get_device_name(),
               "weights": "random bf16 for the 8B shapes; real for " + ", ".join(REAL), "new_tokens": args.new_tokens,
               "warmup": args.warmup, "compile_probe": probe, "records": records}
    path = write_json(args.out / f"generate-{args.name}.json", payload.pop("command"), payload)
    publish({"command": args.command_line, **payload}, path, args.readme)
    return path


def replot(args) -> Path:
    """Several runs' JSONs as one table and plot (and the section in docs/results.md)."""
    payloads = []
    for path in args.replot:
        payload = result_json(path, "a generate result", REPLOT_FIELDS, RECORD_FIELDS)
        unmeasured = [i for i, r in enumerate(payload["records"]) if "steady_ms" not in r and "error" not in r]
        if unmeasured:
            raise UsageError(f"--replot {path}: not a generate result (record {unmeasured[0]} has neither "
                             "steady_ms nor error)")
        first_only = [i for i, r in enumerate(payload["records"]) if "steady_ms" in r and "first_steady_ms" not in r]
        if first_only:
            raise UsageError(f"--replot {path}: record {first_only[0]} has no first_steady_ms: made before steady_ms "
                             "became the lower of the two calls' medians (its steady_ms is the first call's); "
                             "re-run it")
        payloads.append(payload)
    path = args.out / f"generate-{args.name}.md"
    publish(merge(payloads), path, args.readme)
    return path


def prompts(model, context: int, batch: int):
    """Random token ids ``[B, context]``, row ``i`` with ``context · (i + 1) / B`` real tokens, staggered within a
    block (``bench.timing_settings.staggered``), left-padded."""
    import torch

    vocab = model.config.get_text_config(decoder=True).vocab_size
    g = torch.Generator(device="cuda").manual_seed(context + batch)
    ids = torch.randint(1, vocab, (batch, context), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    real = staggered([context * (i + 1) // batch for i in range(batch)])
    for i in range(batch):
        pad = context - real[i]
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids, mask


class SharedPrefill:
    """One dense prefill of a setting's prompts that every system's cache starts from (``--prefill-rows``): the
    :class:`~fathom.integrations.prefill.Prompt` and the seconds it took."""

    def __init__(self, prompt, seconds: float, rows_per_forward: int):
        self.prompt, self.seconds, self.rows_per_forward = prompt, seconds, rows_per_forward

    def cache(self, model, label: str, spec, **store):
        """A new cache of the system holding the prompt (:func:`_cache_for`)."""
        return _cache_for(model, label, spec, self.prompt, **store)


def shared_prefill(model, ids, mask, rows_per_forward: int) -> SharedPrefill:
    """The setting's dense prefill, ``rows_per_forward`` rows at a time, timed (CUDA synced)."""
    import torch

    from fathom.integrations.prefill import prefill

    torch.cuda.synchronize()
    start = time.perf_counter()
    prompt = prefill(model, ids, mask, rows_per_forward=rows_per_forward)
    torch.cuda.synchronize()
    return SharedPrefill(prompt, time.perf_counter() - start, rows_per_forward)


class _Clock:
    """A logits processor that records a CUDA event where each forward's logits are ready, on the GPU's timeline:
    no sync, so a decoding loop that overlaps the host's work with the GPU's (the token graph's) keeps doing so,
    and a loop that leaves the GPU waiting on the host shows it. It also steps a profiler."""

    def __init__(self, profiler=None):
        import torch

        self.start = torch.cuda.Event(enable_timing=True)
        self.events, self.profiler = [], profiler

    def __call__(self, input_ids, scores):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        if self.profiler is not None:
            self.profiler.step()
        return scores

    def seconds(self) -> list[float]:
        """Each forward's logits ready, seconds after :attr:`start` was recorded (call after a sync)."""
        return [self.start.elapsed_time(event) / 1e3 for event in self.events]


def store_settings(args) -> dict:
    """FathomCache's settings of where the offloaded store and recent rows live, from ``--hbm-gb`` and
    ``--row-cache-rows``."""
    return {"hbm_gb": args.hbm_gb, "row_cache_rows": args.row_cache_rows}


def _cache_for(model, label: str, spec, prompt=None, **store):
    """A new cache of the system, holding ``prompt`` (a shared prefill) when given: a FathomCache of ``spec`` (and
    ``store``: :func:`store_settings`), else transformers' DynamicCache, offloaded for ``hf-offloaded``
    (:func:`bench.decoding.hf_cache`: given every layer's keys and values by its own ``update``)."""
    from bench.decoding import hf_cache

    if spec is not None:
        return spec.cache(model, prompt=prompt, **store)
    return hf_cache(model, prompt, offloading=label == "hf-offloaded")


def _one_call(model, label, spec, ids, mask, args, profile: int = 0, cache=None, new_tokens: int | None = None,
              shared: SharedPrefill | None = None) -> dict:
    """One generate call (on a new cache, or continuing ``cache``); its timings, output ids and cache (and
    gpu_busy_ms when ``profile`` steps are profiled). With ``shared`` a new cache starts holding its prompt and
    generate continues from the prompt's greedy token: ``prefill_s`` is then the time to take the prompt in, and
    every forward generate runs is a decode step."""
    import torch
    from transformers import LogitsProcessorList

    from fathom.integrations.token_graph import decode

    profiler = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile, schedule

        profiler = torch_profile(activities=[ProfilerActivity.CUDA],
                                 schedule=schedule(wait=args.warmup, warmup=1, active=profile, repeat=1))
        profiler.start()
    clock = _Clock(profiler)
    torch.cuda.synchronize()
    made = time.perf_counter()
    new_tokens = new_tokens or args.new_tokens
    from_prompt = cache is None and shared is not None
    if from_prompt:
        cache = shared.cache(model, label, spec, **store_settings(args))
        ids, mask = shared.prompt.continued(ids, mask)
        new_tokens -= 1  # the prompt's greedy token is the first one
    elif cache is None:
        cache = _cache_for(model, label, spec, **store_settings(args))
    extra = {"custom_generate": decode} if label.endswith(GRAPH) else {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    clock.start.record()
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, do_sample=False, pad_token_id=0,
                         max_new_tokens=new_tokens, logits_processor=LogitsProcessorList([clock]),
                         **extra)
    torch.cuda.synchronize()
    if profiler is not None:
        profiler.stop()
    times = clock.seconds()
    steps = [b - a for a, b in zip(times, times[1:])]
    prefill_s = times[0]
    if from_prompt:  # the prompt was taken in before generate's first forward, itself a decode step
        prefill_s, steps = start - made, [times[0], *steps]
    result = {"cache_s": start - made, "prefill_s": prefill_s, "first_step_ms": 1e3 * steps[0], "ids": out,
              "cache": cache}
    steady = steady_steps(steps, args.warmup, profile)
    if steady:
        result["steady_ms"] = 1e3 * statistics.median(steady)
    if profiler is not None:
        busy_us = sum(e.self_device_time_total for e in profiler.key_averages())
        result["gpu_busy_ms"] = busy_us / 1e3 / profile
    return result


def steady_steps(steps: list[float], warmup: int, profile: int) -> list[float]:
    """The steps a steady median reads: after ``warmup``, and after the profiler's warm-up and ``profile`` active
    steps when the call is profiled (CUPTI's callbacks on every launch slow a host-bound loop there). One step more
    than the profiler's own count is left out: with a shared prefill a call's first forward is already a step."""
    return steps[warmup + (profile + 1 if profile else 0):]


def _next_turn(model, label, spec, first: dict, mask, args) -> dict:
    """A conversation's second turn on the cache the first left: its output and ``--turn-tokens`` new tokens (the
    user's next message, random ids) fed back, 4 tokens generated. Timings as :func:`_one_call`'s; its
    ``prefill_s`` is the time to the turn's first token."""
    import torch

    ids = first["ids"]
    batch = ids.shape[0]
    g = torch.Generator(device="cuda").manual_seed(ids.shape[1])
    said = torch.randint(1, model.config.get_text_config(decoder=True).vocab_size, (batch, args.turn_tokens),
                         device="cuda", generator=g)
    conversation = torch.cat([ids, said], 1)
    mask = torch.cat([mask, torch.ones((batch, conversation.shape[1] - mask.shape[1]), dtype=mask.dtype,
                                       device=mask.device)], 1)
    return _one_call(model, label, spec, conversation, mask, args, cache=first["cache"], new_tokens=4)


def measure(model, model_name: str, label: str, spec, ids, mask, args, shared: SharedPrefill | None = None) -> dict:
    import torch

    batch, context = ids.shape
    record = {"system": label, "model": model_name, "context": context, "batch": batch,
              "layers": model.config.get_text_config(decoder=True).num_hidden_layers,
              "weights": "real" if model_name in REAL else "random",
              "prefill": "generate's own" if shared is None else "shared"}
    if shared is not None:
        record.update(shared_prefill_s=shared.seconds, prefill_rows=shared.rows_per_forward)
    torch.cuda.reset_peak_memory_stats()
    try:
        first = _one_call(model, label, spec, ids, mask, args, shared=shared)
        record["hbm_gb"] = torch.cuda.max_memory_allocated() / 1e9
        record["pinned_gb"] = _pinned_gb(first["cache"])
        record["attention_gpu_ms"] = attention_gpu_ms(first["cache"]) if spec is not None else None
        _close(first.pop("cache"))
        graph = label.endswith(GRAPH)
        pooled = _one_call(model, label, spec, ids, mask, args, profile=0 if graph else args.profile, shared=shared)
        record.update(store_figures(pooled["cache"]))  # its row cache's counts: this call's decode steps
        turn = _next_turn(model, label, spec, pooled, mask, args) if args.turn_tokens else None
        if graph:  # after the turn: the replays append tokens to the conversation
            pooled["gpu_busy_ms"] = token_graph_gpu_ms(pooled["cache"])
        _close(pooled.pop("cache"))
    except torch.OutOfMemoryError:
        record["error"] = "out of GPU memory"
        return record
    finally:
        from fathom.integrations.sessions import POOL

        POOL.clear()  # the next system has another key: its pinned memory is not kept idle beside the next one's
    record.update(summarise(first, pooled, batch))
    if turn is not None:
        record.update(turn_tokens=args.turn_tokens, turn_first_token_ms=1e3 * turn["prefill_s"],
                      turn_first_step_ms=turn["first_step_ms"])
    return record


def summarise(first: dict, pooled: dict, batch: int) -> dict:
    """One system's figures from its two calls (:func:`_one_call`'s results: the key's first cache, then a pooled one).

    ``steady_ms`` is the lower of the two calls' medians: the steady state the system reaches in a serving process.
    A first call can pay once-per-process costs inside its steady steps that are no part of decoding: HF's
    DynamicCache grows its K/V by ``torch.cat`` and its first call allocates each new size from the driver; HF's
    offloaded cache pins new host blocks. Taking the first call alone made HF's sdpa up to 5x and its
    offloaded cache up to 8.6x slower than they run (``first_steady_ms`` keeps it). The same rule holds for every
    system."""
    figures = {key: first[key] for key in ("prefill_s", "first_step_ms")}
    figures.update({f"pooled_{key}": pooled[key] for key in ("prefill_s", "first_step_ms", "steady_ms")})
    figures["first_steady_ms"] = first["steady_ms"]
    figures["steady_ms"] = min(first["steady_ms"], pooled["steady_ms"])
    figures["tokens_per_s"] = batch * 1e3 / figures["steady_ms"]
    figures["setup_s"] = (first["prefill_s"] + first["first_step_ms"] / 1e3) \
        - (pooled["prefill_s"] + pooled["first_step_ms"] / 1e3)
    figures["gpu_busy_ms"] = busy = pooled.get("gpu_busy_ms")
    figures["host_ms_per_token"] = None if busy is None else max(0.0, figures["steady_ms"] - busy)
    return figures


def store_figures(cache) -> dict:
    """Where an offloaded FathomCache's store and recent rows lived (``--hbm-gb``, ``--row-cache-rows``):
    ``hbm_planes`` (bit planes per channel its near tier holds in HBM), ``store_hbm_gb`` (that tier's scales and
    planes and the row caches, GB), ``row_cache_rows`` and ``row_cache_hit`` (hits / lookups of the rows the
    steps selected since the cache was made or taken from the pool: its decode steps, the first one finding the
    row cache empty; None without a row cache). Empty for transformers' caches and the reference backend."""
    sessions = _offloaded_sessions(cache)
    if sessions is None:
        return {}
    store = sessions.cache
    hits, lookups = store.row_cache_counts()
    return {"hbm_planes": store.shape.layout.hbm_planes, "store_hbm_gb": store.hbm_bytes / 1e9,
            "row_cache_rows": store.shape.row_cache_rows,
            "row_cache_hit": hits / lookups if store.shape.row_cache_rows and lookups else None}


def _offloaded_sessions(cache):
    """A FathomCache's :class:`~fathom.integrations.sessions.OffloadedSessions`; None for transformers' caches and
    the reference backend."""
    from fathom.integrations.sessions import OffloadedSessions

    sessions = getattr(getattr(cache, "decoding", None), "sessions", None)
    return sessions if isinstance(sessions, OffloadedSessions) else None


def _pinned_gb(cache) -> float | None:
    sessions = _offloaded_sessions(cache)
    return None if sessions is None else sessions.cache.pinned_bytes / 1e9


def _close(cache) -> None:
    if hasattr(cache, "close"):
        cache.close()


def attention_gpu_ms(cache, reps: int = 5) -> float | None:
    """GPU time of one token through every layer's Fathom step (its append included), on the cache as the run left
    it: each layer's captured step replayed with random inputs (:func:`_replay_gpu_ms`)."""
    import torch

    sessions = _offloaded_sessions(cache)
    if sessions is None:
        return None
    s = sessions.shape
    q = torch.randn(s.layers, s.sessions, s.kv_heads * s.group_size, s.head_dim, device="cuda")
    kv = torch.randn(2, s.sessions, s.kv_heads, s.head_dim, device="cuda")
    sessions.reserve(reps + 1)
    graphs = [sessions.graph(layer) for layer in range(s.layers)]

    def token():
        sessions.begin_token()  # host checks only: the GPU is still behind the sleep
        for layer, graph in enumerate(graphs):
            graph.replay(q[layer], kv[0][:, :, None], kv[1][:, :, None])

    return _replay_gpu_ms(token, reps)


def token_graph_gpu_ms(cache, reps: int = 5) -> float | None:
    """GPU time of one replay of the cache's token graph (the whole decode token) (:func:`_replay_gpu_ms`); None
    when the room reserved for the cache runs out first."""
    import torch

    graphs = list(cache.decoding.sessions.token_graphs.values())
    if not graphs:
        return None
    graph = graphs[0]
    batch = graph.token.shape[0]
    token = torch.ones(batch, dtype=torch.long, device="cuda")
    position = torch.full((batch,), cache.get_seq_length(), dtype=torch.long, device="cuda")
    try:
        return _replay_gpu_ms(lambda: graph(token, position), reps)
    except ValueError:  # the store would have to grow: the graph is no longer valid for it
        return None


def _replay_gpu_ms(replay, reps: int) -> float:
    """Median GPU time of ``replay()`` over ``reps`` runs after one, each queued behind a sleep kernel so that the
    host's launching is not timed (CUDA events)."""
    import torch

    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def compile_probe() -> dict:
    """A fresh process's first offloaded decode (:data:`PROBE`: import, pinned memory, kernel compile or load,
    capture) with Numba's kernel cache empty, then again with it filled by that run; the warm-up command
    (:data:`WARMUP`) in a fresh process on another empty cache, and the first offloaded decode after it. Each cache
    is a temporary ``NUMBA_CACHE_DIR`` (Numba then reads no other): the package's own is left as it is."""
    with tempfile.TemporaryDirectory() as probed, tempfile.TemporaryDirectory() as warmed:
        cold_s, cold_compiled = _probe(probed)
        warm_s, _ = _probe(probed)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fathom.integrations.warmup", *WARMUP], capture_output=True, text=True,
                       check=True, env={**os.environ, "NUMBA_CACHE_DIR": warmed})
        warmup_s = time.perf_counter() - start
        after_s, after_compiled = _probe(warmed)
    return {"process_cold_s": cold_s, "process_warm_s": warm_s, "cold_kernels_compiled": cold_compiled,
            "warmup_command": " ".join(("python -m fathom.integrations.warmup",) + WARMUP), "warmup_s": warmup_s,
            "process_after_warmup_s": after_s, "after_warmup_kernels_compiled": after_compiled}


def _probe(cache: str) -> tuple[float, int]:
    """:data:`PROBE` in a fresh process whose Numba caches kernels in ``cache``: its seconds and the kernel signatures
    it compiled."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                          env={**os.environ, "NUMBA_CACHE_DIR": cache})
    seconds, compiled = done.stdout.split()[-2:]
    return float(seconds), int(compiled)
