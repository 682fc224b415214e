"""``python -m bench timing``: the whole decode token on the GPU, every method side by side (design §8).

One decode token of Qwen3-8B's shape — 36 layers × 8 KV heads, G = 4, d = 128, bf16 rows, k = 512 (and 2048 at
1M) — over an offloaded cache: each layer appends the new token's K/V and runs its step. Every method, eager
(``Decoder.run`` per layer) and as one CUDA graph of the whole token (``StepGraph``), the store in pinned host
memory (the target regime) and resident in HBM, interleaved (A B A B), medians of ``--reps`` tokens.

* **GPU time**: CUDA events around the token, queued behind a sleep kernel so the host's enqueue is not timed.
* **Wall**: host time of an unqueued token, from the first call to the end of a sync.
* **Host**: host time to enqueue the queued token (per layer), the figure a graph exists to cut.
* **Floor**: the bytes that cross PCIe (scan + rows; rows only with the store in HBM; with ``--hbm-planes t`` the
  scan's planes from ``t`` on) at the rate of one large pinned host -> device copy measured in the same run.
* **Stages**: GPU time per stage of the eager token (CUDA events between stages), summed over layers.

Keys and queries are synthetic, drawn per channel from the statistics of a real d = 128 capture
(``python -m bench channel-stats``: Qwen2.5-Coder-1.5B); Qwen3-8B layer ``l`` and KV head ``h`` take the
capture's layer ``l % 28`` and head ``h % 2``. Each token's queries step from the previous token's (per channel,
correlation :data:`~bench.synthetic_decode.QUERY_CORRELATION`), so consecutive steps select overlapping rows as a
real decode does.

``--row-cache-rows N`` gives every (session, layer, KV head) an HBM row cache of N rows (``fathom.row_cache``);
each method then runs alone on it, from empty, warmed up until :data:`ROW_CACHE_FULL` of its slots hold a row (at
least :data:`ROW_CACHE_WARMUP` tokens, at most :data:`ROW_CACHE_WARMUP_MAX` and its share of the tokens the cache
can still append, which is less where layers share a physical one (see below): the hit rate of a cache that has not
yet evicted is not its steady state's; a stream whose rows barely change may never fill its last slots), and its
records carry the hit rate of its timed tokens (from the GPU's counters), the warm-up tokens, the fraction of slots
filled by then and the rows' bytes over the link. Every token appends a key and value drawn afresh. When pinned memory cannot hold every layer (``--host-gb``), the 36
layers are mapped onto fewer physical ones (layer ``l`` uses ``l % P``): the same bytes cross the link per token
(each physical store is far larger than the GPU's L2), and each record says how many layers were physical.

Writes ``timing-<name>.json``, ``.md`` and ``.png``; ``--replot A.json [B.json ...]`` merges runs and remakes them.

Where the parts live: the model's shape, the settings and the methods in :mod:`bench.timing_settings`; the
synthetic keys and queries in :mod:`bench.synthetic_decode`; the link probes, a setting's cache and decoders, a
timed token and its records in :mod:`bench.timing_run`; the tables, plot, summary and docs/results.md section in
:mod:`bench.timing_report`. This module is the command: its options, their checks and the loop over settings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import timing_report
from bench.cli import UsageError, file_stem, int_list, name_list, require_cuda, result_json, writable_folder
from bench.report import RESULTS
from bench.synthetic_decode import Synthetic
from bench.timing_run import PROFILED_TOKENS, Run, copy_rate, hbm_rate, records
from bench.timing_settings import (CONTEXTS, GROUP_SIZE, HEAD_DIM, KV_HEADS, LAYERS, MANY_SESSIONS_UP_TO, SESSIONS,
                                   method_table, settings_for)

DEFAULT_STATS = Path(__file__).resolve().parent / "data" / "channel-stats-qwen2.5-coder-1.5b-4096-paul-graham.npz"
HEAVY_MS = 1000.0  # methods whose token takes longer are timed with one repetition (dense, oracle at 1M)
ROW_CACHE_WARMUP = 8  # untimed tokens per method and mode before a row cache's hit rate is counted, at least
ROW_CACHE_WARMUP_MAX = 512  # ... and at most, per method, while its row cache is not yet full:
ROW_CACHE_FULL = 0.99  # the fraction of its slots holding a row


def warmup_most(tokens_left: int, methods_left: int, modes: int, timed_tokens: int) -> int:
    """The most warm-up tokens a method's row cache gets in each of its ``modes``: :data:`ROW_CACHE_WARMUP_MAX`, or
    its share of the tokens the cache can still append (``Run.tokens_left``, shared by the methods still to run)
    less what its timed tokens append (``timed_tokens``), split between its modes. Where layers share a physical
    one, each token appends to it once a layer: 16 sessions of 128k on 6 physical layers leave ~340 tokens a
    method, one session on 36 leaves 2,048."""
    return min(ROW_CACHE_WARMUP_MAX, (tokens_left // methods_left - timed_tokens) // modes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def listed(values) -> str:
        return ",".join(map(str, values))

    parser.add_argument("--contexts", type=int_list, default=list(CONTEXTS),
                        help=f"tokens per session, comma-separated (default {listed(CONTEXTS)})")
    parser.add_argument("--sessions", type=int_list, default=list(SESSIONS),
                        help=f"sessions, comma-separated (more than 1 only at contexts <= {MANY_SESSIONS_UP_TO}; "
                             f"default {listed(SESSIONS)})")
    parser.add_argument("--max-tokens", type=int, default=2 * 1048576,
                        help="skip settings holding more tokens per layer (sessions × context; default %(default)s)")
    parser.add_argument("--ragged-sessions", type=int, default=16,
                        help="the session count whose sessions get ragged lengths (0: none; default %(default)s)")
    parser.add_argument("--regimes", type=name_list, default=["host", "hbm"],
                        help="host (pinned store), hbm, comma-separated (default host,hbm)")
    parser.add_argument("--modes", type=name_list, default=["eager", "graph"],
                        help="eager, graph, comma-separated (default eager,graph)")
    parser.add_argument("--methods", type=name_list, default=None,
                        help="labels, e.g. fathom@48,double-sparsity@136 (default every timed method)")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed tokens per method, mode and setting (1..50; default %(default)s)")
    parser.add_argument("--hbm-planes", type=int, default=0,
                        help="host regime: the scales and this many planes per channel in HBM, the rest pinned "
                             "(0..4; default %(default)s)")
    parser.add_argument("--row-cache-rows", type=int, default=0,
                        help="HBM row cache slots per (session, layer, KV head), each method alone on it "
                             "(0: none; default %(default)s)")
    parser.add_argument("--levels", action="store_true",
                        help="every plane method's scan reads a reconstruction table per (layer, KV head), the "
                             "kernel FathomCache(levels='calibrated') runs: the midpoints laid out as one, so the "
                             "scores and selection are the midpoint run's and only the kernel differs")
    parser.add_argument("--kernels", action="store_true",
                        help="also profile each method's eager token per kernel (GPU µs per token, torch's profiler)")
    parser.add_argument("--host-gb", type=float, default=40.0,
                        help="pinned memory for the stores (GB; default %(default)s)")
    parser.add_argument("--stats", type=Path, default=DEFAULT_STATS,
                        help=f"channel statistics (bench channel-stats; default bench/data/{DEFAULT_STATS.name})")
    parser.add_argument("--skip-large-k-hbm", action="store_true", help="no k = 2048 setting with the store in HBM")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--name", default="qwen3-8b", help="file name stem: timing-<name>.* (default %(default)s)")
    parser.add_argument("--replot", type=Path, nargs="+", default=None,
                        help="merge these timing JSONs and remake the table and plot (no GPU)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="with --replot: rewrite this file's sections between the timing markers "
                             "(every method's table, docs/results.md) and the throughput markers (fathom@48 against "
                             "DS-136 with the peers' figures, README.md)")


def validate(args) -> list[dict] | None:
    """Every argument checked before any GPU work (one-line UsageError naming it); returns the ``--replot``
    payloads (None without it)."""
    table = method_table()
    if args.methods is not None:
        unknown = [m for m in args.methods if m not in table]
        if unknown:
            raise UsageError(f"--methods: unknown {unknown}; known: {', '.join(table)}")
    if any(c < 4096 or c % 64 for c in args.contexts):
        raise UsageError(f"--contexts must be multiples of 64 of at least 4096 tokens, got {args.contexts}")
    if any(not 1 <= s <= 64 for s in args.sessions):
        raise UsageError(f"--sessions must lie in 1..64, got {args.sessions}")
    if not set(args.regimes) <= {"host", "hbm"} or not args.regimes:
        raise UsageError(f"--regimes must be host and/or hbm, got {args.regimes}")
    if not set(args.modes) <= {"eager", "graph"} or not args.modes:
        raise UsageError(f"--modes must be eager and/or graph, got {args.modes}")
    if args.max_tokens < 4096:
        raise UsageError(f"--max-tokens must be >= 4096, got {args.max_tokens}")
    if not 0 <= args.ragged_sessions <= 64:
        raise UsageError(f"--ragged-sessions must lie in 0..64 (0: none), got {args.ragged_sessions}")
    if args.replot is None and not settings_for(args):
        raise UsageError(f"no setting to time: every --contexts × --sessions exceeds --max-tokens {args.max_tokens} "
                         f"tokens per layer (or sessions > 1 beyond {MANY_SESSIONS_UP_TO} tokens)")
    if not 1 <= args.reps <= 50:
        raise UsageError(f"--reps must lie in 1..50, got {args.reps}")
    if not 0 <= args.hbm_planes <= 4:
        raise UsageError(f"--hbm-planes must lie in 0..4, got {args.hbm_planes}")
    if not 0 <= args.row_cache_rows <= 1 << 20:
        raise UsageError(f"--row-cache-rows must lie in 0..{1 << 20}, got {args.row_cache_rows}")
    if not 1 <= args.host_gb <= 1000:
        raise UsageError(f"--host-gb must lie in 1..1000, got {args.host_gb}")
    if args.readme is not None:
        text = timing_report.read(args.readme) if args.replot is not None else ""
        if not timing_report.readme_sections(text):
            raise UsageError(f"--readme needs --replot and a file with the section {timing_report.README_START!r} ... "
                             f"{timing_report.README_END!r} or {timing_report.THROUGHPUT_START!r} ... "
                             f"{timing_report.THROUGHPUT_END!r}")
    if args.replot is None and not args.stats.is_file():
        raise UsageError(f"--stats: no file {args.stats} (make it with python -m bench channel-stats)")
    writable_folder("--out", args.out)
    file_stem("--name", args.name)
    if args.replot is None:
        return None
    resolved = [path.resolve() for path in args.replot]
    if len(set(resolved)) < len(resolved):
        raise UsageError(f"--replot names a file twice: {' '.join(map(str, args.replot))}")
    return [replot_payload(path) for path in args.replot]


# what the table, the plot and the section in docs/results.md read of a timing JSON (``--replot``)
REPLOT_FIELDS = ("command", "device", "link_GBps", "keys", "records")
RECORD_FIELDS = ("method", "label", "context", "sessions", "ragged", "k", "regime", "mode", "physical_layers",
                 "gpu_ms", "wall_ms", "host_us_per_layer", "floor_ms", "scan_bytes", "row_bytes", "bits_read",
                 "stages_ms", "speedup_vs_ds136", "wall_speedup_vs_ds136", "gpu_over_floor", "wall_over_gpu")


def replot_payload(path: Path) -> dict:
    """A timing JSON to ``--replot``; a missing, unreadable or non-JSON file, or one without the fields the table
    and plot read, is refused, naming it."""
    return result_json(path, "a timing JSON of python -m bench timing", REPLOT_FIELDS, RECORD_FIELDS)


def run(args: argparse.Namespace) -> Path:
    payloads = validate(args)
    if payloads is not None:
        merged = {**payloads[0], "records": [r for p in payloads for r in p["records"]],
                  "commands": [p["command"] for p in payloads],
                  "link_GBps_runs": sorted({p["link_GBps"] for p in payloads}),  # each run's floor used its own
                  "device": " / ".join(dict.fromkeys(p["device"] for p in payloads))}
        path = timing_report.write(merged, args.out, args.name, args.command_line)
        if args.readme is not None:
            timing_report.update_readme(args.readme, merged, path)
        return path
    require_cuda("timing")
    import torch
    from tqdm import tqdm

    from bench import channel_stats

    table = method_table()
    labels = args.methods or list(table)
    data = Synthetic(channel_stats.load(args.stats))
    link, hbm = copy_rate(torch), hbm_rate(torch)
    settings = settings_for(args)
    all_records = []
    for setting in settings:
        run_ = Run(setting, data, [m for m in labels if setting.regime == "host" or table[m].scans_planes], args)
        timed = list(run_.decoders)
        reps = {label: args.reps for label in timed}
        cached = bool(args.row_cache_rows)
        warmups = ROW_CACHE_WARMUP if cached else 1
        # what a method appends besides its warm-ups past the first few (those are counted again: a margin)
        timed_tokens = (2 * args.reps + warmups) * len(args.modes) + (PROFILED_TOKENS + 1 if args.kernels else 0)
        # interleaved (A B A B) against drifting clocks; with a row cache each method alone on it, from empty
        blocks = [[label] for label in timed] if cached else [timed]
        with tqdm(total=(args.reps + warmups) * len(args.modes) * len(timed),
                  desc=f"{setting.label} {setting.regime} ({run_.physical} physical layers)", unit="token") as bar:
            for i, block in enumerate(blocks):
                if cached:
                    run_.cache.empty_row_cache()
                most = warmup_most(run_.tokens_left(), len(blocks) - i, len(args.modes), timed_tokens)
                for label in block:  # warm-up tokens of each (method, mode); slow methods get one timed token
                    for mode in args.modes:
                        tokens = 0
                        while tokens < warmups or cached and tokens < most \
                                and run_.cache.row_cache_filled() < ROW_CACHE_FULL:
                            if tokens >= warmups:
                                bar.total += 1
                            gpu, *_ = run_.token(label, mode, queued=True)
                            tokens += 1
                            bar.update()
                        if cached:
                            run_.row_cache_warmup[label] += tokens
                        if gpu > HEAVY_MS and reps[label] > 1:
                            bar.total -= (reps[label] - 1) * len(args.modes)
                            reps[label] = 1
                hits, lookups = run_.cache.row_cache_counts()
                for label in block:  # warm-ups append tokens: later methods run at longer contexts
                    run_.timed_from[label] = run_.cache.most_held()
                for rep in range(max(reps[label] for label in block)):
                    for label in block:
                        if rep < reps[label]:
                            for mode in args.modes:
                                run_.measure(label, mode)
                                bar.update()
                if cached:
                    run_.row_cache_filled[block[0]] = run_.cache.row_cache_filled()
                    now_hits, now_lookups = run_.cache.row_cache_counts()
                    run_.row_hit_rate[block[0]] = (now_hits - hits) / max(now_lookups - lookups, 1)
                for label in block:
                    run_.read_bytes(label)
                    if args.kernels:
                        run_.kernels_us[label] = run_.kernel_profile(label)
        all_records += records(run_, timed, link, hbm, args)
        run_.close()
    payload = {"device": torch.cuda.get_device_name(), "link_GBps": link, "hbm_GBps": hbm,
               "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "group": GROUP_SIZE, "head_dim": HEAD_DIM},
               "synthetic": True, "keys": f"per-channel statistics of {data.meta}",
               "scan_reads": "reconstruction tables (the midpoints as tables)" if args.levels else "midpoints",
               "records": all_records}
    return timing_report.write(payload, args.out, args.name, args.command_line)
