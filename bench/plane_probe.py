"""Variants of fathom's reconstruction and depth allocation on the raw store, measured on a real capture (a research
probe for issue 15; none of them is a method of the catalog).

Every variant reads the same planes (the same bytes per token) and differs in one of two places:

* **reconstruction** of a channel read to depth t: ``midpoint`` (design §2: the prefix cell's centre) or
  ``centroid`` (the mean of the 4-bit cells sharing the prefix, weighted by the channel's histogram of codes over
  the sealed blocks: a statistic a store can keep as it keeps s²);
* **plane gains** of the water-filling: design §5's model, the calibration's measured table
  (``fathom[gains]``), or the drops of the code error variance the same histogram gives (no calibration text);
  and, apart, one water line shared by every KV head of a layer (its H·B bits; ``fathom[pooled]``, which the
  fidelity bench reports) instead of one per head, and
  ``depth-2-minimum``: a channel read to 0 or at least 2 planes (design §5's first two gains merged into their
  mean), the test of whether a 1-bit read, whose midpoint overshoots a peaked channel, is worth its bit.

Errors are the fidelity bench's (mean relative attention error over layers, KV heads and positions; raw store,
store σ², the selection protocol at the capture's k); the ``design`` row equals the fidelity bench's ``fathom``
curve (tested). ``python -m bench.plane_probe --model qwen2.5-coder-0.5b --corpus cpython --context 4096`` prints
the table and writes ``bench/results/plane-probe-<model>-<corpus>-<context>.json`` (CPU: about a minute at 4k
once the capture is cached; the capture's prefill is the fidelity bench's, cached and shared with it).
"""

from __future__ import annotations

import argparse

import numpy as np

from fathom.quantize import BLOCK, CELLS, MAX_DEPTH, unpack_planes
VARIANTS = ("design", "centroid", "histogram-gains", "centroid+histogram-gains", "calibrated-gains",
            "shared-water-line", "depth-2-minimum")


def depth_2_minimum_gains() -> np.ndarray:
    """Relative plane gains ``[4]`` under which water-filling reads a channel to depth 0 or >= 2: design §5's first
    two gains replaced by their mean (still non-increasing), the others as they are."""
    from fathom.waterfill import DESIGN_GAINS

    gains = DESIGN_GAINS.copy()
    gains[:2] = gains[:2].mean()
    return gains


def code_histogram(codes: np.ndarray) -> np.ndarray:
    """Counts ``[d, 16]`` of each channel's 4-bit codes ``uint8 [n, d]`` (:func:`fathom.quantize.unpack_planes`)."""
    return np.stack([(codes == u).sum(axis=0) for u in range(CELLS)], axis=1).astype(np.float64)


def prefix_levels(counts: np.ndarray, t: int, centroid: bool) -> np.ndarray:
    """Reconstruction of each depth-``t`` prefix in units of Δ, ``[d, 2^t]``: the cell's midpoint (design §2), or
    the centroid of the 4-bit cells it covers under ``counts [d, 16]`` (the midpoint where it holds none)."""
    width = CELLS >> t
    cells = (np.arange(CELLS) + 0.5 - CELLS / 2).reshape(1 << t, width)  # 4-bit cell centres per prefix
    midpoint = np.broadcast_to(cells.mean(axis=1), (counts.shape[0], 1 << t))
    if not centroid:
        return np.array(midpoint)
    weight = counts.reshape(-1, 1 << t, width)
    total = weight.sum(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (weight * cells).sum(axis=2) / total, midpoint)


def levels_table(counts: np.ndarray, centroid: bool) -> np.ndarray:
    """:func:`prefix_levels` at every depth as the reconstruction table :func:`fathom.quantize.dequantize` reads,
    float32 ``[d, 4, 16]`` (cells past ``2^t`` hold 0)."""
    table = np.zeros((counts.shape[0], MAX_DEPTH, CELLS), np.float32)
    for t in range(1, MAX_DEPTH + 1):
        table[:, t - 1, :1 << t] = prefix_levels(counts, t, centroid)
    return table


def histogram_gains(counts: np.ndarray, centroid: bool) -> np.ndarray:
    """Relative plane gains ``[d, 4]`` (gain = w · γ, w = s² Σ_h q², s² = 64 Δ²): each plane's drop of the code
    error variance under ``counts`` with that reconstruction, made non-increasing as the calibrated table is."""
    from fathom.waterfill import calibrated_gains

    p = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    centres = np.arange(CELLS) + 0.5 - CELLS / 2
    within = 1 / 12  # a 4-bit cell's own uniform error, in Δ²
    errors = [(p * centres ** 2).sum(axis=1) + within]  # depth 0 reads 0
    for t in range(1, MAX_DEPTH + 1):
        level = np.repeat(prefix_levels(counts, t, centroid), CELLS >> t, axis=1)  # [d, 16]
        errors.append((p * (centres - level) ** 2).sum(axis=1) + within)
    drops = np.stack([errors[t - 1] - errors[t] for t in range(1, MAX_DEPTH + 1)], axis=1)
    return calibrated_gains(drops / 64)


