"""What ``python -m bench generate`` writes and reads back: a record's progress line, the table (markdown), the
plot, the section in docs/results.md, and the merge of several runs (``--replot``)."""

from __future__ import annotations

from pathlib import Path

from bench.cli import UsageError
from bench.report import context_label, markdown_table
from bench.shapes import shape_layers

# what the merged table, the plot and the section in docs/results.md read of a generate JSON (``--replot``)
REPLOT_FIELDS = ("command", "device", "weights", "new_tokens", "warmup", "records")
RECORD_FIELDS = ("model", "context", "batch", "system")


def publish(payload: dict, source: Path, readme: Path | None) -> None:
    """The run's (or merged runs') table beside ``source`` (``.md``) with its plot (``.png``), printed, and the
    section in ``readme`` rewritten when one is given."""
    text = markdown(payload)
    source.with_suffix(".md").write_text(text + "\n")
    plot(payload, source.with_suffix(".png"))
    if readme is not None:
        update_readme(readme, payload, source)
    print(text)


def merge(payloads: list[dict]) -> dict:
    """Several runs' payloads as one: their commands joined, each setting as the runs had it (every value where
    they differ: ``2 or 3`` warm-up steps), the fewest new tokens, and one record per setting and system
    (:func:`latest`)."""
    def each(key: str):
        values = list(dict.fromkeys(p[key] for p in payloads))
        return values[0] if len(values) == 1 else " or ".join(map(str, sorted(values, key=str)))

    return {"command": "; ".join(f"`{p['command']}`" for p in payloads).strip("`"), "device": each("device"),
            "weights": each("weights"), "new_tokens": min(p["new_tokens"] for p in payloads),
            "warmup": each("warmup"),
            "compile_probe": next((p["compile_probe"] for p in payloads if p.get("compile_probe")), None),
            "records": latest(r for p in payloads for r in p["records"])}


def latest(records) -> list[dict]:
    """One record per (model, context, batch, system, layers when fewer than the shape's, planes in HBM, row cache
    slots): a later run's replaces an earlier one's, in first order."""
    kept: dict[tuple, dict] = {}
    for record in records:
        kept[(record["model"], record["context"], record["batch"], record["system"], fewer_layers(record),
              record.get("hbm_planes") or 0, record.get("row_cache_rows") or 0)] = record
    return list(kept.values())


def fewer_layers(record: dict) -> int | None:
    """The record's decoder layers where a shape ran with fewer than its own (``--layers``), else None."""
    full = shape_layers(record["model"])
    layers = record.get("layers")
    return layers if full is not None and layers is not None and layers != full else None


def probe_sentence(probe: dict) -> str:
    """What :func:`compile_probe` measured, in words (a probe recorded before the warm-up command existed has only
    its first two times)."""
    text = (f"A fresh process's first offloaded decode: {probe['process_cold_s']:.1f} s with Numba's kernel cache "
            f"empty, {probe['process_warm_s']:.1f} s with it filled")
    if "warmup_s" not in probe:
        return text + "."
    return (text + f" ({probe['cold_kernels_compiled']} kernel signatures compiled when empty); after the warm-up "
            f"command `{probe['warmup_command']}` ({probe['warmup_s']:.1f} s in a fresh process, its cache empty) "
            f"{probe['process_after_warmup_s']:.1f} s, compiling {probe['after_warmup_kernels_compiled']}.")


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']} {context_label(r['context'])} x{r['batch']} {r['system']}: {r['error']}"
    return (f"{r['model']} {context_label(r['context'])} x{r['batch']} {r['system']}: prefill {r['prefill_s']:.2f} s, "
            f"first step {r['first_step_ms']:.0f} ms, steady {r['steady_ms']:.1f} ms ({r['tokens_per_s']:.1f} tok/s), "
            f"pooled first step {r['pooled_first_step_ms']:.0f} ms")


COLUMNS = [("model", "model", ""), ("context", "context", "d"), ("batch", "batch", "d"), ("system", "system", ""),
           ("prefill_s", "prefill s", ".2f"), ("prefill_vs_hf", "prefill / HF", ".2f"),
           ("pooled_prefill_s", "pooled prefill s", ".2f"),
           ("first_step_ms", "first step ms", ".0f"), ("pooled_first_step_ms", "pooled first step ms", ".0f"),
           ("setup_s", "setup s", ".2f"), ("turn_first_token_ms", "turn-2 first token ms", ".0f"),
           ("first_steady_ms", "first cache's steady ms", ".1f"), ("steady_ms", "steady ms/token", ".1f"),
           ("tokens_per_s", "tok/s", ".1f"),
           ("attention_gpu_ms", "attention GPU ms", ".1f"), ("gpu_busy_ms", "GPU busy ms", ".1f"),
           ("host_ms_per_token", "host ms/token", ".1f"), ("hbm_gb", "HBM GB", ".1f"),
           ("pinned_gb", "pinned GB", ".1f")]


