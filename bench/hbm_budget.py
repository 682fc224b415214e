"""The scan's traffic over the link at an equal HBM budget: each method tiered the way its reads allow (issue 14).

A decode step's scan reads, per token of every (layer, KV head), ``bits`` of the store; HBM holding ``budget`` bits
a token of it leaves the rest to cross PCIe. What a budget buys depends on whether the method knows its reads before
the query does:

* **Reads chosen by the query** (fathom's water-filling, SparQ's top channels) are tiered by plane: the scales and
  the first ``t`` planes of every channel in HBM, ``(t + 1/4) · d`` bits a token (t ≥ 1), leave the share
  ``link[t]`` of the scan over the link (``bench.tier_split``, measured on real captures). Layers may take
  different tiers, so a budget between two tiers mixes them (the lower convex hull, each layer at the mean share:
  a layer-by-layer choice could only do better, so fathom's figures here are the conservative ones).
* **A read set fixed offline** (Double Sparsity's and Loki's r channels at 4 planes, the 2-bit thumbnail) is held
  exactly: Double Sparsity's own offloading design keeps its label cache, those channels, in HBM, so its ``4.25 r``
  bits a token cost that much HBM and nothing crosses the link; a smaller budget holds that many of its channels
  whole and the rest crosses.

So the question "at the same HBM budget" has one answer per budget: below DS's own bits fathom reads less over the
link (at no budget, 48 against 136 bits), at and past them DS reads nothing. ``python -m bench.hbm_budget`` prints,
for each committed tier split (``bench/results/tier-split-*.json``), every method's link bits at a range of budgets
and where fathom@48's lead over each fixed read set falls to 2× and to 1×, and writes
``bench/results/hbm-budget.{json,md,png}``; ``--hbm-gb`` turns a budget into the tokens in flight (and the host
memory their K/V take) at which it is what an H200 has left for the scan, for Qwen3-8B's shape.

Example::

    >>> from bench.hbm_budget import link_bits_at, read_set_points
    >>> link_bits_at(read_set_points(136.0), 68.0)    # DS-136 with half its label cache in HBM
    68.0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fathom.quantize import MAX_DEPTH

DEFAULT_BUDGETS = (0, 32, 64, 96, 128, 160, 288)  # bits a token of a (layer, KV head)'s scan held in HBM
REFERENCE = "fathom@48"
LAYERS, KV_HEADS, HEAD_DIM = 36, 8, 128  # Qwen3-8B's attention, the timing bench's shape


def plane_tier_points(bits: float, link: list[float], d: int) -> list[tuple[float, float]]:
    """(HBM bits, link bits) a token of a store tiered by plane, t = 0..4: at t = 0 nothing is in HBM (the scales
    too are in host memory), at t ≥ 1 the scales and t planes of all d channels; ``link[t]``: the share of the
    method's ``bits`` read past the tier (``bench.tier_split``)."""
    if len(link) != MAX_DEPTH + 1:
        raise ValueError(f"link must hold the shares at t = 0..{MAX_DEPTH}, got {len(link)}")
    return [(0.0 if t == 0 else (t + 0.25) * d, share * bits) for t, share in enumerate(link)]


def read_set_points(bits: float) -> list[tuple[float, float]]:
    """(HBM bits, link bits) of a read set fixed offline: none of it in HBM, or all of it (between, channels held
    whole: the straight line)."""
    return [(0.0, bits), (bits, 0.0)]


def link_bits_at(points: list[tuple[float, float]], budget: float) -> float:
    """The fewest link bits a token reachable within ``budget`` HBM bits a token: on the lower convex hull of
    ``points`` (layers at different tiers mix two of them), the last point's past its HBM bits."""
    if not budget >= 0:
        raise ValueError(f"budget must be >= 0 bits a token, got {budget!r}")
    hull: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if hull and y >= hull[-1][1]:  # more HBM for no fewer link bits: never the better choice
            continue
        while len(hull) >= 2 and _turns_down(hull[-2], hull[-1], (x, y)):
            hull.pop()
        hull.append((x, y))
    xs, ys = zip(*hull)
    return float(np.interp(budget, xs, ys))