def evaluate(capture, calibration, budgets: list[float], sel) -> dict[str, dict[float, float]]:
    """Mean relative error of every variant at every budget on ``capture`` (raw store, store σ²); the calibrated
    gains only where ``calibration`` holds plane drops."""
    from fathom import methods as M
    from fathom.attention import attend, logits, relative_error
    from fathom.decode import HeadIndex, method_scores, pooled_layer_depths
    from fathom.scoring import DepthScorer, depth_scores
    from fathom.selection import select_many
    from fathom.waterfill import importance, waterfill_batched

    L, H, n, d = capture.keys.shape
    blocks = (capture.positions + 1) // BLOCK
    context = capture.positions + 1
    causal = np.arange(n)[None, :] < context[:, None]
    sealed = int(blocks.min()) * BLOCK  # the histogram of what every position's store holds
    calibrated = calibration is not None and calibration.head_stats(0, 0, "raw").plane_drops is not None
    errors: dict[tuple[str, float], list[float]] = {}

    for layer in range(L):
        heads = []
        for head in range(H):
            keys, values, q = capture.keys[layer, head], capture.values[layer, head], capture.queries[layer, head]
            stats = None if calibration is None else {"raw": calibration.head_stats(layer, head, "raw")}
            index = HeadIndex.build(keys, stats)
            store = index.stores["raw"]
            counts = code_histogram(unpack_planes(store.planes())[:sealed])
            centroid = DepthScorer(store.planes(), store.scales(), levels_table(counts, centroid=True))
            exact = logits(q, keys, capture.scale)
            heads.append({
                "q": q, "index": index, "exact": exact, "values": values,
                "dense": attend(exact, values, np.broadcast_to(causal[:, None], q.shape[:2] + (n,))),
                "w": importance(q, index.store_variance("raw", blocks)),
                "midpoint": [index.scorers["raw"].khat(t) for t in range(1, MAX_DEPTH + 1)],
                "centroid": [centroid.khat(t) for t in range(1, MAX_DEPTH + 1)],
                "gains": {c: histogram_gains(counts, c) for c in (False, True)}})
        for budget in budgets:
            shared = pooled_layer_depths([M.fathom(budget, pooled=True)] * H, capture.queries[layer],
                                         [h["index"] for h in heads], blocks)
            for h, shared_depths in zip(heads, shared):
                w, design = h["w"], waterfill_batched(h["w"], budget)
                runs = {"design": ("midpoint", design), "centroid": ("centroid", design),
                        "histogram-gains": ("midpoint", waterfill_batched(
                            w, budget, np.broadcast_to(h["gains"][False], w.shape + (MAX_DEPTH,)))),
                        "centroid+histogram-gains": ("centroid", waterfill_batched(
                            w, budget, np.broadcast_to(h["gains"][True], w.shape + (MAX_DEPTH,)))),
                        "shared-water-line": ("midpoint", shared_depths),
                        "depth-2-minimum": ("midpoint", waterfill_batched(
                            w, budget, np.broadcast_to(depth_2_minimum_gains(), w.shape + (MAX_DEPTH,))))}
                if calibrated:
                    runs["calibrated-gains"] = ("midpoint", method_scores(
                        M.fathom(budget, gains="calibrated"), h["q"], h["index"], blocks)[1])
                for name, (reconstruction, depths) in runs.items():
                    scores = depth_scores(h[reconstruction], h["q"], depths)
                    mask = select_many(scores, context, blocks * BLOCK, sel, n)
                    out = attend(h["exact"], h["values"], mask)
                    errors.setdefault((name, budget), []).append(float(relative_error(out, h["dense"]).mean()))
    return {name: {b: float(np.mean(errors[(name, b)])) for b in budgets}
            for name in VARIANTS if (name, budgets[0]) in errors}


def main(argv=None) -> None:
    from bench import cli, decoding
    from bench.capture import add_probe_arguments, check_probe_arguments, probe_capture
    from bench.cli import plain
    from bench.report import command_line, write_json
    from fathom.calibration import Calibration
    from fathom.selection import Selection

    parser = argparse.ArgumentParser(prog="python -m bench.plane_probe", description=plain(__doc__.split("\n\n")[0]))
    add_probe_arguments(parser, "a .calibration.npz with plane drops, for the calibrated gains (default: the model's "
                                "committed one; the variant is left out when it holds none)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[32.0, 48.0, 64.0], help="bits per token")
    args = parser.parse_args(argv)
    try:
        info, calibration = check_probe_arguments(args)
        if any(not 0 < b <= 4.25 * info.head_dim for b in args.budgets):
            raise cli.UsageError(f"--budgets must lie in (0, {4.25 * info.head_dim}], got {args.budgets}")
        sel = Selection.for_context(args.context)
        # a top-k that keeps every token the first position chooses from makes every variant exact: a table of
        # zero errors (and a division by the design row's zero)
        decoding.check_top_k(sel, args.context, args.positions, given=False)
    except cli.UsageError as error:
        parser.exit(2, f"error: {error}\n")
    capture = probe_capture(parser, args)
    loaded = None if calibration is None else Calibration.load(calibration)
    result = evaluate(capture, loaded, args.budgets, sel)
    lines = [f"| variant | {' | '.join(f'{b:g} bits' for b in args.budgets)} |",
             "|---|" + "---|" * len(args.budgets)]
    for name, by_budget in result.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{e:.4f} ({(e / result['design'][b] - 1) * 100:+.1f}%)" for b, e in by_budget.items()) + " |")
    print("\n".join(lines))
    path = args.out / f"plane-probe-{args.model}-{args.corpus}-{args.context}.json"
    command = command_line(argv, "python -m bench.plane_probe")
    write_json(path, command, {"model": args.model, "corpus": args.corpus, "context": args.context,
                               "positions": args.positions, "k": sel.k,
                               "calibration": None if calibration is None else str(calibration),
                               "errors": {name: {f"{b:g}": e for b, e in v.items()} for name, v in result.items()},
                               "table": lines})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
