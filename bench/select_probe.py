"""The selection alone (``fathom.cuda.topk.select``: its two candidate passes over the scores, two passes over the
candidate lists and the ties kernel), timed at a decode step's sizes for several launch shapes, on synthetic scores
crowded into one binade as real scores are (the module notes of ``fathom.cuda.topk``). Every shape's selection must
equal the first's (the rows and head masks ``union_rows`` compacts from it; a difference is refused, not timed), so
a faster shape is the same selection.

``python -m bench.select_probe [--context 131072] [--sessions 1,16] [--per-block 8192,16384,32768]
[--threads 256,512] [--select-threads 1024] [--reps 20] [--out bench/results/select-probe.json]`` (needs a GPU).
One layer of the timing bench's shape: 8 KV heads of G = 4 query heads, k = 512, sink 4, local 32; a batch of
several sessions is ragged as ``bench timing``'s (session i holds ``context · (1 + i) / S`` tokens, down to a
block), in buffers of ``context`` tokens. Each shape is captured in a CUDA graph of ``--reps`` selections (each
after a copy that restores the scan's top-byte histogram, which a selection consumes), replayed five times; the
median replay over ``--reps`` is the figure, the restoring copy included (the same in every shape). The list passes
run ``list_ctas_for``'s CTAs a head, as the decoder's. The probe's timings of the list passes and the ties kernel do
not carry over to a decode step: its scores crowd no head (below), where the bench's layer-0 heads do.

``python -m bench.select_probe --census [--context 131072] [--model M --corpus C]`` (on the CPU) counts why: the
candidate list (the k-th's bin of the top 16 key bits) of each query head at fathom@48 through the reference scan,
over the timing bench's synthetic data (and this probe's scores) or, with ``--model``, a real model's capture at its
last decode position. It holds ~100 candidates on every head of these scores; on the timing bench's data a median
of 4-137 on most layers and up to ~10^5 on layer 0's heads, on Qwen2.5-Coder-1.5B at 16k up to 7,200 on layer 0's:
the list passes' slowest head sets their time. Beside it, each head's share of 64-token blocks holding a token each
pass over the scores acts on (``block_census``): what those passes would walk if they skipped the other blocks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import numpy as np

from bench.cli import UsageError, at_least, int_list, plain, probe_ready, writable_file
from bench.report import command_line, markdown_table

KV_HEADS, GROUP, K, SINK, LOCAL = 8, 4, 512, 4, 32
REPLAYS = 5


def session_lengths(context: int, sessions: int) -> np.ndarray:
    """int32 ``[sessions]``: ``context`` for one session, else ragged as ``bench timing``'s batches."""
    from bench.timing_settings import Setting

    return np.array(Setting(context, sessions, "host", ragged=sessions > 1).block_lengths, np.int32)