def _turns_down(a, b, c) -> bool:
    """b lies on or above the chord a–c: not on the lower hull."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0]) <= 0


def budget_where(lead: float, ours: list[tuple[float, float]], theirs: list[tuple[float, float]],
                 step: float = 0.25) -> float | None:
    """The smallest HBM budget (bits a token, to ``step``) at which ``theirs`` link bits are below ``lead`` × ours
    (fathom's lead falls under ``lead``), or None if it never does within the largest point's HBM."""
    top = max(x for x, _ in ours + theirs)
    for budget in np.arange(0.0, top + step, step):
        mine, other = link_bits_at(ours, budget), link_bits_at(theirs, budget)
        if other < lead * mine or (other == 0.0 and mine == 0.0):
            return float(budget)
    return None


def tokens_at(budget_bits: float, hbm_gb: float, layers: int = LAYERS, kv_heads: int = KV_HEADS) -> float:
    """Tokens in flight at which ``hbm_gb`` of HBM is ``budget_bits`` a token of every (layer, KV head)."""
    return hbm_gb * 8e9 / (budget_bits * layers * kv_heads)


def is_fixed_read_set(method) -> bool:
    """Whether a method's reads are fixed before the query (its read set can be held in HBM exactly)."""
    from fathom.methods import FixedChannels, UniformDepth

    return isinstance(method.policy, (FixedChannels, UniformDepth))


def method_of(label: str, d: int):
    """The method a tier split's label names (``Method.label``: a method that reads no budget is labelled with the
    bits it reads, ``thumbnail-2bit@288``); ValueError for a label the catalog does not know."""
    from fathom import methods

    spec = label.partition("@")[0]
    return methods.parse(spec if methods.entry(spec.partition("[")[0]).budget == "none" else label, d)


def method_points(label: str, entry: dict, d: int) -> tuple[bool, list[tuple[float, float]]]:
    """(fixed read set?, its (HBM, link) points) of one method of a tier split: a fixed read set may also be tiered
    by plane (the better of the two at each budget is on the hull of both)."""
    planes = plane_tier_points(entry["bits"], entry["link"], d)
    if is_fixed_read_set(method_of(label, d)):
        return True, planes + read_set_points(entry["bits"])
    return False, planes


def summarize(split: dict, d: int, budgets: tuple[float, ...]) -> dict:
    """One tier split's curves: every method's link bits at each budget, and where fathom@48's lead over each fixed
    read set falls below 2× and 1× (the budgets in bits a token and as a share of the read set's own bits)."""
    curves, fixed = {}, {}
    for label, entry in split["methods"].items():
        is_fixed, points = method_points(label, entry, d)
        curves[label] = {"bits": entry["bits"], "fixed_read_set": is_fixed, "points": points,
                         "link_at": [link_bits_at(points, b) for b in budgets]}
        if is_fixed:
            fixed[label] = points
    crossings = {}
    if REFERENCE in curves:
        ours = curves[REFERENCE]["points"]
        for label, theirs in fixed.items():
            crossings[label] = {f"lead_below_{lead}x": budget_where(lead, ours, theirs) for lead in (2, 1)}
    return {"model": split["model"], "corpus": split["corpus"], "context": split["context"], "head_dim": d,
            "budgets": list(budgets), "curves": curves, "crossings": crossings}


def table(summary: dict) -> list[str]:
    budgets = summary["budgets"]
    lines = [f"**{summary['model']}**, {summary['corpus']} {summary['context']} (d = {summary['head_dim']}): link "
             "bits a token at an HBM budget of … bits a token", "",
             "| method | reads | " + " | ".join(f"{b:g}" for b in budgets) + " |", "|---|---|" + "---|" * len(budgets)]
    for label, curve in summary["curves"].items():
        reads = "fixed set" if curve["fixed_read_set"] else "by query"
        lines.append(f"| {label} | {reads} | " + " | ".join(f"{x:.1f}" for x in curve["link_at"]) + " |")
    if summary["crossings"]:
        lines += ["", f"| {REFERENCE}'s lead over | falls below 2× at | below 1× at |", "|---|---|---|"]
        for label, at in summary["crossings"].items():
            bits = summary["curves"][label]["bits"]
            cells = ["never" if b is None else f"{b:g} bits ({b / bits:.0%} of its own)"
                     for b in (at["lead_below_2x"], at["lead_below_1x"])]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def deployment(summaries: list[dict], hbm_gb: float) -> list[str]:
    """For Qwen3-8B's shape with ``hbm_gb`` of HBM for the scan: how many tokens must be in flight before fathom@48's
    lead over each fixed read set reaches 2× and 1× (a budget below the crossing's: more tokens than
    :func:`tokens_at` it), and the host memory those tokens' K/V take (bf16 K and V rows)."""
    kv_bytes = LAYERS * KV_HEADS * 4 * HEAD_DIM  # a token's K and V rows over every (layer, KV head)
    lines = [f"Qwen3-8B's shape ({LAYERS} layers × {KV_HEADS} KV heads, d = {HEAD_DIM}) with {hbm_gb:g} GB of HBM "
             "for the scan: the tokens in flight past which fathom@48's scan reads under half / less than the "
             f"method's over the link (their K/V: {kv_bytes / 1e3:.0f} KB a token of host memory)", "",
             f"| capture | against | {REFERENCE} reads under half of its link bits past | fewer link bits past |",
             "|---|---|---|---|"]
    for s in summaries:
        if s["head_dim"] != HEAD_DIM:
            continue
        for label, at in s["crossings"].items():
            cells = []
            for budget in (at["lead_below_2x"], at["lead_below_1x"]):
                if budget is None:
                    cells.append("any number of tokens")
                elif budget == 0:
                    cells.append("no number of tokens")
                else:
                    tokens = tokens_at(budget, hbm_gb)
                    cells.append(f"{tokens / 1e6:.1f} M tokens ({tokens * kv_bytes / 1e12:.1f} TB of K/V; under "
                                 f"{budget:g} bits a token of HBM)")
            lines.append(f"| {s['model']} {s['corpus']} {s['context']} | {label} | " + " | ".join(cells) + " |")
    return lines


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (a committed result names no machine's folder)."""
    from bench.report import RESULTS

    root = RESULTS.parents[1]
    return str(path.resolve().relative_to(root) if path.resolve().is_relative_to(root) else path)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(x for c in summary["curves"].values() for x, _ in c["points"])
    grid = np.linspace(0.0, top, 400)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in summary["curves"].items():
        ax.plot(grid, [link_bits_at(curve["points"], b) for b in grid], label=label,
                linestyle="--" if curve["fixed_read_set"] else "-")
    ax.set_xlabel("HBM budget, bits a token of each (layer, KV head)")
    ax.set_ylabel("scan bits a token over the link")
    ax.set_title(f"{summary['model']}, {summary['corpus']} {summary['context']} (d = {summary['head_dim']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    from bench import cli, models
    from bench.cli import plain
    from bench.report import RESULTS, command_line, write_json

    parser = argparse.ArgumentParser(prog="python -m bench.hbm_budget", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("splits", nargs="*", type=Path,
                        help="tier-split JSONs (default: every bench/results/tier-split-*.json)")
    parser.add_argument("--budgets", type=cli.int_list, default=list(DEFAULT_BUDGETS),
                        help="HBM bits a token, comma-separated, each >= 0 (default "
                             f"{','.join(map(str, DEFAULT_BUDGETS))})")
    parser.add_argument("--hbm-gb", type=float, default=100.0,
                        help="HBM left for the scan on the GPU, GB > 0 (default 100: an H200's 141 less an 8B "
                             "model's bf16 weights and the step's buffers)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="hbm-budget")
    args = parser.parse_args(argv)
    try:
        if any(b < 0 for b in args.budgets):
            raise cli.UsageError(f"--budgets must each be >= 0, got {min(args.budgets)}")
        if not args.hbm_gb > 0:
            raise cli.UsageError(f"--hbm-gb must be > 0, got {args.hbm_gb}")
        cli.file_stem("--name", args.name)
        paths = args.splits or sorted(RESULTS.glob("tier-split-*.json"))
        if not paths:
            raise cli.UsageError("no tier-split JSON given or under bench/results (python -m bench.tier_split)")
        splits = [cli.result_json(p, "a tier split", ("model", "corpus", "context", "methods")) for p in paths]
        for path, split in zip(paths, splits):
            if split["model"] not in models.MODELS:  # the registry gives its head dim
                raise cli.UsageError(f"{path}: model {split['model']!r} is not one of {', '.join(models.MODELS)}")
            for label, entry in split["methods"].items():
                if not isinstance(entry, dict) or "bits" not in entry or len(entry.get("link", ())) != MAX_DEPTH + 1:
                    raise cli.UsageError(f"{path}: method {label} lacks bits or its link shares at t = 0..4")
                try:
                    method_of(label, models.info(split["model"]).head_dim)
                except ValueError as error:
                    raise cli.UsageError(f"{path}: method {label}: {error}") from None
        out = cli.writable_folder("--out", args.out)
    except cli.UsageError as error:
        parser.exit(2, f"error: {error}\n")
    summaries = [summarize(split, models.info(split["model"]).head_dim, tuple(args.budgets)) for split in splits]
    lines = []
    for summary in summaries:
        lines += table(summary) + [""]
    lines += deployment(summaries, args.hbm_gb)
    print("\n".join(lines))
    command = command_line(argv, "python -m bench.hbm_budget")
    json_path = write_json(out / f"{args.name}.json", command, {
        "splits": [_shown(p) for p in paths], "hbm_gb": args.hbm_gb, "summaries": summaries, "table": lines})
    (out / f"{args.name}.md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
    reference = next((s for s in summaries if s["head_dim"] == HEAD_DIM), summaries[0])
    plot(reference, out / f"{args.name}.png")
    print(f"wrote {json_path}, {out / f'{args.name}.md'}, {out / f'{args.name}.png'}")


if __name__ == "__main__":
    main()
