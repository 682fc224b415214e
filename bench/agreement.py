"""``python -m bench agreement``: how often a method's greedy next token equals the dense model's, on real code.

A window of ``--context`` tokens of the CPython standard library source (a
coding-session proxy) is continued greedily by the dense model for ``--steps``
tokens (the real ``generate``). Every method is then teacher-forced on those
tokens: at each step it decodes the dense model's previous token with its own
sparse attention over the context and over its own K/V of the tokens before
(a sparse step writes the K/V every later layer and step sees), and the step
agrees when its greedy next token equals the dense model's. Windows start at
evenly spaced offsets into the corpus, so the fraction has ``windows × steps``
trials (steps of one window are not independent: the interval is a guide).

Two equivalent paths (tested equal on a tiny model):

* ``step`` — the faithful one: a FathomCache per method, prefilled by its own
  dense pass, then one token per forward, exactly as ``generate`` decodes.
* ``batched`` (default) — one dense prefill per window shared by every method,
  then one forward over the ``steps`` teacher tokens per method in which every
  full-attention layer attends each position ``p`` sparsely over tokens
  ``0..p``: a bit-plane store of the first ``(p + 1) // 64`` blocks (the tail
  exact), σ² of those blocks, sink + local + top-k — what a store grown token by
  token holds at step ``p`` (:func:`fathom.decode.method_scores` and
  :func:`fathom.selection.select_many`, the pieces of the reference step).
  Causality makes the K/V of position ``p`` the same as the step path's.

The summary: for the fathom curve of the store the calibration chose, the bits
at which it first reaches the agreement of the best 136-bit scan (SparQ,
Double Sparsity, Loki at r = 32), interpolated linearly in agreement against
log2(bits) between the two budgets around the crossing (paper: 92 bits).
"""

from __future__ import annotations

import argparse
import copy
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import artifacts, cli, corpora, decoding, models
from bench.cli import UsageError
from bench.capture import global_layers
from bench.decoding import MethodSpec
from bench.report import RESULTS, markdown_table, write_json
from bench.ruler.score import wilson
from fathom import methods

ATTENTION = "fathom_teacher"
FATHOM_BUDGETS = (32, 48, 64, 92, 136)
SCAN_136 = ("sparq@136", "double-sparsity@136", "loki@136")
CORPUS = "cpython"


