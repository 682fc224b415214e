"""The selection alone (``fathom.cuda.topk.select``: its two candidate passes over the scores and the ties kernel),
timed at a decode step's sizes for several launch shapes, on synthetic scores crowded into one binade as real scores
are (the module notes of ``fathom.cuda.topk``). Every shape's selection must equal the first's (the rows and head
masks ``union_rows`` compacts from it; a difference is refused, not timed), so a faster shape is the same selection.

``python -m bench.select_probe [--context 131072] [--sessions 1,16] [--per-block 8192,16384,32768]
[--threads 256,512] [--select-threads 1024] [--reps 20] [--out bench/results/select-probe.json]`` (needs a GPU).
One layer of the timing bench's shape: 8 KV heads of G = 4 query heads, k = 512, sink 4, local 32; a batch of
several sessions is ragged as ``bench timing``'s (session i holds ``context · (1 + i) / S`` tokens, down to a
block), in buffers of ``context`` tokens. Each shape is captured in a CUDA graph of ``--reps`` selections (each
after a copy that restores the scan's top-byte histogram, which a selection consumes), replayed five times; the
median replay over ``--reps`` is the figure, the restoring copy included (the same in every shape). The ties
kernel's timings here do not carry over to a decode step: at 256 ties threads the probe's selection took 0.91x its
time at 1,024, where the whole token's ties kernel took 1.9x (results.md, 2026-12-06), likely because the plane
scan's scores put more candidates (or more exact ties) in the k-th's bin than these continuous ones do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import numpy as np

from bench.cli import UsageError, at_least, int_list, plain, probe_ready
from bench.report import command_line, markdown_table

KV_HEADS, GROUP, K, SINK, LOCAL = 8, 4, 512, 4, 32
REPLAYS = 5


def session_lengths(context: int, sessions: int) -> np.ndarray:
    """int32 ``[sessions]``: ``context`` for one session, else ragged as ``bench timing``'s batches."""
    from bench.timing_settings import Setting

    return np.array(Setting(context, sessions, "host", ragged=sessions > 1).lengths, np.int32)


