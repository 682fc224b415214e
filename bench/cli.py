"""How ``python -m bench`` commands refuse bad input: one line, before any expensive work.

A command checks its arguments first and raises :class:`UsageError` with a
message that names the argument and what it allows; ``bench.__main__.main``
prints ``error: <message>`` to stderr and exits with status 2, without a
traceback (argparse's own errors exit 2 the same way). Any other exception is
a bug and keeps its traceback. The helpers below are the checks more than one
command needs, argparse types whose refusal says what a value should be
(:func:`int_list`), :func:`result_json`, a result file to ``--replot`` read or refused, and :func:`plain`, a
docstring as ``--help`` text.

Example (a command's first lines)::

    >>> from bench.cli import UsageError, at_least
    >>> at_least("--steps", 15, 1)
    >>> try:
    ...     at_least("--steps", 0, 1)
    ... except UsageError as error:
    ...     print(f"error: {error}")
    error: --steps must be >= 1, got 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path


class UsageError(ValueError):
    """Bad command-line input: the message is one line naming the argument and its allowed range."""


def at_least(name: str, value: int | float, minimum: int | float) -> None:
    """Refuse ``value < minimum``."""
    if value < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {value}")


def require_cuda(command: str) -> None:
    """Refuse to run ``python -m bench <command>`` without a CUDA GPU (call it before importing the GPU path)."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"python -m bench {command} needs a CUDA GPU (torch.cuda.is_available() is False)")


def probe_ready(parser, gib: int, out: Path, check=None) -> None:
    """A standalone probe's (``python -m bench.<probe>``) checks before it pins memory, in this order: ``--gib``
    at least 1, the probe's own ``check`` (a callable raising :class:`UsageError`), ``--out`` writable and a CUDA
    GPU present; each refused through its ``parser`` (``error: …``, exit 2)."""
    try:
        at_least("--gib", gib, 1)
        if check is not None:
            check()
        writable_file("--out", out)
        import torch

        if not torch.cuda.is_available():
            raise UsageError("needs a CUDA GPU (torch.cuda.is_available() is False)")
    except UsageError as error:
        parser.error(str(error))


def writable_folder(name: str, folder: Path) -> Path:
    """Create ``folder`` if needed and prove it writable by writing and removing a probe file; an existing file
    there is refused as such."""
    if folder.exists() and not folder.is_dir():  # mkdir would only say "File exists"
        raise UsageError(f"{name} {folder} names an existing file; {name} must be a folder")
    return _probe(name, folder)


def writable_file(name: str, path: Path) -> Path:
    """A file to write (a JSON named by ``--out``): not an existing folder; its folder created if needed and
    proved writable as :func:`writable_folder` does."""
    if path.is_dir():
        raise UsageError(f"{name} {path} names an existing folder; {name} must name the file to write")
    _probe(name, path.parent)
    return path


def _probe(name: str, folder: Path) -> Path:
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"{name} {folder}: cannot write there ({error.strerror or error})") from None
    return folder


def file_stem(name: str, value: str | None) -> None:
    """Refuse a file name stem (``--name``) that is empty or would leave the results folder."""
    if value is not None and (not value or "/" in value or value in (".", "..")):
        raise UsageError(f"{name} must be a file name stem (no '/'), got {value!r}")


def utf8_text(name: str, path: Path) -> str:
    """The contents of a UTF-8 text file; a missing, unreadable or non-UTF-8 file is refused, naming it."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(f"{name} {path}: cannot read it ({error.strerror or error})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{name} {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def result_json(path: Path, what: str, fields: tuple[str, ...], record_fields: tuple[str, ...] = ()) -> dict:
    """A result JSON to ``--replot``: a missing, unreadable or non-JSON file, one without ``fields``, or (with
    ``record_fields``) one whose ``records`` are not objects holding them, is refused in one line naming the file
    and calling it not ``what`` (e.g. "a fidelity result")."""
    try:
        payload = json.loads(utf8_text("--replot", path))
    except json.JSONDecodeError as error:
        raise UsageError(f"--replot {path}: not JSON ({error})") from None
    if not isinstance(payload, dict):
        raise UsageError(f"--replot {path}: not {what} (not a JSON object)")
    missing = [key for key in fields if key not in payload]
    if missing:
        raise UsageError(f"--replot {path}: not {what} (it lacks {', '.join(missing)})")
    if record_fields:
        records = payload["records"]
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise UsageError(f"--replot {path}: not {what} (its records are not a list of objects)")
        for i, record in enumerate(records):
            missing = [key for key in record_fields if key not in record]
            if missing:
                raise UsageError(f"--replot {path}: not {what} (record {i} lacks {', '.join(missing)})")
    return payload


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers (``32768,131072``); argparse names the option."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None


def name_list(text: str) -> list[str]:
    """An argparse ``type``: comma-separated names (``host,hbm``; a method spec's tag list keeps its commas,
    ``fathom@48,fathom[gains,pooled]@48``)."""
    from fathom.methods import split_specs

    return split_specs(text)


def plain(text: str) -> str:
    """A docstring as plain text for ``--help``: reST markup (double backquotes, roles such as ``:func:``, bold)
    dropped, the words kept.

    >>> plain("``python -m bench``: see :func:`~bench.cli.plain` and **this**")
    'python -m bench: see plain and this'
    """
    text = re.sub(r":[a-z]+:`~[\w.]*?(\w+)`", r"\1", text)  # :func:`~a.b.c` -> c
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
