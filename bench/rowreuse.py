"""``python -m bench rowreuse``: how often the rows a generated token fetches were fetched by the tokens before.

Issue 14 item 2 (an HBM row cache) on generated tokens: a real model decodes a
real text greedily with ``generate`` through a :class:`~fathom.integrations.
transformers.FathomCache` on the NumPy reference backend, each method with its
own sparse attention. Every decode step of every full-attention layer records,
per (session, KV head), the rows the step fetches (the union over the group's
query heads, :attr:`~fathom.integrations.sessions.ReferenceSessions.on_step`),
minus the sink, the local window and the open tail block: those are fetched
every step and would live in an always-resident area.

The prompt holds ``context − new_tokens`` tokens of the corpus, so the last
step decodes at ``context``; one dense prefill per (model, context) is shared
by the methods (:func:`~fathom.integrations.prefill.prefill`). Per
(layer, session, KV head) the row sets are replayed through
:mod:`bench.row_cache`: keeping only the previous step's rows, LRU caches
of ``c ×`` that head's mean rows per step, and with ``--ways`` set-associative
caches of the same sizes (what a GPU can assign slots in with one parallel
pass, where the LRU takes a pass over every slot). Reported per method and context:
each head's hit rate (mean over steps), then the mean and the 10th percentile
over heads, and the fraction of the selected rows' bytes that still cross the
link (all misses / all selected rows). And how well the rows that cross share
4 KiB host pages (a random gather over the link is paid per page,
:mod:`bench.row_cache`): rows per page touched, per (layer, session) step,
for all selected rows and for each LRU's misses, in the host cache's layout
(``stream-major``) and with a token's KV heads side by side (``token-major``).
"""

from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import artifacts, cli, corpora, decoding, models
from bench.cli import UsageError
from bench.decoding import MethodSpec
from bench.report import RESULTS, context_label, markdown_table, write_json
from bench.row_cache import LAYOUTS, lru_misses, pages_touched, previous_step_reuse, set_associative_misses, step_hits
from fathom import methods
from fathom.selection import Selection

MIN_CONTEXT = 512  # tokens: the prompt must leave top-k a choice beyond sink, local and k


def parse_methods(texts: list[str], head_dim: int) -> list[MethodSpec]:
    """The ``--methods`` specs for a model of ``head_dim`` (the one place specs are parsed here); dense is
    refused: it fetches every row, there is nothing to cache."""
    specs = decoding.parse_specs(texts, head_dim)
    if any(s.method == "dense" for s in specs):
        raise UsageError("--methods: dense fetches every row every step; name sparse methods")
    return specs


