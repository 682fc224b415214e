"""Time one offloaded decode step of one layer on the GPU, stage by stage (SPEC §8).

``python -m bench.gpu_step --out DIR`` (needs a CUDA GPU). K/V rows and landmarks in
pinned, mapped host memory; Qwen3-8B's shape by default (8 KV heads, G = 4,
d = 128) at 128k tokens, k = 512. Methods, interleaved step by step (A B A B):
fathom at B bits (water-filling, σ² from the store), double-sparsity and loki
(32 channels at depth 4, 136 bits; loki on a rotated cache, the keys' PCA basis),
sparq (16 query-chosen channels, 68 bits), the 2-bit thumbnail (288 bits),
landmark (256 bits), oracle (every sealed bf16 K row, 2048 bits) and dense, with
the store in pinned host memory (the target regime); and fathom and
double-sparsity again with the store resident in HBM (where fathom is not
expected to be faster: the scan is compute-bound there). Each stage is timed with
CUDA events on the one stream every kernel runs on; medians of ``--steps`` steps
after 2 warm-ups. Then the transport comparison on double-sparsity's run list
(known on the host): the zero-copy gather kernel against one ``cudaMemcpyAsync``
per run, one ``cudaMemcpyBatchAsync`` for all runs, and one contiguous copy of
the same bytes (the link's ceiling), plus the gather from an HBM-resident store.

Writes ``gpu_step_<n/1024>k.json``, ``.md`` and ``.png`` (GPU time per stage)
into ``--out``; ``--replot JSON`` remakes the table and plot from a result on any
machine. Keys are synthetic: random, with channel standard deviations spread
log-uniformly over 2.5 decades (not real captures).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numba import cuda

from bench.report import RESULTS, write_json
from fathom import methods
from fathom.bits import row_bytes
from fathom.cuda.gather import gather_runs
from fathom.host.cache import CacheShape, OffloadedCache
from fathom.host.decoder import Decoder, DecoderSettings
from fathom.quantize import BLOCK
from fathom.selection import Selection

STAGES = ("plan", "gather", "scan", "top-k", "union", "rows", "attention")
WARMUP = 2
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than the host takes to enqueue a step


def _events(n: int) -> list[torch.cuda.Event]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def timed_step(decoder: Decoder, q: torch.Tensor, queued: bool) -> tuple[dict[str, float], float]:
    """One step with an event between stages -> (µs per stage, wall-clock µs).

    ``queued``: a sleep kernel first holds the GPU until the host has enqueued the whole step, so the
    events measure GPU time (kernels and copies) rather than gaps while the host launches (Numba launches
    cost tens of µs of host time each). Unqueued, the events and the wall-clock time show the host-bound step.
    """
    ev = _events(len(STAGES) + 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if queued:
        torch.cuda._sleep(SLEEP_CYCLES)
    q3 = decoder.check(0, q)
    ev[0].record()
    decoder.plan(0, q3)
    ev[1].record()
    decoder.stage(0)
    ev[2].record()
    decoder.scan(0, q3)
    ev[3].record()
    decoder.select(0)
    ev[4].record()
    decoder.union(0)
    ev[5].record()
    decoder.fetch(0)
    ev[6].record()
    decoder.attend(q3)
    ev[7].record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6
    return {s: ev[i].elapsed_time(ev[i + 1]) * 1e3 for i, s in enumerate(STAGES)}, wall


def step_bytes(decoder: Decoder) -> tuple[float, float, float]:
    """(scan bytes, row bytes, mean scan bits per token) of the last step, read back after it."""
    scan = decoder.scan_nbytes(0)
    tokens = decoder.streams * decoder.cache.layer(0).n_blocks * BLOCK
    return scan, decoder.row_nbytes(), scan * 8 / tokens

def host_runs(cache: OffloadedCache, depths: np.ndarray, staged_ptr: int) -> list[tuple[int, int, int]]:
    """(dst, src, bytes) of every run of ``depths [S·H, d]`` (planes, then scales), compact like the kernel."""
    s, store = cache.shape, cache.layer(0)
    cap, n_seg, nb, d = s.segment_blocks, s.segments, store.n_blocks, s.head_dim
    planes_ptr, scales_ptr = store.planes.host_ptr, store.scales.host_ptr
    copies, dst = [], staged_ptr
    for g in range(depths.shape[0]):
        for c in np.flatnonzero(depths[g]):
            for seg in range(n_seg):
                blocks = min(max(nb - seg * cap, 0), cap)
                if not blocks:
                    continue
                if blocks != cap and depths[g, c] > 1:
                    raise ValueError("transport comparison expects full segments (contiguous runs)")
                src_seg = (g * n_seg + seg) * d + c
                n_plane_bytes = int(depths[g, c]) * blocks * 8
                copies.append((dst, planes_ptr + src_seg * 4 * cap * 8, n_plane_bytes))
                dst += n_plane_bytes
                copies.append((dst, scales_ptr + src_seg * cap * 2, blocks * 2))
                dst += blocks * 2
    return copies


def transport(cache: OffloadedCache, decoder: Decoder, steps: int) -> dict:
    """Zero-copy gather kernel vs cudaMemcpyAsync per run vs cudaMemcpyBatchAsync vs one copy (same bytes)."""
    from cuda.bindings import runtime as rt

    depths = decoder.depths.cpu().numpy()
    total = sum(n for *_, n in host_runs(cache, depths, 0))
    staged = torch.empty(total, dtype=torch.uint8, device="cuda")
    copies = host_runs(cache, depths, staged.data_ptr())
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    stream = torch.cuda.Stream()  # the batch API refuses the legacy default stream
    handle = rt.cudaStream_t(stream.cuda_stream)
    store = cache.layer(0)
    st = decoder.staging
    planes_flat = store.planes_dev.reshape(store.planes_dev.size)
    scales_flat = store.scales_dev.reshape(store.scales_dev.size)
    planes_hbm = cuda.to_device(store.planes.host.reshape(-1))
    scales_hbm = cuda.to_device(store.scales.host.reshape(-1))
    attrs = rt.cudaMemcpyAttributes()
    attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    host_copy = torch.empty(total, dtype=torch.uint8).pin_memory()

    def kernel_mapped():
        gather_runs(st.runs, planes_flat, scales_flat, st.cap, store.n_blocks, st.planes, st.scales)

    def kernel_hbm():
        gather_runs(st.runs, planes_hbm, scales_hbm, st.cap, store.n_blocks, st.planes, st.scales)

    def memcpy_per_run():
        for dst, src, n in copies:
            rt.cudaMemcpyAsync(dst, src, n, kind, handle)

    def memcpy_batch():
        dsts, srcs, sizes = zip(*copies)
        err, *_ = rt.cudaMemcpyBatchAsync(list(dsts), list(srcs), list(sizes), len(copies), [attrs], [0], 1,
                                          handle)
        if int(err):
            raise RuntimeError(f"cudaMemcpyBatchAsync: {err}")

    def memcpy_one():
        rt.cudaMemcpyAsync(staged.data_ptr(), host_copy.data_ptr(), total, kind, handle)

    variants = {"zero-copy kernel (mapped)": (kernel_mapped, None), "cudaMemcpyAsync per run": (memcpy_per_run, stream),
                "cudaMemcpyBatchAsync": (memcpy_batch, stream), "one contiguous cudaMemcpyAsync": (memcpy_one, stream),
                "gather kernel, store in HBM": (kernel_hbm, None)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    errors = {}
    for i in range(steps + WARMUP):
        for name, (fn, on) in variants.items():
            if name in errors:
                continue
            start, end = _events(2)
            try:
                with torch.cuda.stream(on or torch.cuda.default_stream()):
                    torch.cuda.synchronize()
                    start.record()
                    fn()
                    end.record()
                torch.cuda.synchronize()
            except (RuntimeError, TypeError, AttributeError, ValueError) as e:  # a missing API is a result
                errors[name] = repr(e)
                continue
            if i >= WARMUP:
                times[name].append(start.elapsed_time(end) * 1e3)
    out = {"bytes": total, "copies": len(copies), "steps": steps, "errors": errors, "variants": {}}
    for name, ts in times.items():
        if ts:
            us = statistics.median(ts)
            out["variants"][name] = {"us": us, "GBps": total / us / 1e3}
    return out


def build(args) -> tuple[dict[str, OffloadedCache], torch.Tensor, np.ndarray]:
    """Caches of the same keys and values: raw store in host memory, raw store in HBM, rotated store in host
    memory (the PCA basis of each head's first chunk of keys, by decreasing variance)."""
    torch.manual_seed(0)
    s = CacheShape(sessions=1, layers=1, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   max_tokens=args.tokens + BLOCK)
    std = torch.exp(torch.empty(s.kv_heads, s.head_dim, device="cuda").uniform_(np.log(0.05), np.log(15.0)))
    chunk = 8192
    caches: dict[str, OffloadedCache] = {}
    for start in range(0, args.tokens, chunk):
        m = min(chunk, args.tokens - start)
        k = torch.randn(1, s.kv_heads, m, s.head_dim, device="cuda") * std[None, :, None, :]
        v = torch.randn(1, s.kv_heads, m, s.head_dim, device="cuda")
        if not caches:
            keys = k[0].double().cpu().numpy()
            cov = np.einsum("hni,hnj->hij", keys, keys) / m
            basis = np.linalg.eigh(cov)[1][..., ::-1][None]  # [1, H, d, d], columns by decreasing variance
            caches = {"host": OffloadedCache(s), "hbm": OffloadedCache(CacheShape(**{**vars(s), "store": "device"})),
                      "rotated": OffloadedCache(s, basis=np.ascontiguousarray(basis))}
        for cache in caches.values():
            cache.append(0, k, v)
    torch.cuda.synchronize()
    q = torch.randn(1, s.kv_heads * args.group, s.head_dim, device="cuda")
    ds_rank = torch.argsort(std, dim=1, descending=True).cpu().numpy()[None]  # DS: largest mean|k| first
    return caches, q, ds_rank


def decoders(args, caches: dict[str, OffloadedCache], ds_rank: np.ndarray) -> dict[str, Decoder]:
    """Every timed (method, store) pair, named ``label`` (host store) or ``label (HBM store)``."""
    d, sel = args.head_dim, Selection(k=args.k)
    host = [(methods.fathom(args.budget), "host"), (methods.double_sparsity(d // 4), "host"),
            (methods.sparq(d // 8), "host"), (methods.loki(d // 4), "rotated"), (methods.thumbnail(2), "host"),
            (methods.landmark(), "host"), (methods.oracle(), "host"), (methods.dense(), "host"),
            (methods.fathom(args.budget), "hbm"), (methods.double_sparsity(d // 4), "hbm")]
    out = {}
    for method, where in host:
        name = method.label(d) + (" (HBM store)" if where == "hbm" else "")
        out[name] = Decoder(caches[where], DecoderSettings(method, sel), args.group, ds_rank=ds_rank)
    return out


def markdown(result: dict) -> str:
    lines = [(f"One layer, {result['config']['tokens']} tokens, {result['device']}; K/V rows and landmarks in pinned "
              "host memory, the bit-plane store too unless marked (HBM store); median of "
              f"{result['config']['steps']} steps, methods interleaved. Stages: GPU time (µs, CUDA events with "
              "the step queued behind a sleep kernel); wall: host time of an unqueued step (µs)."), "",
             "| method | bits/token | " + " | ".join(STAGES) + " | GPU total | wall | scan MB | scan GB/s | "
             "rows MB | rows GB/s |", "|" + " --- |" * (len(STAGES) + 8)]
    for name, m in result["methods"].items():
        stages = " | ".join(f"{m['stages_us'][s]:.0f}" for s in STAGES)
        lines.append(f"| {name} | {m['bits_per_token']:.1f} | {stages} | {m['gpu_us']:.0f} | {m['wall_us']:.0f} | "
                     f"{m['scan_bytes'] / 1e6:.2f} | {m['scan_GBps']:.1f} | {m['row_bytes'] / 1e6:.2f} | "
                     f"{m['rows_GBps']:.1f} |")
    ms = result["methods"]
    ratios = [f"{ms[ds + where]['gpu_us'] / ms[fa + where]['gpu_us']:.2f}× with the store in {memory}"
              for fa in ms if fa.startswith("fathom@") and "(" not in fa
              for ds in ms if ds.startswith("double-sparsity@") and "(" not in ds
              for where, memory in (("", "host memory"), (" (HBM store)", "HBM"))
              if fa + where in ms and ds + where in ms]
    if ratios:
        lines += ["", "GPU time of double-sparsity over fathom: " + ", ".join(ratios) + "."]
    t = result["transport"]
    lines += ["", (f"Transport of double-sparsity's scan: {t['bytes'] / 1e6:.2f} MB in {t['copies']} runs "
                  "(planes and scales separately)."), "", "| transport | µs | GB/s |", "| --- | --- | --- |"]
    lines += [f"| {name} | {v['us']:.0f} | {v['GBps']:.1f} |" for name, v in t["variants"].items()]
    lines += [f"| {name} | failed: {err} | |" for name, err in t["errors"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Stacked GPU time per stage of every timed method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["methods"] if n != "dense"]  # dense is 20x the others: in the table only
    fig, ax = plt.subplots(figsize=(9, 4.5))
    left = np.zeros(len(names))
    for stage in STAGES:
        widths = np.array([result["methods"][n]["stages_us"][stage] for n in names])
        ax.barh(names, widths, left=left, label=stage)
        left += widths
    ax.invert_yaxis()
    ax.set_xlabel("GPU time of one layer's decode step (µs)")
    cfg = result["config"]
    ax.set_title(f"{result['device']}: one layer, {cfg['tokens']} tokens, {cfg['kv_heads']} KV heads, "
                 f"G = {cfg['group']}, d = {cfg['head_dim']}, k = {cfg['k']} (synthetic keys)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench gpu-step", description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", type=Path, default=None, help="remake .md and .png from this JSON (no GPU)")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--budget", type=float, default=48.0)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args(argv)
    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        args.replot.with_suffix(".md").write_text(markdown(result))
        plot(result, args.replot.with_suffix(".png"))
        return
    command = "python -m bench gpu-step " + shlex.join(sys.argv[1:] if argv is None else argv)

    caches, q, ds_rank = build(args)
    timed = decoders(args, caches, ds_rank)
    samples = {name: {"gpu": [], "host": []} for name in timed}
    for i in range(args.steps + WARMUP):
        for name, decoder in timed.items():  # A B A B
            for mode, queued in (("host", False), ("gpu", True)):
                stages, wall = timed_step(decoder, q, queued)
                if i >= WARMUP:
                    samples[name][mode].append((stages, wall))
    result = {"device": torch.cuda.get_device_name(), "config": vars(args) | {"out": None}, "methods": {}}
    for name, decoder in timed.items():
        gpu, host = samples[name]["gpu"], samples[name]["host"]
        stages = {s: statistics.median(x[0][s] for x in gpu) for s in STAGES}
        scan, rows, bits = step_bytes(decoder)
        result["methods"][name] = {
            "store": decoder.cache.shape.store, "stages_us": stages,
            "gpu_us": statistics.median(sum(x[0].values()) for x in gpu),
            "wall_us": statistics.median(x[1] for x in host),
            "host_bound_stages_us": {s: statistics.median(x[0][s] for x in host) for s in STAGES},
            "scan_bytes": scan, "row_bytes": rows, "bits_per_token": bits,
            "rows_per_kv_head": rows / row_bytes(args.head_dim) / decoder.streams,
            "scan_GBps": scan / max(stages["gather"], 1e-3) / 1e3, "rows_GBps": rows / stages["rows"] / 1e3}
    result["transport"] = transport(caches["host"], timed[methods.double_sparsity(args.head_dim // 4).label(
        args.head_dim)], args.steps)
    name = f"gpu_step_{args.tokens // 1024}k"
    write_json(args.out / f"{name}.json", command, result)
    table = markdown(result)
    (args.out / f"{name}.md").write_text(table)
    plot(result, args.out / f"{name}.png")
    print(table)
    for cache in caches.values():
        cache.close()


if __name__ == "__main__":
    main()
