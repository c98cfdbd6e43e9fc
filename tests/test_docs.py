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


def test_readme_table_lists_every_public_op():
    from tests import op_table

    table = (ROOT / "README.md").read_text().split("What exists today:", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"`([a-z_0-9]+)`", table))
    missing = sorted({op.name for op in op_table.OPS} - named)
    assert not missing, f"README's table of ops lacks {missing}"
