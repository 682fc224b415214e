"""The README and ``docs/`` stay inside the repository: every relative link reaches a file (and heading) of the
checkout, nothing cites a specification outside it, and the sections the benches rewrite are where the benches'
commands say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", _without_code(path.read_text(encoding="utf-8")),
                                                  flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_in_the_repository_and_reaches_its_target(doc):
    for target in LINK.findall(_without_code(doc.read_text(encoding="utf-8"))):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.is_relative_to(ROOT), f"{doc.name}: {target} leaves the repository"
        assert path.exists(), f"{doc.name}: {target}: no such file"
        if anchor:
            assert anchor in anchors(path), f"{doc.name}: {target}: no such heading in {path.name}"


def test_nothing_cites_a_specification_outside_the_repository():
    for path in [*DOCS, *ROOT.glob("fathom/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        text = path.read_text(encoding="utf-8")
        for needle in ("../" + "shared", "SP" + "EC §", "SP" + "EC.md"):  # spelled apart: this file passes
            assert needle not in text, f"{path.relative_to(ROOT)} cites {needle!r}: cite docs/design.md (design §n)"


def test_the_design_keeps_its_section_numbers():
    numbered = [int(m) for m in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), flags=re.M)]
    assert numbered == list(range(1, 11))


@pytest.mark.parametrize("marker", ["timing", "generate"])
def test_the_generated_sections_live_in_the_results_doc(marker):
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert results.count(start) == results.count(end) == 1 and results.index(start) < results.index(end)
    for doc in DOCS:
        if doc.name != "results.md":
            assert start not in doc.read_text(encoding="utf-8"), doc.name


def test_the_timing_section_is_what_replot_makes_of_the_committed_json():
    from bench import timing_report

    source = ROOT / "bench" / "results" / "timing-qwen3-8b.json"
    section = (ROOT / "docs" / "results.md").read_text(encoding="utf-8").split(timing_report.README_START)[1]
    section = section.split(timing_report.README_END)[0]
    assert timing_report.readme_table(json.loads(source.read_text(encoding="utf-8"))) in section
    assert "--readme docs/results.md" in section and "bench/results/timing-qwen3-8b.json" in section
