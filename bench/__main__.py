"""``python -m bench <command>``: fidelity (error against bits), headline (summary table), gpu-step (GPU timing), fetch (models and corpora into the cache)."""

from __future__ import annotations

import argparse
import sys

from bench import fetch, fidelity, headline
from bench.report import command_line


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["fetch"]:  # fetch and gpu-step parse their own arguments
        raise SystemExit(fetch.main(argv[1:]))
    if argv[:1] == ["gpu-step"]:
        from bench import gpu_step  # imports the CUDA path: only when asked for

        return gpu_step.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fidelity.add_arguments(commands.add_parser("fidelity", help="attention error against scan bits, every method"))
    headline.add_arguments(commands.add_parser("headline", help="one table of the real-model fidelity summaries"))
    commands.add_parser("fetch", help="download, check and convert models and corpora (see fetch --help)")
    commands.add_parser("gpu-step", help="time one offloaded decode step on the GPU (see gpu-step --help)")
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    if args.command == "fidelity":
        fidelity.run(args)
    elif args.command == "headline":
        headline.run(args)


if __name__ == "__main__":
    main()
