"""``python -m bench fidelity``: attention error against scan bits for every method (design §6, §7).

Real models (default): the evaluation capture is a window of ``--text`` /
``--corpus`` (Paul Graham essays by default), the calibration capture a window
of another corpus (Jane Austen by default) of the same length; the basis rule
(raw vs rotated store) is decided on the calibration capture and recorded.
``--synthetic``: the same on synthetic keys (every output says "synthetic").
``--device cuda``: the prefills with the model on the GPU (fp32) and the
evaluation in torch on the GPU (:mod:`fathom.cuda.fidelity`); ``--device cpu``
(default): CPU prefills and the NumPy evaluation (:mod:`fathom.fidelity`).
``--levels``: every plane method's planes read through the reconstruction
tables calibrated on the calibration text instead of the cells' midpoints.
``--predict``: the plan rule's pick and the baselines also scored through
:mod:`fathom.prediction` (``[lmmse]`` curves, beside the others).

Writes ``<name>.json`` (one record per method × budget, and a ``summary``),
``<name>.md`` and ``<name>.png`` under ``--out`` (``bench/results``; with
``--quick``, ``bench/results/local``, which git ignores). Every argument is
checked before any model is loaded (:func:`check_arguments`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
import time
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import cli
from bench.decoding import check_top_k
from bench.report import LOCAL_RESULTS, RESULTS, context_label, markdown_table, write_json
from fathom import methods as M
from fathom.bits import fixed_channel_bits
from fathom.calibration import Calibration, calibrate
from fathom.capture import Capture
from fathom.fidelity import Evaluator, MethodResult, evaluate, plan_layers
from fathom.selection import Selection
from fathom.synthetic import SyntheticConfig, generate

FATHOM_BUDGETS = (32, 48, 64, 68, 92, 136)  # 68: matched to SparQ r = d/8 at d = 128
PLAN_MEANS = (48, 64)
BASIS_RULE_BUDGETS = (48, 64)  # the raw-vs-rotated decision compares these budgets on calibration text
QUICK_MODEL, QUICK_CONTEXT, QUICK_POSITIONS = "smollm2-135m", 4096, 32
CALIBRATION_CORPUS = "austen"  # the calibration text when --calibration-corpus is not given
EVALUATION_CORPUS = "paul-graham"
CALIBRATION_SOURCES = ("text", "prompt")  # --calibrate-on: another text, or the evaluation text's prompt
DEVICES = ("cpu", "cuda")
SYNTHETIC_QUICK = SyntheticConfig(layers=4, kv_heads=2, group_size=4, head_dim=128, tokens=4096, positions=16)
SYNTHETIC_FULL = SyntheticConfig(layers=8, kv_heads=4, group_size=4, head_dim=128, tokens=16384, positions=32)
COLUMNS = [("label", "method@bits", "s"), ("bits_read", "bits read", ".1f"),
           ("scan_bytes", "scan KiB/step", ",.0f"), ("row_bytes", "row KiB/step", ",.0f"),
           ("rows_per_head", "rows/KV head", ".0f"), ("rel_error", "rel. error", ".4f"),
           ("oracle_overlap", "oracle top-k hit", ".3f"), ("channels_touched", "channels", ".1f"),
           ("mean_depth", "depth", ".2f")]


# The fathom curves every run reports: the raw, rotated and per-head stores, each with design §5's plane gains and
# with the calibrated gain table, each planned per query group (design §5) and pooled over a layer's KV heads (runs
# made before the per-head rule hold only the first four curves, before the pooled plan the first six), named as
# the methods name themselves (fathom, fathom[gains], fathom[pooled], fathom-rotated, ...).
FATHOM_STORES = (M.fathom, M.fathom_rotated, M.fathom_mixed)
POOLING = (False, True)
FATHOM_FAMILIES = tuple(make(0, gains=gains, pooled=pooled).name for pooled in POOLING for make in FATHOM_STORES
                        for gains in M.GAIN_SOURCES)
# The per-layer plan of the per-head store with the plan rule's gains (design §5's optional tuning step), at every
# flat budget the plan's candidates span: a curve reported beside the others, never the headline (runs made before
# it hold none).
PLAN_FAMILIES = tuple(M.fathom_plan((48.0,), 48.0, M.PER_HEAD, gains=gains).name for gains in M.GAIN_SOURCES)


def method_grid(d: int, basis: str) -> list[M.Method]:
    """Every method at matched bits: fathom flat budgets (reaching DS r = d/4's bits) on the raw, rotated and
    per-head stores, each with its basis' default σ², with design §5's or the calibrated plane gains, planned per
    query group or pooled over a layer's KV heads (:data:`FATHOM_FAMILIES`); the other σ² source on the preferred
    store; every baseline at the design's channel fractions, and SparQ r = 16 / Double Sparsity r = 32 (68 / 136
    bits at any d). (Per-layer plans are added by :func:`run`.)"""
    flat = [make(b, gains=g, pooled=p) for p in POOLING for make in FATHOM_STORES for g in M.GAIN_SOURCES
            for b in flat_budgets(d)]
    other = "calibration" if M.DEFAULT_VARIANCE[basis] == "store" else "store"
    other_variance = [(M.fathom if basis == "raw" else M.fathom_rotated)(b, other) for b in (48, 64)]
    grid = flat + other_variance + M.baselines(d) + [M.sparq(16), M.double_sparsity(32)]
    return list({m.label(d): m for m in grid}.values())  # one method per label, in first-seen order


def predicting_grid(grid: list[M.Method], family: str, d: int) -> list[M.Method]:
    """``--predict``'s methods: every flat budget of the ``family`` curve in ``grid`` and the comparators the
    summary reads (Double Sparsity at r = d/4 and at 136 bits, SparQ-68), each scoring through
    :mod:`fathom.prediction`."""
    comparators = {f"double-sparsity@{fixed_channel_bits(d // 4):g}", "double-sparsity@136", "sparq@68"}
    return [M.predicting(m) for m in grid if m.name == family or m.label(d) in comparators]


def flat_budgets(d: int) -> list[float]:
    """The budgets of every flat fathom curve at head dim ``d``: :data:`FATHOM_BUDGETS` and DS at r = d/4's bits."""
    return sorted(set(FATHOM_BUDGETS) | {fixed_channel_bits(d // 4)})


def plan_curve_budgets(d: int) -> list[float]:
    """The mean budgets of the per-head store's per-layer plan curve (:data:`PLAN_FAMILIES`): the flat curves'
    budgets that the plan's candidates span."""
    return [float(b) for b in flat_budgets(d) if M.PLAN_BUDGETS[0] <= b <= M.PLAN_BUDGETS[-1]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.corpora import AUSTEN_NOVELS, CORPORA
    from bench.artifacts import CACHE_ENV
    from bench.models import MODELS

    corpora = f"{', '.join(CORPORA)} or austen:NOVEL, one of {', '.join(AUSTEN_NOVELS)}"
    parser.add_argument("--model", default=None, help=f"real model: one of {', '.join(MODELS)} (default "
                                                      f"{QUICK_MODEL}; fetched on first use, see bench fetch)")
    parser.add_argument("--context", type=int, default=None,
                        help=f"window length n in tokens (default the model's context; {QUICK_CONTEXT} with --quick)")
    parser.add_argument("--text", type=Path, default=None, help="evaluation text: any UTF-8 file")
    parser.add_argument("--corpus", default=None, help=f"evaluation corpus when no --text is given: {corpora} "
                                                       f"(default {EVALUATION_CORPUS})")
    parser.add_argument("--calibration-corpus", default=None,
                        help="calibration corpus, not the evaluation one: the same choices as --corpus "
                             f"(default {CALIBRATION_CORPUS})")
    parser.add_argument("--calibrate-on", default="text",
                        help="text (default): calibrate on --calibration-corpus; prompt: on the evaluation text's "
                             "own first n - P tokens and the queries of their last P positions, the positions just "
                             "before the evaluated ones (what a cache can measure at prefill; every method's "
                             "calibration, DS's channels too; the result's name ends in -prompt)")
    parser.add_argument("--positions", type=int, default=None, help="decode positions P (default 128; 64 at >= 64k)")
    parser.add_argument("--synthetic", action="store_true", help="synthetic keys instead of a real model")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_MODEL} at {QUICK_CONTEXT} tokens, {QUICK_POSITIONS} positions (README: about 2.5 "
                             "minutes on 2 CPU cores with the captures cached, about another minute on the first run; "
                             "~20 s with --synthetic)")
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"model / corpus / capture cache folder (default ${CACHE_ENV} or ~/.cache/fathom)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default bench/results; bench/results/local, which git ignores, "
                             "with --quick)")
    parser.add_argument("--name", default=None, help="file name stem (default from the setting)")
    parser.add_argument("-k", type=int, default=None, help="top-k per query head (default by context, design §6)")
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="remake a fidelity JSON's summary, table and plot from its records with this code's "
                             "summary (no model, no GPU); every other argument is ignored")
    parser.add_argument("--levels", action="store_true",
                        help="read every method's planes through the reconstruction tables calibrated on the "
                             "calibration text (each cell read as the mean of the calibration keys in it) instead of "
                             "the cells' midpoints (design §2); the basis and plan rules and the per-layer plans "
                             "too; the result's name ends in -levels")
    parser.add_argument("--predict", action="store_true",
                        help="also score the plan rule's pick at every flat budget, Double Sparsity (r = d/4 and r = "
                             "32) and SparQ r = 16 through fathom.prediction: the planes read predict the unread "
                             "channels from the store's own key covariance (the same planes and bits; curves tagged "
                             "[lmmse], reported beside the others, never the headline)")
    parser.add_argument("--device", default="cpu", help="cpu (default): CPU prefills and the NumPy evaluation; "
                        "cuda: prefills with the model on the GPU (fp32) and the evaluation in torch on the GPU")


REPLOT_FIELDS = ("command", "synthetic", "capture", "selection", "summary", "records")


def replot_payload(path: Path) -> dict:
    """A fidelity JSON to ``--replot``, refused in one line without the fields the summary is remade from."""
    required = tuple(f.name for f in dataclasses.fields(MethodResult)  # the per-head figures the table reads too:
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING) + (
        "rel_error_per_head", "oracle_overlap")  # a run made before them is refused, not half-replotted
    payload = cli.result_json(path, "a fidelity result", REPLOT_FIELDS, required)
    for field, keys in (("summary", ("basis", "basis_rule_errors")), ("capture", ("head_dim",))):
        missing = [key for key in keys if not isinstance(payload[field], dict) or key not in payload[field]]
        if missing:
            raise cli.UsageError(f"--replot {path}: not a fidelity result (its {field} lacks {', '.join(missing)})")
    return payload


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad input before any expensive work (:class:`bench.cli.UsageError`, naming the argument and
    what it allows) and fill in the defaults: ``model``, ``context``, ``positions``, ``k``, ``corpus``, ``out``."""
    if args.device not in DEVICES:
        raise cli.UsageError(f"--device must be one of {', '.join(DEVICES)}, got {args.device!r}")
    if args.device == "cuda":
        cli.require_cuda("fidelity --device cuda")
    args.out = cli.writable_folder("--out", args.out or (LOCAL_RESULTS if args.quick else RESULTS))
    cli.file_stem("--name", args.name)
    if args.k is not None:
        cli.at_least("-k", args.k, 1)
    if args.calibrate_on not in CALIBRATION_SOURCES:
        raise cli.UsageError(f"--calibrate-on must be one of {', '.join(CALIBRATION_SOURCES)}, got "
                             f"{args.calibrate_on!r}")
    if args.synthetic:
        if args.calibrate_on == "prompt":
            raise cli.UsageError("--calibrate-on prompt does not apply to --synthetic (its calibration text is "
                                 "another synthetic text)")
        given = [flag for flag, value in (("--model", args.model), ("--context", args.context),
                                          ("--positions", args.positions), ("--text", args.text),
                                          ("--corpus", args.corpus), ("--calibration-corpus", args.calibration_corpus))
                 if value is not None]
        if given:
            raise cli.UsageError(f"{given[0]} does not apply to --synthetic (its shape is fixed; see --quick)")
        cfg = SYNTHETIC_QUICK if args.quick else SYNTHETIC_FULL
        n, positions = cfg.tokens, cfg.positions
    else:
        n, positions = _check_real(args)
    sel = Selection(k=args.k) if args.k is not None else Selection.for_context(n)
    check_top_k(sel, n, positions, given=args.k is not None)
    args.k = sel.k


def _check_real(args: argparse.Namespace) -> tuple[int, int]:
    """The real-model arguments' checks (see :func:`check_arguments`) -> (context, positions)."""
    from bench.capture import decode_positions
    from bench.corpora import check_argument
    from bench.models import model_argument

    args.model = args.model or QUICK_MODEL
    longest = model_argument(args.model).context
    if args.context is None:
        args.context = QUICK_CONTEXT if args.quick else longest
    if not 1 <= args.context <= longest:
        raise cli.UsageError(f"--context must lie in 1..{longest} tokens ({args.model}'s context), "
                             f"got {args.context}")
    if args.positions is not None and not 1 <= args.positions < args.context:
        raise cli.UsageError(f"--positions must lie in 1..{args.context - 1} (below --context), "
                             f"got {args.positions}")
    if args.positions is None:  # a default too long for a short --context is reported as a too-short context
        args.positions = QUICK_POSITIONS if args.quick else decode_positions(args.context)
    if args.calibrate_on == "prompt":
        if args.calibration_corpus is not None:
            raise cli.UsageError("give --calibration-corpus or --calibrate-on prompt, not both (both name the "
                                 "calibration text)")
        if 2 * args.positions > args.context:  # the prompt's own P queries lie before the evaluated P
            raise cli.UsageError(f"--positions must lie in 1..{args.context // 2} with --calibrate-on prompt (its "
                                 f"queries are the {args.positions} before the evaluated ones), got {args.positions}")
    else:
        args.calibration_corpus = args.calibration_corpus or CALIBRATION_CORPUS
    for flag, name in (("--corpus", args.corpus), ("--calibration-corpus", args.calibration_corpus)):
        if name is not None:
            check_argument(flag, name)
    if args.text is not None:
        if args.corpus is not None:
            raise cli.UsageError("give --text or --corpus, not both (both name the evaluation text)")
        # a token covers at least one byte of UTF-8 (plus a BOS): a shorter file cannot fill the window
        if len(cli.utf8_text("--text", args.text).encode()) + 1 < args.context:
            raise cli.UsageError(f"--text {args.text} is too short for --context {args.context} tokens")
    args.corpus = args.corpus or (None if args.text is not None else EVALUATION_CORPUS)
    if args.corpus == args.calibration_corpus:
        raise cli.UsageError("--corpus and --calibration-corpus must differ: calibrate on one text, "
                             "evaluate on another")
    return args.context, args.positions


def _synthetic(args) -> tuple[Capture, Capture, str, dict]:
    cfg = SYNTHETIC_QUICK if args.quick else SYNTHETIC_FULL
    calibration_text = SyntheticConfig(**{**cfg.__dict__, "text_seed": cfg.text_seed + 1})
    name = "fidelity-synthetic-quick" if args.quick else "fidelity-synthetic"
    info = {"synthetic": True, "data": "synthetic keys (fathom.synthetic), calibration on another synthetic text",
            "config": cfg.__dict__}
    return generate(cfg), generate(calibration_text), name, info


def _real(args) -> tuple[Capture, Capture, str, dict]:
    """The evaluation and calibration captures of the setting :func:`check_arguments` filled in."""
    from bench.capture import load_capture
    from bench.models import load

    model, n = args.model, args.context
    loaded = []

    def model_once():
        if not loaded:
            loaded.append(load(model, args.cache))
        return loaded[0]

    evaluation_text = args.text if args.text is not None else args.corpus
    text_name = evaluation_text.name if isinstance(evaluation_text, Path) else evaluation_text
    prompt = args.calibrate_on == "prompt"
    # the prompt: the evaluation window's first n - P tokens (a window is a text's first tokens), its last P queries
    calibration = (evaluation_text, n - args.positions) if prompt else (args.calibration_corpus, n)
    captures, seconds = [], {}
    for role, (text, tokens) in (("evaluation", (evaluation_text, n)), ("calibration", calibration)):
        print(f"capture {model} at {tokens} tokens of {text} ({role}) ...", flush=True)
        cap, secs = load_capture(model, text, tokens, args.cache, positions=args.positions, loaded=model_once,
                                 device=args.device)
        captures.append(cap)
        seconds[f"prefill_{role}_s"] = round(secs, 1)
    name = f"fidelity-{model}-{context_label(n)}-{text_name}" + ("-quick" if args.quick else "") + \
        ("-prompt" if prompt else "")
    info = {"synthetic": False, "model": model, "evaluation_text": text_name,
            "calibration_text": f"the prompt ({text_name}'s first {n - args.positions} tokens)" if prompt else
            args.calibration_corpus, "calibrated_on": args.calibrate_on, **seconds}
    return captures[0], captures[1], name, info


def evaluator(device: str, levels: bool = False) -> Evaluator:
    """The evaluation for ``--device`` (checked by :func:`check_arguments`): the NumPy reference on the CPU, its
    torch twin on a CUDA device; ``levels``: every plane read through the calibration's reconstruction tables."""
    if device == "cpu":
        return partial(evaluate, levels=levels)
    from fathom.cuda.fidelity import evaluate as on_device

    return partial(on_device, levels=levels, device=device)


def choose_basis(calibration_capture: Capture, calibration: Calibration, sel: Selection,
                 on_head=None, evaluate_fn: Evaluator = evaluate) -> tuple[str, dict, np.ndarray]:
    """The basis rule (design §7): both stores on calibration text, each with its own default σ²; the lower mean
    error wins, for the model and per (layer, KV head) -> (model's basis, its errors, ``[L, H]`` head bases)."""
    methods = [M.fathom(b) for b in BASIS_RULE_BUDGETS] + [M.fathom_rotated(b) for b in BASIS_RULE_BUDGETS]
    results = evaluate_fn(calibration_capture, calibration, methods, sel, on_head)
    half = len(BASIS_RULE_BUDGETS)
    errors = {"raw": float(np.mean([r.rel_error for r in results[:half]])),
              "rotated": float(np.mean([r.rel_error for r in results[half:]]))}
    per_head = {b: np.mean([r.rel_error_per_head for r in rs], axis=0)
                for b, rs in (("raw", results[:half]), ("rotated", results[half:]))}
    head_basis = np.where(per_head["rotated"] < per_head["raw"], "rotated", "raw")
    return min(errors, key=errors.get), errors, head_basis


def choose_plan(calibration_capture: Capture, calibration: Calibration, sel: Selection,
                on_head=None, evaluate_fn: Evaluator = evaluate) -> tuple[str, dict]:
    """The plan rule, decided as the basis rule decides: the per-head store's four plans — design §5's or the
    calibrated plane gains, each planned per query group or pooled over a layer's KV heads — on calibration text
    at the rule's budgets; the lowest mean error wins -> (its method name, every plan's error). Recorded with
    every run (``summary.plan_rule``, its curve ``summary.families[plan_rule]``) and the run's headline curve: on
    every run that recorded it when it became the headline (4k-32k, four models, prose and code, midpoints and
    levels) its pick was the per-head plan most accurate at 48 bits on the evaluation text (docs/decisions.md)."""
    methods = [M.fathom_mixed(b, g, p) for p in POOLING for g in M.GAIN_SOURCES for b in BASIS_RULE_BUDGETS]
    results = evaluate_fn(calibration_capture, calibration, methods, sel, on_head)
    n = len(BASIS_RULE_BUDGETS)
    errors = {methods[i].name: float(np.mean([r.rel_error for r in results[i:i + n]]))
              for i in range(0, len(methods), n)}
    return min(errors, key=errors.get), errors


def equal_error_bits(curve: list[MethodResult], target: float) -> tuple[float | None, str]:
    """Bits at which a fathom curve reaches ``target`` error, interpolated in log-log between budgets.

    Returns (bits, how): "interpolated"; "at most" (already below target at the
    lowest budget: bits is that budget); "not reached" (None).
    """
    pts = sorted((r.bits_read, r.rel_error) for r in curve)
    if pts[0][1] <= target:
        return pts[0][0], "at most"
    for (b0, e0), (b1, e1) in zip(pts, pts[1:]):
        if e1 <= target < e0:
            f = (np.log(e0) - np.log(target)) / (np.log(e0) - np.log(e1))
            return float(np.exp(np.log(b0) + f * (np.log(b1) - np.log(b0)))), "interpolated"
    return None, "not reached"


def _double_sparsity(by_label: dict[str, MethodResult], d: int) -> tuple[tuple[str, MethodResult], ...]:
    """The two Double Sparsity comparators by summary key suffix: DS-136 ("") and DS at r = d/4 ("_quarter")."""
    return (("", by_label["double-sparsity@136"]),
            ("_quarter", by_label[f"double-sparsity@{fixed_channel_bits(d // 4):g}"]))


def family_summary(results: list[MethodResult], family: str, d: int) -> dict:
    """One fathom curve against the baselines: its error at 48 bits, whether that beats SparQ-68, and its
    equal-error savings vs Double Sparsity at r = d/4 and at 136 bits."""
    by_label = {r.label: r for r in results}
    curve = [r for r in results if r.method == family]
    fathom48 = by_label[f"{family}@48"]
    out = {"fathom48_error": fathom48.rel_error,
           "fathom48_beats_sparq68": fathom48.rel_error < by_label["sparq@68"].rel_error,
           "channels_touched_48": fathom48.channels_touched}
    for key, ds in _double_sparsity(by_label, d):
        bits, how = equal_error_bits(curve, ds.rel_error)
        out.update({f"equal_error_bits{key}": bits, f"equal_error_how{key}": how,
                    f"equal_error_saving{key}": None if bits is None else ds.bits / bits})
    return out


def predicted_summary(results: list[MethodResult], family: str, d: int) -> dict | None:
    """``--predict``'s figures (None in a run without them): the ``family`` curve scored through
    :mod:`fathom.prediction` against the baselines as the paper defines them (:func:`family_summary`) and against
    the same baselines scoring through the same prediction (``_lmmse`` keys)."""
    name = M.predicting_name(family)
    by_label = {r.label: r for r in results}
    if f"{name}@48" not in by_label:
        return None
    out = {"family": name, **family_summary(results, name, d)}
    curve = [r for r in results if r.method == name]
    sparq = by_label[M.predicting_name("sparq") + "@68"]
    out.update({"sparq68_lmmse_error": sparq.rel_error,
                "fathom48_beats_sparq68_lmmse": out["fathom48_error"] < sparq.rel_error})
    for key, ds in _double_sparsity(by_label, d):
        ds = by_label[M.predicting_name(ds.method) + f"@{ds.bits:g}"]
        bits, how = equal_error_bits(curve, ds.rel_error)
        out.update({f"ds{key}_lmmse_error": ds.rel_error, f"equal_error_bits{key}_lmmse": bits,
                    f"equal_error_how{key}_lmmse": how,
                    f"equal_error_saving{key}_lmmse": None if bits is None else ds.bits / bits})
    return out


def store_family(basis: str) -> str:
    """The fathom curve of the store the basis rule chose for the whole model: the headline of runs made before the
    per-head rule."""
    return "fathom" if basis == "raw" else "fathom-rotated"


def summarize(results: list[MethodResult], d: int, basis: str, basis_errors: dict,
              heads_rotated: int | None = None, plan_errors: dict | None = None,
              gains_errors: dict | None = None) -> dict:
    """The headline numbers: equal-error savings vs Double Sparsity at r = d/4 (the design's fraction, the primary
    comparator) and at 136 bits (r = 32; the same at d = 128), fathom-48 vs SparQ-68 (r = 16), channels at 48,
    and where fathom-48 loses: the overlap of each one's top-k with the oracle's, and on how many (layer, KV
    head) pairs fathom-48 is less accurate than DS r = d/4 and SparQ-68; the same savings for every fathom curve
    (``families``: each store, design or calibrated gains).

    The headline curve is decided on calibration text: the plan rule's pick of the per-head store's plans
    (:func:`choose_plan`) where the run recorded it; else the per-head store with design §5's gains
    (``fathom-mixed``, each head on the basis it chose on calibration text; ``heads_rotated`` of them rotated)
    where the results hold it (runs made before the plan rule); else the store the basis rule chose for the whole
    model (``basis``; runs made before the per-head rule).
    ``plan_errors``: the plan rule's errors on calibration text (:func:`choose_plan`), recorded with its pick;
    ``gains_errors``: the gains rule's of runs made before the plan rule (design §5's or the calibrated gains on
    the per-head store, planned per query group), kept as they were recorded. A ``--predict`` run also gets
    ``predicted`` (:func:`predicted_summary` of the plan rule's pick), beside the headline."""
    by_label = {r.label: r for r in results}
    present = {r.method for r in results}
    plan_rule = None if plan_errors is None else min(plan_errors, key=plan_errors.get)
    family = plan_rule if plan_rule in present else "fathom-mixed" if "fathom-mixed" in present else \
        store_family(basis)
    fathom48 = by_label[f"{family}@48"]
    sparq68 = by_label["sparq@68"]
    families = {f: family_summary(results, f, d) for f in FATHOM_FAMILIES + PLAN_FAMILIES if f in present}
    predicted = None if plan_rule is None else predicted_summary(results, plan_rule, d)
    summary = {"basis": basis, "variance": M.DEFAULT_VARIANCE[basis], "basis_rule_errors": basis_errors,
               "heads_rotated": heads_rotated, "plan_rule_errors": plan_errors,
               "plan_rule": plan_rule,
               **({} if gains_errors is None else {"gains_rule_errors": gains_errors,
                                                   "gains_rule": min(gains_errors, key=gains_errors.get)}),
               "families": families, "fathom_family": family,
               **({} if predicted is None else {"predicted": predicted}),
               "fathom48_error": fathom48.rel_error, "sparq68_error": sparq68.rel_error,
               "fathom48_beats_sparq68": fathom48.rel_error < sparq68.rel_error,
               "oracle_error": by_label[f"oracle@{16 * d}"].rel_error,
               "channels_touched_48": fathom48.channels_touched, "mean_depth_48": fathom48.mean_depth,
               "fathom48_overlap": fathom48.oracle_overlap, "sparq68_overlap": sparq68.oracle_overlap}
    for key, ds in _double_sparsity(by_label, d):
        summary.update({f"ds{key}_label": ds.label, f"ds{key}_error": ds.rel_error,
                        f"ds{key}_overlap": ds.oracle_overlap,
                        **{f"equal_error_{what}{key}": families[family][f"equal_error_{what}{key}"]
                           for what in ("bits", "how", "saving")}})
    mine = np.array(fathom48.rel_error_per_head)
    for key, other in (("ds_quarter", by_label[summary["ds_quarter_label"]]), ("sparq68", sparq68)):
        summary[f"heads_fathom48_worse_than_{key}"] = int((mine > np.array(other.rel_error_per_head)).sum())
    summary["heads"] = int(mine.size)
    return summary


def replot(args: argparse.Namespace) -> Path:
    """``--replot``: the summary, table and plot of a fidelity JSON remade from its records (the records, the
    command that measured them and its date are kept; ``replotted_by`` records this command)."""
    path = args.replot
    payload = replot_payload(path)
    keep = {f.name for f in dataclasses.fields(MethodResult)}
    results = [MethodResult(**{k: v for k, v in r.items() if k in keep}) for r in payload["records"]]
    shape, sel, old = payload["capture"], Selection(**payload["selection"]), payload["summary"]
    try:
        summary = summarize(results, shape["head_dim"], old["basis"], old["basis_rule_errors"],
                            old.get("heads_rotated"), old.get("plan_rule_errors"), old.get("gains_rule_errors"))
    except KeyError as error:  # the summary compares named methods: a run of fewer cannot be summarised
        raise cli.UsageError(f"--replot {path}: its records lack {error}, which the summary compares") from None
    payload.update(summary=summary, replotted_by=args.command_line)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    info = {k: payload.get(k) for k in ("synthetic", "model", "evaluation_text", "calibration_text", "levels")}
    _write_table(path.with_suffix(".md"), payload["records"], shape, sel, info, summary)
    _plot(path.with_suffix(".png"), results, shape, sel, info)
    print(f"\n{path.with_suffix('.md').read_text()}")
    return path


def run(args: argparse.Namespace) -> Path:
    if args.replot is not None:
        return replot(args)
    start = time.perf_counter()
    check_arguments(args)
    evaluate_fn = evaluator(args.device, args.levels)
    capture, calibration_capture, name, info = (_synthetic if args.synthetic else _real)(args)
    info["levels"] = "calibrated" if args.levels else "midpoint"
    name = args.name or name + ("-levels" if args.levels else "")
    shape = capture.shape
    d, n = shape["head_dim"], shape["tokens"]
    sel = Selection(k=args.k) if args.k is not None else Selection.for_context(n)
    heads = shape["layers"] * shape["kv_heads"]
    calibration = calibrate(calibration_capture)
    seconds = {}
    tick = time.perf_counter()
    with tqdm(total=heads, desc="basis rule (calibration text)", unit="head") as bar:
        basis, basis_errors, head_basis = choose_basis(calibration_capture, calibration, sel, bar.update,
                                                       evaluate_fn)
    calibration = calibration.with_preferred_basis(basis).with_head_basis(head_basis)
    seconds["basis_rule_s"], tick = round(time.perf_counter() - tick, 1), time.perf_counter()
    with tqdm(total=heads, desc="plan rule (calibration text)", unit="head") as bar:
        pick, plan_errors = choose_plan(calibration_capture, calibration, sel, bar.update, evaluate_fn)
    seconds["plan_rule_s"], tick = round(time.perf_counter() - tick, 1), time.perf_counter()
    with tqdm(total=2 * heads, desc="per-layer plans (calibration text)", unit="head") as bar:
        plans = plan_layers(calibration_capture, calibration, list(PLAN_MEANS), sel, basis, on_head=bar.update,
                            evaluator=evaluate_fn)
        plans += plan_layers(calibration_capture, calibration, plan_curve_budgets(d), sel, M.PER_HEAD,
                             on_head=bar.update, evaluator=evaluate_fn, gains=M.read_spec(f"{pick}@48").gains)
    seconds["per_layer_plan_s"], tick = round(time.perf_counter() - tick, 1), time.perf_counter()
    methods = method_grid(d, basis) + plans
    if args.predict:
        methods += predicting_grid(methods, pick, d)
    with tqdm(total=heads, desc=f"fidelity {name}", unit="head") as bar:
        results = evaluate_fn(capture, calibration, methods, sel, on_head=bar.update)
    seconds["evaluation_s"] = round(time.perf_counter() - tick, 1)
    summary = summarize(results, d, basis, basis_errors, int((head_basis == "rotated").sum()), plan_errors)
    plan_budgets = {m.label(d): list(m.policy.budgets) for m in plans}
    meta = {"model": info.get("model", "synthetic"), "context": n}
    records = [r.record(**meta) for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    if not info["synthetic"]:
        calibration.save(args.out / f"{name}.calibration.npz")
    write_json(args.out / f"{name}.json", args.command_line, {
        **info, "device": args.device, **seconds, "capture": shape, "layers": capture.meta.get("layers"),
        "selection": sel.__dict__, "per_layer_plans": plan_budgets, "summary": summary,
        "wall_s": round(time.perf_counter() - start, 1), "records": records})
    _write_table(args.out / f"{name}.md", records, shape, sel, info, summary)
    _plot(args.out / f"{name}.png", results, shape, sel, info)
    print(f"\n{(args.out / f'{name}.md').read_text()}")
    return args.out / f"{name}.json"


def _title(shape: dict, sel: Selection, info: dict) -> str:
    what = "**synthetic** keys" if info["synthetic"] else \
        f"{info['model']} on {info['evaluation_text']} (calibrated on {info['calibration_text']})"
    levels = "; planes read through calibrated levels" if info.get("levels") == "calibrated" else ""
    return (f"{what}: {shape['layers']} layers × {shape['kv_heads']} KV heads × G = {shape['group']}, "
            f"d = {shape['head_dim']}, n = {shape['tokens']}, {shape['positions']} decode positions, k = {sel.k}"
            f"{levels}")


def _write_table(path: Path, records: list[dict], shape: dict, sel: Selection, info: dict, summary: dict) -> None:
    kib = [{**r, "scan_bytes": r["scan_bytes"] / 1024, "row_bytes": r["row_bytes"] / 1024} for r in records]
    def saving(key: str) -> str:
        value = summary[f"equal_error_saving{key}"]
        return f"vs {summary[f'ds{key}_label']}: " + ("not reached within the fathom budgets" if value is None else
                                                      f"{value:.2f}× ({summary[f'equal_error_how{key}']} "
                                                      f"{summary[f'equal_error_bits{key}']:.1f} bits)")

    fathom48, ds, sparq = f"{summary['fathom_family']}@48", summary["ds_quarter_label"], "sparq@68"
    lines = [f"Fidelity of {_title(shape, sel, info)}.", "",
             f"Store basis (decided on calibration text, each store with its default σ²): **{summary['basis']}** "
             f"(mean error at {'/'.join(map(str, BASIS_RULE_BUDGETS))} bits: "
             + ", ".join(f"{k} {v:.4f}" for k, v in summary["basis_rule_errors"].items()) + ")"
             + ("." if summary.get("heads_rotated") is None else
                f" for the whole model; per (layer, KV head) the same rule picks the rotated store on "
                f"{summary['heads_rotated']} of {summary['heads']} heads, and the headline curve "
                f"{summary['fathom_family']} scans each head's pick."),
             f"Equal-error saving {saving('_quarter')}"
             + (f"; {saving('')}." if summary["ds_quarter_label"] != summary["ds_label"] else "."),
             f"{fathom48} {summary['fathom48_error']:.4f} vs {sparq} {summary['sparq68_error']:.4f}; "
             f"at 48 bits {summary['channels_touched_48']:.1f} of {shape['head_dim']} channels are read, "
             f"{summary['mean_depth_48']:.2f} planes deep on average.",
             f"Oracle top-k hit (the fraction of the exact top-{sel.k} a method selects): {fathom48} "
             f"{summary['fathom48_overlap']:.3f}, {ds} {summary['ds_quarter_overlap']:.3f}, {sparq} "
             f"{summary['sparq68_overlap']:.3f}. {fathom48} is less accurate than {ds} on "
             f"{summary['heads_fathom48_worse_than_ds_quarter']} and than {sparq} on "
             f"{summary['heads_fathom48_worse_than_sparq68']} of {summary['heads']} (layer, KV head) pairs.", "",
             *_family_lines(summary, shape, info.get("levels") == "calibrated"), *_predicted_lines(summary),
             markdown_table(kib, COLUMNS), ""]
    key = list(dict.fromkeys([fathom48, ds, "double-sparsity@136", sparq, M.oracle().label(shape['head_dim'])]))
    hit = [fathom48, ds, sparq]
    by_label = {r["label"]: r for r in records}
    error = {k: np.array(by_label[k]["rel_error_per_head"]) for k in key}
    overlap = {k: np.array(by_label[k]["oracle_overlap_per_head"]) for k in hit}
    columns = [(k, k, ".4f") for k in key] + [(f"hit {k}", f"hit {k}", ".3f") for k in hit]
    rows = [{"layer": i, **{k: error[k][i].mean() for k in key}, **{f"hit {k}": overlap[k][i].mean() for k in hit}}
            for i in range(shape["layers"])]
    lines += ["Error and oracle top-k hit per layer:", "",
              markdown_table(rows, [("layer", "layer", "d")] + columns), ""]
    rows = [{"layer": i, "head": h, **{k: error[k][i, h] for k in key}, **{f"hit {k}": overlap[k][i, h] for k in hit}}
            for i in range(shape["layers"]) for h in range(shape["kv_heads"])]
    lines += ["Error and oracle top-k hit per (layer, KV head):", "",
              markdown_table(rows, [("layer", "layer", "d"), ("head", "KV head", "d")] + columns)]
    path.write_text("\n".join(lines) + "\n")


def _family_lines(summary: dict, shape: dict, levels: bool = False) -> list[str]:
    """Every fathom curve's savings side by side (none in results written before the per-head rule)."""
    families = summary.get("families")
    if not families:
        return []

    def saving(f: dict, key: str) -> str:
        value = f[f"equal_error_saving{key}"]
        return "not reached" if value is None else f"{value:.2f}×"

    rows = [{"family": name, "e48": f["fathom48_error"], "sparq": "yes" if f["fathom48_beats_sparq68"] else "no",
             "quarter": saving(f, "_quarter"), "ds136": saving(f, ""), "channels": f["channels_touched_48"]}
            for name, f in families.items()]
    columns = [("family", "fathom curve", "s"), ("e48", "error at 48 bits", ".4f"),
               ("sparq", "beats sparq@68", "s"), ("quarter", f"saving vs {summary['ds_quarter_label']}", "s")] + \
        ([] if summary["ds_quarter_label"] == summary["ds_label"] else
         [("ds136", f"saving vs {summary['ds_label']}", "s")]) + [("channels", "channels at 48", ".1f")]
    rotated = summary.get("heads_rotated")
    per_head = "" if rotated is None else (f"; fathom-mixed: each (layer, KV head) scans the basis it chose on "
                                           f"calibration text, rotated on {rotated} of {summary['heads']}")
    at = f"the per-head store at {'/'.join(map(str, BASIS_RULE_BUDGETS))} bits"
    plans, gains = summary.get("plan_rule_errors"), summary.get("gains_rule_errors")
    if plans:
        pick = families.get(summary["plan_rule"])
        rule = [f"Plans on calibration text ({at}): " + ", ".join(f"{k} {v:.4f}" for k, v in plans.items())
                + f"; the plan rule picks **{summary['plan_rule']}**"
                + ("" if pick is None else f", here {pick['fathom48_error']:.4f} at 48 bits and "
                   f"{saving(pick, '_quarter')} vs {summary['ds_quarter_label']}")
                + f" (the headline curve). FathomCache decodes with it as "
                f"{_cache_call(summary['plan_rule'], levels)}, or as the spec `{summary['plan_rule']}@48`"
                + (" at the midpoints." if levels else "."), ""]
    elif gains:
        rule = [f"Plane gains on calibration text ({at}): " + ", ".join(f"{k} {v:.4f}" for k, v in gains.items())
                + f"; the gains rule picks **{summary['gains_rule']}** (recorded; the headline reads design §5's "
                "gains).", ""]
    else:
        rule = []
    return [f"Every fathom curve (raw and rotated stores; `[gains]`: water-filled with the plane gains measured "
            f"on calibration text instead of design §5's model; `[pooled]`: one water line for every KV head of a "
            f"layer{per_head}):", "",
            markdown_table(rows, columns), "", *rule]


def _predicted_lines(summary: dict) -> list[str]:
    """``--predict``'s paragraph: the plan rule's pick scored through the prediction, against the baselines as the
    paper defines them and as they score through the same prediction (none in a run without it)."""
    p = summary.get("predicted")
    if p is None:
        return []

    def saving(key: str) -> str:
        value = p[f"equal_error_saving{key}"]
        return "not reached" if value is None else f"{value:.2f}×"

    quarter, ds136 = summary["ds_quarter_label"], summary["ds_label"]
    both = quarter != ds136
    return [f"Scored through the prediction (`[lmmse]`: the planes read predict the unread channels from the store's "
            f"own key covariance, fathom.prediction; the same planes and bits, not the headline): {p['family']}@48 "
            f"{p['fathom48_error']:.4f} (sparq@68 {summary['sparq68_error']:.4f}, sparq[lmmse]@68 "
            f"{p['sparq68_lmmse_error']:.4f}); equal-error saving vs {quarter} {saving('_quarter')}"
            + (f", vs {ds136} {saving('')}" if both else "")
            + f"; vs the same baseline through the prediction ({p['ds_quarter_lmmse_error']:.4f}) "
            f"{saving('_quarter_lmmse')}" + (f", vs DS-136 through it {saving('_lmmse')}" if both else "") + ".",
            ""]


def _cache_call(family: str, levels: bool = False) -> str:
    """The FathomCache call that decodes with a fathom curve of this run (``family``: its label's name; ``levels``:
    a run through the calibrated levels), its calibration this run's ``.calibration.npz``."""
    spec = M.read_spec(f"{family}@48")
    settings = [repr(spec.name)] + [f"{key}={value!r}" for key, value in spec.settings().items()] + \
        (["levels='calibrated'"] if levels else [])
    return f"`FathomCache(model, {', '.join(settings)}, calibration=<this run's .calibration.npz>)`"


def _plot(path: Path, results: list[MethodResult], shape: dict, sel: Selection, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    families: dict[str, list[MethodResult]] = {}
    for r in results:
        if r.method != "dense":
            families.setdefault(r.method, []).append(r)
    for family, rs in families.items():
        rs = sorted(rs, key=lambda r: r.bits_read)
        if family == "oracle":
            ax.axhline(rs[0].rel_error, color="k", ls=":", label=f"oracle (exact top-{sel.k})")
            continue
        predicted = family.endswith("lmmse]")
        curve = family in FATHOM_FAMILIES + PLAN_FAMILIES or (predicted and family.startswith("fathom"))
        style = (":o" if predicted else "--o" if "[gains]" in family else "-o") if curve else \
            ("x" if predicted else "s")
        ax.plot([r.bits_read for r in rs], [r.rel_error for r in rs], style, label=family, ms=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("scan bits per token (per KV head, per layer)")
    ax.set_ylabel("attention output rel. error vs dense")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    # the whole figure's title, wrapped: centred over the axes alone, a long title ran off the figure's left edge
    fig.suptitle(textwrap.fill(_title(shape, sel, info).replace("**", ""), 110), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
