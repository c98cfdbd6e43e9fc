"""The rules of docs/contributing.md that a reader of the code cannot see at a glance, checked
against the tree: the map names every module, families reach into no other family's privates,
no module reads another's underscore names, compat imports nothing from ops/ and calls the
internal surface (torch.ops.pcops) by keyword only, with the names its schemas give."""

import ast
import re
import sys
from pathlib import Path

import pytest
import torch

import pcops  # noqa: F401  (registers torch.ops.pcops)

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pcops"
CONTRIBUTING = (ROOT / "docs" / "contributing.md").read_text()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _family(module: str):
    """``ops.<family>`` for a module of an op family, ``compat`` for a drop-in, ``distributed`` for
    pcops.distributed, else None (shared)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["pcops", "ops"] and not parts[2].startswith("_"):
        return "ops." + parts[2]
    if len(parts) >= 2 and parts[:2] in (["pcops", "compat"], ["pcops", "distributed"]):
        return parts[1]
    return None


def _imports(path: Path):
    """(line, imported module or name as a dotted path, local name) of each ``from ... import``."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}", alias.asname or alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, alias.asname or alias.name.split(".")[0]


SOURCES = sorted(PKG.rglob("*.py"))


def test_the_map_names_every_module_family_and_drop_in():
    block = CONTRIBUTING.split("## The map", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"[\w.]+/?", block))
    top = [p.name + ("/" if p.is_dir() else "") for p in PKG.iterdir() if p.name not in ("__pycache__", "py.typed")]
    families = [p.name + "/" for p in (PKG / "ops").iterdir() if p.is_dir() and p.name != "__pycache__"]
    shared_ops = [p.name for p in (PKG / "ops").glob("_*.py")]
    drop_ins = [p.name for p in (PKG / "compat").glob("*.py") if p.name != "__init__.py"]
    missing = [name for name in top + families + shared_ops + drop_ins if name not in named]
    assert not missing, f"docs/contributing.md's map does not name {missing}"


def test_no_family_imports_another_familys_privates_and_compat_nothing_from_ops():
    wrong = []
    for path in SOURCES:
        own = _family(_module(path))
        if own is None:
            continue
        for line, target, _ in _imports(path):
            if not target.startswith("pcops."):
                continue
            other = _family(target)
            if other is None or other == own:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if own in ("compat", "distributed") and other.startswith("ops."):
                wrong.append(where + f" ({own} builds on the public functions and the internal surface)")
            elif any(part.startswith("_") and not part.startswith("__") for part in target.split(".")[2:]):
                wrong.append(where + " (another family's private module or name)")
    assert not wrong, "\n".join(wrong)


def test_no_module_reads_another_modules_underscore_names():
    wrong = []
    for path in SOURCES:
        module = _module(path)
        local = {name: target for _, target, name in _imports(path) if target.startswith("pcops")}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in local:
                attr, target = node.attr, local[node.value.id]
                private = attr.startswith("_") and not attr.startswith("__")
                if private and target != module and (_family(target) is None or _family(target) != _family(module)):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {target}.{attr}")
    assert not wrong, "\n".join(wrong)


def _surface_calls():
    """(file:line, op name, positional count, keyword names) of every ``torch.ops.pcops.<op>(...)`` in compat/."""
    for path in sorted((PKG / "compat").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if ast.unparse(owner) == "torch.ops.pcops":
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", node.func.attr, len(node.args), [k.arg for k in node.keywords]


def test_compat_calls_the_documented_internal_surface_by_keyword_with_the_schemas_names():
    table = CONTRIBUTING.split("### The internal surface compat builds on", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))
    calls = list(_surface_calls())
    assert calls, "compat calls no torch.ops.pcops op: the surface table should then be empty"
    assert {op for _, op, _, _ in calls} == documented, "docs/contributing.md's surface table and compat's calls differ"
    for where, op, positional, keywords in calls:
        assert positional == 0, f"{where}: torch.ops.pcops.{op} called with {positional} positional arguments (keywords only)"
        names = [a.name for a in getattr(torch.ops.pcops, op).default._schema.arguments]
        unknown = [k for k in keywords if k not in names]
        assert not unknown, f"{where}: torch.ops.pcops.{op} has no argument {unknown} (schema: {names})"


@pytest.mark.parametrize("rule", ["family", "attribute"])
def test_the_import_rules_catch_a_violation(tmp_path, monkeypatch, rule):
    """The checks above can fail: a module written against each rule is caught."""
    family = tmp_path / "pcops" / "ops" / "transport"
    family.mkdir(parents=True)
    bad = family / "bad.py"
    bad.write_text("from ..geometry.chamfer import _secret\n" if rule == "family" else "from ... import _validate\nx = _validate._hidden\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", [bad])
    check = (test_no_family_imports_another_familys_privates_and_compat_nothing_from_ops if rule == "family"
             else test_no_module_reads_another_modules_underscore_names)
    with pytest.raises(AssertionError, match="_secret" if rule == "family" else "_hidden"):
        check()


def test_tests_mirror_the_op_families():
    """tests/ops/<family>/test_<module>*.py for every op module (or package) of pcops/ops/<family>."""
    missing = []
    for family in sorted(p for p in (PKG / "ops").iterdir() if p.is_dir() and not p.name.startswith("_")):
        modules = [p.stem for p in family.glob("*.py") if not p.name.startswith("_")]
        modules += [p.name for p in family.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
        for module in modules:
            if not list((ROOT / "tests" / "ops" / family.name).glob(f"test_{module}*.py")):
                missing.append(f"tests/ops/{family.name}/test_{module}.py")
    assert not missing, f"no tests for {missing}"
