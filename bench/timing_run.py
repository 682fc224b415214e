"""Measuring one setting of ``python -m bench timing``: the link's and HBM's copy rates, the cache filled once with a
decoder (and a whole-token graph) per method, a token timed (GPU, wall, host enqueue, stages), the bytes it reads,
and the records the samples make."""

from __future__ import annotations

import statistics
import time

from bench.synthetic_decode import Synthetic
from bench.timing_report import tokens_per_s
from bench.timing_settings import (GROUP_SIZE, HEAD_DIM, HEADROOM, KV_HEADS, LAYERS, Setting, method_table,
                                   physical_layers)
from fathom.quantize import BLOCK

# cycles of the sleep kernel that holds the GPU while the host enqueues a token (~2 GHz): longer than the enqueue of
# a graph replay, or of an eager token (~3 ms of Numba launches per layer)
SLEEP_CYCLES = {"graph": 40_000_000, "eager": 300_000_000}
PROFILED_TOKENS = 3  # eager tokens per method under the profiler (--kernels), after one unprofiled


def kernel_name(raw: str) -> str:
    """A profiler's kernel name, short: a Numba kernel of the package as ``module.function``
    (``topk._first_pass_kernel``; a factory's kernel by its factory, ``scan._scan_kernel``), any other kernel's
    first 60 characters."""
    name = raw.split("[abi", 1)[0]
    if name.startswith("fathom::cuda::"):
        name = name.removeprefix("fathom::cuda::").replace("::_3clocals_3e::kernel", "").replace("::", ".")
    return name[:60]


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


def cache_shape(setting: Setting, args, layers: int):
    """The timed cache's shape, ``layers`` physical layers of ``setting`` (``args``: ``hbm_planes``,
    ``row_cache_rows``)."""
    from fathom.host.cache import CacheShape

    return CacheShape(sessions=setting.sessions, layers=layers, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_tokens=max(setting.lengths) + HEADROOM,
                      store="host" if setting.regime == "host" else "device",
                      hbm_planes=args.hbm_planes if setting.regime == "host" else None,
                      row_cache_rows=args.row_cache_rows)


def held_layers(setting: Setting, args) -> int:
    """Physical layers pinned host memory holds within ``args.host_gb``, counted as the cache counts a layer's
    pinned bytes (its K/V rows reserve ``max_tokens`` a session; the timed cache is given a basis, so it holds the
    rotated store too)."""
    from fathom.host.cache import PinnedLayer, store_names

    return physical_layers(PinnedLayer.nbytes(cache_shape(setting, args, 1), store_names(rotated=True)), args.host_gb)


