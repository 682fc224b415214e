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
correlation :data:`QUERY_CORRELATION`), so consecutive steps select overlapping rows as a real decode does.

``--row-cache-rows N`` gives every (session, layer, KV head) an HBM row cache of N rows (``fathom.row_cache``);
each method then runs alone on it, from empty, warmed up for :data:`ROW_CACHE_WARMUP` tokens, and its records
carry the hit rate of its timed tokens (from the GPU's counters) and the rows' bytes over the link. When pinned memory cannot hold every layer (``--host-gb``), the 36
layers are mapped onto fewer physical ones (layer ``l`` uses ``l % P``): the same bytes cross the link per token
(each physical store is far larger than the GPU's L2), and each record says how many layers were physical.

Writes ``timing-<name>.json``, ``.md`` and ``.png``; ``--replot A.json [B.json ...]`` merges runs and remakes them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.cli import UsageError, file_stem, int_list, name_list, require_cuda, utf8_text, writable_folder
from bench.report import RESULTS, markdown_table, write_json

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 36, 8, 4, 128  # Qwen3-8B
DEFAULT_STATS = Path(__file__).resolve().parent / "data" / "channel-stats-qwen2.5-coder-1.5b-4096-paul-graham.npz"
CONTEXTS = (32768, 131072, 262144, 1048576)
SESSIONS = (1, 4, 16)
MANY_SESSIONS_UP_TO = 131072  # sessions > 1 at contexts up to this
HEADROOM = 4096  # tokens appended while timing
# cycles of the sleep kernel that holds the GPU while the host enqueues a token (~2 GHz): longer than the enqueue of
# a graph replay, or of an eager token (~3 ms of Numba launches per layer)
SLEEP_CYCLES = {"graph": 40_000_000, "eager": 300_000_000}
HEAVY_MS = 1000.0  # methods whose token takes longer are timed with one repetition (dense, oracle at 1M)
# The decode queries' step-to-step correlation per channel: at 0.8, oracle top-512 over the synthetic keys (32k)
# re-selects 65% of the previous step's rows and an LRU of 4× a step's rows hits 89%, inside what bench rowreuse
# measured on real generated tokens (59-71% and 89-93%)
QUERY_CORRELATION = 0.8
ROW_CACHE_WARMUP = 8  # untimed tokens per method and mode before a row cache's hit rate is counted


@dataclass(frozen=True)
class Setting:
    """One cache: ``sessions`` at ``context`` tokens (``ragged``: session i holds ``context · (1 + i) / S``)."""

    context: int
    sessions: int
    regime: str
    k: int = 512
    ragged: bool = False

    @property
    def lengths(self) -> list[int]:
        if not self.ragged:
            return [self.context] * self.sessions
        return [self.context * (i + 1) // self.sessions // 64 * 64 for i in range(self.sessions)]

    @property
    def label(self) -> str:
        s = f"{self.context // 1024}k × {self.sessions}" + (" ragged" if self.ragged else "")
        return s + ("" if self.k == 512 else f", k = {self.k}")


def method_table():
    """Every timed method, by label (d = 128)."""
    from fathom import methods

    grid = [methods.fathom(32), methods.fathom(48), methods.fathom(64), methods.sparq(16), methods.sparq(32),
            methods.double_sparsity(32), methods.loki(32), methods.thumbnail(2), methods.landmark(),
            methods.oracle(), methods.dense()]
    return {m.label(HEAD_DIM): m for m in grid}


def settings_for(args) -> list[Setting]:
    """Every (regime, context, sessions) asked for, within ``--max-tokens`` per layer; k = 2048 too at 1M."""
    out = []
    for regime in args.regimes:
        for context in args.contexts:
            for sessions in args.sessions:
                if sessions > 1 and context > MANY_SESSIONS_UP_TO or sessions * context > args.max_tokens:
                    continue
                out.append(Setting(context, sessions, regime, ragged=sessions == args.ragged_sessions))
            if context >= 1048576 and (regime == "host" or not args.skip_large_k_hbm):
                out.append(Setting(context, 1, regime, k=2048))
    return out


def physical_layers(setting: Setting, host_gb: float) -> int:
    """How many layers' stores pinned host memory holds within ``host_gb``."""
    tokens = sum(setting.lengths) + setting.sessions * HEADROOM
    per_token = 4 * HEAD_DIM + HEAD_DIM * 2 // 8  # K/V rows + landmarks
    if setting.regime == "host":
        per_token += 2 * (HEAD_DIM * 4 + HEAD_DIM * 2 // 64) // 8 * 8  # raw + rotated store
    per_layer = tokens * KV_HEADS * per_token
    return int(max(1, min(LAYERS, host_gb * 1e9 // per_layer)))


class Synthetic:
    """Keys, values and queries drawn per channel from a real capture's statistics (on the GPU)."""

    def __init__(self, stats: dict, seed: int = 0):
        import torch

        self.torch = torch
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.stats = {k: torch.as_tensor(v, device="cuda") for k, v in stats.items() if k != "meta"}
        self.meta = stats["meta"]

    def _pick(self, name: str, layer: int):
        L, H = self.stats[name].shape[:2]
        return self.stats[name][layer % L][[h % H for h in range(KV_HEADS)]]  # [KV_HEADS, d]

    def keys(self, layer: int, sessions: int, m: int):
        mean, std = self._pick("key_mean", layer), self._pick("key_std", layer)
        z = self.torch.randn((sessions, KV_HEADS, m, HEAD_DIM), device="cuda", generator=self.gen)
        return mean[None, :, None] + std[None, :, None] * z

    def values(self, sessions: int, m: int):
        return self.torch.randn((sessions, KV_HEADS, m, HEAD_DIM), device="cuda", generator=self.gen)

    def queries(self, layer: int, sessions: int):
        mean, std = self._pick("query_mean", layer), self._pick("query_std", layer)
        z = self.torch.randn((sessions, KV_HEADS, GROUP, HEAD_DIM), device="cuda", generator=self.gen)
        return (mean[None, :, None] + std[None, :, None] * z).reshape(sessions, KV_HEADS * GROUP, HEAD_DIM)

    def query_walk(self, plan: list[int], sessions: int) -> QueryWalk:
        """Decode queries of the layers ``plan`` that drift from token to token (:class:`QueryWalk`)."""
        mean = self.torch.stack([self._pick("query_mean", layer) for layer in plan])[:, None, :, None]
        std = self.torch.stack([self._pick("query_std", layer) for layer in plan])[:, None, :, None]
        return QueryWalk(mean, std, sessions, self.gen)

    def calibration(self, layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Double Sparsity's channel order (mean |q| · mean |k|, from samples) and Loki's basis (the key covariance
        is diagonal: its eigenbasis is the channels, ordered by score variance σ_k² · E[q²]), per physical layer."""
        ranks, bases = [], []
        for layer in range(layers):
            k = self.keys(layer, 1, 4096)[0]
            q = self.queries(layer, 256).reshape(256, KV_HEADS, GROUP, HEAD_DIM).transpose(0, 1)
            ds = (q.abs().mean(dim=(1, 2)) * k.abs().mean(dim=1)).cpu().numpy()
            score_var = (k.var(dim=1) * q.square().mean(dim=(1, 2))).cpu().numpy()
            ranks.append(np.argsort(-ds, axis=-1, kind="stable"))
            order = np.argsort(-score_var, axis=-1, kind="stable")
            bases.append(np.eye(HEAD_DIM, dtype=np.float32)[:, order].transpose(1, 0, 2))  # [H, d, d]
        return np.stack(ranks), np.stack(bases)


class QueryWalk:
    """Per layer, session, KV head and query head, ``q = mean + std · z`` with ``z`` an AR(1) walk per channel:
    ``z ← ρ z + √(1 − ρ²) ε`` each token (ρ = :data:`QUERY_CORRELATION`), so every token's query is distributed as
    the capture's and consecutive tokens' overlap."""

    def __init__(self, mean, std, sessions: int, gen):
        import torch

        self.torch, self.mean, self.std, self.gen = torch, mean, std, gen  # mean, std [L, 1, H, 1, d]
        self.z = torch.randn((mean.shape[0], sessions, KV_HEADS, GROUP, HEAD_DIM), device="cuda", generator=gen)

    def step(self):
        """The next token's queries, float32 ``[L, S, H·G, d]``."""
        noise = self.torch.randn(self.z.shape, device="cuda", generator=self.gen)
        self.z.mul_(QUERY_CORRELATION).add_(noise, alpha=math.sqrt(1 - QUERY_CORRELATION ** 2))
        q = self.mean + self.std * self.z
        return q.reshape(q.shape[0], q.shape[1], KV_HEADS * GROUP, HEAD_DIM)


def copy_rate(torch) -> float:
    """GB/s of one 1 GiB pinned host -> device copy (median of 5): the link's rate for the floor."""
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return (1 << 30) / statistics.median(times[1:]) / 1e6


def hbm_rate(torch) -> float:
    """GB/s read of a 4 GiB device -> device copy (bytes read, median of 5)."""
    a = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return (1 << 32) / statistics.median(times[1:]) / 1e6


class Run:
    """One setting: the cache filled once, a decoder (and a whole-token graph) per method, timed interleaved."""

    def __init__(self, setting: Setting, data: Synthetic, labels: list[str], args):
        import torch

        from fathom.host.cache import CacheShape, HostKVCache
        from fathom.host.decoder import Decoder, DecoderSettings
        from fathom.host.graph import StepGraph
        from fathom.selection import Selection

        self.torch, self.setting = torch, setting
        self.physical = physical_layers(setting, args.host_gb)
        self.plan = [layer % self.physical for layer in range(LAYERS)]
        shape = CacheShape(sessions=setting.sessions, layers=self.physical, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           max_tokens=max(setting.lengths) + HEADROOM,
                           store="host" if setting.regime == "host" else "device",
                           hbm_planes=args.hbm_planes if setting.regime == "host" else None,
                           row_cache_rows=args.row_cache_rows)
        started = time.perf_counter()
        ds_rank, basis = data.calibration(self.physical)
        self.cache = HostKVCache(shape, basis=basis)
        chunk = 65536
        for layer in range(self.physical):
            for s, n in enumerate(setting.lengths):
                for start in range(0, n, chunk):
                    m = min(chunk, n - start)
                    self.cache.append(layer, data.keys(layer, 1, m), data.values(1, m), sessions=[s])
        torch.cuda.synchronize()
        self.fill_s = time.perf_counter() - started
        self.walk = data.query_walk(self.plan, setting.sessions)
        self.q = self.walk.step()
        self.k_new = torch.stack([data.keys(layer, setting.sessions, 1) for layer in self.plan])
        self.v_new = torch.stack([data.values(setting.sessions, 1) for _ in self.plan])
        table = method_table()
        sel = Selection(k=setting.k)
        self.decoders, self.graphs = {}, {}
        for label in labels:
            decoder = Decoder(self.cache, DecoderSettings(table[label], sel), GROUP, ds_rank=ds_rank)
            self.decoders[label] = decoder
            if "graph" in args.modes:
                self.graphs[label] = StepGraph(decoder, layers=self.plan, append=True)
        self.samples = {(label, mode): {"gpu": [], "wall": [], "host": [], "stages": []}
                        for label in labels for mode in args.modes}
        self.nbytes: dict[str, dict] = {}  # per method: what one eager token read (:meth:`read_bytes`)
        self.row_hit_rate: dict[str, float | None] = dict.fromkeys(labels)

    def eager_token(self, decoder, events=None) -> None:
        """Append + step of every layer, eagerly; with ``events``, a pair of events around each stage."""
        for i, layer in enumerate(self.plan):
            self.cache.append(layer, self.k_new[i], self.v_new[i])
            decoder.run(layer, self.q[i], on_stage=None if events is None else self._stage_timer(events))

    def _stage_timer(self, events: list):
        """A :meth:`Decoder.run` ``on_stage`` hook: an event pair around each stage, appended to ``events``."""
        def around(name: str, enqueue) -> None:
            start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            enqueue()
            end.record()
            events.append((name, start, end))
        return around

    def token(self, label: str, mode: str, queued: bool) -> tuple[float, float, float, dict]:
        """One decode token -> (GPU ms, wall ms, host enqueue ms, stage ms)."""
        torch = self.torch
        decoder = self.decoders[label]
        events = [] if (queued and mode == "eager") else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.q = self.walk.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if queued:
            torch.cuda._sleep(SLEEP_CYCLES[mode])
        start.record()
        if mode == "graph":
            self.graphs[label](self.q, self.k_new, self.v_new)
        else:
            self.eager_token(decoder, events)
        end.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        stages: dict[str, float] = {}
        for name, a, b in events or []:
            stages[name] = stages.get(name, 0.0) + a.elapsed_time(b)
        return start.elapsed_time(end), wall * 1e3, host * 1e3, stages

    def measure(self, label: str, mode: str) -> None:
        gpu, _, host, stages = self.token(label, mode, queued=True)
        _, wall, _, _ = self.token(label, mode, queued=False)
        sample = self.samples[label, mode]
        sample["gpu"].append(gpu)
        sample["wall"].append(wall)
        sample["host"].append(host)
        sample["stages"].append(stages)

    def read_bytes(self, label: str) -> None:
        """What one eager token of ``label`` reads (host syncs, untimed), into ``nbytes[label]``: scan bytes and the
        part of them over the link (the store's far tier, K rows, landmarks), row bytes and the part over the link
        (the row cache's misses), mean scan bits per token."""
        decoder = self.decoders[label]
        scan = scan_link = rows = row_link = tokens = 0.0
        self.q = self.walk.step()
        for i, layer in enumerate(self.plan):
            decoder.run(layer, self.q[i])
            scan += decoder.scan_nbytes(layer)
            scan_link += decoder.scan_nbytes_by_tier(layer)[1]
            rows += decoder.row_nbytes(layer)
            row_link += decoder.row_nbytes_by_tier(layer)[1]
            tokens += float((self.cache.lengths(layer) // 64 * 64).sum()) * KV_HEADS
        self.nbytes[label] = {"scan": scan, "scan_link": scan_link, "rows": rows, "row_link": row_link,
                              "bits": scan * 8 / max(tokens, 1)}

    def close(self) -> None:
        self.graphs.clear()
        self.decoders.clear()
        self.cache.close()


def records(run: Run, labels: list[str], link_gbps: float, hbm_gbps: float, args) -> list[dict]:
    from fathom.host.decoder import STAGES

    out = []
    for label in labels:
        read = run.nbytes[label]
        scan, scan_link, rows, bits = read["scan"], read["scan_link"], read["rows"], read["bits"]
        link_bytes = (scan_link if run.setting.regime == "host" else 0.0) + read["row_link"]
        for mode in args.modes:
            sample = run.samples[label, mode]
            stage_ms = {name: statistics.median(s.get(name, 0.0) for s in run.samples[label, "eager"]["stages"])
                        for name in STAGES} if "eager" in args.modes else {}
            out.append({"method": label.split("@")[0], "label": label,
                        "bits": float(label.split("@")[1]) if "@" in label else 0.0, "bits_read": bits,
                        "context": run.setting.context, "lengths": run.setting.lengths,
                        "sessions": run.setting.sessions, "ragged": run.setting.ragged, "k": run.setting.k,
                        "layers": LAYERS, "physical_layers": run.physical, "regime": run.setting.regime,
                        "mode": mode, "reps": len(sample["gpu"]),
                        "gpu_ms": statistics.median(sample["gpu"]), "wall_ms": statistics.median(sample["wall"]),
                        "host_ms": statistics.median(sample["host"]),
                        "host_us_per_layer": statistics.median(sample["host"]) * 1e3 / LAYERS,
                        "scan_bytes": scan, "row_bytes": rows, "row_link_bytes": read["row_link"],
                        "link_bytes": link_bytes, "row_cache_rows": run.cache.shape.row_cache_rows,
                        "row_hit_rate": run.row_hit_rate[label],
                        "hbm_planes": run.cache.shape.layout.hbm_planes,
                        "host_plane_fraction": scan_link / scan if scan else None,
                        "hbm_gb": run.cache.hbm_bytes / 1e9, "pinned_gb": run.cache.pinned_bytes / 1e9,
                        "floor_ms": link_bytes / link_gbps / 1e6,
                        "hbm_scan_ms": scan / hbm_gbps / 1e6 if run.setting.regime == "hbm" else None,
                        "stages_ms": stage_ms, "fill_s": round(run.fill_s, 1)})
    by_key = {(r["label"], r["mode"]): r for r in out}
    for r in out:
        ds = by_key.get(("double-sparsity@136", r["mode"]))
        r["speedup_vs_ds136"] = ds["gpu_ms"] / r["gpu_ms"] if ds else None
        r["wall_speedup_vs_ds136"] = ds["wall_ms"] / r["wall_ms"] if ds else None
        r["gpu_over_floor"] = r["gpu_ms"] / r["floor_ms"] if r["floor_ms"] > 0 else None
        r["wall_over_gpu"] = r["wall_ms"] / r["gpu_ms"]
    return out


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
                        help="with --replot: rewrite this file's section between the timing markers "
                             "(docs/results.md)")


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
    if not 1 <= args.reps <= 50:
        raise UsageError(f"--reps must lie in 1..50, got {args.reps}")
    if not 0 <= args.hbm_planes <= 4:
        raise UsageError(f"--hbm-planes must lie in 0..4, got {args.hbm_planes}")
    if not 0 <= args.row_cache_rows <= 1 << 20:
        raise UsageError(f"--row-cache-rows must lie in 0..{1 << 20}, got {args.row_cache_rows}")
    if not 1 <= args.host_gb <= 1000:
        raise UsageError(f"--host-gb must lie in 1..1000, got {args.host_gb}")
    if args.readme is not None and (args.replot is None or README_START not in _read(args.readme)):
        raise UsageError(f"--readme needs --replot and a file with the marker {README_START!r}")
    if args.replot is None and not args.stats.is_file():
        raise UsageError(f"--stats: no file {args.stats} (make it with python -m bench channel-stats)")
    writable_folder("--out", args.out)
    file_stem("--name", args.name)
    return None if args.replot is None else [replot_payload(path) for path in args.replot]


# what the table, the plot and the section in docs/results.md read of a timing JSON (``--replot``)
REPLOT_FIELDS = ("command", "device", "link_GBps", "keys", "records")
RECORD_FIELDS = ("method", "label", "context", "sessions", "ragged", "k", "regime", "mode", "physical_layers",
                 "gpu_ms", "wall_ms", "host_us_per_layer", "floor_ms", "scan_bytes", "row_bytes", "bits_read",
                 "stages_ms", "speedup_vs_ds136", "wall_speedup_vs_ds136", "gpu_over_floor", "wall_over_gpu")


def replot_payload(path: Path) -> dict:
    """A timing JSON to ``--replot``; a missing, unreadable or non-JSON file, or one without the fields the table
    and plot read, is refused, naming it."""
    try:
        payload = json.loads(utf8_text("--replot", path))
    except json.JSONDecodeError as error:
        raise UsageError(f"--replot {path}: not JSON ({error})") from None
    what = "not a timing JSON of python -m bench timing"
    if not isinstance(payload, dict):
        raise UsageError(f"--replot {path}: {what} (not a JSON object)")
    missing = [key for key in REPLOT_FIELDS if key not in payload]
    if missing:
        raise UsageError(f"--replot {path}: {what} (it lacks {', '.join(missing)})")
    records = payload["records"]
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise UsageError(f"--replot {path}: {what} (its records are not a list of objects)")
    for i, record in enumerate(records):
        missing = [key for key in RECORD_FIELDS if key not in record]
        if missing:
            raise UsageError(f"--replot {path}: {what} (record {i} lacks {', '.join(missing)})")
    return payload


def run(args: argparse.Namespace) -> Path:
    payloads = validate(args)
    if payloads is not None:
        merged = {**payloads[0], "records": [r for p in payloads for r in p["records"]],
                  "commands": [p["command"] for p in payloads]}
        path = _write(merged, args.out, args.name, args.command_line)
        if args.readme is not None:
            update_readme(args.readme, merged, path)
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
        # interleaved (A B A B) against drifting clocks; with a row cache each method alone on it, from empty
        blocks = [[label] for label in timed] if cached else [timed]
        with tqdm(total=(args.reps + warmups) * len(args.modes) * len(timed),
                  desc=f"{setting.label} {setting.regime} ({run_.physical} physical layers)", unit="token") as bar:
            for block in blocks:
                if cached:
                    run_.cache.empty_row_cache()
                for label in block:  # warm-up tokens of each (method, mode); slow methods get one timed token
                    for mode in args.modes:
                        for _ in range(warmups):
                            gpu, *_ = run_.token(label, mode, queued=True)
                            bar.update()
                        if gpu > HEAVY_MS and reps[label] > 1:
                            bar.total -= (reps[label] - 1) * len(args.modes)
                            reps[label] = 1
                hits, lookups = run_.cache.row_cache_counts()
                for rep in range(max(reps[label] for label in block)):
                    for label in block:
                        if rep < reps[label]:
                            for mode in args.modes:
                                run_.measure(label, mode)
                                bar.update()
                if cached:
                    now_hits, now_lookups = run_.cache.row_cache_counts()
                    run_.row_hit_rate[block[0]] = (now_hits - hits) / max(now_lookups - lookups, 1)
                for label in block:
                    run_.read_bytes(label)
        all_records += records(run_, timed, link, hbm, args)
        run_.close()
    payload = {"device": torch.cuda.get_device_name(), "link_GBps": link, "hbm_GBps": hbm,
               "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "group": GROUP, "head_dim": HEAD_DIM},
               "synthetic": True, "keys": f"per-channel statistics of {data.meta}", "records": all_records}
    return _write(payload, args.out, args.name, args.command_line)


README_START, README_END = "<!-- timing:start -->", "<!-- timing:end -->"  # in docs/results.md
ROOT = RESULTS.parents[1]  # the repository


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def readme_table(payload: dict) -> str:
    """The performance table of docs/results.md: per setting, every method's GPU ms per decode token (graph mode)
    and its ratio to DS-136, and fathom@48's wall / GPU, GPU / floor and host µs per layer."""
    records = [r for r in payload["records"] if r["mode"] == "graph"]
    settings = list(dict.fromkeys((r["regime"], _setting_label(r)) for r in records))
    labels = list(dict.fromkeys(r["label"] for r in records))
    by = {(r["regime"], _setting_label(r), r["label"]): r for r in records}
    head = "| setting | store | " + " | ".join(labels) + " | fathom@48: DS-136 / fathom (wall) | GPU / floor | " \
                                                           "wall / GPU | host µs / layer |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for regime, setting in settings:
        cells = []
        for label in labels:
            r = by.get((regime, setting, label))
            cells.append("—" if r is None else f"{r['gpu_ms']:.1f}")
        f = by.get((regime, setting, "fathom@48"))
        extra = ["—"] * 4 if f is None else [
            f"**{f['speedup_vs_ds136']:.2f}×** ({f['wall_speedup_vs_ds136']:.2f}×)" if f["speedup_vs_ds136"] else "—",
            f"{f['gpu_over_floor']:.2f}", f"{f['wall_over_gpu']:.2f}", f"{f['host_us_per_layer']:.0f}"]
        lines.append(f"| {setting} | {regime} | " + " | ".join(cells + extra) + " |")
    return "\n".join(lines)


def _shown(path: Path) -> Path:
    """``path`` relative to the repository root where it lies inside it."""
    return path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path


def update_readme(readme: Path, payload: dict, source: Path) -> None:
    """Rewrite the section between the markers of ``readme`` (the results doc, ``docs/results.md``) with
    :func:`readme_table` of ``payload``."""
    text = _read(readme)
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    body = (f"\n`{payload['commands'][0] if payload.get('commands') else payload['command']}` (and the others "
            f"recorded in `{_shown(source)}`): GPU ms "
            f"per decode token, graph mode, medians; table generated by `python -m bench timing --replot ... --readme "
            f"{_shown(readme)}`.\n\n{readme_table(payload)}\n")
    readme.write_text(text[:start] + body + text[end:], encoding="utf-8")


def _write(payload: dict, out: Path, name: str, command: str) -> Path:
    path = write_json(out / f"timing-{name}.json", command, payload)
    table = markdown(payload)
    (out / f"timing-{name}.md").write_text(table)
    plot(payload, out / f"timing-{name}.png")
    print(summary(payload))
    return path


def _setting_label(r: dict) -> str:
    """The setting, with the store's tier (planes in HBM, host regime) and the row cache where a record has them."""
    label = Setting(r["context"], r["sessions"], r["regime"], r["k"], r["ragged"]).label
    if r["regime"] == "host" and r.get("hbm_planes"):
        label += f", t = {r['hbm_planes']}"
    if r.get("row_cache_rows"):
        label += f", row cache {r['row_cache_rows']}"
    return label


COLUMNS = [("label", "method@bits", "s"), ("mode", "mode", "s"), ("gpu_ms", "GPU ms", ".2f"),
           ("wall_ms", "wall ms", ".2f"), ("wall_over_gpu", "wall / GPU", ".2f"),
           ("host_us_per_layer", "host µs / layer", ".0f"), ("floor_ms", "floor ms", ".2f"),
           ("gpu_over_floor", "GPU / floor", ".2f"), ("speedup_vs_ds136", "GPU × vs DS-136", ".2f"),
           ("wall_speedup_vs_ds136", "wall × vs DS-136", ".2f"), ("bits_read", "bits read", ".1f"),
           ("scan_mb", "scan MB", ".1f"), ("row_mb", "rows MB", ".1f"), ("row_hit_rate", "row cache hits", ".2f"),
           ("row_link_mb", "rows over link MB", ".1f")]


def markdown(payload: dict) -> str:
    lines = [f"Whole decode token of Qwen3-8B's shape ({LAYERS} layers × {KV_HEADS} KV heads, G = {GROUP}, "
             f"d = {HEAD_DIM}) on {payload['device']}: every layer appends the token's K/V and runs its step. "
             f"GPU: CUDA events, the token queued behind a sleep kernel; wall: host time of an unqueued token; host: "
             f"enqueue time per layer; floor: link bytes at {payload['link_GBps']:.1f} GB/s (one 1 GiB pinned copy, "
             f"same run). Medians. **Synthetic** keys and queries with the per-channel statistics of "
             f"{payload['keys'].split('of ', 1)[1]}.", ""]
    groups: dict[tuple, list[dict]] = {}
    for r in payload["records"]:
        groups.setdefault((r["regime"], _setting_label(r)), []).append(r)
    for (regime, _), rows in groups.items():
        r0 = rows[0]
        lines += [f"### {_setting_label(r0)}, store in {'pinned host memory' if regime == 'host' else 'HBM'} "
                  f"({r0['physical_layers']} physical layers)", ""]
        table = [{**r, "scan_mb": r["scan_bytes"] / 1e6, "row_mb": r["row_bytes"] / 1e6,
                  "row_link_mb": r.get("row_link_bytes", r["row_bytes"]) / 1e6} for r in rows]
        lines += [markdown_table(table, COLUMNS), ""]
        eager = [r for r in rows if r["mode"] == "eager" and r["stages_ms"]]
        if eager:
            lines += ["GPU ms per stage (eager token, summed over layers):", "",
                      markdown_table([{"label": r["label"], **r["stages_ms"]} for r in eager],
                                     [("label", "method@bits", "s")]
                                     + [(s, s, ".2f") for s in eager[0]["stages_ms"]]), ""]  # decoder's order
    return "\n".join(lines) + "\n"


def summary(payload: dict) -> str:
    """The short table printed last: fathom-48 against DS-136 per setting, graph mode."""
    rows = []
    by = {(r["regime"], _setting_label(r), r["mode"], r["label"]): r for r in payload["records"]}
    for (regime, setting, mode, label), r in by.items():
        if label == "fathom@48" and mode == "graph":
            ds = by.get((regime, setting, mode, "double-sparsity@136"))
            rows.append({"setting": f"{setting} {regime}", "fathom": r["gpu_ms"], "ds": ds and ds["gpu_ms"],
                         "x": r["speedup_vs_ds136"], "wall_x": r["wall_speedup_vs_ds136"],
                         "floor": r["gpu_over_floor"], "wall_gpu": r["wall_over_gpu"]})
    return markdown_table(rows, [("setting", "setting", "s"), ("fathom", "fathom@48 GPU ms", ".2f"),
                                 ("ds", "DS-136 GPU ms", ".2f"), ("x", "GPU ×", ".2f"), ("wall_x", "wall ×", ".2f"),
                                 ("floor", "fathom GPU / floor", ".2f"), ("wall_gpu", "fathom wall / GPU", ".2f")])


def plot(payload: dict, path: Path) -> None:
    """GPU ms per decode token of every method (graph mode, store in host memory), one panel per setting, with the
    PCIe floor of each method as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["records"] if r["regime"] == "host" and r["mode"] == "graph"]
    settings = list(dict.fromkeys(_setting_label(r) for r in rows))
    if not settings:
        return
    cols = min(3, len(settings))
    fig, axes = plt.subplots(math.ceil(len(settings) / cols), cols, figsize=(5.2 * cols, 3.6 *
                             math.ceil(len(settings) / cols)), squeeze=False)
    for ax, setting in zip(axes.flat, settings):
        rs = [r for r in rows if _setting_label(r) == setting]
        labels = [r["label"] for r in rs]
        ax.barh(labels, [r["gpu_ms"] for r in rs], color=["C0" if r["method"] == "fathom" else "C7" for r in rs])
        ax.scatter([r["floor_ms"] for r in rs], labels, marker="|", s=200, color="C3", label="PCIe floor")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{setting} (graph, store in host memory)", fontsize=9)
        ax.set_xlabel("GPU ms per decode token")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="x", which="both")
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{payload['device']}: decode token of Qwen3-8B's shape (synthetic keys with real channel "
                 "statistics)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
