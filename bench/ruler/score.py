"""Scoring RULER generations with lm-eval's own functions, and the table, JSON and plot of the scores.

Each generation is post-processed as lm-eval's ``HFLM`` does
(``lm_eval.models.utils.postprocess_generated_text``: cut at the task's stop
sequences and the end-of-sequence text), then scored by the task's own
``process_results`` and aggregated by its own aggregation function, both taken
from the task's YAML through lm-eval's YAML loader (for these five tasks:
``common_utils.process_results`` — RULER's ``string_match_all`` — and
``common_utils.aggregate_metrics``). Building the task objects is not needed
to score (it would synthesize 500 documents per task).

Intervals: the 95% Wilson score interval of the mean score over ``n`` samples.
It is exact in its coverage sense for 0/1 scores (the single-answer needle
tasks); for partial-credit scores in [0, 1] (ruler_vt's 5 variables,
ruler_cwe's 10 words) the variance of the mean is at most that of a 0/1 score
with the same mean, so the interval is conservative there.
"""

from __future__ import annotations

import math
import textwrap
from functools import lru_cache
from pathlib import Path

from bench.report import markdown_table, write_json

Z95 = 1.959963984540054


def wilson(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``mean`` over ``n`` trials (``(0, 1)`` for n = 0).

    >>> [round(x, 4) for x in wilson(0.5, 10)]
    [0.2366, 0.7634]
    >>> wilson(0.0, 10)[0], wilson(1.0, 10)[1]
    (0.0, 1.0)
    """
    if n == 0:
        return 0.0, 1.0
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
    # the interval holds the mean; min / max keep it so where rounding at 0 or 1 would not
    return max(0.0, min(mean, centre - half)), min(1.0, max(mean, centre + half))


@lru_cache(maxsize=None)
def task_functions(tasks: tuple[str, ...]) -> dict[str, dict]:
    """Per task: lm-eval's ``process_results`` and its aggregation per metric, from the task's own YAML (loaded
    once per process: scoring and aggregating read the same)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    from bench.ruler.samples import ruler_folder

    index = TaskManager(include_path=str(ruler_folder()), include_defaults=False).task_index
    functions = {}
    for name in tasks:
        config = load_yaml(index[name].yaml_path, resolve_func=True)
        functions[name] = {"process_results": config["process_results"],
                           "aggregation": {m["metric"]: m["aggregation"] for m in config["metric_list"]}}
    return functions


def qualified(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def score_generations(samples: list[dict], generations: list[dict], eos_text: str | None) -> tuple[list[dict], dict]:
    """lm-eval's score of every generation -> (per generation: id, task, context, method, score, text;
    which lm-eval functions scored them)."""
    from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text

    by_id = {s["id"]: s for s in samples}
    unknown = sorted({g["id"] for g in generations} - set(by_id))
    if unknown:
        raise ValueError(f"generations name samples the samples file does not hold: {', '.join(unknown[:5])}")
    functions = task_functions(tuple(sorted({by_id[g["id"]]["task"] for g in generations})))
    scored, used = [], {}
    for g in generations:
        sample = by_id[g["id"]]
        f = functions[sample["task"]]
        until = handle_stop_sequences(list(sample["gen_kwargs"].get("until") or []), eos=eos_text)
        text = postprocess_generated_text(g["text"], until, None)
        metrics = f["process_results"](sample["doc"], [text])
        scored.append({"id": g["id"], "task": sample["task"], "context": sample["context"], "method": g["method"],
                       "score": float(metrics[str(sample["context"])]), "text": text})
        used[sample["task"]] = {"process_results": qualified(f["process_results"]),
                                "aggregation": sorted({qualified(a) for a in f["aggregation"].values()})}
    return scored, {"postprocess": qualified(postprocess_generated_text), "tasks": used}


def aggregate(scored: list[dict], aggregation_of=None) -> list[dict]:
    """One row per task × context × method: the mean score (by lm-eval's aggregation when
    ``aggregation_of(task, context)`` gives it), ``n`` and the 95% Wilson interval."""
    groups: dict[tuple, list[float]] = {}
    for s in scored:
        groups.setdefault((s["task"], s["context"], s["method"]), []).append(s["score"])
    rows = []
    for (task, context, method), scores in groups.items():
        function = aggregation_of(task, context) if aggregation_of else None
        mean = float(function(scores)) if function else sum(scores) / len(scores)
        lo, hi = wilson(mean, len(scores))
        rows.append({"task": task, "context": context, "method": method, "score": mean, "n": len(scores),
                     "lo": lo, "hi": hi})
    return rows


def lm_eval_aggregation(tasks: list[str]):
    """``aggregation_of(task, context)``: the task's aggregation of that context's metric (lm-eval lists
    4k-128k; a context it does not list, e.g. a tiny test context, uses the one function all its metrics share)."""
    functions = task_functions(tuple(sorted(tasks)))

    def aggregation_of(task: str, context: int):
        per_metric = functions[task]["aggregation"]
        if str(context) in per_metric:
            return per_metric[str(context)]
        shared = set(per_metric.values())
        if len(shared) != 1:
            raise ValueError(f"lm-eval's {task} has no metric for context {context}")
        return shared.pop()

    return aggregation_of


def write(out: Path, name: str, command: str, rows: list[dict], methods: list[str], info: dict) -> Path:
    """``<name>.json`` (rows, per-sample scores in ``info``), ``<name>.md`` and ``<name>.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = write_json(out / f"{name}.json", command, {**info, "interval": "95% Wilson score interval",
                                                      "rows": rows})
    table = _table(rows, methods)
    (out / f"{name}.md").write_text(
        f"RULER (lm-eval's own tasks and metric) — {info['title']}. Made by `{command}`.\n\n"
        "Each cell: mean score [95% Wilson interval], over n samples per task; greedy decoding, "
        f"top-k = {info.get('k', '—')} per query head plus sink 4 and local 32.\n\n{table}\n", encoding="utf-8")
    _plot(out / f"{name}.png", rows, methods, info["title"])
    return path


def _table(rows: list[dict], methods: list[str]) -> str:
    by_key = {(r["task"], r["context"], r["method"]): r for r in rows}
    lines = []
    for task, context in sorted({(r["task"], r["context"]) for r in rows}, key=lambda t: (t[1], t[0])):
        n = {by_key[(task, context, m)]["n"] for m in methods if (task, context, m) in by_key}
        line = {"task": task, "context": context, "n": "/".join(str(x) for x in sorted(n))}
        for m in methods:
            r = by_key.get((task, context, m))
            line[m] = None if r is None else f"{r['score']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]"
        lines.append(line)
    return markdown_table(lines, [("task", "task", "s"), ("context", "context", "d"), ("n", "n", "s")]
                          + [(m, m, "s") for m in methods])


def _plot(path: Path, rows: list[dict], methods: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    contexts = sorted({r["context"] for r in rows})
    tasks = sorted({r["task"] for r in rows})
    by_key = {(r["task"], r["context"], r["method"]): r for r in rows}
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts) + 2, 4), squeeze=False, sharey=True)
    width = 0.8 / len(methods)
    for ax, context in zip(axes[0], contexts):
        for i, m in enumerate(methods):
            cells = [by_key.get((t, context, m)) for t in tasks]
            x = np.arange(len(tasks)) + (i - (len(methods) - 1) / 2) * width
            score = [c["score"] if c else np.nan for c in cells]
            err = [[c["score"] - c["lo"] if c else 0 for c in cells], [c["hi"] - c["score"] if c else 0 for c in cells]]
            ax.bar(x, score, width, yerr=err, capsize=2, label=m)
        ax.set_xticks(np.arange(len(tasks)), tasks, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"context {context}", fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("lm-eval score (95% Wilson interval)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(textwrap.fill(title, 40 * len(contexts) + 60), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
