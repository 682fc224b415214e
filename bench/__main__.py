"""``python -m bench <command>``: fidelity (error against bits), headline (summary table), timing (the decode token
on the GPU), soak (memory over many caches), channel-stats (real channel statistics for it), fetch (models and corpora into the cache)."""

from __future__ import annotations

import argparse
import sys

from bench import channel_stats, fetch, fidelity, headline, soak, timing
from bench.report import command_line


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["fetch"]:  # fetch parses its own arguments
        raise SystemExit(fetch.main(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fidelity.add_arguments(commands.add_parser("fidelity", help="attention error against scan bits, every method"))
    headline.add_arguments(commands.add_parser("headline", help="one table of the real-model fidelity summaries"))
    channel_stats.add_arguments(commands.add_parser("channel-stats", help="per-channel key/query statistics of a "
                                                    "real capture (for the GPU timing's synthetic keys)"))
    commands.add_parser("fetch", help="download, check and convert models and corpora (see fetch --help)")
    timing.add_arguments(commands.add_parser("timing", help="the whole decode token on the GPU, every method, eager "
                                                          "and CUDA graph"))
    soak.add_arguments(commands.add_parser("soak", help="create / use / close an offloaded cache many times: memory "
                                                      "stays flat"))
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    if args.command == "fidelity":
        fidelity.run(args)
    elif args.command == "headline":
        headline.run(args)
    elif args.command == "channel-stats":
        channel_stats.run(args)
    elif args.command == "timing":
        timing.run(args)
    elif args.command == "soak":
        soak.run(args)


if __name__ == "__main__":
    main()
