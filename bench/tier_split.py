"""Which tier serves each method's scan on a real capture: the share of its scan bits a store with the scales and
its first ``t`` bit planes in HBM reads over the link, t = 0..4 (issue 14: tiered planes).

A method reads channel c to depth b_c (planes 1..b_c: the water-filling's depths for fathom, 4 on r channels for
SparQ, Double Sparsity and Loki, 2 everywhere for the thumbnail); with the first ``t`` planes in HBM the link
carries ``Σ_c max(b_c − t, 0)`` bits a token (and the scales when t = 0): :func:`fathom.bits.tier_scan_bits`,
what the offloaded decoder counts (``Decoder.scan_nbytes_by_tier``) and ``bench timing`` reports as
``host_plane_fraction``, there on synthetic keys. Here the depths come from a real model's keys and queries
(the fidelity bench's capture and calibration), every layer, KV head and decode position, each position's scan
weighted by the sealed tokens it reads. ``python -m bench.tier_split --model smollm2-135m --corpus paul-graham
--context 8192`` prints the table and writes ``bench/results/tier-split-<model>-<corpus>-<context>.json`` and, beside
it, ``.reads.npz``: each method's read share per (layer, KV head, channel, plane), what ``bench.hbm_budget`` holds
planes in HBM by (CPU: seconds once the capture is cached; the capture is the fidelity bench's, cached and shared
with it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fathom.bits import SCALE_BITS
from fathom.quantize import BLOCK, MAX_DEPTH

DEFAULT_METHODS = ("fathom@32", "fathom@48", "fathom@64", "sparq@68", "double-sparsity@68", "double-sparsity@136",
                   "thumbnail-2bit")


def read_shares(capture, calibration, methods: list) -> np.ndarray:
    """float64 ``[methods, L, H, d, 4]``: per method, (layer, KV head), channel c and plane p, the share of the
    tokens its scans read whose read of channel c reaches plane p (depth > p), each decode position weighted by the
    sealed tokens it scans (``fathom.decode.plane_depths``, what the decoder reads). Plane 0's share is also the
    channel's: its scale is read with it."""
    from fathom import fidelity
    from fathom.decode import HeadIndex, plane_depths

    L, H, _, d = capture.keys.shape
    blocks = (capture.positions + 1) // BLOCK
    weight = (blocks * BLOCK).astype(np.float64)  # the sealed tokens each position's scan reads
    rotated = fidelity.needs_rotated(methods, calibration)
    shares = np.zeros((len(methods), L, H, d, MAX_DEPTH))
    for layer in range(L):
        for head in range(H):
            stats = None if calibration is None else \
                {b: calibration.head_stats(layer, head, b) for b in ("raw", "rotated")}
            index = HeadIndex.build(capture.keys[layer, head], stats,
                                    calibration.basis[layer, head] if rotated else None)
            q = capture.queries[layer, head]
            for i, method in enumerate(fidelity.head_methods(methods, calibration, layer, head)):
                store = index.stores[method.basis]
                q_store = q @ store.basis if store.basis is not None else q
                depths = plane_depths(method, q_store, index.stats[method.basis],
                                      index.store_variance(method.basis, blocks), layer)  # [positions, d]
                reached = depths[:, :, None] > np.arange(MAX_DEPTH)  # [positions, d, plane]
                shares[i, layer, head] = np.tensordot(weight, reached, axes=1) / weight.sum()
    return shares


def link_fractions_of(shares: np.ndarray, labels: list[str]) -> dict[str, dict]:
    """:func:`read_shares` summed into each method's ``bits`` (mean scan bits a token), ``link`` (the share of its
    scan bits over the link with the scales and t = 0..4 planes in HBM, all layers: ``fathom.bits.tier_scan_bits``'
    split) and ``worst_layer_link`` (the largest layer's share at each t)."""
    planes = shares.sum(axis=3)  # [methods, L, H, plane]: bits a token read of each plane, over the channels
    scales = SCALE_BITS * planes[..., 0]  # a channel read at all reads its scale
    far = np.stack([planes[..., t:].sum(axis=-1) + (scales if t == 0 else 0.0) for t in range(MAX_DEPTH + 1)],
                   axis=-1).sum(axis=2)  # [methods, L, t], summed over heads
    scan = far[..., 0]
    return {label: {"bits": float(scan[i].mean() / shares.shape[2]),
                    "link": [float(far[i, :, t].sum() / scan[i].sum()) for t in range(MAX_DEPTH + 1)],
                    "worst_layer_link": [float((far[i, :, t] / scan[i]).max()) for t in range(MAX_DEPTH + 1)]}
            for i, label in enumerate(labels)}


