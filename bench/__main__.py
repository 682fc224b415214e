"""``python -m bench <command>``: fidelity (error against bits), headline (summary table), ruler (RULER through lm-eval and FathomCache), agreement (greedy-token agreement with dense), gpu-step (GPU timing), fetch (models and corpora into the cache)."""

from __future__ import annotations

import argparse
import sys

from bench import agreement, fetch, fidelity, headline, ruler
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
    ruler.add_arguments(commands.add_parser("ruler", help="lm-eval's RULER tasks decoded through FathomCache"))
    agreement.add_arguments(commands.add_parser("agreement", help="greedy next-token agreement with dense, "
                                                                  "teacher-forced on real source code"))
    commands.add_parser("fetch", help="download, check and convert models and corpora (see fetch --help)")
    commands.add_parser("gpu-step", help="time one offloaded decode step on the GPU (see gpu-step --help)")
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    if args.command == "fidelity":
        fidelity.run(args)
    elif args.command == "headline":
        headline.run(args)
    elif args.command == "ruler":
        ruler.run(args)
    elif args.command == "agreement":
        agreement.run(args)


if __name__ == "__main__":
    main()