def method_grid(head_dim: int, basis: str) -> list[str]:
    """dense, oracle, fathom at 32..136 bits (and fathom-rotated when the calibration chose the rotated
    store), SparQ / Double Sparsity / Loki at r = d/8, d/4, 16 and 32 (68 and 136 bits at d = 128),
    the 2-bit thumbnail and landmarks."""
    rs = sorted({head_dim // 8, head_dim // 4, 16, 32})
    families = ["fathom"] + (["fathom-rotated"] if basis == "rotated" else [])
    return (["dense", "oracle"] + [f"{f}@{b}" for f in families for b in FATHOM_BUDGETS]
            + [f"{m}@{decoding.fixed_channel_budget(r)}" for m in decoding.FIXED_CHANNELS for r in rs]
            + ["thumbnail", "landmark"])


def windows(text: str, tokenizer, count: int, tokens: int) -> list[np.ndarray]:
    """``count`` windows of ``tokens`` token ids, starting at the line starts nearest to evenly spaced offsets."""
    out = []
    for i in range(count):
        start = text.find("\n", i * len(text) // count) + 1
        chars = tokens * 8  # source code runs at ~3-4 characters per token
        ids = tokenizer(text[start:start + chars], add_special_tokens=False).input_ids[:tokens]
        if len(ids) < tokens:
            raise UsageError(f"window {i} of the corpus holds only {len(ids)} tokens, fewer than {tokens}")
        out.append(np.array(ids))
    return out


@dataclass
class TeacherAttention:
    """The registered attention function of the batched path: in each full-attention layer, every one of the
    forward's T query positions attends sparsely with ``method`` over its own context (keys up to itself);
    other layers (sliding-window) run sdpa."""

    method: object  # fathom.methods.Method
    selection: object  # fathom.selection.Selection
    calibration: object | None  # fathom.calibration.Calibration
    layers: list[int]
    bits: list[float] | None = None  # scan bits per token read, per (layer, KV head): the step's mean

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        import torch
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if module.layer_idx not in self.layers:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        scale = kwargs.get("scaling") or module.scaling
        slot = self.layers.index(module.layer_idx)
        _, Hq, T, d = query.shape
        H = key.shape[1]
        G = Hq // H
        out = np.empty((T, Hq, value.shape[-1]), np.float32)
        for h in range(H):
            q = query[0, h * G:(h + 1) * G].transpose(0, 1).float().cpu().numpy()  # [T, G, d]
            out[:, h * G:(h + 1) * G] = self.head(slot, h, q, key[0, h].float().cpu().numpy(),
                                                 value[0, h].float().cpu().numpy(), scale)
        return torch.from_numpy(out).to(query.device, query.dtype)[None], None  # [1, T, Hq, dv], as sdpa's

    def head(self, slot: int, h: int, q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float):
        """Outputs ``[T, G, dv]`` of the last ``T`` positions of one KV head, each over its own context."""
        from fathom.attention import attend, logits
        from fathom.decode import HeadIndex, method_scores, step_bits
        from fathom.quantize import BLOCK
        from fathom.selection import select_many

        N, T = keys.shape[0], q.shape[0]
        contexts = np.arange(N - T, N) + 1
        blocks = contexts // BLOCK
        if self.calibration is None:
            stats, basis = None, None
        else:
            stats = {b: self.calibration.head_stats(slot, h, b) for b in ("raw", "rotated")}
            basis = self.calibration.basis[slot, h] if self.method.basis == "rotated" else None
        index = HeadIndex.build(np.ascontiguousarray(keys), stats, basis)
        scores, depths = method_scores(self.method, q, index, blocks)
        if scores is None:
            mask = np.arange(N)[None, None, :] < contexts[:, None, None]
        else:
            mask = select_many(scores, contexts, blocks * BLOCK, self.selection, N)
        if self.bits is not None:
            self.bits.append(float(np.mean(step_bits(self.method, depths, keys.shape[1]))))
        return attend(logits(q, keys, scale), values, np.broadcast_to(mask, (T,) + mask.shape[1:]))


def dense_continuation(model, ids: np.ndarray, steps: int):
    """The dense prefill of ``ids[:-1]`` (a DynamicCache) and the dense greedy continuation of ``ids``."""
    import torch
    from transformers import DynamicCache

    prompt = torch.as_tensor(ids, device=model.device)[None]
    prefix = DynamicCache()
    with torch.inference_mode():
        model(prompt[:, :-1], past_key_values=prefix, use_cache=True, logits_to_keep=1)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=copy.deepcopy(prefix),
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return prefix, out[0, len(ids):].cpu().numpy()


def batched_logits(model, prefix, last: int, teacher: np.ndarray, attention: TeacherAttention) -> np.ndarray:
    """Next-token logits ``[T, vocab]`` of one method at every teacher-forced step, in one forward (the
    batched path)."""
    import torch

    from fathom.integrations.attention import attention_implementation

    inputs = torch.as_tensor(np.concatenate([[last], teacher[:-1]]))[None]
    with attention_implementation(model, ATTENTION, attention), torch.inference_mode():
        logits = model(inputs, past_key_values=copy.deepcopy(prefix), use_cache=True).logits[0]
    return logits.float().numpy()


def step_logits(model, ids: np.ndarray, teacher: np.ndarray, spec: MethodSpec, k: int,
                calibration: Path | None, **settings) -> np.ndarray:
    """Next-token logits ``[T, vocab]`` of one method at every teacher-forced step through a FathomCache,
    one token per forward after its own prefill of ``ids[:-1]`` (the step path; ``settings``: FathomCache's, e.g.
    ``backend``)."""
    import torch

    cache = spec.cache(model, k=k, calibration=calibration, **settings)
    inputs = torch.as_tensor(np.concatenate([ids[-1:], teacher[:-1]]), device=model.device)
    logits = []
    with torch.inference_mode():
        model(torch.as_tensor(ids[:-1], device=model.device)[None], past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        for token in inputs:
            logits.append(model(token.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1])
    cache.close()
    return torch.stack(logits).float().cpu().numpy()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"one of {', '.join(models.MODELS)} (default %(default)s)")
    parser.add_argument("--context", type=int, default=2048,
                        help="window length in tokens before the steps (default %(default)s)")
    parser.add_argument("--steps", type=int, default=64,
                        help="teacher-forced greedy steps per window, T (default %(default)s)")
    parser.add_argument("--windows", type=int, default=4,
                        help=f"windows at evenly spaced offsets of the {CORPUS} corpus (default %(default)s)")
    parser.add_argument("-k", type=int, default=None, help="top-k per query head (default by context, design §6)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"{decoding.spec_help(exclude=decoding.PER_LAYER)}. Default: the full grid: dense, "
                             f"oracle, fathom at {', '.join(map(str, FATHOM_BUDGETS))} bits (and fathom-rotated "
                             "when the calibration chose the rotated store), sparq, double-sparsity and loki at "
                             "r = d/8, d/4, 16 and 32 channels, thumbnail, landmark")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a .calibration.npz (default: the model's committed one, calibrated on Jane Austen)")
    parser.add_argument("--path", choices=("batched", "step"), default="batched",
                        help="batched: one shared prefill, one forward per method (default); step: FathomCache "
                             "token by token")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model runs (default cpu); cuda with --path step: FathomCache's offloaded "
                             "backend, the GPU kernels (the batched path is the NumPy reference, on the host)")
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"model / corpus cache folder (default ${artifacts.CACHE_ENV} or ~/.cache/fathom)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--name", default=None,
                        help="file name stem (default agreement-<model>-<context>-T<steps>-w<windows>[-k<k>])")


def check_args(args) -> tuple[list[MethodSpec], Path | None, str]:
    """Everything checked before a model is loaded (ValueError names the argument)."""
    info = models.model_argument(args.model)
    args.out = cli.writable_folder("--out", args.out)
    cli.file_stem("--name", args.name)
    if not 128 <= args.context <= info.context - 1:
        raise UsageError(f"--context must lie in 128..{info.context - 1} ({args.model}), got {args.context}")
    if not 1 <= args.steps <= info.context - args.context:
        raise UsageError(f"--steps must lie in 1..{info.context - args.context} (context + steps <= "
                         f"{info.context}), got {args.steps}")
    cli.at_least("--windows", args.windows, 1)
    if args.device == "cuda" and args.path != "step":
        raise UsageError("--device cuda needs --path step (the batched path runs the NumPy reference on the host)")
    if args.k is not None:
        cli.at_least("-k", args.k, 1)
    from fathom.selection import Selection

    selection = Selection(k=args.k) if args.k is not None else Selection.for_context(args.context + args.steps)
    decoding.check_top_k(selection, args.context, 1, given=args.k is not None)  # the first step's context
    calibration = args.calibration or decoding.default_calibration(args.model)
    basis = "raw"
    if calibration is not None:
        decoding.check_calibration(calibration, args.model)
        basis = str(np.load(calibration)["preferred_basis"]) or "raw"
    specs = decoding.parse_specs(args.methods or method_grid(info.head_dim, basis), info.head_dim)
    planned = [s.method for s in specs if methods.entry(s.method).per_layer]
    if planned:
        raise UsageError(f"--methods: {planned[0]} needs per-layer budgets the agreement bench does not plan")
    decoding.require_calibration(specs, calibration, args.model)
    return specs, calibration, basis


def measure(model, ids_windows: list[np.ndarray], steps: int, specs: list[MethodSpec], k: int,
            calibration: Path | None, path: str = "batched", bar=None) -> dict[str, dict]:
    """Per method: the agreeing steps of every window and the mean scan bits read (batched path)."""
    from fathom.calibration import Calibration
    from fathom.selection import Selection

    d = decoding.head_dim(model)
    layers = global_layers(model.config)
    loaded = None if calibration is None else Calibration.load(calibration)
    results = {s.label: {"agree": [], "bits_read": []} for s in specs}
    for ids in ids_windows:
        prefix, teacher = dense_continuation(model, ids, steps)
        for spec in specs:
            bits: list[float] = []
            if path == "batched":
                attention = TeacherAttention(spec.method_at(d), Selection(k=k), loaded, layers, bits)
                logits = batched_logits(model, prefix, ids[-1], teacher, attention)
            else:
                logits = step_logits(model, ids, teacher, spec, k, calibration)
            results[spec.label]["agree"].append((logits.argmax(-1) == teacher).tolist())
            results[spec.label]["bits_read"].append(float(np.mean(bits)) if bits else None)
            if bar is not None:
                bar.update()
    return results


def bits_to_reach(curve: list[tuple[float, float]], target: float) -> tuple[float | None, str]:
    """Bits at which an agreement curve ``[(bits, agreement)]`` first reaches ``target``, interpolated
    linearly in agreement against log2(bits) between the budgets around the crossing.

    >>> bits_to_reach([(32, 0.8), (64, 0.9), (128, 0.95)], 0.85)
    (45.25483399593904, 'interpolated')
    """
    pts = sorted(curve)
    if pts[0][1] >= target:
        return pts[0][0], "at most"
    for (b0, a0), (b1, a1) in zip(pts, pts[1:]):
        if a1 >= target:
            f = (target - a0) / (a1 - a0)
            return float(2 ** (np.log2(b0) + f * (np.log2(b1) - np.log2(b0)))), "interpolated"
    return None, "not reached"


def summarize(rows: list[dict], family: str) -> dict:
    """The best 136-bit scan's agreement and the bits at which the ``family`` curve reaches it."""
    by_label = {r["label"]: r for r in rows}
    scans = [by_label[label] for label in SCAN_136 if label in by_label]
    curve = [(r["bits"], r["agreement"]) for r in rows if r["method"] == family]
    if not scans or not curve:
        return {"fathom_family": family, "best_136": None}
    best = max(scans, key=lambda r: r["agreement"])
    bits, how = bits_to_reach(curve, best["agreement"])
    return {"fathom_family": family, "best_136": best["label"], "best_136_agreement": best["agreement"],
            "best_136_interval": [best["lo"], best["hi"]], "fathom_bits_to_reach": bits, "how": how,
            "interpolation": "linear in agreement against log2(bits) between the budgets around the crossing"}


def run(args: argparse.Namespace) -> Path:
    specs, calibration, basis = check_args(args)
    from fathom.selection import Selection

    start = time.perf_counter()
    k = args.k if args.k is not None else Selection.for_context(args.context + args.steps).k
    if args.device == "cuda":
        cli.require_cuda("agreement --device cuda")
    model, tokenizer = models.load(args.model, args.cache)
    model.to(args.device)
    ids_windows = windows(corpora.load(CORPUS, args.cache), tokenizer, args.windows, args.context)
    with tqdm(total=args.windows * len(specs), desc=f"agreement {args.model} ({args.path})", unit="run") as bar:
        results = measure(model, ids_windows, args.steps, specs, k, calibration, args.path, bar)
    d = models.info(args.model).head_dim
    rows = []
    for spec in specs:
        agree = np.array(results[spec.label]["agree"], bool)
        n, mean = agree.size, float(agree.mean())
        lo, hi = wilson(mean, n)
        bits_read = [b for b in results[spec.label]["bits_read"] if b is not None]
        bits = spec.method_at(d).nominal_bits(d)  # design §4: the budget, r·4.25, 2.25·d, d·16/8, 16·d
        rows.append({"label": spec.label, "method": spec.method, "bits": bits, "bits_per_channel": bits / d,
                     "bits_read": float(np.mean(bits_read)) if bits_read else None,
                     "agreement": mean, "n": n, "lo": lo, "hi": hi,
                     "per_window": agree.mean(axis=1).tolist()})
    family = "fathom-rotated" if basis == "rotated" else "fathom"
    summary = {f: summarize(rows, f) for f in dict.fromkeys([family, "fathom"])}
    name = args.name or (f"agreement-{args.model}-{args.context}-T{args.steps}-w{args.windows}"
                         + ("" if args.k is None else f"-k{args.k}"))
    title = (f"{args.model} (d = {d}) on {CORPUS} source: {args.windows} windows × {args.steps} teacher-forced "
             f"steps after {args.context} tokens, top-k = {k}, calibration "
             f"{'none' if calibration is None else calibration.name} (store basis {basis})")
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_json(args.out / f"{name}.json", args.command_line, {
        "model": args.model, "head_dim": d, "corpus": CORPUS, "context": args.context, "steps": args.steps,
        "windows": args.windows, "k": k, "path": args.path, "device": args.device, "basis": basis,
        "calibration": None if calibration is None else str(calibration), "interval": "95% Wilson score interval",
        "summary": summary, "wall_s": round(time.perf_counter() - start, 1), "rows": rows})
    _write_table(args.out / f"{name}.md", rows, summary, title, args.command_line)
    _plot(args.out / f"{name}.png", rows, summary[family], title)
    print((args.out / f"{name}.md").read_text())
    return path


def _reach_line(s: dict) -> str:
    if s.get("best_136") is None:
        return f"{s['fathom_family']}: no 136-bit scan or no curve in this run."
    bits = s["fathom_bits_to_reach"]
    reach = {"interpolated": f"reaches it at {bits:.1f} bits (interpolated)",
             "at most": f"reaches it already at its lowest budget, {bits:g} bits",
             "not reached": "does not reach it within its budgets"}[s["how"]]
    return (f"{s['fathom_family']} {reach}; the best 136-bit scan is {s['best_136']} at "
            f"{s['best_136_agreement']:.4f} [{s['best_136_interval'][0]:.4f}, {s['best_136_interval'][1]:.4f}] "
            "(paper: fathom reaches it at 92 bits).")


def _write_table(path: Path, rows: list[dict], summary: dict, title: str, command: str) -> None:
    columns = [("label", "method@bits", "s"), ("bits_per_channel", "bits/channel", ".2f"),
               ("bits_read", "bits read", ".1f"), ("agreement", "agreement", ".4f"), ("lo", "95% lo", ".4f"),
               ("hi", "95% hi", ".4f"), ("n", "steps", "d")]
    lines = [f"Greedy next-token agreement with dense — {title}. Made by `{command}`.", "",
             *[_reach_line(s) for s in summary.values()], "", markdown_table(rows, columns), ""]
    path.write_text("\n".join(lines))


def _plot(path: Path, rows: list[dict], summary: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    families: dict[str, list[dict]] = {}
    for r in rows:
        families.setdefault(r["method"], []).append(r)
    for family, rs in families.items():
        if family in ("dense", "oracle"):
            ax.axhline(rs[0]["agreement"], ls=":", lw=1, color="k" if family == "oracle" else None,
                       label=f"{family} ({rs[0]['agreement']:.3f})")
            continue
        rs = sorted(rs, key=lambda r: r["bits"])
        ax.errorbar([r["bits"] for r in rs], [r["agreement"] for r in rs],
                    yerr=[[r["agreement"] - r["lo"] for r in rs], [r["hi"] - r["agreement"] for r in rs]],
                    fmt="-o" if family.startswith("fathom") else "s", ms=4, capsize=2, label=family)
    if summary.get("fathom_bits_to_reach"):
        ax.axvline(summary["fathom_bits_to_reach"], color="grey", lw=0.8, ls="--",
                   label=f"{summary['fathom_family']} reaches {summary['best_136']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("scan bits per token")
    ax.set_ylabel("greedy next token = dense (95% Wilson)")
    ax.set_title(textwrap.fill(title, 120), fontsize=7)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