class RowRecorder:
    """``ReferenceSessions.on_step``: the rows each (layer, session, KV head) step fetched beyond the always-kept
    ones, in step order; ticks ``bar`` once per decoded token."""

    def __init__(self, selection, bar=None):
        self.selection, self.bar = selection, bar
        self.rows: dict[tuple[int, int, int], list[np.ndarray]] = {}

    def __call__(self, layer: int, session: int, head: int, decoded) -> None:
        from fathom.quantize import BLOCK
        from fathom.selection import always_kept

        n = decoded.mask.shape[1]
        fetched = decoded.mask.any(axis=0) & ~always_kept(n, n // BLOCK * BLOCK, self.selection)
        self.rows.setdefault((layer, session, head), []).append(np.flatnonzero(fetched))
        if self.bar is not None and (layer, session, head) == (0, 0, 0):
            self.bar.update()


def rows_per_page(steps: dict[tuple[int, int, int], list[np.ndarray]], row_bytes: int) -> dict[str, float]:
    """Per layout: the rows of ``steps`` (per (layer, session, KV head), the rows each step t = 1.. fetches over
    the link) over the 4 KiB pages they touch, each (layer, session) step's pages counted once (one gather)."""
    groups: dict[tuple[int, int], list[list[np.ndarray]]] = {}
    for (layer, session, _), per_step in sorted(steps.items()):
        groups.setdefault((layer, session), []).append(per_step[1:])
    rows = sum(len(r) for heads in groups.values() for per_step in heads for r in per_step)
    pages = {layout: sum(pages_touched(list(step), row_bytes, layout)
                         for heads in groups.values() for step in zip(*heads)) for layout in LAYOUTS}
    return {layout: rows / pages[layout] if pages[layout] else float("nan") for layout in LAYOUTS}


def reuse_summary(rows: dict[tuple[int, int, int], list[np.ndarray]], capacities: list[int],
                  row_bytes: int, ways: list[int] = ()) -> dict:
    """Previous-step reuse and LRU hit rates of every (layer, session, KV head)'s row sets: per policy the mean
    over heads of each head's mean over steps, its 10th percentile and minimum over heads, the per-layer means,
    the mean over heads at each step and the fraction of selected rows that miss (the link's share); for all
    selected rows and each LRU's misses, :func:`rows_per_page` (``row_bytes``: a token's K and V of one head).
    ``ways``: also a set-associative cache of each capacity with sets of that many rows (``set_associative``: the
    same figures, but the pages)."""
    heads = sorted(rows)
    selected = np.array([[len(r) for r in rows[h][1:]] for h in heads])  # [heads, T - 1]
    mean_rows = np.array([np.mean([len(r) for r in rows[h]]) for h in heads])
    layers = np.array([h[0] for h in heads])

    def policy(hits: np.ndarray) -> dict:  # hits [heads, T - 1]
        ratio = np.where(selected > 0, hits / np.maximum(selected, 1), np.nan)
        per_head = np.nanmean(ratio, axis=1)
        return {"hit_mean": float(np.mean(per_head)), "hit_p10_heads": float(np.percentile(per_head, 10)),
                "hit_min_heads": float(np.min(per_head)), "link_fraction": float(1 - hits.sum() / selected.sum()),
                "per_layer": [float(np.mean(per_head[layers == layer])) for layer in np.unique(layers)],
                "per_step": [float(x) for x in np.nanmean(ratio, axis=0)]}

    previous = np.array([previous_step_reuse(rows[h]) for h in heads]) * selected
    lru = []
    for c in capacities:
        sizes = np.maximum(1, np.rint(c * mean_rows)).astype(int)
        misses = {h: lru_misses(rows[h], int(size)) for h, size in zip(heads, sizes)}
        hits = np.array([step_hits(rows[h], misses[h]) for h in heads])
        lru.append({"capacity": c, "rows_held_mean": float(sizes.mean()), **policy(hits),
                    "miss_rows_per_page": rows_per_page(misses, row_bytes)})
    associative = []
    for w in ways:
        for c in capacities:
            sizes = np.maximum(w, np.rint(c * mean_rows)).astype(int)  # at least one set
            hits = np.array([step_hits(rows[h], set_associative_misses(rows[h], int(size), w))
                             for h, size in zip(heads, sizes)])
            associative.append({"capacity": c, "ways": w, "rows_held_mean": float((sizes // w * w).mean()),
                                **policy(hits)})
    return {"heads": len(heads), "steps": selected.shape[1] + 1, "mean_rows": float(mean_rows.mean()),
            "previous_step": policy(np.nan_to_num(previous)), "lru": lru, "set_associative": associative,
            "row_bytes": row_bytes, "selected_rows_per_page": rows_per_page(rows, row_bytes)}


def generate_rows(model, prompt, ids: np.ndarray, spec: MethodSpec, new_tokens: int, k: int | None,
                  calibration: Path | None, no_repeat_ngram: int = 0, bar=None) -> tuple[dict, np.ndarray, int]:
    """Decode ``new_tokens`` steps greedily after ``prompt`` (the dense prefill of ``ids``) with ``spec`` on the
    reference backend -> (the recorded rows, the generated token ids, the top-k used). ``no_repeat_ngram`` > 0:
    the greedy token never repeats an n-gram of that length (generate's ``no_repeat_ngram_size``)."""
    import torch

    cache = spec.cache(model, k=k, calibration=calibration, backend="reference", prompt=prompt)
    recorder = RowRecorder(cache.selection, bar)
    cache.decoding.sessions.on_step = recorder
    inputs, mask = prompt.continued(torch.as_tensor(ids)[None])
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             no_repeat_ngram_size=no_repeat_ngram)
    selection_k = cache.selection.k
    cache.close()
    return recorder.rows, out[0, len(ids):].numpy(), selection_k


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=cli.name_list, default=["smollm2-135m"],
                        help=f"comma-separated, of {', '.join(models.MODELS)} (default smollm2-135m)")
    parser.add_argument("--contexts", type=cli.int_list, default=[4096, 8192],
                        help="comma-separated context lengths at the last generated token (default 4096,8192)")
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="greedy decode steps recorded per run (default %(default)s)")
    parser.add_argument("--methods", type=cli.name_list, default=["oracle", "fathom@48"],
                        help=f"comma-separated {decoding.spec_help(exclude=('dense', *decoding.PER_LAYER))} "
                             "(default oracle,fathom@48)")
    parser.add_argument("--capacities", type=cli.int_list, default=[1, 2, 4, 8],
                        help="LRU capacities in units of a head's mean rows per step (default 1,2,4,8)")
    parser.add_argument("--ways", type=cli.int_list, default=[],
                        help="also set-associative caches of every capacity, with sets of these many rows "
                             "(comma-separated; default: none)")
    parser.add_argument("--no-repeat-ngram", type=int, default=0,
                        help="greedy, but never repeating an n-gram of this length (small models loop on plain "
                             "greedy decoding; default %(default)s: plain greedy)")
    parser.add_argument("--corpus", default="paul-graham",
                        help=f"the prompt's text, one of {', '.join(corpora.CORPORA)} (default %(default)s)")
    parser.add_argument("-k", type=int, default=None, help="top-k per query head (default by context, design §6)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a .calibration.npz for methods that read one (default: the model's committed one)")
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"model / corpus cache folder (default ${artifacts.CACHE_ENV} or ~/.cache/fathom)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--name", default=None,
                        help="file name stem (default rowreuse-<models>-<contexts>-T<new tokens>[-nr<n>])")