# shown when a record's store kept planes or rows in HBM (--hbm-gb, --row-cache-rows)
TIER_COLUMNS = [("hbm_planes", "planes in HBM", "d"), ("store_hbm_gb", "store HBM GB", ".2f"),
                ("row_cache_hit", "row cache hits", ".2f")]


def markdown(payload: dict) -> str:
    rows = [r for r in payload["records"] if "error" not in r]
    failed = [r for r in payload["records"] if "error" in r]
    tiered = any(r.get("hbm_planes") or r.get("row_cache_rows") for r in rows)
    text = (f"`{payload['command']}` on {payload['device']}; weights: {payload['weights']}; "
            f"{payload['new_tokens']}+ new tokens, steady = the lower of the two caches' medians after "
            f"{payload['warmup']} steps.\n\n"
            + markdown_table(rows, COLUMNS + (TIER_COLUMNS if tiered else [])))
    notes = _setting_notes(rows)
    if notes:
        text += "\n\n" + notes
    if failed:
        text += "\n\nNot measured: " + "; ".join(f"{r['model']} {r['context']} x{r['batch']} {r['system']} "
                                                 f"({r['error']})" for r in failed)
    probe = payload.get("compile_probe")
    if probe:
        text += "\n\n" + probe_sentence(probe)
    return text


def _setting_notes(rows: list[dict]) -> str:
    """What the table's columns mean differently for some settings: fewer layers than the shape's, and caches that
    started from a shared prefill (their prefill s is the time to take it in)."""
    notes = []
    for setting in sorted({(r["model"], r["context"], r["batch"]) for r in rows}):
        group = [r for r in rows if (r["model"], r["context"], r["batch"]) == setting]
        name = f"{setting[0]} {context_label(setting[1])} x{setting[2]}"
        layers = fewer_layers(group[0])
        if layers is not None:
            notes.append(f"{name}: {layers} of the shape's {shape_layers(setting[0])} layers "
                         "(host memory).")
        if group[0].get("prefill") == "shared":
            seconds, rows_at_once = group[0]["shared_prefill_s"], group[0]["prefill_rows"]
            notes.append(f"{name}: every cache started from one shared dense prefill ({seconds:.1f} s, {rows_at_once} "
                         "row(s) at a time); prefill s is the time to take it in (so no prefill / HF), the first "
                         "step decodes the prefill's token, and HBM GB includes the prompt's keys and values, held "
                         "on the GPU throughout.")
    return " ".join(notes)


README_START, README_END = "<!-- generate:start -->", "<!-- generate:end -->"  # in docs/results.md


def check_readme(readme: Path) -> str:
    """``readme``'s text, refused in one line without the section to rewrite (checked before a run)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--readme {readme}: not a readable text file ({error})") from None
    if README_START not in text or README_END not in text.split(README_START, 1)[1]:
        raise UsageError(f"--readme {readme}: no {README_START} ... {README_END} section to rewrite")
    return text


def update_readme(readme: Path, payload: dict, source: Path) -> None:
    text = check_readme(readme)
    start, end = README_START, README_END
    body = f"From `{source.name}`:\n\n" + markdown(payload)
    head, rest = text.split(start, 1)
    readme.write_text(head + start + "\n" + body + "\n" + end + rest.split(end, 1)[1], encoding="utf-8")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["records"] if "error" not in r]
    settings = sorted({(r["model"], r["context"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(settings)), figsize=(4 * max(1, len(settings)), 3.6), squeeze=False)
    for ax, (model, context, batch) in zip(axes[0], settings):
        group = [r for r in rows if (r["model"], r["context"], r["batch"]) == (model, context, batch)]
        ax.barh([r["system"] for r in group], [r["steady_ms"] for r in group], color="#4c72b0")
        ax.set_xscale("log")
        ax.set_title(f"{model} {context_label(context)} x{batch}", fontsize=9)
        ax.set_xlabel("ms per token (steady, log)")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
