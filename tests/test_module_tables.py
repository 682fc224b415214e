"""The module tables of ``fathom.cuda``, ``fathom.host``, ``fathom.integrations`` and ``bench`` (their ``__init__``
docstrings) name exactly the package's modules (a subpackage counts as one), the cuda table's NumPy twins exist, and
``docs/modules.md`` names every module of the reference and every package: the docs cannot drift from the code."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["fathom/cuda", "fathom/host", "fathom/integrations", "bench"]
BORDER = re.compile(r"=+(?: +=+)+")


def table(package: str) -> list[list[str]]:
    """The rows of the reST simple table in ``<package>/__init__.py``'s docstring, as the text of each column (a
    row's continuation lines joined to it)."""
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text(encoding="utf-8")))
    lines = doc.splitlines()
    borders = [i for i, line in enumerate(lines) if BORDER.fullmatch(line)]
    assert len(borders) == 3, f"{package}/__init__.py: one table (3 border lines), found {len(borders)}"
    spans = [m.span() for m in re.finditer(r"=+", lines[borders[0]])]
    spans[-1] = (spans[-1][0], None)  # the last column may run past its border
    rows: list[list[str]] = []
    for line in lines[borders[1] + 1:borders[2]]:
        cells = [line[start:stop].strip() for start, stop in spans]
        if cells[0]:
            rows.append(cells)
        else:  # a continuation line
            assert rows, f"{package}: the table starts with a continuation line: {line!r}"
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows


def listed(package: str) -> list[str]:
    names = []
    for row in table(package):
        match = re.fullmatch(r"``(\w+)``", row[0])
        assert match, f"{package}: first column must be ``module``, got {row[0]!r}"
        names.append(match.group(1))
    return names


def package_modules(package: str) -> list[str]:
    """The package's modules (``__init__`` and ``__main__`` aside) and subpackages."""
    folder = ROOT / package
    files = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
    return sorted(files + [p.parent.name for p in folder.glob("*/__init__.py")])


@pytest.mark.parametrize("package", PACKAGES)
def test_the_module_table_names_every_module_of_the_package_and_nothing_else(package):
    names = listed(package)
    found = package_modules(package)
    assert len(names) == len(set(names)), f"{package}: listed twice: {names}"
    assert sorted(set(names) - set(found)) == [], f"{package}: the table lists modules that do not exist"
    assert sorted(set(found) - set(names)) == [], f"{package}: modules missing from the table"


def test_every_numpy_twin_the_cuda_table_names_exists():
    for row in table("fathom/cuda"):
        for reference in re.findall(r"``([a-z_]+(?:\.\w+)+)``", row[-1]):  # module.attribute[.attribute]
            module, *attributes = reference.split(".")
            target = importlib.import_module(f"fathom.{module}")
            for attribute in attributes:
                assert hasattr(target, attribute), f"{row[0]}: no fathom.{reference}"
                target = getattr(target, attribute)


def test_the_layout_doc_names_every_reference_module_and_every_package():
    layout = (ROOT / "docs" / "modules.md").read_text(encoding="utf-8")
    reference = sorted(p.name for p in (ROOT / "fathom").glob("*.py") if not p.name.startswith("_"))
    assert [name for name in reference if f"`fathom/{name}`" not in layout] == [], "docs/modules.md misses these"
    assert [package for package in PACKAGES if f"`{package}/`" not in layout] == [], "docs/modules.md misses these"