def check_args(args) -> dict[str, tuple[list[MethodSpec], Path | None]]:
    """Everything checked before a model is loaded -> per model its method specs and calibration."""
    args.out = cli.writable_folder("--out", args.out)
    cli.file_stem("--name", args.name)
    cli.at_least("--new-tokens", args.new_tokens, 2)
    cli.at_least("--no-repeat-ngram", args.no_repeat_ngram, 0)
    if args.k is not None:
        cli.at_least("-k", args.k, 1)
    for c in args.capacities:
        cli.at_least("--capacities", c, 1)
    for w in args.ways:
        cli.at_least("--ways", w, 1)
    if args.corpus not in corpora.CORPORA:
        raise UsageError(f"--corpus must be one of {', '.join(corpora.CORPORA)}, got {args.corpus!r}")
    if args.calibration is not None and len(args.models) > 1:
        raise UsageError("--calibration is per model: name one model with it")
    for name, values in (("--models", args.models), ("--contexts", args.contexts), ("--methods", args.methods),
                         ("--capacities", args.capacities), ("--ways", args.ways)):
        if len(set(values)) < len(values):
            raise UsageError(f"{name} names a value more than once: {','.join(map(str, values))}")
    plan = {}
    for model in args.models:
        if model not in models.MODELS:
            raise UsageError(f"--models must name models of {', '.join(models.MODELS)}, got {model!r}")
        info = models.info(model)
        for context in args.contexts:
            if not max(MIN_CONTEXT, args.new_tokens + 1) <= context <= info.context:
                raise UsageError(f"--contexts must lie in {max(MIN_CONTEXT, args.new_tokens + 1)}..{info.context} "
                                 f"({model}; the prompt holds context − new tokens), got {context}")
            prompt = context - args.new_tokens  # what the first generated token's step chooses from
            selection = Selection(k=args.k) if args.k is not None else Selection.for_context(prompt)
            decoding.check_top_k(selection, prompt, 1, given=args.k is not None, context_flag="--contexts (less "
                                 "--new-tokens)")
        specs = parse_methods(args.methods, info.head_dim)
        planned = [s.method for s in specs if methods.entry(s.method).per_layer]
        if planned:
            raise UsageError(f"--methods: {planned[0]} plans its budgets on the prompt; name a fixed-budget method")
        calibration = args.calibration or decoding.default_calibration(model)
        if calibration is not None:
            decoding.check_calibration(calibration, model)
        decoding.require_calibration(specs, calibration, model)
        plan[model] = (specs, calibration)
    return plan


