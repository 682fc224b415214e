"""``python -m bench fidelity``: attention error against scan bits for every method (SPEC §6, §7).

For now on synthetic keys (:mod:`fathom.synthetic`; every output says
"synthetic"): the capture to evaluate and the calibration capture are two
texts of the same synthetic model. Writes ``<name>.json`` (one record per
method × budget), ``<name>.md`` and ``<name>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from bench.report import RESULTS, markdown_table, write_json
from fathom import methods as M
from fathom.calibration import calibrate
from fathom.fidelity import evaluate, plan_layers
from fathom.selection import Selection
from fathom.synthetic import SyntheticConfig, generate

FATHOM_BUDGETS = (32, 48, 64, 68, 92, 136)
QUICK = SyntheticConfig(layers=4, kv_heads=2, group=4, head_dim=128, tokens=4096, positions=16)
FULL = SyntheticConfig(layers=8, kv_heads=4, group=4, head_dim=128, tokens=16384, positions=32)
COLUMNS = [("label", "method@bits", "s"), ("bits_read", "bits read", ".1f"),
           ("scan_bytes", "scan KiB/step", ",.0f"), ("row_bytes", "row KiB/step", ",.0f"),
           ("rows_per_head", "rows/KV head", ".0f"), ("rel_error", "rel. error", ".4f"),
           ("channels_touched", "channels", ".1f"), ("mean_depth", "depth", ".2f")]


def method_grid(d: int) -> list[M.Method]:
    """Every method at matched bits: fathom flat budgets (both σ² sources), rotated, and every baseline.

    (The per-layer plans are added by :func:`run`: they need the calibration capture.)"""
    return ([M.fathom(b) for b in FATHOM_BUDGETS]
            + [M.fathom(b, "calibration") for b in (48, 68)]
            + [M.fathom_rotated(b) for b in (48, 68, 136)]
            + M.baselines(d))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small synthetic setting, under a minute on 2 cores")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--name", default=None, help="file name stem (default fidelity-synthetic[-quick])")
    parser.add_argument("-k", type=int, default=None, help="top-k per query head (default by context, SPEC §6)")


def run(args: argparse.Namespace) -> Path:
    cfg = QUICK if args.quick else FULL
    name = args.name or ("fidelity-synthetic-quick" if args.quick else "fidelity-synthetic")
    sel = Selection(k=args.k) if args.k is not None else Selection.for_context(cfg.tokens)
    start = time.perf_counter()
    capture = generate(cfg)
    calibration_capture = generate(SyntheticConfig(**{**cfg.__dict__, "text_seed": cfg.text_seed + 1}))
    calibration = calibrate(calibration_capture)
    methods = method_grid(cfg.head_dim) + plan_layers(calibration_capture, calibration, [48, 64], sel)
    with tqdm(total=cfg.layers * cfg.kv_heads, desc="fidelity (synthetic)", unit="head") as bar:
        results = evaluate(capture, calibration, methods, sel, on_head=bar.update)
    plans = {m.label(cfg.head_dim): list(m.policy.budgets) for m in methods if m.name.endswith("-plan")}
    meta = {"model": "synthetic", "context": cfg.tokens}
    records = [r.record(**meta) for r in results]
    write_json(args.out / f"{name}.json", args.command_line, {
        "synthetic": True, "data": "synthetic keys (fathom.synthetic), calibration on another synthetic text",
        "config": cfg.__dict__, "selection": sel.__dict__, "per_layer_plans": plans, "wall_s": round(time.perf_counter() - start, 1),
        "records": records})
    _write_table(args.out / f"{name}.md", records, cfg, sel)
    _plot(args.out / f"{name}.png", results, cfg, sel)
    print(f"\n{(args.out / f'{name}.md').read_text()}")
    return args.out / f"{name}.json"


def _write_table(path: Path, records: list[dict], cfg: SyntheticConfig, sel: Selection) -> None:
    kib = [{**r, "scan_bytes": r["scan_bytes"] / 1024, "row_bytes": r["row_bytes"] / 1024} for r in records]
    title = (f"Fidelity on **synthetic** keys: {cfg.layers} layers × {cfg.kv_heads} KV heads × G = {cfg.group}, "
             f"d = {cfg.head_dim}, n = {cfg.tokens}, {cfg.positions} decode positions, k = {sel.k}.\n\n")
    path.write_text(title + markdown_table(kib, COLUMNS) + "\n")


def _plot(path: Path, results, cfg: SyntheticConfig, sel: Selection) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    families: dict[str, list] = {}
    for r in results:
        if r.method != "dense":
            families.setdefault(r.method, []).append(r)
    for family, rs in families.items():
        rs = sorted(rs, key=lambda r: r.bits_read)
        if family == "oracle":
            ax.axhline(rs[0].rel_error, color="k", ls=":", label=f"oracle (exact top-{sel.k})")
            continue
        style = "-o" if family.startswith("fathom") else "s"
        ax.plot([r.bits_read for r in rs], [r.rel_error for r in rs], style, label=family, ms=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("scan bits per token (per KV head, per layer)")
    ax.set_ylabel("attention output rel. error vs dense")
    ax.set_title(f"synthetic keys, d={cfg.head_dim}, n={cfg.tokens}, k={sel.k}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
