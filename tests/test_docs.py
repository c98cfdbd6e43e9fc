"""Every ```python block in README.md and docs/ runs as written, so the examples cannot rot."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    pytest.param(code, id=f"{page.relative_to(ROOT)}#{n}")
    for page in PAGES
    for n, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


@pytest.mark.parametrize("code", BLOCKS)
def test_python_block_runs(code):
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})
