"""What ``python -m bench timing`` writes and prints: the JSON, its markdown tables (per setting; GPU ms per stage;
GPU µs per kernel with ``--kernels``), the plot, the short summary, and the sections that ``--replot ... --readme``
rewrites: every method's table (docs/results.md) and the throughput table with the peers' figures (README.md)."""

from __future__ import annotations

import math
from pathlib import Path

from bench.report import markdown_table, repo_path, write_json
from bench.timing_settings import GROUP_SIZE, HEAD_DIM, KV_HEADS, LAYERS, Setting

README_START, README_END = "<!-- timing:start -->", "<!-- timing:end -->"  # in docs/results.md
THROUGHPUT_START, THROUGHPUT_END = "<!-- throughput:start -->", "<!-- throughput:end -->"  # in README.md
# The peers' published aggregate decode throughput at ~120k tokens (issue 14): whole models, other hardware.
PEERS = (("ShadowKV", "Llama-3.1-8B, 122k, batch 24", "one A100", 245.9),
         ("RetroInfer", "Llama-3-8B, 120k", "one A100", 386.0))


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def readme_table(payload: dict) -> str:
    """The performance table of docs/results.md: per setting, every method's GPU ms per decode token (graph mode)
    and its ratio to DS-136, and fathom@48's wall / GPU, GPU / floor and host µs per layer."""
    records = [r for r in payload["records"] if r["mode"] == "graph"]
    settings = list(dict.fromkeys((r["regime"], _setting_label(r)) for r in records))
    labels = list(dict.fromkeys(r["label"] for r in records))
    by = {(r["regime"], _setting_label(r), r["label"]): r for r in records}
    head = "| setting | store | " + " | ".join(labels) + " | fathom@48: DS-136 / fathom (wall) | GPU / floor | " \
                                                           "wall / GPU | host µs / layer |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for regime, setting in settings:
        cells = []
        for label in labels:
            r = by.get((regime, setting, label))
            cells.append("—" if r is None else f"{r['gpu_ms']:.1f}")
        f = by.get((regime, setting, "fathom@48"))
        extra = ["—"] * 4 if f is None else [
            f"**{f['speedup_vs_ds136']:.2f}×** ({f['wall_speedup_vs_ds136']:.2f}×)" if f["speedup_vs_ds136"] else "—",
            f"{f['gpu_over_floor']:.2f}", f"{f['wall_over_gpu']:.2f}", f"{f['host_us_per_layer']:.0f}"]
        lines.append(f"| {setting} | {regime} | " + " | ".join(cells + extra) + " |")
    return "\n".join(lines)