class Run:
    """One setting: the cache filled once, a decoder (and a whole-token graph) per method, timed interleaved."""

    def __init__(self, setting: Setting, data: Synthetic, labels: list[str], args):
        import numpy as np
        import torch

        from fathom.host.cache import HostKVCache
        from fathom.host.decoder import Decoder, DecoderSettings
        from fathom.host.graph import StepGraph
        from fathom.quantize import CELLS, MAX_DEPTH, midpoint_levels
        from fathom.selection import Selection

        self.torch, self.setting = torch, setting
        self.physical = held_layers(setting, args)
        self.layer_order = [layer % self.physical for layer in range(LAYERS)]  # the physical layer of each of the 36
        shape = cache_shape(setting, args, self.physical)
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
        self.data = data
        self.walk = data.query_walk(self.layer_order, setting.sessions)
        self.q = self.walk.step()
        self.k_new, self.v_new = self.new_token()
        table = method_table()
        sel = Selection(k=setting.k)
        self.decoders, self.graphs = {}, {}
        # --levels: the midpoints as each (layer, KV head)'s table, so only the scan's kernel differs
        tables = np.broadcast_to(midpoint_levels(HEAD_DIM), (self.physical, KV_HEADS, HEAD_DIM, MAX_DEPTH, CELLS))
        for label in labels:
            levels = tables if args.levels and table[label].scans_planes else None
            decoder = Decoder(self.cache, DecoderSettings(table[label], sel), GROUP_SIZE, ds_rank=ds_rank,
                              levels=levels)
            self.decoders[label] = decoder
            if "graph" in args.modes:
                self.graphs[label] = StepGraph(decoder, layers=self.layer_order, append=True)
        self.samples = {(label, mode): {"gpu": [], "wall": [], "host": [], "stages": []}
                        for label in labels for mode in args.modes}
        self.nbytes: dict[str, dict] = {}  # per method: what one eager token read (:meth:`read_bytes`)
        self.row_hit_rate: dict[str, float | None] = dict.fromkeys(labels)
        self.row_cache_warmup = dict.fromkeys(labels, 0)  # untimed tokens before the hit rate was counted
        self.row_cache_filled: dict[str, float | None] = dict.fromkeys(labels)  # slots holding a row by then
        self.timed_from = dict.fromkeys(labels, 0)  # the longest session's tokens when the timed tokens began
        self.kernels_us: dict[str, dict[str, float]] = {}  # per method, with --kernels (:meth:`kernel_profile`)
        self.kernel_sealing_tokens: dict[str, int] = {}  # of its profiled tokens, those that sealed some block

    def tokens_left(self) -> int:
        """Decode tokens the cache can still append: a token appends to a physical layer once for each of the
        ``ceil(LAYERS / physical)`` layers mapped onto it."""
        return (self.cache.shape.max_tokens - self.cache.most_held()) // -(-LAYERS // self.physical)

    def new_token(self):
        """The next token's keys and values to append, float32 ``[L, S, H, 1, d]``, drawn afresh every token: a key
        appended unchanged would fill whole sealed blocks with one score, unlike a decode's keys."""
        return self.data.appended(self.layer_order, self.setting.sessions)

    def eager_token(self, decoder, events=None) -> None:
        """Append + step of every layer, eagerly; with ``events``, a pair of events around each stage."""
        for i, layer in enumerate(self.layer_order):
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
        self.k_new, self.v_new = self.new_token()
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
        for i, layer in enumerate(self.layer_order):
            decoder.run(layer, self.q[i])
            scan += decoder.scan_nbytes(layer)
            scan_link += decoder.scan_nbytes_by_tier(layer)[1]
            rows += decoder.row_nbytes(layer)
            row_link += decoder.row_nbytes_by_tier(layer)[1]
            tokens += float((self.cache.lengths(layer) // 64 * 64).sum()) * KV_HEADS
        self.nbytes[label] = {"scan": scan, "scan_link": scan_link, "rows": rows, "row_link": row_link,
                              "bits": scan * 8 / max(tokens, 1)}

    def kernel_profile(self, label: str) -> dict[str, float]:
        """GPU µs per token of each kernel of ``label``'s eager token, largest first (torch's profiler over
        :data:`PROFILED_TOKENS` tokens; kernel durations, so the eager launch gaps are not in them). How many of
        them sealed a block goes to ``kernel_sealing_tokens``: such a token's seal kernels do the block's work, the
        others' return at once. Several sessions' ends are staggered (``Setting.lengths``), so most of their tokens
        seal, as a server's do; one session seals on one token in 64 / (its appends a token to a physical layer), so
        there the seal's figure is those tokens', not a steady cost."""
        torch = self.torch
        self.token(label, "eager", queued=False)
        physical = range(self.physical)
        sealing = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(PROFILED_TOKENS):
                blocks = [self.cache.lengths(layer) // BLOCK for layer in physical]
                self.token(label, "eager", queued=False)
                # a token that completes a 64-token block of a session in some physical layer (each takes one
                # append a logical layer mapped onto it) seals it there
                sealing += any((self.cache.lengths(layer) // BLOCK > before).any()
                               for layer, before in zip(physical, blocks))
            torch.cuda.synchronize()
        self.kernel_sealing_tokens[label] = sealing
        total: dict[str, float] = {}
        for event in profile.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                name = kernel_name(event.name)
                total[name] = total.get(name, 0.0) + event.device_time_total / PROFILED_TOKENS
        return dict(sorted(total.items(), key=lambda item: -item[1]))

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
                        "row_cache_warmup": run.row_cache_warmup[label] if run.cache.shape.row_cache_rows else None,
                        "row_cache_filled": run.row_cache_filled[label], "timed_from_tokens": run.timed_from[label],
                        "hbm_planes": run.cache.shape.layout.hbm_planes,
                        "host_plane_fraction": scan_link / scan if scan else None,
                        "hbm_gb": run.cache.hbm_bytes / 1e9, "pinned_gb": run.cache.pinned_bytes / 1e9,
                        "floor_ms": link_bytes / link_gbps / 1e6,
                        "hbm_scan_ms": scan / hbm_gbps / 1e6 if run.setting.regime == "hbm" else None,
                        "stages_ms": stage_ms, "kernels_us": run.kernels_us.get(label),
                        "kernel_tokens": PROFILED_TOKENS if label in run.kernels_us else None,
                        "kernel_sealing_tokens": run.kernel_sealing_tokens.get(label),
                        "fill_s": round(run.fill_s, 1)})
    by_key = {(r["label"], r["mode"]): r for r in out}
    for r in out:
        ds = by_key.get(("double-sparsity@136", r["mode"]))
        r["tokens_per_s"] = tokens_per_s(r)
        r["speedup_vs_ds136"] = ds["gpu_ms"] / r["gpu_ms"] if ds else None
        r["wall_speedup_vs_ds136"] = ds["wall_ms"] / r["wall_ms"] if ds else None
        r["gpu_over_floor"] = r["gpu_ms"] / r["floor_ms"] if r["floor_ms"] > 0 else None
        r["wall_over_gpu"] = r["wall_ms"] / r["gpu_ms"]
    return out
