"""The module tables of ``fathom.cuda`` and ``fathom.host`` (their ``__init__`` docstrings) name exactly the
package's modules, and the cuda table's NumPy twins exist: the docs cannot drift from the code."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

FATHOM = Path(__file__).resolve().parents[1] / "fathom"
BORDER = re.compile(r"=+(?: +=+)+")


def table(package: str) -> list[list[str]]:
    """The rows of the reST simple table in ``fathom/<package>/__init__.py``'s docstring, as the text of each
    column (a row's continuation lines joined to it)."""
    doc = ast.get_docstring(ast.parse((FATHOM / package / "__init__.py").read_text(encoding="utf-8")))
    lines = doc.splitlines()
    borders = [i for i, line in enumerate(lines) if BORDER.fullmatch(line)]
    assert len(borders) == 3, f"fathom/{package}/__init__.py: one table (3 border lines), found {len(borders)}"
    spans = [m.span() for m in re.finditer(r"=+", lines[borders[0]])]
    spans[-1] = (spans[-1][0], None)  # the last column may run past its border
    rows: list[list[str]] = []
    for line in lines[borders[1] + 1:borders[2]]:
        cells = [line[start:stop].strip() for start, stop in spans]
        if cells[0]:
            rows.append(cells)
        else:  # a continuation line
            assert rows, f"fathom/{package}: the table starts with a continuation line: {line!r}"
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows


def listed(package: str) -> list[str]:
    names = []
    for row in table(package):
        match = re.fullmatch(r"``(\w+)``", row[0])
        assert match, f"fathom/{package}: first column must be ``module``, got {row[0]!r}"
        names.append(match.group(1))
    return names


@pytest.mark.parametrize("package", ["cuda", "host"])
def test_the_module_table_names_every_module_of_the_package_and_nothing_else(package):
    names = listed(package)
    modules = sorted(p.stem for p in (FATHOM / package).glob("*.py") if p.stem != "__init__")
    assert len(names) == len(set(names)), f"fathom/{package}: listed twice: {names}"
    assert sorted(set(names) - set(modules)) == [], f"fathom/{package}: the table lists modules that do not exist"
    assert sorted(set(modules) - set(names)) == [], f"fathom/{package}: modules missing from the table"


def test_every_numpy_twin_the_cuda_table_names_exists():
    for row in table("cuda"):
        for reference in re.findall(r"``([a-z_]+(?:\.\w+)+)``", row[-1]):  # module.attribute[.attribute]
            module, *attributes = reference.split(".")
            target = importlib.import_module(f"fathom.{module}")
            for attribute in attributes:
                assert hasattr(target, attribute), f"{row[0]}: no fathom.{reference}"
                target = getattr(target, attribute)
