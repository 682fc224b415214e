"""``python -m bench ruler``: lm-eval's RULER tasks decoded through FathomCache, every method on the same samples.

Two ways, both real (docs/results.md "RULER through lm-eval"):

* ``lm-eval``: end to end through lm-eval on this machine — lm-eval builds the
  samples, generates through :class:`bench.ruler.harness.FathomLM` (lm-eval's
  ``HFLM`` with a fresh FathomCache per batch) and scores them.
* ``samples`` → ``generate`` → ``score``: lm-eval builds the samples here and
  writes them to a JSON; ``generate`` (no lm-eval import: the GPU machine has
  none) decodes them through FathomCache for every method; ``score`` scores the
  generations here with lm-eval's own functions.

Both write ``ruler-<model>-<contexts>[-lm-eval].{json,md,png}``: per task ×
context × method the mean score, the sample count and a 95% Wilson interval.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from bench import artifacts, cli, decoding, models
from bench.cli import UsageError
from bench.report import RESULTS

METHODS_AT_ANY_D = ("dense", "oracle", "fathom@48", "sparq@68", "double-sparsity@136")
DEFAULT_CONTEXTS = (4096,)
DEFAULT_LIMIT = 2
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def default_methods(head_dim: int) -> list[str]:
    """dense, oracle, fathom-48, sparq-68, DS-136, and Double Sparsity at r = d/4 where d != 128 (issue 8)."""
    quarter = f"double-sparsity@{decoding.fixed_channel_budget(head_dim // 4)}"
    return list(METHODS_AT_ANY_D) + ([quarter] if quarter not in METHODS_AT_ANY_D else [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.ruler.samples import TASKS

    steps = parser.add_subparsers(dest="ruler_command", required=True)

    def common(p, model=True):
        if model:
            p.add_argument("--model", default=DEFAULT_MODEL,
                           help=f"one of {', '.join(models.MODELS)} (default {DEFAULT_MODEL})")
        p.add_argument("--cache", type=Path, default=None,
                       help=f"model cache folder (default ${artifacts.CACHE_ENV} or ~/.cache/fathom)")

    def decoding_args(p):
        p.add_argument("--methods", nargs="+", default=None,
                       help=f"{decoding.spec_help()}. Default: {' '.join(METHODS_AT_ANY_D)}, and "
                            "double-sparsity at r = d/4 where d != 128")
        p.add_argument("-k", type=int, default=None, help="top-k per query head (default by context, design §6)")
        p.add_argument("--calibration", type=Path, default=None,
                       help="a .calibration.npz (default: the model's committed one under bench/results)")

    def selection_args(p):
        p.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS),
                       help="prompt lengths in tokens (lm-eval's max_seq_lengths), e.g. 4096 8192 (default "
                            f"{' '.join(map(str, DEFAULT_CONTEXTS))})")
        p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                       help=f"samples per task and context (default {DEFAULT_LIMIT})")
        p.add_argument("--tasks", nargs="+", default=None, help=f"a subset of the five tasks, {', '.join(TASKS)} "
                                                                "(default all)")

    p = steps.add_parser("lm-eval", help="end to end through lm-eval (HFLM + FathomCache) on this machine")
    common(p), selection_args(p), decoding_args(p)
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    p.add_argument("--name", default=None, help="file name stem (default ruler-<model>-<contexts>-lm-eval)")

    p = steps.add_parser("samples", help="build the samples with lm-eval's task code -> a JSON")
    common(p), selection_args(p)
    p.add_argument("--out", type=Path, default=None, help="samples JSON (default bench/results/ruler-samples-...)")

    p = steps.add_parser("generate", help="generations through FathomCache for every method (no lm-eval)")
    common(p, model=False), decoding_args(p)
    p.add_argument("--samples", type=Path, required=True, help="a JSON written by ruler samples")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs (default cpu)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples per generate call, of one task and context (default 1)")
    p.add_argument("--prefill-rows", type=int, default=None,
                   help="rows of a batch the shared dense prefill runs at once (default the whole batch; fewer "
                        "where a padded batch's attention mask does not fit, e.g. 1 at 32k)")
    p.add_argument("--token-graph", action="store_true",
                   help="decode with the whole token as one CUDA graph (--device cuda, full-attention models): the "
                        "same tokens as generate's own loop, faster")
    p.add_argument("--dense-in-hbm", action="store_true",
                   help="run the dense method on transformers' DynamicCache, the K/V in HBM and sdpa's attention "
                        "(--device cuda), instead of FathomCache's offloaded dense, which reads every K/V row over "
                        "the link each token: the same attention, the dense reference in a fraction of the time")
    p.add_argument("--out", type=Path, default=None, help="generations JSON (default beside the samples)")
    p.add_argument("--resume", action="store_true", help="keep the generations already in --out, do the rest")

    p = steps.add_parser("score", help="score generations with lm-eval's own functions -> table, JSON, PNG")
    p.add_argument("--generations", type=Path, required=True, help="a JSON written by ruler generate")
    p.add_argument("--samples", type=Path, default=None,
                   help="its samples JSON (default: the file ruler generate read, else the same name beside "
                        "--generations)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    p.add_argument("--name", default=None, help="file name stem (default ruler-<model>-<contexts>)")


def _check_selection(args) -> list[str]:
    from bench.ruler.samples import MIN_CONTEXT, TASKS

    info = models.model_argument(args.model)
    cli.at_least("--limit", args.limit, 1)
    for context in args.contexts:
        if not MIN_CONTEXT <= context <= info.context:
            raise UsageError(f"--contexts must lie in {MIN_CONTEXT}..{info.context} ({args.model}'s context), "
                             f"got {context}")
    if len(set(args.contexts)) != len(args.contexts):
        raise UsageError(f"--contexts names a context more than once: {args.contexts}")
    tasks = args.tasks or list(TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UsageError(f"--tasks must be among {', '.join(TASKS)}, got {', '.join(unknown)}")
    return tasks


def _check_decoding(args, model: str) -> tuple[list[decoding.MethodSpec], Path | None]:
    info = models.info(model)
    specs = decoding.parse_specs(args.methods or default_methods(info.head_dim), info.head_dim)
    if args.k is not None:
        cli.at_least("-k", args.k, 1)
    calibration = args.calibration or decoding.default_calibration(model)
    if calibration is not None:
        decoding.check_calibration(calibration, model)
    decoding.require_calibration(specs, calibration, model)
    return specs, calibration


def _contexts_tag(contexts) -> str:
    return "-".join(f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in sorted(contexts))


def _title(model: str, contexts, limit, calibration: Path | None) -> str:
    info = models.info(model)
    calibrated = "no calibration" if calibration is None else f"calibration {Path(calibration).name}"
    return (f"{model} (d = {info.head_dim}), contexts {', '.join(map(str, sorted(contexts)))}, "
            f"limit {limit} per task, {calibrated}")


def run(args: argparse.Namespace) -> Path:
    return {"lm-eval": _lm_eval, "samples": _samples, "generate": _generate, "score": _score}[args.ruler_command](args)


def _check_out(args) -> None:
    """A results folder (``--out``) writable and a ``--name`` that stays in it, checked first."""
    args.out = cli.writable_folder("--out", args.out)
    cli.file_stem("--name", args.name)


def _lm_eval(args) -> Path:
    _check_out(args)
    tasks = _check_selection(args)
    specs, calibration = _check_decoding(args, args.model)
    from tqdm import tqdm

    from bench.ruler import harness, score

    start = time.perf_counter()
    model, tokenizer = models.load(args.model, args.cache)
    with tqdm(total=len(args.contexts) * len(specs), desc="ruler through lm-eval", unit="run") as bar:
        scored, aggregates = harness.evaluate(model, tokenizer, models.ensure(args.model, args.cache), specs, tasks,
                                              args.contexts, args.limit, args.k, calibration, on_run=bar.update)
    rows = score.aggregate(scored, score.lm_eval_aggregation(tasks))
    ks = sorted({a["k"] for a in aggregates})
    name = args.name or f"ruler-{args.model}-{_contexts_tag(args.contexts)}-lm-eval"
    info = {"title": _title(args.model, args.contexts, args.limit, calibration) + ", end to end through lm-eval",
            "model": args.model, "contexts": args.contexts, "limit": args.limit, "tasks": tasks,
            "methods": [s.label for s in specs], "k": "/".join(map(str, ks)),
            "calibration": None if calibration is None else str(calibration),
            "lm_eval_version": _version("lm_eval"), "transformers_version": _version("transformers"),
            "scoring": "lm-eval's own evaluate(): the task's process_results and aggregation",
            "lm_eval_aggregates": aggregates, "wall_s": round(time.perf_counter() - start, 1), "per_sample": scored}
    path = score.write(args.out, name, args.command_line, rows, info["methods"], info)
    print((args.out / f"{name}.md").read_text())
    return path


def _samples(args) -> Path:
    tasks = _check_selection(args)
    from tqdm import tqdm

    from bench.report import write_json
    from bench.ruler import samples

    out = args.out or RESULTS / f"ruler-samples-{args.model}-{_contexts_tag(args.contexts)}-limit{args.limit}.json"
    cli.writable_file("--out", out)
    tokenizer_path = models.ensure(args.model, args.cache)
    with tqdm(total=len(tasks) * len(args.contexts), desc="ruler samples (lm-eval task code)", unit="task") as bar:
        built = samples.build(tasks, args.contexts, args.limit, tokenizer_path, on_task=bar.update)
    write_json(out, args.command_line, {"model": args.model, "contexts": args.contexts, "limit": args.limit,
                                        "tasks": tasks, "lm_eval_version": _version("lm_eval"),
                                        "built_by": "lm-eval's TaskManager and Task.build_all_requests, seeded as "
                                                    "lm_eval.simple_evaluate", "samples": built})
    print(f"{len(built)} samples of {', '.join(tasks)} at {args.contexts} -> {out}")
    return out


def _generate(args) -> Path:
    from bench.ruler import generate

    payload = generate.read_samples(args.samples)
    model_name = payload["model"]
    models.model_argument(model_name)
    out = args.out or args.samples.with_name(args.samples.name.replace("ruler-samples-", "ruler-generations-", 1)
                                             if args.samples.name.startswith("ruler-samples-")
                                             else f"ruler-generations-{args.samples.name}")
    cli.writable_file("--out", out)  # before the specs' check, which imports transformers
    specs, calibration = _check_decoding(args, model_name)
    cli.at_least("--batch-size", args.batch_size, 1)
    if args.prefill_rows is not None:
        cli.at_least("--prefill-rows", args.prefill_rows, 1)
    if args.token_graph and args.device != "cuda":
        raise UsageError("--token-graph needs --device cuda (the graph runs on the offloaded backend)")
    if args.dense_in_hbm and (args.device != "cuda" or "dense" not in [s.method for s in specs]):
        raise UsageError("--dense-in-hbm runs the dense method in HBM: it needs --device cuda and dense among "
                         f"--methods, got --device {args.device}, methods {' '.join(s.label for s in specs)}")
    if args.token_graph and models.info(model_name).sliding_window is not None:
        raise UsageError(f"--token-graph needs full-attention layers only; {model_name} has sliding-window layers "
                         "(their growing dense cache is in no graph): leave it out")
    samples_sha256 = _sha256(args.samples)
    previous = None
    if args.resume and out.exists():
        try:
            previous = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UsageError(f"--resume: {out} is not a readable generations JSON ({error})") from None
        if not isinstance(previous, dict) or previous.get("samples_file") != str(args.samples):
            held = previous.get("samples_file") if isinstance(previous, dict) else None
            raise UsageError(f"--resume: {out} holds generations of {held}, not {args.samples}")
        if previous.get("samples_sha256", samples_sha256) != samples_sha256:
            raise UsageError(f"--resume: {out} was generated from another {args.samples} (sha256 differs)")
        if previous.get("dense_in_hbm", False) != args.dense_in_hbm:
            raise UsageError(f"--resume: {out} ran dense {'in HBM' if previous.get('dense_in_hbm') else 'offloaded'};"
                             " resume it the same way (--dense-in-hbm or not)")
        _check_resumed(out, previous, {
            "methods": [s.label for s in specs], "k_requested": args.k, "device": args.device,
            "batch_size": args.batch_size,
            "calibration": None if calibration is None else Path(calibration).name})
    import torch
    import transformers

    if args.device == "cuda":
        cli.require_cuda("ruler generate --device cuda")
    model, tokenizer = models.load(model_name, args.cache)
    model.to(args.device)
    header = {"command": args.command_line, "samples_file": str(args.samples), "samples_sha256": samples_sha256,
              "model": model_name,
              "methods": [s.label for s in specs], "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "batch_size": args.batch_size, "prefill_rows": args.prefill_rows,
              "token_graph": args.token_graph, "dense_in_hbm": args.dense_in_hbm, "k_requested": args.k,
              "calibration": None if calibration is None else str(calibration),
              "eos_text": tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False),
              "torch_version": torch.__version__, "transformers_version": transformers.__version__}
    result = generate.run(model, tokenizer, payload["samples"], specs, out, header, args.k, calibration,
                          args.batch_size, previous, args.prefill_rows, args.token_graph, args.dense_in_hbm)
    print(f"{len(result['generations'])} generations -> {out}")
    return out


def _score(args) -> Path:
    _check_out(args)
    from bench.ruler import score
    from bench.ruler.generate import read_samples

    try:
        generations = json.loads(args.generations.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--generations {args.generations}: not a readable generations JSON ({error})") from None
    if not isinstance(generations, dict) or "generations" not in generations or "samples_file" not in generations:
        raise UsageError(f"--generations {args.generations}: not written by python -m bench ruler generate")
    samples_path = _samples_of(args, generations)
    payload = read_samples(samples_path)
    recorded = generations.get("samples_sha256")  # generations made before 2026-12-02 did not record it
    if recorded is not None and recorded != _sha256(samples_path):
        raise UsageError(f"--samples {samples_path}: not the samples {args.generations} was generated from "
                         "(sha256 differs)")
    scored, functions = score.score_generations(payload["samples"], generations["generations"],
                                                generations.get("eos_text"))
    tasks = sorted({s["task"] for s in scored})
    rows = score.aggregate(scored, score.lm_eval_aggregation(tasks))
    contexts = sorted({s["context"] for s in scored})
    ks = sorted({g["k"] for g in generations["generations"] if g["k"] is not None})  # None: dense in HBM
    name = args.name or f"ruler-{payload['model']}-{_contexts_tag(contexts)}"
    title = (_title(payload["model"], contexts, payload["limit"], generations.get("calibration"))
             + f", generated on {generations['device_name']}"
             + _partial(payload["samples"], scored, generations["methods"]))
    info = {"title": title, "model": payload["model"], "contexts": contexts, "limit": payload["limit"],
            "tasks": tasks, "methods": generations["methods"], "k": "/".join(map(str, ks)),
            "calibration": generations.get("calibration"), "generations_file": str(args.generations),
            "generate_command": generations["command"], "samples_command": payload["command"],
            "lm_eval_version": _version("lm_eval"), "scoring": functions,
            "generation": {k: generations.get(k) for k in ("device", "device_name", "batch_size", "dense_in_hbm",
                                                           "token_graph", "torch_version",
                                                           "transformers_version", "seconds_by_method", "wall_s")},
            "per_sample": scored}
    path = score.write(args.out, name, args.command_line, rows, generations["methods"], info)
    print((args.out / f"{name}.md").read_text())
    return path


def _check_resumed(out: Path, previous: dict, now: dict) -> None:
    """A resumed run continues only with what made the generations it holds (one table must not mix runs):
    the same methods, top-k, device, batch size (its padding) and calibration file."""
    held = {**{key: previous.get(key) for key in now},
            "calibration": None if previous.get("calibration") is None else Path(previous["calibration"]).name}
    differ = [key for key in now if held[key] != now[key] and key in previous]
    if differ:
        raise UsageError(f"--resume: {out} was generated with " + ", ".join(f"{key} {held[key]!r}" for key in differ)
                         + "; resume it with the same (now " + ", ".join(f"{key} {now[key]!r}" for key in differ)
                         + ")")


def _samples_of(args, generations: dict) -> Path:
    """The samples file to score against: ``--samples``, else the one ruler generate read, else the file of that
    name beside ``--generations`` (the two travel together); refused in one line when none is there."""
    if args.samples is not None:
        return args.samples
    recorded = Path(generations["samples_file"])
    for path in (recorded, args.generations.parent / recorded.name):
        if path.exists():
            return path
    raise UsageError(f"--generations {args.generations}: its samples file {recorded} is not there, nor beside it; "
                     "remake it with python -m bench ruler samples (the same --model, --contexts and --limit) and "
                     "pass it as --samples")


def _partial(samples: list[dict], scored: list[dict], methods: list[str]) -> str:
    """``", partial: …"`` when a method holds fewer generations of some task than the samples file has samples."""
    held = Counter((sample["task"], sample["context"]) for sample in samples)
    generated = Counter((s["task"], s["context"], s["method"]) for s in scored)
    short = sorted({(generated.get((*setting, m), 0), total) for setting, total in held.items() for m in methods}
                   - {(total, total) for total in held.values()})
    if not short:
        return ""
    return (", partial: " + ", ".join(f"{n} of {total}" for n, total in short)
            + " samples of a task generated (ruler generate --resume continues it)")


def _sha256(path: Path) -> str:
    try:
        return artifacts.sha256_file(path)
    except OSError as error:
        raise UsageError(f"--samples {path}: not readable ({error})") from None


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
