"""``python -m bench headline``: one table of the real-model fidelity settings' summaries -> ``headline.md``."""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

from bench import cli
from bench.capture import decode_positions
from bench.fidelity import FATHOM_FAMILIES, PLAN_FAMILIES, store_family
from bench.report import RESULTS, context_label, markdown_table

COLUMNS = [("setting", "model, context (text)", "s"), ("d", "d", "d"), ("basis", "store (basis rule), σ²", "s"),
           ("curve", "fathom curve", "s"),
           ("ds_quarter", "DS r=d/4 err", ".4f"), ("fathom48", "fathom-48 err", ".4f"),
           ("sparq68", "sparq-68 err", ".4f"), ("plan48", "fathom-plan-48 err", ".4f"), ("oracle", "oracle err", ".4f"),
           ("saving_quarter", "saving vs DS r=d/4", "s"), ("saving", "saving vs DS-136", "s"),
           ("hits", "top-k hit fathom-48 / DS r=d/4 / sparq-68", "s"), ("channels", "channels read @48", "s"),
           ("device", "device", "s"), ("prefill", "prefills (min)", ".1f"), ("evaluation", "evaluation (min)", ".1f")]
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder of fidelity-*.json (default bench/results)")


def _saving(summary: dict, key: str) -> str:
    value = summary[f"equal_error_saving{key}"]
    if value is None:
        return "not reached"
    return f"{'≥ ' if summary[f'equal_error_how{key}'] == 'at most' else ''}{value:.2f}× ({summary[f'ds{key}_label']})"


def rows(results: Path) -> list[dict]:
    """One row per real setting: DS at r = d/4 (the design's fraction) is the primary comparator at every head
    dim; DS-136 (r = 32) a secondary column where it differs (d = 64: half the channels; d = 256: an eighth)."""
    out = []
    for path, payload in _results(results):
        if payload.get("synthetic") or path.stem.endswith("-quick"):
            continue
        with _reading(path):
            out.append(_row(payload))
    return out


def _setting(payload: dict) -> str:
    """``model 32k (text)``, with ``P = 512`` when the run used other than the default decode positions,
    ``levels`` when its planes were read through calibrated levels and ``calibrated on the prompt`` when it was
    (two runs of one setting that differ are two rows that must not read alike)."""
    shape = payload["capture"]
    positions = shape.get("positions", decode_positions(shape["tokens"]))  # older results: the default
    at = "" if positions == decode_positions(shape["tokens"]) else f", P = {positions}"
    levels = ", levels" if payload.get("levels") == "calibrated" else ""  # older results: the midpoints
    prompt = ", calibrated on the prompt" if payload.get("calibrated_on") == "prompt" else ""  # older: on a text
    return f"{payload['model']} {context_label(shape['tokens'])} ({payload['evaluation_text']}{at}{levels}{prompt})"


def _row(payload: dict) -> dict:
    """:func:`rows`' row of one fidelity result."""
    s, shape = payload["summary"], payload["capture"]
    d = shape["head_dim"]
    hits = [s.get(k) for k in ("fathom48_overlap", "ds_quarter_overlap", "sparq68_overlap")]
    plan = next(label for label in payload["per_layer_plans"] if label.endswith("@48"))  # on the rule's store
    return {"setting": _setting(payload),
            "d": d, "basis": f"{s['basis']}, {s.get('variance', 'store (old run)')}" if s.get(
                "heads_rotated") is None else f"per head: {s['heads_rotated']} of {s['heads']} rotated",
            "curve": s.get("fathom_family", store_family(s["basis"])),  # results before the per-head rule: unnamed
            "ds_quarter": s["ds_quarter_error"], "fathom48": s["fathom48_error"],
            "sparq68": s["sparq68_error"], "oracle": s["oracle_error"],
            "plan48": next(r["rel_error"] for r in payload["records"] if r["label"] == plan),
            "saving_quarter": _saving(s, "_quarter"),
            "saving": _saving(s, "") if s["ds_label"] != s["ds_quarter_label"] else "= primary",
            "hits": "—" if None in hits else " / ".join(f"{h:.3f}" for h in hits),
            "channels": f"{s['channels_touched_48']:.1f} / {d}", "device": payload.get("device", "cpu"),
            # the two captures' prefills, when recorded (older cached captures did not record theirs)
            "prefill": (payload.get("prefill_evaluation_s", 0) + payload.get("prefill_calibration_s", 0)) / 60
            or None,
            "evaluation": sum(payload.get(k, 0) for k in ("basis_rule_s", "gains_rule_s", "plan_rule_s",
                                                           "per_layer_plan_s", "evaluation_s")) / 60 or None}


def _results(results: Path):
    """``(path, payload)`` of every ``fidelity-*.json`` in ``results``, one that is not JSON refused naming it."""
    for path in sorted(results.glob("fidelity-*.json")):
        with _reading(path):
            payload = json.loads(path.read_text(encoding="utf-8"))
        yield path, payload