def prompt_ids(text: str, tokenizer, tokens: int) -> np.ndarray:
    """The first ``tokens`` token ids of ``text``."""
    ids = tokenizer(text[:tokens * 8], add_special_tokens=False).input_ids[:tokens]  # prose: ~4 characters a token
    if len(ids) < tokens:
        raise UsageError(f"--corpus holds only {len(ids)} tokens, fewer than the {tokens} of the prompt")
    return np.array(ids)


def run(args: argparse.Namespace) -> Path:
    plan = check_args(args)
    import torch

    from fathom.integrations.prefill import prefill

    start = time.perf_counter()
    text = corpora.load(args.corpus, args.cache)
    runs = []
    total = len(args.contexts) * sum(len(specs) for specs, _ in plan.values()) * args.new_tokens
    with tqdm(total=total, desc="rowreuse", unit="token") as bar:
        for name, (specs, calibration) in plan.items():
            model, tokenizer = models.load(name, args.cache)
            for context in args.contexts:
                ids = prompt_ids(text, tokenizer, context - args.new_tokens)
                bar.set_description(f"rowreuse {name} {context_label(context)}: prefill")
                prompt = prefill(model, torch.as_tensor(ids)[None])
                for spec in specs:
                    bar.set_description(f"rowreuse {name} {context_label(context)} {spec.label}")
                    began = time.perf_counter()
                    rows, generated, k = generate_rows(model, prompt, ids, spec, args.new_tokens, args.k,
                                                       calibration, args.no_repeat_ngram, bar)
                    runs.append({"model": name, "context": context, "prompt_tokens": len(ids),
                                 "method": spec.label, "k": k,
                                 **reuse_summary(rows, args.capacities, 4 * models.info(name).head_dim,
                                                 args.ways),
                                 "decode_s": round(time.perf_counter() - began, 1),
                                 "generated": tokenizer.decode(generated)})
    name = args.name or (f"rowreuse-{'-'.join(args.models)}-{'-'.join(context_label(c) for c in args.contexts)}"
                         f"-T{args.new_tokens}" + (f"-nr{args.no_repeat_ngram}" if args.no_repeat_ngram else ""))
    greedy = f"greedy (no repeated {args.no_repeat_ngram}-gram)" if args.no_repeat_ngram else "greedy"
    title = (f"{', '.join(args.models)} on {args.corpus}: {args.new_tokens} {greedy} generated tokens ending at "
             f"{', '.join(context_label(c) for c in args.contexts)}, reference backend; rows beyond sink "
             "/ local / tail, per (layer, KV head)")
    path = write_json(args.out / f"{name}.json", args.command_line, {
        "models": args.models, "corpus": args.corpus, "contexts": args.contexts, "new_tokens": args.new_tokens,
        "no_repeat_ngram": args.no_repeat_ngram, "capacities": args.capacities, "ways": args.ways,
        "calibration": {m: None if c is None else str(c) for m, (_, c) in plan.items()},
        "hit_rate": "per head: hits / selected rows, mean over steps 1..T-1 (step 0 finds the cache cold); "
                    "then the mean and the 10th percentile over (layer, session, KV head)",
        "link_fraction": "all misses / all selected rows (sink, local and tail excluded from both)",
        "wall_s": round(time.perf_counter() - start, 1), "runs": runs})
    _write_table(args.out / f"{name}.md", runs, args.capacities, args.ways, title, args.command_line)
    _plot(args.out / f"{name}.png", runs, title)
    print((args.out / f"{name}.md").read_text())
    return path


