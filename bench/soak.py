"""``python -m bench soak``: create / use / close an offloaded cache many times; host and GPU memory must stay flat.

Each cycle makes a 4-layer cache (pinned host memory), appends a prompt to every layer, builds a decoder (fathom
at 48 bits) and a CUDA graph of one token, decodes a few tokens, and closes everything. Every ``--every`` cycles it
records the process's resident host memory (``/proc/self/statm``), the GPU memory in use (``cudaMemGetInfo``: every
allocation of the process, torch's pool included) and what torch's allocator holds. Writes ``soak.json``, ``.md``
and ``.png`` with the command.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.cli import UsageError, require_cuda, writable_folder
from bench.report import RESULTS, markdown_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=int, default=1000,
                        help="create / use / close cycles (2..100000; default %(default)s)")
    parser.add_argument("--every", type=int, default=50,
                        help="record memory every this many cycles (1..cycles / 2; default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def run(args: argparse.Namespace) -> Path:
    # the growth is measured from the second sample (the first cycle is warm-up) to the last: with --every above
    # half the cycles they are one sample and the growth reads 0 whatever memory did
    if not 2 <= args.cycles <= 100_000:
        raise UsageError(f"--cycles must lie in 2..100000, got {args.cycles}")
    if not 1 <= args.every <= args.cycles // 2:
        raise UsageError(f"--every must lie in 1..{args.cycles // 2} (half of --cycles: growth is measured between "
                         f"two samples after the first), got {args.every}")
    writable_folder("--out", args.out)
    require_cuda("soak")
    import torch
    from tqdm import tqdm

    from fathom import methods
    from fathom.host.cache import CacheShape, HostKVCache
    from fathom.host.decoder import Decoder, DecoderSettings
    from fathom.host.graph import StepGraph
    from fathom.selection import Selection

    shape = CacheShape(sessions=2, layers=4, kv_heads=8, head_dim=128, max_tokens=16384)
    k = torch.randn(2, 8, 8192, 128, device="cuda")
    q = torch.randn(4, 2, 32, 128, device="cuda")
    k1 = torch.randn(4, 2, 8, 1, 128, device="cuda")
    samples = []
    started = time.perf_counter()
    for cycle in tqdm(range(args.cycles + 1), desc="soak", unit="cycle"):
        with HostKVCache(shape) as cache:
            for layer in range(shape.layers):
                cache.append(layer, k, k)
            decoder = Decoder(cache, DecoderSettings(methods.fathom(48), Selection(k=512)), group_size=4)
            token = StepGraph(decoder, append=True)
            for _ in range(3):
                token(q, k1, k1)
            decoder.run(0, q[0])
            torch.cuda.synchronize()
            del token, decoder
        if cycle % args.every == 0:
            free, total = torch.cuda.mem_get_info()
            samples.append({"cycle": cycle, "host_rss_mb": _rss_mb(), "gpu_used_mb": (total - free) / 1e6,
                            "torch_reserved_mb": torch.cuda.memory_reserved() / 1e6,
                            "torch_allocated_mb": torch.cuda.memory_allocated() / 1e6,
                            "seconds": round(time.perf_counter() - started, 1)})
    first, last = samples[1], samples[-1]  # after the first cycle's warm-up; --every <= cycles / 2 leaves 3 samples
    payload = {"device": torch.cuda.get_device_name(), "cycles": args.cycles, "shape": vars(shape),
               "samples": samples, "growth_after_first": {key: last[key] - first[key] for key in
                                                          ("host_rss_mb", "gpu_used_mb", "torch_reserved_mb")}}
    path = write_json(args.out / "soak.json", args.command_line, payload)
    table = markdown_table(samples, [("cycle", "cycle", "d"), ("host_rss_mb", "host RSS MB", ".0f"),
                                     ("gpu_used_mb", "GPU used MB", ".0f"), ("torch_reserved_mb", "torch reserved MB",
                                                                             ".0f"),
                                     ("seconds", "s", ".0f")])
    path.with_suffix(".md").write_text(f"Create / use / close soak on {payload['device']} (`{args.command_line}`): "
                                       f"growth from cycle {first['cycle']} to {last['cycle']}: "
                                       + ", ".join(f"{k} {v:+.1f}" for k, v in payload["growth_after_first"].items())
                                       + ".\n\n" + table + "\n")
    _plot(samples, path.with_suffix(".png"))
    print(table)
    return path


def _plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    cycles = [s["cycle"] for s in samples]
    for key, label in (("host_rss_mb", "host RSS"), ("gpu_used_mb", "GPU in use"), ("torch_reserved_mb",
                                                                                      "torch reserved")):
        ax.plot(cycles, [s[key] for s in samples], "-o", ms=3, label=label)
    ax.set_xlabel("create / use / close cycles")
    ax.set_ylabel("MB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
