"""A GPU's gather of K/V rows from pinned, device-mapped host memory, measured by where the rows lie: at random over
growing footprints, in runs of consecutive rows, and at random within a few random 4 KiB pages or 2 MiB regions;
then small gathers the size of a decode step's one layer; beside them a long read. The decode step's row gather
(``fathom.cuda.attention``) is such a gather: what it pays per host page touched is measured here
(docs/results.md).

``python -m bench.gather_probe [--gib 8] [--row-bytes 512] [--rows 131072] [--out bench/results/gather-probe.json]``
(needs a GPU). The memory is fathom's own (:class:`fathom.host.pinned.MappedBuffer`); the gather is torch's
``index_select`` of ``--rows`` rows, 10 timed after 2 untimed, CUDA events.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.cli import UsageError, plain, probe_ready
from bench.report import command_line, markdown_table

GIB = 1 << 30
PAGE, REGION = 4096, 2 << 20
REPS = 10
SMALL_GATHERS = (1024, 4096, 16384)  # rows: a decode step's gather of one layer is a few thousand
LAYER_BYTES = 512 << 20  # one layer's K/V rows at 128k × 8 KV heads × 512 B
DEVICE = "cuda"  # where the row ids are drawn (the tests draw them on the CPU, under the CUDA simulator)


def patterns(total_rows: int, row_bytes: int, gathered: int) -> list[tuple[str, int, int]]:
    """``(pattern, parameter, footprint rows)`` measured for a buffer of ``total_rows`` rows: ``random`` within the
    first ``parameter`` rows (a quarter GiB, 2 GiB, all), ``runs`` of ``parameter`` consecutive rows at random,
    ``pages`` / ``regions``: at random within ``parameter`` random 4 KiB pages / 2 MiB regions (those that fit)."""
    out = [("random", rows, rows) for rows in sorted({min(total_rows, GIB // 4 // row_bytes),
                                                       min(total_rows, 2 * GIB // row_bytes), total_rows})]
    out += [("runs", c, total_rows) for c in (2, 8, 32, 128) if c <= gathered]
    for name, unit in (("pages", PAGE), ("regions", REGION)):
        out += [(name, count, count * unit // row_bytes) for count in (512, 4096, 32768)
                if count * unit <= total_rows * row_bytes]
    return out


def describe(pattern: str, parameter: int, row_bytes: int) -> str:
    """A pattern in words, for the table."""
    if pattern == "random":
        return f"at random within the first {parameter * row_bytes / GIB:g} GiB"
    if pattern == "runs":
        return f"in runs of {parameter} consecutive rows, at random"
    if pattern == "long read":
        return f"a long read (a sum) of {parameter / GIB:g} GiB"
    if pattern == "small":
        return f"a small gather: {parameter:,} rows at random"
    return f"at random within {parameter:,} random {'4 KiB pages' if pattern == 'pages' else '2 MiB regions'}"


def row_index(pattern: str, parameter: int, total_rows: int, row_bytes: int, gathered: int, generator, device):
    """The ``gathered`` row ids of one pattern (int64 on ``device``): see :func:`patterns`."""
    import torch

    def draw(high: int, n: int):
        return torch.randint(0, high, (n,), device=device, generator=generator)

    if pattern == "random":
        return draw(parameter, gathered)
    if pattern == "runs":
        starts = draw(total_rows // parameter, gathered // parameter) * parameter
        return (starts[:, None] + torch.arange(parameter, device=device)).reshape(-1)
    per_unit = (PAGE if pattern == "pages" else REGION) // row_bytes
    units = torch.randperm(total_rows // per_unit, device=device, generator=generator)[:parameter]
    return units[draw(parameter, gathered)] * per_unit + draw(per_unit, gathered)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gather_probe",
                                     description=plain(__doc__.split("\n\n")[0]))  # no reST in --help
    parser.add_argument("--gib", type=int, default=8, help="GiB of pinned, mapped rows (default 8)")
    parser.add_argument("--row-bytes", type=int, default=512,
                        help="bytes a row: a token's K and V of one head, 4·d in fp16 (default 512: d = 128)")
    parser.add_argument("--rows", type=int, default=131072, help="rows a gather (default 131072)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gather-probe.json"),
                        help="JSON written here, the table beside it as .md (default bench/results/gather-probe.json)")
    args = parser.parse_args(argv)

    def check_rows() -> None:
        if not (args.row_bytes >= 4 and args.row_bytes % 4 == 0 and PAGE % args.row_bytes == 0):
            raise UsageError(f"--row-bytes must be a multiple of 4 that divides {PAGE}, got {args.row_bytes}")
        if not 128 <= args.rows <= args.gib * GIB // args.row_bytes:
            raise UsageError(f"--rows must lie in 128..{args.gib * GIB // args.row_bytes} (the rows --gib holds), "
                             f"got {args.rows}")

    probe_ready(parser, args.gib, args.out, check_rows)  # before the pinning: the files are the last thing written
    import numpy as np
    import torch

    from fathom.host.pinned import MappedBuffer

    total_rows = args.gib * GIB // args.row_bytes
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def gb_per_s(work, nbytes: int, reps: int = REPS) -> float:
        for _ in range(2):
            work()
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            work()
        end.record()
        torch.cuda.synchronize()
        return reps * nbytes / (start.elapsed_time(end) / 1e3) / 1e9

    results = []

    def record(pattern: str, parameter: int, footprint_rows: int, rate: float) -> None:
        results.append({"pattern": pattern, "parameter": parameter, "footprint_bytes": footprint_rows * args.row_bytes,
                        "GB_per_s": rate})
        print(json.dumps(results[-1]), flush=True)

    with MappedBuffer((total_rows, args.row_bytes // 4), np.int32) as buffer:
        rows = buffer.tensor()
        rows.fill_(1)
        generator = torch.Generator(device=DEVICE)
        generator.manual_seed(0)
        for pattern, parameter, footprint in patterns(total_rows, args.row_bytes, args.rows):
            index = row_index(pattern, parameter, total_rows, args.row_bytes, args.rows, generator, DEVICE)
            record(pattern, parameter, footprint,
                   gb_per_s(lambda: torch.index_select(rows, 0, index), index.numel() * args.row_bytes))
        # a decode step's gather is small: ~3,000 rows a layer at 128k × 1, from that layer's 512 MiB of rows; each
        # repetition reads fresh rows of the next "layer" (512 MiB further on), as the step's layers follow each other
        layer_rows = min(total_rows, LAYER_BYTES // args.row_bytes)
        layers = total_rows // layer_rows
        for count in SMALL_GATHERS:
            indices = iter([row_index("random", layer_rows, total_rows, args.row_bytes, count, generator, DEVICE)
                            + (rep % layers) * layer_rows for rep in range(REPS + 2)])
            record("small", count, layer_rows,
                   gb_per_s(lambda: torch.index_select(rows, 0, next(indices)), count * args.row_bytes))
        spans = {min(total_rows, GIB // 4 // args.row_bytes), min(total_rows, 2 * GIB // args.row_bytes)}
        for span_rows in sorted(spans):
            span = rows[:span_rows]
            record("long read", span_rows * args.row_bytes, span_rows,
                   gb_per_s(lambda: span.sum(dtype=torch.int64), span_rows * args.row_bytes, reps=3))
    out = {"command": command_line(argv, "python -m bench.gather_probe"), "device": torch.cuda.get_device_name(),
           "gib": args.gib, "row_bytes": args.row_bytes, "rows": args.rows, "reps": REPS, "results": results}
    args.out.write_text(json.dumps(out, indent=1))
    table = markdown_table([{"what": describe(r["pattern"], r["parameter"], args.row_bytes),
                             "footprint": r["footprint_bytes"] / GIB, "rate": r["GB_per_s"]} for r in results],
                           [("what", "rows gathered", "s"), ("footprint", "footprint GiB", ".3f"),
                            ("rate", "GB/s", ".1f")])
    args.out.with_suffix(".md").write_text(
        f"A gather of {args.rows:,} rows of {args.row_bytes} B from {args.gib} GiB of pinned, device-mapped host "
        f"memory ({out['device']}), by where the rows lie. Made by `{out['command']}`.\n\n{table}\n")


if __name__ == "__main__":
    main()
