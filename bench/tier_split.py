"""Which tier serves each method's scan on a real capture: the share of its scan bits a store with the scales and
its first ``t`` bit planes in HBM reads over the link, t = 0..4 (issue 14: tiered planes).

A method reads channel c to depth b_c (planes 1..b_c: the water-filling's depths for fathom, 4 on r channels for
SparQ, Double Sparsity and Loki, 2 everywhere for the thumbnail); with the first ``t`` planes in HBM the link
carries ``Σ_c max(b_c − t, 0)`` bits a token (and the scales when t = 0): :func:`fathom.bits.tier_scan_bits`,
what the offloaded decoder counts (``Decoder.scan_nbytes_by_tier``) and ``bench timing`` reports as
``host_plane_fraction``, there on synthetic keys. Here the depths come from a real model's keys and queries
(the fidelity bench's capture and calibration), every layer, KV head and decode position, each position's scan
weighted by the sealed tokens it reads. ``python -m bench.tier_split --model smollm2-135m --corpus paul-graham
--context 8192`` prints the table and writes ``bench/results/tier-split-<model>-<corpus>-<context>.json`` (CPU:
seconds once the capture is cached; the capture is the fidelity bench's, cached and shared with it).
"""

from __future__ import annotations

import argparse

import numpy as np

from fathom.quantize import BLOCK, MAX_DEPTH

DEFAULT_METHODS = ("fathom@32", "fathom@48", "fathom@64", "sparq@68", "double-sparsity@68", "double-sparsity@136",
                   "thumbnail-2bit")


def link_fractions(capture, calibration, methods: list) -> dict[str, dict]:
    """Per method (``fathom.methods.Method``, plane methods only): ``bits`` (mean scan bits a token), ``link`` (the
    share of its scan bits over the link with t = 0..4 planes in HBM, all layers) and ``worst_layer_link`` (the
    largest layer's share at each t)."""
    from fathom import fidelity
    from fathom.bits import tier_scan_bits
    from fathom.decode import HeadIndex, plane_depths

    L, H, _, d = capture.keys.shape
    blocks = (capture.positions + 1) // BLOCK
    weight = blocks * BLOCK  # the sealed tokens each position's scan reads
    rotated = fidelity.needs_rotated(methods, calibration)
    tiers = range(MAX_DEPTH + 1)
    # bits over the link per (method, layer, t), summed over heads and positions weighted by ``weight``
    far = np.zeros((len(methods), L, len(tiers)))
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
                                      index.store_variance(method.basis, blocks), layer)
                for t in tiers:
                    far[i, layer, t] += (tier_scan_bits(depths, t)[1] * weight).sum()
    scan = far[:, :, 0]  # with no plane in HBM every bit of the scan crosses the link
    return {method.label(d): {"bits": float(scan[i].mean() / (weight.sum() * H)),
                              "link": [float(far[i, :, t].sum() / scan[i].sum()) for t in tiers],
                              "worst_layer_link": [float((far[i, :, t] / scan[i]).max()) for t in tiers]}
            for i, method in enumerate(methods)}


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
    from bench.report import command_line, write_json
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
    result = link_fractions(capture, None if calibration is None else Calibration.load(calibration), methods)
    lines = table(result)
    print("\n".join(lines))
    path = args.out / f"tier-split-{args.model}-{args.corpus}-{args.context}.json"
    command = command_line(argv, "python -m bench.tier_split")
    write_json(path, command, {"model": args.model, "corpus": args.corpus, "context": args.context,
                               "positions": args.positions,
                               "calibration": None if calibration is None else str(calibration),
                               "methods": result, "table": lines})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