def top_histogram(scores, lengths, heads_per_session: int, sink: int, local: int):
    """int32 ``[streams, G, 256]``: the top key byte of every candidate (sealed tokens ``sink .. min(n_sealed,
    n - local)``), as the scan counts it for the selection (``fathom.cuda.scan``)."""
    import torch

    from fathom.quantize import BLOCK
    from fathom.selection import order_keys

    streams, heads, tokens = scores.shape
    keys = torch.from_numpy(order_keys(scores.cpu().numpy()).astype(np.int64)).to(scores.device)  # made once, at setup
    n = lengths.to(torch.int64).repeat_interleave(heads_per_session)[:, None, None]
    token = torch.arange(tokens, device=scores.device)
    candidate = (token >= sink) & (token < torch.minimum(n // BLOCK * BLOCK, n - local))
    top = torch.where(candidate, keys >> 24, torch.full_like(keys, 256))  # bin 256: not a candidate
    hist = torch.zeros((streams, heads, 257), dtype=torch.int64, device=scores.device)
    hist.scatter_add_(2, top, torch.ones_like(top))
    return hist[..., :256].to(torch.int32).contiguous()


def synthetic_scores(streams: int, context: int, generator, device):
    """float32 ``[streams, G, context]``: scores crowded into one binade, as real scores crowd (a shared offset
    q · mean(k)): every candidate shares the top key byte."""
    import torch

    shape = (streams, GROUP, context)
    return 24 + 2 * torch.rand(shape, generator=generator, device=device) * torch.randn(
        shape, generator=generator, device=device).clamp(-3, 3)


BLOCK_FIELDS = ("blocks_first", "blocks_first_carried", "blocks_second")  # block_census's fractions


def _candidate_keys(scores: np.ndarray, k: int, sink: int, local: int) -> tuple[np.ndarray, int]:
    """The order keys of the candidates ``sink .. n − local`` of ``scores float32 [n]`` and the k-th largest of
    them; refused where there are at most k."""
    from fathom.selection import order_keys

    keys = order_keys(np.asarray(scores, np.float32)[sink:len(scores) - local])
    if len(keys) <= k:
        raise ValueError(f"the census needs more than k = {k} candidates, got {len(keys)}")
    return keys, np.partition(keys, len(keys) - k)[len(keys) - k]


def bin_census(scores: np.ndarray, k: int = K, sink: int = SINK, local: int = LOCAL) -> tuple[int, int]:
    """(candidates in the k-th largest's bin of the top 16 key bits, candidates whose key equals the k-th's) among
    the candidates ``sink .. n − local`` of ``scores float32 [n]`` (n a multiple of 64: every token sealed): the
    list the second pass appends for the ties kernel, and the ties it breaks by index."""
    keys, kth = _candidate_keys(scores, k, sink, local)
    return int(np.count_nonzero(keys >> 16 == kth >> 16)), int(np.count_nonzero(keys == kth))


def block_census(scores: np.ndarray, k: int = K, sink: int = SINK, local: int = LOCAL) -> dict[str, float]:
    """How much of the candidates ``sink .. n − local`` of ``scores float32 [n]`` (n a multiple of 64) each pass over
    the scores would walk if it skipped the 64-token blocks holding no token it acts on (a block's largest key would
    tell): the fractions of those blocks holding a key at or above the k-th largest's top byte (``first``: the first
    pass counts every token of that bin), at or above the least key the first pass acts on when it counts only from
    the (4k)-th largest's top two bytes (``first_carried``: its top byte and a zero byte where that is not the k-th's;
    what a head would carry from a step like this one, as the carried-prefix branches of docs/results.md did), and at
    or above the k-th's top two bytes (``second``)."""
    from fathom.quantize import BLOCK

    keys, kth = _candidate_keys(scores, k, sink, local)
    tokens = np.arange(sink, sink + len(keys))
    block_max = np.zeros(int(tokens[-1]) // BLOCK + 1, np.uint32)
    np.maximum.at(block_max, tokens // BLOCK, keys)
    block_max = block_max[int(tokens[0]) // BLOCK:]
    bin_low = int(kth >> 24) << 8
    bound = int(np.partition(keys, len(keys) - 4 * k)[len(keys) - 4 * k]) if len(keys) > 4 * k else 0
    prefix = bound >> 16 if bound >> 24 == kth >> 24 else (bound >> 24) << 8
    lower = min(max(prefix, bin_low), bin_low + 256)
    return {f"blocks_{name}": float(np.mean(block_max >> 16 >= least))
            for name, least in (("first", bin_low), ("first_carried", lower), ("second", int(kth >> 16)))}


def head_census(keys: np.ndarray, q: np.ndarray, k: int, layer: int, kv_head: int) -> list[dict]:
    """:func:`bin_census` of each query head of ``q float32 [G, d]`` over ``keys float32 [n, d]`` (n a multiple of
    64) through the reference plane scan at fathom@48 (design §5's gains, the store's σ²): a record per query head,
    labelled with ``layer`` and ``kv_head``."""
    from fathom.decode import running_scale_variance
    from fathom.quantize import BLOCK, pack_planes, quantize
    from fathom.scoring import approx_scores
    from fathom.waterfill import importance, waterfill_batched

    codes, scales = quantize(np.ascontiguousarray(keys, np.float32))
    sigma2 = running_scale_variance(scales, np.array([len(keys) // BLOCK]))[0]
    depths = waterfill_batched(importance(q, sigma2), 48.0)
    return census_records(approx_scores(q, pack_planes(codes), scales, depths), k, layer, kv_head)


def census_records(scores: np.ndarray, k: int, layer: int | None, kv_head: int) -> list[dict]:
    """:func:`bin_census` of each query head's ``scores float32 [G, n]``: a record per head, labelled with ``layer``
    (None: this probe's own scores) and ``kv_head``."""
    records = []
    for g, row in enumerate(scores):
        in_bin, ties = bin_census(row, k)
        records.append({"layer": layer, "kv_head": kv_head, "head": g, "in_bin": in_bin, "ties": ties,
                        **block_census(row, k)})
    return records


def census(context: int, layers: list[int] | None = None, seed: int = 0) -> list[dict]:
    """:func:`head_census` of every query head over the timing bench's synthetic data (its default channel
    statistics: keys and queries drawn per channel, ``bench.synthetic_decode``), k = 512, per (layer, KV head) of the
    statistics' model, then :func:`bin_census` of this probe's own scores (``layer`` None): one record each."""
    import torch

    from bench import channel_stats
    from bench.synthetic_decode import Synthetic
    from bench.timing import DEFAULT_STATS

    data = Synthetic(channel_stats.load(DEFAULT_STATS), seed=seed, device="cpu")
    n_layers, n_heads = data.stats["key_mean"].shape[:2]
    records = []
    for layer in range(n_layers) if layers is None else layers:
        keys = data.keys(layer, 1, context)[0].numpy()  # [KV heads, n, d], KV head h drawn from statistics h % H
        q = data.queries(layer, 1)[0].reshape(keys.shape[0], GROUP, -1).numpy()
        for h in range(n_heads):
            records += head_census(keys[h], q[h], K, layer, h)
        print(f"layer {layer}: k-th's bin {[r['in_bin'] for r in records[-n_heads * GROUP:]]}", flush=True)
    probe = synthetic_scores(1, context, torch.Generator().manual_seed(seed), "cpu")[0].numpy()
    records += census_records(probe, K, None, 0)
    return records


def capture_census(capture) -> list[dict]:
    """:func:`head_census` of a real model's :class:`fathom.capture.Capture` at its last decode position (the sealed
    tokens before it; k by context, ``Selection.for_context``), per (layer, KV head)."""
    from fathom.quantize import BLOCK
    from fathom.selection import Selection

    position = len(capture.positions) - 1
    n = int(capture.positions[position]) // BLOCK * BLOCK
    k = Selection.for_context(n).k
    records = []
    for layer in range(capture.keys.shape[0]):
        for h in range(capture.keys.shape[1]):
            records += head_census(capture.keys[layer, h, :n], capture.queries[layer, h, position], k, layer, h)
        print(f"layer {layer}: k-th's bin {[r['in_bin'] for r in records if r['layer'] == layer]}", flush=True)
    return records


class SelectionBuffers:
    """One layer's selection buffers (as ``fathom.host.decoder.Decoder`` holds them) over synthetic scores of
    ``sessions`` (:func:`session_lengths`) of ``kv_heads`` KV heads, each a buffer of ``context`` tokens."""

    def __init__(self, context: int, sessions: int, kv_heads: int = KV_HEADS, k: int = K, seed: int = 0):
        import torch

        from fathom.cuda.interop import DEVICE, multiprocessors
        from fathom.cuda.score_keys import score_keys
        from fathom.cuda.topk import TIES_PER_HEAD, list_ctas_for, union_blocks

        self.lengths = torch.tensor(session_lengths(context, sessions), device=DEVICE)
        self.kv_heads, self.k = kv_heads, k
        streams = sessions * kv_heads
        self.scores = synthetic_scores(streams, context, torch.Generator(device=DEVICE).manual_seed(seed), DEVICE)
        self.saved_hist = top_histogram(self.scores, self.lengths, kv_heads, SINK, LOCAL)
        zeros = lambda shape, dtype=torch.int32: torch.zeros(shape, dtype=dtype, device=DEVICE)  # noqa: E731
        self.top_hist, self.hists = zeros(self.saved_hist.shape), zeros((streams, GROUP, 3, 256))
        # as the scan writes them (fathom.cuda.score_keys), made on the host once: the probe times the selection only
        self.keys = torch.from_numpy(score_keys(self.scores.cpu().numpy()).view(np.int32)).to(DEVICE)
        self.cand_key, self.cand_idx = zeros(self.scores.shape), zeros(self.scores.shape)
        self.list_sizes, self.ties = zeros((streams, GROUP, 2)), zeros((streams, GROUP, min(TIES_PER_HEAD, context)))
        self.list_ctas = list_ctas_for(streams, GROUP, multiprocessors())  # as the decoder's
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
        select(as_array(self.keys).view(np.uint32), as_array(self.lengths), self.kv_heads, self.k, SINK, LOCAL,
               as_array(self.top_hist), as_array(self.hists), as_array(self.cand_key).view(np.uint32),
               as_array(self.cand_idx), as_array(self.list_sizes), as_array(self.ties),
               as_array(self.winners).view(np.uint32), as_array(self.any_rows).view(np.uint64), threads,
               select_threads, per_block, self.list_ctas, stream)

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
                        help="threads a CTA of the candidate passes, multiples of 32 (default 256,512)")
    parser.add_argument("--select-threads", type=int_list, default=[1024],
                        help="threads a CTA of the ties kernel (default 1024, the decoder's on a GPU)")
    parser.add_argument("--reps", type=int, default=20, help="selections a replay (default 20)")
    parser.add_argument("--census", action="store_true",
                        help="instead of timing: how many candidates the k-th's bin holds for each query head of the "
                             "timing bench's synthetic data through the reference scan, and of this probe's scores "
                             "(on the CPU, about 2.5 min at 128k)")
    parser.add_argument("--model", default=None,
                        help="with --census: a real model's capture over --corpus instead (its last decode position)")
    parser.add_argument("--corpus", default=None, help="with --census --model: the text (default paul-graham)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON written here, its table beside it (default bench/results/select-probe.json, with "
                             "--census select-probe-census.json)")
    args = parser.parse_args(argv)
    if args.census:
        return main_census(parser, args, argv)
    if args.model is not None or args.corpus is not None:
        parser.error("--model and --corpus are read only with --census")
    args.out = args.out or Path("bench/results/select-probe.json")

    def check():
        at_least("--context", args.context, 4096)
        at_least("--reps", args.reps, 1)
        for name, values, low in (("--sessions", args.sessions, 1), ("--per-block", args.per_block, 1)):
            for value in values:
                at_least(name, value, low)
        if any(not 32 <= t <= 1024 or t % 32 for t in args.threads):
            raise UsageError(f"--threads must be multiples of 32 in 32..1024, got {args.threads}")
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


def _census_row(label: str, records: list[dict]) -> dict:
    """One row of the census table over ``records``: the k-th's bin (median, max), the most ties, the mean block
    shares."""
    bins = [r["in_bin"] for r in records]
    return {"layer": label, "heads": len(records), "median": float(np.median(bins)), "max": max(bins),
            "ties": max(r["ties"] for r in records),
            **{name: float(np.mean([r[name] for r in records])) for name in BLOCK_FIELDS}}


def main_census(parser, args, argv) -> None:
    """``--census``: :func:`census` at ``--context`` tokens, or with ``--model`` :func:`capture_census` of the
    model's capture over ``--corpus``; its records as JSON and a table a layer."""
    from bench import artifacts, corpora, models
    from bench.capture import load_capture

    args.out = args.out or Path("bench/results/select-probe-census.json")
    try:
        highest = models.model_argument(args.model).context if args.model else None
        at_least("--context", args.context, 4096)
        if highest is not None and args.context > highest:
            raise UsageError(f"--context must be at most {highest} for {args.model}, got {args.context}")
        if args.context % 64:
            raise UsageError(f"--context must be a multiple of 64 (whole blocks), got {args.context}")
        if args.corpus is not None and not args.model:
            raise UsageError("--corpus is read only with --model")
        args.corpus = args.corpus or "paul-graham"
        corpora.check_argument("--corpus", args.corpus)
        writable_file("--out", args.out)
    except UsageError as error:
        parser.error(str(error))
    if args.model:
        try:
            capture, _ = load_capture(args.model, args.corpus, args.context)
        except UsageError as error:
            parser.exit(2, f"error: {error}\n")
        except artifacts.FetchError as error:
            parser.exit(1, f"error: {error}\n")
        records = capture_census(capture)
        source = (f"{args.model} on {args.corpus}, its last decode position (token {int(capture.positions[-1])}), "
                  f"k by context")
    else:
        records = census(args.context)
        source = f"the timing bench's synthetic data, {args.context} tokens, k = {K}"
    rows = []
    for layer in sorted({r["layer"] for r in records if r["layer"] is not None}) + [None]:
        mine = [r for r in records if r["layer"] == layer]
        if not mine:  # a capture's census has no probe row
            continue
        rows.append(_census_row("this probe's scores" if layer is None else str(layer), mine))
    every = [r for r in records if r["layer"] is not None]
    if every:
        rows.append(_census_row("every layer", every))
    out = {"command": command_line(argv, "python -m bench.select_probe"), "source": source,
           "context": args.context, "records": records, "layers": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    table = markdown_table(rows, [("layer", "layer", "s"), ("heads", "query heads", "d"),
                                  ("median", "k-th's bin, median", ".0f"), ("max", "k-th's bin, max", "d"),
                                  ("ties", "ties at the k-th, max", "d"),
                                  ("blocks_first", "blocks the first pass acts on", ".3f"),
                                  ("blocks_first_carried", "… counting from the (4k)-th's prefix", ".3f"),
                                  ("blocks_second", "blocks the second pass acts on", ".3f")])
    args.out.with_suffix(".md").write_text(f"`{out['command']}`: the candidates the selection's second pass appends "
                                           f"for the ties kernel (the k-th largest's bin of the top 16 key bits) "
                                           f"at fathom@48 through the reference scan; {source}. The blocks columns: "
                                           f"the mean fraction of a head's 64-token blocks of candidates holding a "
                                           f"token each pass acts on (``block_census``)\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
