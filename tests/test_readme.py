"""The README's Python examples run as written (under the CUDA simulator in CI, on the GPU with FATHOM_GPU=1).

Every ```python block of the README whose first line is ``# checked: <name>`` is executed in a fresh namespace.
"""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = {m.group(1): m.group(0) for m in re.finditer(r"```python\n# checked: (\S+)\n.*?```", README.read_text(),
                                                        flags=re.S)}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_readme_example_runs(name):
    code = BLOCKS[name].removeprefix("```python\n").removesuffix("```")
    exec(compile(code, f"README.md:{name}", "exec"), {"__name__": f"readme_{name}"})


def test_the_examples_are_found():
    assert {"reference", "decode-step", "offloaded-decode"} <= set(BLOCKS)