@contextmanager
def _reading(path: Path):
    """A result the headline cannot read refused in one line naming it (not a traceback)."""
    try:
        yield
    except (KeyError, TypeError, StopIteration, AttributeError, ValueError) as error:  # JSONDecodeError is one
        raise cli.UsageError(f"--results: {path} is not a fidelity result the headline reads "
                             f"({type(error).__name__}: {error})") from None


def family_rows(results: Path) -> list[dict]:
    """One row per real setting that reports every fathom curve (runs since the per-head rule): each curve's
    error at 48 bits and its equal-error saving vs DS at r = d/4."""
    out = []
    for path, payload in _results(results):
        if path.stem.endswith("-quick"):
            continue
        with _reading(path):
            row = _family_row(payload)
        if row is not None:
            out.append(row)
    return out


def _family_row(payload: dict) -> dict | None:
    """:func:`family_rows`' row of one fidelity result (None for a synthetic run or one before every curve)."""
    if payload.get("synthetic") or not payload["summary"].get("families"):
        return None
    families = payload["summary"]["families"]
    s = payload["summary"]
    row = {"setting": _setting(payload), "sparq68": s["sparq68_error"],
           "ds_quarter": f"{s['ds_quarter_error']:.4f} ({s['ds_quarter_label']})"}
    for name in FATHOM_FAMILIES + PLAN_FAMILIES:
        f = families.get(name)
        if f is not None:
            row[name] = _curve(f)
    if s.get("plan_rule") in families:
        row["plan_rule"] = f"{s['plan_rule']}: {_curve(families[s['plan_rule']])}"
    return row


def _curve(family: dict) -> str:
    """A fathom curve's error at 48 bits / equal-error saving vs DS at r = d/4."""
    saving = family["equal_error_saving_quarter"]
    at_most = "≥ " if family["equal_error_how_quarter"] == "at most" else ""
    return f"{family['fathom48_error']:.4f} / " + ("—" if saving is None else f"{at_most}{saving:.2f}×")


FAMILY_COLUMNS = [("setting", "model, context (text)", "s"), ("ds_quarter", "DS r=d/4 err", "s"),
                  ("sparq68", "sparq-68 err", ".4f"), ("plan_rule", "the plan rule's pick", "s")] + \
    [(f, f, "s") for f in FATHOM_FAMILIES + PLAN_FAMILIES]


def family_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    """:data:`FAMILY_COLUMNS` less the columns no run reports (the pooled plan's curves, the plan rule's pick and the
    per-head store's per-layer plan, before they were run)."""
    optional = ("pooled", "plan_rule", "-plan")
    return [c for c in FAMILY_COLUMNS if not any(o in c[0] for o in optional) or any(c[0] in row for row in rows)]


def run(args: argparse.Namespace) -> Path:
    if not args.results.is_dir():
        raise cli.UsageError(f"--results {args.results}: not a folder of fidelity-*.json")
    cli.writable_folder("--results", args.results)
    table = markdown_table(rows(args.results), COLUMNS)
    families = family_rows(args.results)
    path = args.results / "headline.md"
    path.write_text(f"Real-model fidelity (made by `{args.command_line}` from the fidelity-*.json beside it). "
                    "Double Sparsity at r = d/4 (the design's channel fraction) is the primary comparator at every "
                    "head dim; DS-136 (r = 32) is shown where it differs. Top-k hit: the fraction of the oracle's "
                    "exact top-k a method selects. fathom-plan-48: the per-layer plan (design §5's optional "
                    "tuning step, calibrated on the calibration text) at a mean of 48 bits. Store, σ²: the store "
                    "the basis rule chose for the model and the σ² source fathom reads there; \"per head\": runs "
                    "since the per-head rule, whose fathom columns are the per-head store (fathom-mixed: each "
                    "(layer, KV head) on the basis it chose on calibration text, with that basis' σ²). Fathom curve: "
                    "the curve of the fathom columns, decided on calibration text: in the runs since the plan rule "
                    "its pick of the per-head store's plans (below), before it fathom-mixed (design §5's gains, "
                    "planned per query group). Prefills: the "
                    "dense fp32 prefills of the evaluation and calibration "
                    "windows (as recorded with the captures); evaluation: basis rule, per-layer plan and the "
                    "evaluation of every method.\n\n"
                    f"{table}\n\n"
                    "Every fathom curve, in the runs that report them all: error at 48 bits / equal-error saving vs "
                    "DS at r = d/4. Raw and rotated stores, and the per-head store (fathom-mixed); `[gains]`: "
                    "water-filled with the plane gains measured on the calibration text instead of design §5's "
                    "model; `[pooled]`: one water line for every KV head of a layer; fathom-mixed-plan: the "
                    "per-head store with a per-layer plan calibrated on the calibration text at each mean budget, "
                    "with the plan rule's gains (runs since 2026-12-07; never the headline). The plan rule's pick: "
                    "the per-head "
                    "store's plan (gains, pooling) with the lowest error on calibration text (runs since the rule; "
                    "the fathom columns above).\n\n"
                    f"{markdown_table(families, family_columns(families))}\n")
    print(table)
    return path
