"""``python -m bench <command>``: fidelity (error against bits), headline (summary table), gpu-step (GPU timing), fetch (models and corpora into the cache)."""

from __future__ import annotations

import argparse
import sys

from bench import cli, fetch, fidelity, headline
from bench.report import command_line


def main(argv: list[str] | None = None) -> None:
    """Run one command. Bad input (:class:`bench.cli.UsageError`) prints ``error: …`` and exits 2; a failed
    download or cache repair (:class:`bench.fetch.FetchError`) prints ``error: …`` and exits 1; a bug raises."""
    try:
        _run(sys.argv[1:] if argv is None else argv)
    except cli.UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except fetch.FetchError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def _run(argv: list[str]) -> None:
    if argv[:1] == ["fetch"]:  # fetch and gpu-step parse their own arguments
        raise SystemExit(fetch.main(argv[1:]))
    if argv[:1] == ["gpu-step"]:
        if not any(a.split("=")[0] == "--replot" for a in argv):  # remaking a table and plot needs no GPU
            cli.require_cuda("gpu-step")
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
    written = {"fidelity": fidelity.run, "headline": headline.run}[args.command](args)
    # the result and its siblings (a fidelity run's .md, .png, .calibration.npz): the last thing printed
    print(f"\nwrote {', '.join(str(p) for p in sorted(written.parent.glob(written.stem + '.*')))}")


if __name__ == "__main__":
    main()