def link_fractions(capture, calibration, methods: list) -> dict[str, dict]:
    """Per method (``fathom.methods.Method``, plane methods only), keyed by its label: ``bits``, ``link`` and
    ``worst_layer_link`` (:func:`link_fractions_of` of :func:`read_shares`)."""
    d = capture.keys.shape[-1]
    return link_fractions_of(read_shares(capture, calibration, methods), [m.label(d) for m in methods])


def reads_path(split: Path) -> Path:
    """Where a split's read shares (:func:`read_shares`, float32, with the methods' labels) lie: beside its JSON."""
    return split.with_suffix(".reads.npz")


def table(result: dict[str, dict]) -> list[str]:
    lines = ["| method | bits read | over the link with t = 1 | t = 2 | t = 3 | worst layer, t = 1 / 2 |",
             "|---|---|---|---|---|---|"]
    for label, r in result.items():
        link, worst = r["link"], r["worst_layer_link"]
        lines.append(f"| {label} | {r['bits']:.1f} | {link[1]:.1%} | {link[2]:.1%} | {link[3]:.1%} | "
                     f"{worst[1]:.1%} / {worst[2]:.1%} |")
    return lines


def main(argv=None) -> None:
    from bench import cli, decoding
    from bench.capture import add_probe_arguments, check_probe_arguments, probe_capture
    from bench.cli import plain
    from bench.report import command_line, repo_path, write_json
    from fathom import methods as catalog
    from fathom.calibration import Calibration

    parser = argparse.ArgumentParser(prog="python -m bench.tier_split", description=plain(__doc__.split("\n\n")[0]))
    add_probe_arguments(parser, "a .calibration.npz (default: the model's committed one)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help=f"plane methods: {decoding.spec_help()} (default {' '.join(DEFAULT_METHODS)})")
    args = parser.parse_args(argv)
    try:
        info, calibration = check_probe_arguments(args)
        specs = decoding.parse_specs(args.methods, info.head_dim)
        planned = [spec.label for spec in specs if catalog.entry(spec.method).per_layer]
        if planned:  # its budgets come from a plan over the layers, which a spec does not carry
            raise cli.UsageError(f"--methods: {planned[0]} plans its budgets per layer; name a fixed-budget method")
        methods = [spec.method_at(info.head_dim) for spec in specs]
        flat = [spec.label for spec, method in zip(specs, methods) if not method.scans_planes]
        if flat:
            raise cli.UsageError(f"--methods must scan bit planes; {', '.join(flat)} read none")
        decoding.require_calibration(specs, calibration, args.model)
    except cli.UsageError as error:
        parser.exit(2, f"error: {error}\n")
    capture = probe_capture(parser, args)
    shares = read_shares(capture, None if calibration is None else Calibration.load(calibration), methods)
    labels = [m.label(info.head_dim) for m in methods]
    result = link_fractions_of(shares, labels)
    lines = table(result)
    print("\n".join(lines))
    path = args.out / f"tier-split-{args.model}-{args.corpus}-{args.context}.json"
    command = command_line(argv, "python -m bench.tier_split")
    write_json(path, command, {"model": args.model, "corpus": args.corpus, "context": args.context,
                               "positions": args.positions,
                               "calibration": None if calibration is None else str(repo_path(calibration)),
                               "methods": result, "table": lines})
    reads = reads_path(path)
    np.savez_compressed(reads, labels=np.array(labels), shares=shares.astype(np.float32))
    print(f"wrote {path}, {reads}")


if __name__ == "__main__":
    main()