def throughput_table(payload: dict) -> str:
    """The README's throughput table: per setting timed in graph mode, fathom@48 against DS-136 on the same store
    (GPU ms a token of every session, aggregate tokens a second, the ratio, each one's row cache hit rate, fathom's
    GPU / floor) and, where the run timed it (``--regimes host,hbm``), against DS-136 as its own offloading design
    keeps it: its 136 bits a token in HBM (the hbm regime's store: DS's scan reads only its own channels, so the
    time is that of its label cache in HBM; the K/V rows are in host memory in both), then the peers' published
    figures with their hardware."""
    records = [r for r in payload["records"] if r["mode"] == "graph"]
    by = {(r["regime"], _setting_label(r), r["label"]): r for r in records}
    ds_own = {_sessions_key(r): r for r in records if r["regime"] == "hbm" and r["label"] == "double-sparsity@136"}
    head = ("| setting | physical layers | fathom@48 ms | fathom@48 tokens / s | DS-136 ms, same tiers | "
            "DS-136 tokens / s | fathom vs DS-136 | DS-136 in HBM ms (fathom vs it) | row cache hits (fathom / DS) | "
            "GPU / floor |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for regime, setting in dict.fromkeys((r["regime"], _setting_label(r)) for r in records):
        f, ds = by.get((regime, setting, "fathom@48")), by.get((regime, setting, "double-sparsity@136"))
        if f is None:
            continue
        hits = " / ".join("—" if r is None or r.get("row_hit_rate") is None else f"{r['row_hit_rate']:.3f}"
                          for r in (f, ds))
        own = ds_own.get(_sessions_key(f)) if regime == "host" else None
        lines.append(f"| {setting}{'' if regime == 'host' else ', store in HBM'} | {f['physical_layers']} | "
                     f"{f['gpu_ms']:.2f} | **{tokens_per_s(f):.0f}** | "
                     + (f"{ds['gpu_ms']:.2f} | {tokens_per_s(ds):.0f} | {f['speedup_vs_ds136']:.2f}× | "
                        if ds is not None else "— | — | — | ")
                     + ("— | " if own is None else f"{own['gpu_ms']:.2f} ({own['gpu_ms'] / f['gpu_ms']:.2f}×) | ")
                     + f"{hits} | {f['gpu_over_floor']:.1f} |")
    lines += ["", "| peer (published) | model, context, batch | hardware | tokens / s |", "|---|---|---|---|"]
    lines += [f"| {name} | {setting} | {hardware} | {rate:g} |" for name, setting, hardware, rate in PEERS]
    return "\n".join(lines)


def readme_sections(text: str) -> list[tuple[str, str]]:
    """The marker pairs ``text`` holds, each start before its end: the sections ``--readme`` rewrites."""
    return [(start, end) for start, end in ((README_START, README_END), (THROUGHPUT_START, THROUGHPUT_END))
            if start in text and end in text.split(start, 1)[1]]


def update_readme(readme: Path, payload: dict, source: Path) -> None:
    """Rewrite each section of ``readme`` between a pair of markers: every method's table (:func:`readme_table`,
    docs/results.md) and the throughput table (:func:`throughput_table`, README.md)."""
    text = read(readme)
    commands = payload["commands"] if payload.get("commands") else [payload["command"]]
    shown = f"`python -m bench timing --replot ... --readme {repo_path(readme)}`"
    for start_marker, end_marker in readme_sections(text):
        start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
        if start_marker == README_START:
            body = (f"\n`{commands[0]}` (and the others recorded in `{repo_path(source)}`): GPU ms per decode token, "
                    f"graph mode, medians; table generated by {shown}.\n\n{readme_table(payload)}\n")
        else:
            body = (f"\n{'; '.join(f'`{c}`' for c in commands)} on {payload['device']} (recorded in "
                    f"`{repo_path(source)}`): the attention of all {LAYERS} layers of Qwen3-8B's shape and each "
                    f"token's append, synthetic keys, one CUDA graph a token, medians; the peers' figures are whole "
                    f"models on other hardware. DS-136 is timed on fathom's store through the same plane tiers (at "
                    f"t = 2 half of its planes cross the link) and, where the run timed it, as its own design keeps "
                    f"it: its 136 bits a token in HBM, less HBM than t = 2's 288, so no scan bytes cross the link "
                    f"(`python -m bench.hbm_budget`: at which HBM budget a token fathom's scan still reads less over "
                    f"the link). Generated by {shown}.\n\n{throughput_table(payload)}\n")
        text = text[:start] + body + text[end:]
    readme.write_text(text, encoding="utf-8")


def write(payload: dict, out: Path, name: str, command: str) -> Path:
    path = write_json(out / f"timing-{name}.json", command, payload)
    table = markdown(payload)
    (out / f"timing-{name}.md").write_text(table)
    plot(payload, out / f"timing-{name}.png")
    print(summary(payload))
    return path


def tokens_per_s(record: dict) -> float:
    """Aggregate decode tokens a second of a record's attention: its sessions over its GPU time per token."""
    return record["sessions"] * 1e3 / record["gpu_ms"]


def _sessions_key(r: dict) -> tuple:
    """What a setting is apart from where its store lives: the sessions, their lengths, k and the row cache."""
    return r["context"], r["sessions"], r["k"], r["ragged"], r.get("row_cache_rows")


def _setting_label(r: dict) -> str:
    """The setting, with the store's tier (planes in HBM, host regime) and the row cache where a record has them."""
    label = Setting(r["context"], r["sessions"], r["regime"], r["k"], r["ragged"]).label
    if r["regime"] == "host" and r.get("hbm_planes"):
        label += f", t = {r['hbm_planes']}"
    if r.get("row_cache_rows"):
        label += f", row cache {r['row_cache_rows']}"
    return label


COLUMNS = [("label", "method@bits", "s"), ("mode", "mode", "s"), ("gpu_ms", "GPU ms", ".2f"),
           ("tokens_per_s", "tokens / s (GPU)", ".0f"),
           ("wall_ms", "wall ms", ".2f"), ("wall_over_gpu", "wall / GPU", ".2f"),
           ("host_us_per_layer", "host µs / layer", ".0f"), ("floor_ms", "floor ms", ".2f"),
           ("gpu_over_floor", "GPU / floor", ".2f"), ("speedup_vs_ds136", "GPU × vs DS-136", ".2f"),
           ("wall_speedup_vs_ds136", "wall × vs DS-136", ".2f"), ("bits_read", "bits read", ".1f"),
           ("scan_mb", "scan MB", ".1f"), ("row_mb", "rows MB", ".1f"), ("row_hit_rate", "row cache hits", ".2f"),
           ("row_link_mb", "rows over link MB", ".1f")]
# with a row cache each method warms its own and then is timed alone: its warm-ups append, so methods of one setting
# run at their own contexts
ROW_CACHE_COLUMNS = [("row_cache_warmup", "row cache warm-up tokens", "d"),
                     ("timed_from_tokens", "timed from token", ",d")]


def markdown(payload: dict) -> str:
    rates = payload.get("link_GBps_runs") or [payload["link_GBps"]]  # merged runs: each floor at its run's rate
    rate = f"{rates[0]:.1f} GB/s" if len(rates) == 1 else \
        f"each run's own rate ({', '.join(f'{r:.1f}' for r in rates)} GB/s)"
    lines = [f"Whole decode token of Qwen3-8B's shape ({LAYERS} layers × {KV_HEADS} KV heads, G = {GROUP_SIZE}, "
             f"d = {HEAD_DIM}) on {payload['device']}: every layer appends the token's K/V and runs its step. "
             f"GPU: CUDA events, the token queued behind a sleep kernel; wall: host time of an unqueued token; host: "
             f"enqueue time per layer; floor: link bytes at {rate} (one 1 GiB pinned copy, "
             f"same run). Medians. **Synthetic** keys and queries with the per-channel statistics of "
             f"{payload['keys'].split('of ', 1)[1]}."
             + (f" The plane scans read {payload['scan_reads']}." if payload.get("scan_reads", "midpoints")
                != "midpoints" else ""), ""]
    groups: dict[tuple, list[dict]] = {}
    for r in payload["records"]:
        groups.setdefault((r["regime"], _setting_label(r)), []).append(r)
    for (regime, _), rows in groups.items():
        r0 = rows[0]
        lines += [f"### {_setting_label(r0)}, store in {'pinned host memory' if regime == 'host' else 'HBM'} "
                  f"({r0['physical_layers']} physical layers)", ""]
        table = [{**r, "scan_mb": r["scan_bytes"] / 1e6, "row_mb": r["row_bytes"] / 1e6,
                  "tokens_per_s": tokens_per_s(r),  # also for records made before it was recorded
                  "row_link_mb": r.get("row_link_bytes", r["row_bytes"]) / 1e6} for r in rows]
        cached = any(r.get("row_cache_rows") for r in rows)
        lines += [markdown_table(table, COLUMNS + ROW_CACHE_COLUMNS if cached else COLUMNS), ""]
        eager = [r for r in rows if r["mode"] == "eager" and r["stages_ms"]]
        if eager:
            lines += ["GPU ms per stage (eager token, summed over layers):", "",
                      markdown_table([{"label": r["label"], **r["stages_ms"]} for r in eager],
                                     [("label", "method@bits", "s")]
                                     + [(s, s, ".2f") for s in eager[0]["stages_ms"]]), ""]  # decoder's order
        profiled = {r["label"]: r["kernels_us"] for r in rows if r.get("kernels_us")}
        if profiled:
            lines += [f"GPU µs per token by kernel (eager token, torch's profiler; the {KERNELS_SHOWN} largest of "
                      f"any method{sealing_note(rows)}):", "", kernel_table(profiled), ""]
    return "\n".join(lines) + "\n"


KERNELS_SHOWN = 12


def sealing_note(rows: list[dict]) -> str:
    """How many of each method's profiled tokens sealed a block (their seal kernels do its work; the others' return
    at once), for the kernel table's caption; '' for records made before it was recorded."""
    counts = {(r["kernel_tokens"], r["kernel_sealing_tokens"]) for r in rows
              if r.get("kernels_us") and r.get("kernel_sealing_tokens") is not None}
    if not counts:
        return ""
    return "; " + ", ".join(f"{sealing} of {tokens} tokens sealed a block" for tokens, sealing in sorted(counts))


def kernel_table(profiled: dict[str, dict[str, float]]) -> str:
    """Kernels as rows, methods as columns (µs per token), the largest first."""
    largest = sorted({name for us in profiled.values() for name in us},
                     key=lambda name: -max(us.get(name, 0.0) for us in profiled.values()))[:KERNELS_SHOWN]
    rows = [{"kernel": name, **{label: us.get(name) for label, us in profiled.items()}} for name in largest]
    rows.append({"kernel": "all kernels", **{label: sum(us.values()) for label, us in profiled.items()}})
    return markdown_table(rows, [("kernel", "kernel", "s")] + [(label, label, ".0f") for label in profiled])


def summary(payload: dict) -> str:
    """The short table printed last: fathom-48 against DS-136 per setting, graph mode."""
    rows = []
    by = {(r["regime"], _setting_label(r), r["mode"], r["label"]): r for r in payload["records"]}
    for (regime, setting, mode, label), r in by.items():
        if label == "fathom@48" and mode == "graph":
            ds = by.get((regime, setting, mode, "double-sparsity@136"))
            rows.append({"setting": f"{setting} {regime}", "fathom": r["gpu_ms"], "ds": ds and ds["gpu_ms"],
                         "x": r["speedup_vs_ds136"], "wall_x": r["wall_speedup_vs_ds136"],
                         "floor": r["gpu_over_floor"], "wall_gpu": r["wall_over_gpu"]})
    return markdown_table(rows, [("setting", "setting", "s"), ("fathom", "fathom@48 GPU ms", ".2f"),
                                 ("ds", "DS-136 GPU ms", ".2f"), ("x", "GPU ×", ".2f"), ("wall_x", "wall ×", ".2f"),
                                 ("floor", "fathom GPU / floor", ".2f"), ("wall_gpu", "fathom wall / GPU", ".2f")])


def plot(payload: dict, path: Path) -> None:
    """GPU ms per decode token of every method (graph mode, store in host memory), one panel per setting, with the
    PCIe floor of each method as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["records"] if r["regime"] == "host" and r["mode"] == "graph"]
    settings = list(dict.fromkeys(_setting_label(r) for r in rows))
    if not settings:
        return
    cols = min(3, len(settings))
    fig, axes = plt.subplots(math.ceil(len(settings) / cols), cols, figsize=(5.2 * cols, 3.6 *
                             math.ceil(len(settings) / cols)), squeeze=False)
    for ax, setting in zip(axes.flat, settings):
        rs = [r for r in rows if _setting_label(r) == setting]
        labels = [r["label"] for r in rs]
        ax.barh(labels, [r["gpu_ms"] for r in rs], color=["C0" if r["method"] == "fathom" else "C7" for r in rs])
        ax.scatter([r["floor_ms"] for r in rs], labels, marker="|", s=200, color="C3", label="PCIe floor")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{setting} (graph, store in host memory)", fontsize=9)
        ax.set_xlabel("GPU ms per decode token")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="x", which="both")
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{payload['device']}: decode token of Qwen3-8B's shape (synthetic keys with real channel "
                 "statistics)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
