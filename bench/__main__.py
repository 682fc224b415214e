"""``python -m bench <command>``: fidelity (error against bits), headline (summary table), ruler (RULER through
lm-eval and FathomCache), agreement (greedy-token agreement with dense), timing (the decode token on the GPU), generate (a model through
transformers' generate, HF's caches and FathomCache side by side), rowreuse (how often generated tokens
fetch the rows earlier tokens fetched: an HBM row cache's hit rate), soak
(memory over many caches), channel-stats (real channel statistics for the timing's keys), fetch (models and
corpora into the cache)."""

from __future__ import annotations

import argparse
import sys

from bench import (agreement, artifacts, channel_stats, cli, fetch, fidelity, generate, headline, rowreuse, ruler,
                   soak, timing)
from bench.report import command_line


def main(argv: list[str] | None = None) -> None:
    """Run one command. Bad input (:class:`bench.cli.UsageError`) prints ``error: …`` and exits 2; a failed
    download or cache repair (:class:`bench.artifacts.FetchError`) prints ``error: …`` and exits 1; a bug raises."""
    try:
        _run(sys.argv[1:] if argv is None else argv)
    except cli.UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except artifacts.FetchError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def _run(argv: list[str]) -> None:
    if argv[:1] == ["fetch"]:  # fetch parses its own arguments
        raise SystemExit(fetch.main(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m bench", description=cli.plain(__doc__))  # no reST in --help
    commands = parser.add_subparsers(dest="command", required=True)
    fidelity.add_arguments(commands.add_parser("fidelity", help="attention error against scan bits, every method"))
    headline.add_arguments(commands.add_parser("headline", help="one table of the real-model fidelity summaries"))
    ruler.add_arguments(commands.add_parser("ruler", help="lm-eval's RULER tasks decoded through FathomCache"))
    agreement.add_arguments(commands.add_parser("agreement", help="greedy next-token agreement with dense, "
                                                                  "teacher-forced on real source code"))
    timing.add_arguments(commands.add_parser("timing", help="the whole decode token on the GPU, every method, eager "
                                                          "and CUDA graph"))
    generate.add_arguments(commands.add_parser("generate", help="a model decoding through transformers' generate: "
                                                              "HF's caches and FathomCache side by side"))
    rowreuse.add_arguments(commands.add_parser("rowreuse", help="row reuse between generated tokens: an HBM row "
                                                              "cache's hit rate (CPU reference)"))
    soak.add_arguments(commands.add_parser("soak", help="create / use / close an offloaded cache many times: memory "
                                                      "stays flat"))
    channel_stats.add_arguments(commands.add_parser("channel-stats", help="per-channel key/query statistics of a "
                                                    "real capture (for the GPU timing's synthetic keys)"))
    commands.add_parser("fetch", help="download, check and convert models and corpora (see fetch --help)")
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    if getattr(args, "cache", None) is not None:  # every command's model / corpus / capture cache folder
        args.cache = cli.writable_folder("--cache", args.cache)
    run = {"fidelity": fidelity.run, "headline": headline.run, "ruler": ruler.run, "agreement": agreement.run,
           "timing": timing.run, "generate": generate.run, "rowreuse": rowreuse.run, "soak": soak.run,
           "channel-stats": channel_stats.run}[args.command]
    written = run(args)
    # the result and its siblings (a fidelity run's .md, .png, .calibration.npz): the last thing printed
    print(f"\nwrote {', '.join(str(p) for p in sorted(written.parent.glob(written.stem + '.*')))}")


if __name__ == "__main__":
    main()
