"""``python -m bench <command>``: fidelity (error against bits)."""

from __future__ import annotations

import argparse

from bench import fidelity
from bench.report import command_line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fidelity.add_arguments(commands.add_parser("fidelity", help="attention error against scan bits, every method"))
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)
    if args.command == "fidelity":
        fidelity.run(args)


if __name__ == "__main__":
    main()
