"""Writing a benchmark's results: JSON (with the command that made them), a markdown table and a PNG plot."""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LOCAL_RESULTS = RESULTS / "local"  # quick runs' results: ignored by git, so a first run leaves the checkout clean


def repo_path(path: str | Path) -> Path:
    """``path`` relative to the repository where it lies inside it (what a committed result or a doc names: no
    machine's folder), else as given."""
    path, root = Path(path), RESULTS.parents[1]
    return path.resolve().relative_to(root) if path.resolve().is_relative_to(root) else path


def context_label(n: int) -> str:
    """A context length for file names and tables: ``4k`` for 4096 tokens, the token count when not whole k."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def command_line(argv: list[str] | None = None, program: str = "python -m bench") -> str:
    """The command that made a result, as a user would type it: each argument shell-quoted, so that the line runs
    again as it ran (a path with a space stays one argument). ``program``: another entry point, e.g. ``python -m
    bench.tier_split``."""
    return f"{program} " + shlex.join(sys.argv[1:] if argv is None else argv)


def write_json(path: Path, command: str, payload: dict) -> Path:
    payload = {"command": command, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec); None cells print as a dash."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = ["—" if row.get(k) is None else format(row[k], f) for k, _, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
