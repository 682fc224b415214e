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
* **Reads chosen by the query, tiered by how often each plane is read** (a store layout not built yet: a tier per
  (layer, KV head, channel, plane) instead of one t): each channel's planes held in HBM most read first, the order
  learned on one text and the link bits counted on another (``bench.tier_split``'s read shares of the same model on
  two corpora). The query-chosen reads are skewed (a few channels carry most of the variance), so a small budget
  serves most of them; a fixed read set is this order's special case (its shares are 1).

So the question "at the same HBM budget" has one answer per budget and per tiering. ``python -m bench.hbm_budget``
prints, for each committed tier split (``bench/results/tier-split-*.json``), every method's link bits at a range of
budgets and where fathom@48's lead over each fixed read set falls to 2× and to 1×, and writes
``bench/results/hbm-budget.{json,md,png}``; ``--hbm-gb`` turns a budget into the tokens in flight (and the host
memory their K/V take) at which it is what an H200 has left for the scan, for Qwen3-8B's shape.

Example::

    >>> from bench.hbm_budget import link_bits_at, read_set_points
    >>> link_bits_at(read_set_points(136.0), 68.0)    # DS-136 with half its label cache in HBM
    68.0
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from fathom.bits import SCALE_BITS
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


def read_tier_points(learned: np.ndarray, evaluated: np.ndarray, step: float = 0.25) -> list[tuple[float, float]]:
    """(HBM bits, link bits) a token of a store tiered by how often each plane is read: plane p of channel c of each
    (layer, KV head) is held in HBM in the order of its read share on a learning text (``learned``: ``[L, H, d, 4]``
    shares, ``bench.tier_split.read_shares``), the most read first (ties: the shallower plane, so a channel's planes
    stay a prefix), each a bit a token of its (layer, KV head) and plane 0 with the channel's scale (1.25); the link
    carries the evaluated text's reads (``evaluated``, the same shape) of what is not held. Averaged over the
    (layer, KV head)s; a point each ``step`` bits of HBM. A fixed read set (shares 1 on its planes, 0 elsewhere) is
    held first and whole: the read-set line."""
    if learned.shape != evaluated.shape or learned.ndim != 4 or learned.shape[-1] != MAX_DEPTH:
        raise ValueError(f"learned and evaluated must be read shares [L, H, d, {MAX_DEPTH}] of one shape, got "
                         f"{learned.shape} and {evaluated.shape}")
    cost = np.where(np.arange(MAX_DEPTH) == 0, 1 + SCALE_BITS, 1.0)
    plane = np.broadcast_to(np.arange(MAX_DEPTH), learned.shape)
    order = np.lexsort((plane.ravel(), -learned.ravel()))
    stores = learned.shape[0] * learned.shape[1]
    hbm = np.concatenate([[0.0], np.cumsum(np.broadcast_to(cost, learned.shape).ravel()[order])]) / stores
    read = (evaluated * cost).ravel()[order]
    link = (read.sum() - np.concatenate([[0.0], np.cumsum(read)])) / stores
    keep = np.unique(np.searchsorted(hbm, np.arange(0.0, hbm[-1], step)))  # the first point past each step
    keep = np.union1d(keep, [len(hbm) - 1])
    return list(zip(hbm[keep].tolist(), np.maximum(link[keep], 0.0).tolist()))


