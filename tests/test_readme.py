"""The README's and the docs' Python examples run as written (under the CUDA simulator in CI, on the GPU with
FATHOM_GPU=1).

Every ```python block of ``README.md`` and ``docs/*.md`` whose first line is ``# checked: <name>`` is executed in
a fresh namespace (names are unique across the files).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> dict[str, tuple[str, str]]:
    blocks: dict[str, tuple[str, str]] = {}
    for path in DOCS:
        for m in re.finditer(r"```python\n# checked: (\S+)\n.*?```", path.read_text(encoding="utf-8"), flags=re.S):
            assert m.group(1) not in blocks, f"# checked: {m.group(1)} twice ({blocks[m.group(1)][0]}, {path.name})"
            blocks[m.group(1)] = (str(path.relative_to(ROOT)), m.group(0))
    return blocks


BLOCKS = _blocks()


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_readme_example_runs(name):
    where, block = BLOCKS[name]
    code = block.removeprefix("```python\n").removesuffix("```")
    exec(compile(code, f"{where}:{name}", "exec"), {"__name__": f"readme_{name}"})


def test_the_examples_are_found():
    assert {"reference", "decode-step", "offloaded-decode"} <= set(BLOCKS)
    assert BLOCKS["offloaded-decode"][0] == "README.md"  # the README's "Use the kernels"
