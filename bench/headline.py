"""``python -m bench headline``: one table of the real-model fidelity settings' summaries -> ``headline.md``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import cli
from bench.report import RESULTS, context_label, markdown_table

COLUMNS = [("setting", "model, context", "s"), ("d", "d", "d"), ("basis", "store basis", "s"),
           ("ds136", "DS-136 err", ".4f"), ("fathom48", "fathom-48 err", ".4f"), ("sparq68", "sparq-68 err", ".4f"),
           ("oracle", "oracle err", ".4f"), ("saving", "saving vs DS-136", "s"),
           ("saving_quarter", "saving vs DS r=d/4", "s"), ("channels", "channels read @48", ".1f"),
           ("wall", "run wall (min)", ".1f"), ("prefill", "prefills (min)", ".1f")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of fidelity-*.json (default bench/results)")


def _saving(summary: dict, key: str) -> str:
    value = summary[f"equal_error_saving{key}"]
    if value is None:
        return "not reached"
    return f"{'≥ ' if summary[f'equal_error_how{key}'] == 'at most' else ''}{value:.2f}× ({summary[f'ds{key}_label']})"


def rows(results: Path) -> list[dict]:
    out = []
    for path in sorted(results.glob("fidelity-*.json")):
        payload = json.loads(path.read_text())
        if payload.get("synthetic") or path.stem.endswith("-quick"):
            continue
        s, shape = payload["summary"], payload["capture"]
        out.append({"setting": f"{payload['model']} {context_label(shape['tokens'])} ({payload['evaluation_text']})",
                    "d": shape["head_dim"], "basis": s["basis"], "ds136": s["ds_error"],
                    "fathom48": s["fathom48_error"], "sparq68": s["sparq68_error"], "oracle": s["oracle_error"],
                    "saving": _saving(s, ""), "saving_quarter": _saving(s, "_quarter"),
                    "channels": s["channels_touched_48"], "wall": payload["wall_s"] / 60,
                    # the two captures' prefills, when recorded (older cached captures did not record theirs)
                    "prefill": (payload.get("prefill_evaluation_s", 0) + payload.get("prefill_calibration_s", 0)) / 60
                    or None})
    return out


def run(args: argparse.Namespace) -> Path:
    if not args.results.is_dir():
        raise cli.UsageError(f"--results {args.results}: not a folder of fidelity-*.json")
    cli.writable_folder("--results", args.results)
    table = markdown_table(rows(args.results), COLUMNS)
    path = args.results / "headline.md"
    path.write_text(f"Real-model fidelity (made by `{args.command_line}` from the fidelity-*.json beside it). "
                    "Run wall: the fidelity command as recorded (its captures may have been cached); prefills: "
                    "the dense CPU prefills of the evaluation and calibration windows.\n\n"
                    f"{table}\n")
    print(table)
    return path