def _hull(points: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The lower convex hull of ``points`` where link bits fall as HBM grows (layers at different tiers mix two
    points; more HBM for no fewer link bits is never the better choice) -> (HBM bits, link bits)."""
    hull: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if hull and y >= hull[-1][1]:
            continue
        while len(hull) >= 2 and _turns_down(hull[-2], hull[-1], (x, y)):
            hull.pop()
        hull.append((x, y))
    xs, ys = zip(*hull)
    return np.array(xs), np.array(ys)


def link_bits_at(points: list[tuple[float, float]], budget):
    """The fewest link bits a token reachable within ``budget`` HBM bits a token (a number, or an array of them): on
    the lower convex hull of ``points``, the last point's past its HBM bits."""
    budgets = np.asarray(budget, np.float64)
    if not (budgets >= 0).all():
        raise ValueError(f"budget must be >= 0 bits a token, got {budget!r}")
    xs, ys = _hull(points)
    out = np.interp(budgets, xs, ys)
    return float(out) if out.ndim == 0 else out


def _turns_down(a, b, c) -> bool:
    """b lies on or above the chord a–c: not on the lower hull."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0]) <= 0


def budget_where(lead: float, ours: list[tuple[float, float]], theirs: list[tuple[float, float]],
                 step: float = 0.25) -> float | None:
    """The smallest HBM budget (bits a token, to ``step``) at which ``theirs`` link bits are below ``lead`` × ours
    (fathom's lead falls under ``lead``), or None if it never does within the largest point's HBM."""
    top = max(x for x, _ in ours + theirs)
    budgets = np.arange(0.0, top + step, step)
    mine, other = link_bits_at(ours, budgets), link_bits_at(theirs, budgets)
    below = (other < lead * mine) | ((other == 0.0) & (mine == 0.0))
    return float(budgets[np.argmax(below)]) if below.any() else None


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


def summarize(split: dict, d: int, budgets: tuple[float, ...], reads: tuple | None = None) -> dict:
    """One tier split's curves: every method's link bits at each budget, and where fathom@48's lead over each fixed
    read set falls below 2× and 1× (the budgets in bits a token). ``reads``: (the learning text's corpus, the
    methods' labels, their read shares there and on this split's text, ``[methods, L, H, d, 4]``) adds each
    by-query method tiered by read frequency, labelled ``<method> by reads`` (:func:`read_tier_points`), and
    fathom@48's crossings in that tiering too."""
    curves, fixed = {}, {}
    for label, entry in split["methods"].items():
        is_fixed, points = method_points(label, entry, d)
        curves[label] = {"bits": entry["bits"], "fixed_read_set": is_fixed, "points": points}
        if is_fixed:
            fixed[label] = points
    if reads is not None:
        corpus, labels, learned, evaluated = reads
        for i, label in enumerate(labels):
            if label in curves and not curves[label]["fixed_read_set"]:
                curves[f"{label} by reads"] = {"bits": curves[label]["bits"], "fixed_read_set": False,
                                               "learned_on": corpus,
                                               "points": read_tier_points(learned[i], evaluated[i])}
    for curve in curves.values():
        curve["link_at"] = link_bits_at(curve["points"], np.array(budgets, np.float64)).tolist()
    crossings = {ours: {label: {f"lead_below_{lead}x": budget_where(lead, curves[ours]["points"], theirs)
                                for lead in (2, 1)} for label, theirs in fixed.items()}
                 for ours in (REFERENCE, f"{REFERENCE} by reads") if ours in curves}
    return {"model": split["model"], "corpus": split["corpus"], "context": split["context"], "head_dim": d,
            "budgets": list(budgets), "curves": curves, "crossings": crossings}


def table(summary: dict) -> list[str]:
    budgets = summary["budgets"]
    lines = [f"**{summary['model']}**, {summary['corpus']} {summary['context']} (d = {summary['head_dim']}): link "
             "bits a token at an HBM budget of … bits a token", "",
             "| method | tiered | " + " | ".join(f"{b:g}" for b in budgets) + " |", "|---|---|" + "---|" * len(budgets)]
    for label, curve in summary["curves"].items():
        tiered = ("its read set whole" if curve["fixed_read_set"] else
                  f"by read share on {curve['learned_on']}" if "learned_on" in curve else "by plane")
        lines.append(f"| {label} | {tiered} | " + " | ".join(f"{x:.1f}" for x in curve["link_at"]) + " |")
    for ours, against in summary["crossings"].items():
        lines += ["", f"| {ours}'s lead over | falls below 2× at | below 1× at |", "|---|---|---|"]
        for label, at in against.items():
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
             "| capture | fathom@48 tiered | against | under half of its link bits past | fewer link bits past |",
             "|---|---|---|---|---|"]
    for s in summaries:
        if s["head_dim"] != HEAD_DIM:
            continue
        for ours, against in s["crossings"].items():
            tiered = f"by read share on {s['curves'][ours]['learned_on']}" if "learned_on" in s["curves"][ours] \
                else "by plane"
            for label, at in against.items():
                cells = []
                for budget in (at["lead_below_2x"], at["lead_below_1x"]):
                    if budget is None:
                        cells.append("any number of tokens")
                    elif budget == 0:
                        cells.append("no number of tokens")
                    else:
                        tokens = tokens_at(budget, hbm_gb)
                        cells.append(f"{tokens / 1e6:.1f} M tokens ({tokens * kv_bytes / 1e12:.1f} TB of K/V; "
                                     f"under {budget:g} bits a token of HBM)")
                lines.append(f"| {s['model']} {s['corpus']} {s['context']} | {tiered} | {label} | "
                             + " | ".join(cells) + " |")
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {label: c for label, c in summary["curves"].items()  # fathom@48 and the baselines, each way tiered
             if label.split(" ")[0] == REFERENCE or label.startswith(("sparq", "double-sparsity"))}
    grid = np.linspace(0.0, 300.0, 601)  # past 2.25 bits a channel at d = 128 every curve but SparQ's is near 0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in shown.items():
        ax.plot(grid, link_bits_at(curve["points"], grid), label=label,
                linestyle="--" if curve["fixed_read_set"] else ":" if "learned_on" in curve else "-")
    ax.set_xlabel("HBM budget, bits a token of each (layer, KV head)")
    ax.set_ylabel("scan bits a token over the link")
    ax.set_title(f"{summary['model']}, {summary['corpus']} {summary['context']} (d = {summary['head_dim']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _read_shares(split: Path) -> tuple[list[str], np.ndarray]:
    """A split's read shares file -> (labels, shares ``[methods, L, H, d, 4]``), a malformed one refused naming it."""
    from bench.cli import UsageError

    from bench.tier_split import reads_path

    path = reads_path(split)
    try:
        with np.load(path) as data:
            labels, shares = [str(x) for x in data["labels"]], np.asarray(data["shares"], np.float64)
    except (OSError, KeyError, ValueError) as error:
        raise UsageError(f"{path}: not a tier split's read shares ({error})") from None
    if shares.ndim != 5 or shares.shape[0] != len(labels) or shares.shape[-1] != MAX_DEPTH \
            or not ((shares >= 0) & (shares <= 1)).all():
        raise UsageError(f"{path}: read shares must be [methods, L, H, d, {MAX_DEPTH}] in 0..1, one row a label, "
                         f"got {shares.shape}")
    return labels, shares


def _learned_elsewhere(path, split, paths, splits, shares) -> tuple | None:
    """The read-tier input of ``split``: its read shares and those of the same model on another corpus (the first
    such split), over the methods both hold; None where either is missing."""
    if path not in shares:
        return None
    for other_path, other in zip(paths, splits):
        if other_path in shares and other["model"] == split["model"] and other["corpus"] != split["corpus"]:
            (mine, evaluated), (theirs, learned) = shares[path], shares[other_path]
            if evaluated.shape[1:] != learned.shape[1:]:
                continue
            common = [label for label in mine if label in theirs]
            return (other["corpus"], common, learned[[theirs.index(x) for x in common]],
                    evaluated[[mine.index(x) for x in common]])
    return None


def main(argv=None) -> None:
    from bench import cli, models, tier_split
    from bench.cli import plain
    from bench.report import RESULTS, command_line, repo_path, write_json

    parser = argparse.ArgumentParser(prog="python -m bench.hbm_budget", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("splits", nargs="*", type=Path,
                        help="tier-split JSONs (default: every bench/results/tier-split-*.json)")
    parser.add_argument("--budgets", type=cli.int_list, default=list(DEFAULT_BUDGETS),
                        help="HBM bits a token, comma-separated, each >= 0 (default "
                             f"{','.join(map(str, DEFAULT_BUDGETS))})")
    parser.add_argument("--hbm-gb", type=float, default=100.0,
                        help="HBM left for the scan on the GPU, finite GB > 0 (default 100: an H200's 141 less an 8B "
                             "model's bf16 weights and the step's buffers)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="hbm-budget")
    args = parser.parse_args(argv)
    try:
        if any(b < 0 for b in args.budgets):
            raise cli.UsageError(f"--budgets must each be >= 0, got {min(args.budgets)}")
        if not 0 < args.hbm_gb < math.inf:
            raise cli.UsageError(f"--hbm-gb must be a finite number > 0, got {args.hbm_gb}")
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
        shares = {path: _read_shares(path) for path in paths if tier_split.reads_path(path).is_file()}
    except cli.UsageError as error:
        parser.exit(2, f"error: {error}\n")
    summaries = [summarize(split, models.info(split["model"]).head_dim, tuple(args.budgets),
                           _learned_elsewhere(path, split, paths, splits, shares))
                 for path, split in zip(paths, splits)]
    lines = []
    for summary in summaries:
        lines += table(summary) + [""]
    lines += deployment(summaries, args.hbm_gb)
    print("\n".join(lines))
    command = command_line(argv, "python -m bench.hbm_budget")
    json_path = write_json(out / f"{args.name}.json", command, {
        "splits": [str(repo_path(p)) for p in paths], "hbm_gb": args.hbm_gb, "table": lines,
        "summaries": [{**s, "curves": {label: {k: v for k, v in c.items() if k != "points"}  # the splits' to remake
                                       for label, c in s["curves"].items()}} for s in summaries]})
    (out / f"{args.name}.md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
    reference = next((s for s in summaries if s["head_dim"] == HEAD_DIM), summaries[0])
    plot(reference, out / f"{args.name}.png")
    print(f"wrote {json_path}, {out / f'{args.name}.md'}, {out / f'{args.name}.png'}")


if __name__ == "__main__":
    main()