def _write_table(path: Path, runs: list[dict], capacities: list[int], ways: list[int], title: str,
                 command: str) -> None:
    rows = []
    for r in runs:
        row = {"model": r["model"], "context": context_label(r["context"]), "method": r["method"], "k": r["k"],
               "rows": r["mean_rows"], "previous": _hit(r["previous_step"])}
        row["pages"] = _per_page(r["selected_rows_per_page"])
        for c in r["lru"]:
            row[f"lru{c['capacity']}"] = _hit(c)
            row[f"link{c['capacity']}"] = c["link_fraction"]
            row[f"pages{c['capacity']}"] = _per_page(c["miss_rows_per_page"])
        for c in r.get("set_associative", []):
            row[f"set{c['ways']}x{c['capacity']}"] = _hit(c)
        rows.append(row)
    columns = [("model", "model", "s"), ("context", "context", "s"), ("method", "method", "s"), ("k", "k", "d"),
               ("rows", "rows / step", ".0f"), ("previous", "previous step: mean (p10)", "s"),
               *[(f"lru{c}", f"LRU {c}×: mean (p10)", "s") for c in capacities],
               *[(f"set{w}x{c}", f"{w}-way {c}×: mean (p10)", "s") for w in ways for c in capacities],
               *[(f"link{c}", f"link {c}×", ".3f") for c in capacities],
               ("pages", "rows / page: selected", "s"), *[(f"pages{c}", f"rows / page: LRU {c}× misses", "s")
                                                          for c in capacities]]
    lines = [f"Row reuse on generated tokens — {title}. Made by `{command}`.", "",
             "Hit rate per (layer, KV head): hits / selected rows, mean over steps; the table gives its mean and "
             "10th percentile over heads. LRU c×: c times the head's mean rows per step; w-way c×: as many rows "
             "in sets of w (row r in set r mod the sets), each set an LRU. link: misses / selected "
             "rows, what still crosses the link. rows / page: the rows a (layer, session) step fetches over the "
             "4 KiB host pages they lie on, in the host cache's layout (each KV head's rows contiguous) / with a "
             "token's KV heads side by side (a random gather over the link is paid per page: with 8 rows of 512 B a "
             "page it reads at the link's rate, with one a page over 8 GiB at a third of it).", "",
             markdown_table(rows, columns), ""]
    path.write_text("\n".join(lines))


def _per_page(by_layout: dict) -> str:
    return " / ".join(f"{by_layout[layout]:.2f}" for layout in LAYOUTS)


def _hit(policy: dict) -> str:
    return f"{policy['hit_mean']:.3f} ({policy['hit_p10_heads']:.3f})"


def _plot(path: Path, runs: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    for r in runs:
        label = f"{r['model']} {context_label(r['context'])} {r['method']}"
        x = [c["capacity"] for c in r["lru"]]
        line, = ax.plot(x, [c["hit_mean"] for c in r["lru"]], "-o", ms=4, label=f"{label}: LRU")
        ax.plot(x, [c["hit_p10_heads"] for c in r["lru"]], ":", color=line.get_color(), lw=1)
        ax.plot([1], [r["previous_step"]["hit_mean"]], "x", ms=7, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LRU capacity (× a head's mean rows per step); x: previous step's rows only")
    ax.set_ylabel("hit rate (mean over heads; dotted: 10th percentile)")
    ax.set_ylim(0, 1)
    ax.set_title(textwrap.fill(title, 110), fontsize=7)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
