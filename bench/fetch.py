"""``python -m bench fetch NAME [NAME ...] [--cache DIR]``: real models and corpora into the self-checking cache
(:mod:`bench.artifacts`), each printed with where it lies, its size and the time it took."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from bench import corpora, models
from bench.artifacts import CACHE_ENV, bytes_under, cache_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Fetch the named models and corpora (``all-models`` and ``all-corpora`` name every one); 0 when done."""
    groups = {"all-models": list(models.MODELS), "all-corpora": list(corpora.CORPORA)}
    known = ", ".join([*groups, *models.MODELS, *corpora.CORPORA])
    parser = argparse.ArgumentParser(
        prog="python -m bench fetch",
        description="Download, check and convert real models and text into the cache.",
    )
    parser.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help=f"one of {known} (or austen:NOVEL for one novel)",
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"cache folder (default ${CACHE_ENV} or ~/.cache/fathom)"
    )
    args = parser.parse_args(argv)
    names = [name for arg in args.names for name in groups.get(arg, [arg])]
    for name in names:
        if name not in models.MODELS and not corpora.is_corpus(name):
            parser.error(f"unknown name {name!r}; known: {known}, austen:NOVEL")
    if args.cache is not None and args.cache.exists() and not args.cache.is_dir():
        parser.error(f"--cache {args.cache} names an existing file; --cache must be a folder")
    root = cache_dir(args.cache)
    for name in names:
        started = time.perf_counter()
        path = models.ensure(name, root) if name in models.MODELS else corpora.ensure(name, root)
        seconds = time.perf_counter() - started
        print(f"{name}: {path} ({bytes_under(path) / 1e6:.1f} MB, {seconds:.1f} s)", flush=True)
    return 0