def top_histogram(scores, lengths, heads_per_session: int, sink: int, local: int):
    """int32 ``[streams, G, 256]``: the top key byte of every candidate (sealed tokens ``sink .. min(n_sealed,
    n - local)``), as the scan counts it for the selection (``fathom.cuda.scan``)."""
    import torch

    from fathom.quantize import BLOCK

    streams, heads, tokens = scores.shape
    bits = scores.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.where(bits == 0x80000000, torch.zeros_like(bits), bits)  # -0 counts as +0
    keys = torch.where(bits >> 31 == 1, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    n = lengths.to(torch.int64).repeat_interleave(heads_per_session)[:, None, None]
    token = torch.arange(tokens, device=scores.device)
    candidate = (token >= sink) & (token < torch.minimum(n // BLOCK * BLOCK, n - local))
    top = torch.where(candidate, keys >> 24, torch.full_like(keys, 256))  # bin 256: not a candidate
    hist = torch.zeros((streams, heads, 257), dtype=torch.int64, device=scores.device)
    hist.scatter_add_(2, top, torch.ones_like(top))
    return hist[..., :256].to(torch.int32).contiguous()


class SelectionBuffers:
    """One layer's selection buffers (as ``fathom.host.decoder.Decoder`` holds them) over synthetic scores of
    ``sessions`` (:func:`session_lengths`) of ``kv_heads`` KV heads, each a buffer of ``context`` tokens."""

    def __init__(self, context: int, sessions: int, kv_heads: int = KV_HEADS, k: int = K, seed: int = 0):
        import torch

        from fathom.cuda.interop import DEVICE
        from fathom.cuda.topk import union_blocks

        self.lengths = torch.tensor(session_lengths(context, sessions), device=DEVICE)
        self.kv_heads, self.k = kv_heads, k
        streams = sessions * kv_heads
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        # one binade, as real scores crowd (a shared offset q · mean(k)): every candidate shares the top key byte
        self.scores = (24 + 2 * torch.rand((streams, GROUP, context), generator=generator, device=DEVICE)
                       * torch.randn((streams, GROUP, context), generator=generator, device=DEVICE).clamp(-3, 3))
        self.saved_hist = top_histogram(self.scores, self.lengths, kv_heads, SINK, LOCAL)
        zeros = lambda shape, dtype=torch.int32: torch.zeros(shape, dtype=dtype, device=DEVICE)  # noqa: E731
        self.top_hist, self.hist2 = zeros(self.saved_hist.shape), zeros(self.saved_hist.shape)
        self.cand_key, self.cand_idx = zeros(self.scores.shape), zeros(self.scores.shape)
        self.cand_count = zeros((streams, GROUP))
        self.winners, self.any_rows = zeros((streams, context)), zeros((streams, -(-context // 64)), torch.int64)
        rows = min(GROUP * k + SINK + LOCAL + 63, context)
        self.row_index, self.head_mask, self.n_rows = zeros((streams, rows)), zeros((streams, rows)), zeros(streams)
        self.union_threads = 1024
        self.block_rows = zeros((streams, union_blocks(context, self.union_threads)))

    def select(self, per_block: int, threads: int, select_threads: int, stream) -> None:
        """Restore the scan's histogram, then select (marks only: :meth:`rows` compacts and clears them)."""
        from fathom.cuda.interop import as_array
        from fathom.cuda.topk import select

        self.top_hist.copy_(self.saved_hist)
        select(as_array(self.scores).view(np.uint32), as_array(self.lengths), self.kv_heads, self.k, SINK, LOCAL,
               as_array(self.top_hist), as_array(self.hist2), as_array(self.cand_key).view(np.uint32),
               as_array(self.cand_idx), as_array(self.cand_count), as_array(self.winners).view(np.uint32),
               as_array(self.any_rows).view(np.uint64), threads, select_threads, per_block, stream)

    def rows(self, stream):
        """The selection's rows and head masks per stream (``union_rows``), which clears the marks."""
        from fathom.cuda.interop import as_array
        from fathom.cuda.topk import union_rows

        union_rows(as_array(self.any_rows).view(np.uint64), as_array(self.winners).view(np.uint32),
                   as_array(self.lengths), self.kv_heads, as_array(self.block_rows), as_array(self.row_index),
                   as_array(self.head_mask), as_array(self.n_rows), self.union_threads, stream)
        return [x.clone() for x in (self.n_rows, self.row_index, self.head_mask)]


def measure(sel: SelectionBuffers, per_block: int, threads: int, select_threads: int, reps: int):
    """(median µs a selection, the selection's rows): ``reps`` selections in one CUDA graph, replayed
    :data:`REPLAYS` times after an eager run that yields the rows."""
    import torch
    from numba import cuda

    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    sel.select(per_block, threads, select_threads, stream)  # compiles, outside the capture
    rows = sel.rows(stream)
    graph = torch.cuda.CUDAGraph()
    with cuda.defer_cleanup(), torch.cuda.graph(graph):
        capture = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        for _ in range(reps):
            sel.select(per_block, threads, select_threads, capture)
    times = []
    for _ in range(REPLAYS):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / reps)
    sel.rows(stream)  # clear the replays' marks
    return statistics.median(times), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.select_probe", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--context", type=int, default=131072, help="tokens a session (default 131072)")
    parser.add_argument("--sessions", type=int_list, default=[1, 16], help="batch sizes (default 1,16)")
    parser.add_argument("--per-block", type=int_list, default=[8192, 16384, 32768],
                        help="tokens a CTA of the candidate passes (default 8192,16384,32768; the first is the "
                             "reference selection)")
    parser.add_argument("--threads", type=int_list, default=[256, 512],
                        help="threads a CTA of the candidate passes (default 256,512)")
    parser.add_argument("--select-threads", type=int_list, default=[1024],
                        help="threads a CTA of the ties kernel (default 1024, the decoder's on a GPU)")
    parser.add_argument("--reps", type=int, default=20, help="selections a replay (default 20)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/select-probe.json"),
                        help="JSON written here, its table beside it (default bench/results/select-probe.json)")
    args = parser.parse_args(argv)

    def check():
        at_least("--context", args.context, 4096)
        at_least("--reps", args.reps, 1)
        for name, values, low in (("--sessions", args.sessions, 1), ("--per-block", args.per_block, 1)):
            for value in values:
                at_least(name, value, low)
        if any(not 32 <= t <= 1024 for t in args.threads):
            raise UsageError(f"--threads must be in 32..1024, got {args.threads}")
        if any(not 32 <= t <= 1024 for t in args.select_threads):
            raise UsageError(f"--select-threads must be in 32..1024, got {args.select_threads}")

    probe_ready(parser, 1, args.out, check)
    import torch

    records = []
    for sessions in args.sessions:
        sel = SelectionBuffers(args.context, sessions)
        reference = None
        for per_block, threads, select_threads in itertools.product(args.per_block, args.threads,
                                                                     args.select_threads):
            us, rows = measure(sel, per_block, threads, select_threads, args.reps)
            if reference is None:
                reference = rows
            elif not all(torch.equal(a, b) for a, b in zip(rows, reference)):
                raise SystemExit(f"error: per_block {per_block}, threads {threads} / {select_threads} selected "
                                 f"other rows than the first shape at {sessions} sessions")
            records.append({"sessions": sessions, "context": args.context, "per_block": per_block,
                            "threads": threads, "select_threads": select_threads, "us": us,
                            "rows": int(reference[0].sum())})
            print(f"{sessions} sessions, per_block {per_block}, threads {threads} / {select_threads}: {us:.1f} µs",
                  flush=True)
        del sel
        torch.cuda.empty_cache()
    out = {"command": command_line(argv, "python -m bench.select_probe"), "device": torch.cuda.get_device_name(),
           "reps": args.reps, "replays": REPLAYS, "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    for r in records:  # against the batch's first shape (the reference selection)
        r["speedup"] = next(x for x in records if x["sessions"] == r["sessions"])["us"] / r["us"]
        r["ms_36"] = r["us"] * 36e-3
    table = markdown_table(records, [("sessions", "sessions", "d"), ("per_block", "tokens a CTA", "d"),
                                     ("threads", "threads", "d"), ("select_threads", "ties threads", "d"),
                                     ("us", "µs a selection", ".1f"),
                                     ("ms_36", "36 layers, ms", ".2f"), ("speedup", "vs the first shape", ".2f")])
    args.out.with_suffix(".md").write_text(f"`{out['command']}` on {out['device']}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
