"""``pcops.compat.install``: one line that points other libraries' imports at pcops' drop-ins.

Rules:

- ``install(name)`` puts ``pcops.compat.<name>`` into ``sys.modules`` under ``name``, plus every
  entry of that module's ``__aliases__`` dict (``{"spconv.pytorch": <module>, ...}``), so that a
  later ``import name`` (and ``import name.sub``) anywhere in the process gets the drop-in. A
  drop-in may also define ``__install__()``, run once just before its entries are set (its
  return, if any, says what it did), and ``__in_sys_modules__ = False`` to set no entry at all:
  ``"pyg"`` defines PyG's ``torch.ops.pyg`` point-cloud operators and turns on the flags PyG
  reads at each call, and leaves ``import pyg_lib`` failing (``pcops/compat/pyg_lib.py``).
- A real package is never shadowed: when ``importlib.util.find_spec(name)`` finds one (or one is
  already imported) the name is skipped, with the reason.
- It must run before the imports it redirects: ``import name`` that ran before keeps the module
  it got (reported and warned about). ``"pyg"`` may come at any time: PyG reads its flags at
  each call. It needs torch_geometric installed, and stands for the module ``pyg_lib``, whose
  real package it never shadows.

The result is an ``InstallReport``: for each name whether it was installed, the reason, and the
``sys.modules`` entries set. Names asked for explicitly and skipped also raise a warning;
``install()`` with no names tries every drop-in and only reports what does not apply.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import Dict, NamedTuple, Tuple

# user-facing name -> the module name it stands for
_TARGETS: Dict[str, str] = {
    "torch_cluster": "torch_cluster",
    "torch_scatter": "torch_scatter",
    "spconv": "spconv",
    "pointops": "pointops",
    "pyg": "pyg_lib",
}
_ALIASES = {"pyg_lib": "pyg"}
_COMPAT = "pcops.compat."


class Outcome(NamedTuple):
    installed: bool
    reason: str
    modules: Tuple[str, ...] = ()


class InstallReport(Dict[str, Outcome]):
    """``{name: Outcome(installed, reason, modules)}`` in the order asked."""

    @property
    def installed(self) -> Tuple[str, ...]:
        return tuple(n for n, o in self.items() if o.installed)

    @property
    def skipped(self) -> Dict[str, str]:
        return {n: o.reason for n, o in self.items() if not o.installed}

    def __repr__(self) -> str:
        rows = [f"  {n}: {'installed' if o.installed else 'skipped'} ({o.reason})" for n, o in self.items()]
        return "InstallReport(\n" + "\n".join(rows) + "\n)"


def _real(module: str):
    """The imported or importable module ``module`` that is not pcops' (None if there is none)."""
    present = sys.modules.get(module)
    if present is not None:
        return None if getattr(present, "__name__", "").startswith(_COMPAT) else present
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a broken parent or a module without a spec: treat as present
        return module


def _where(found) -> str:
    if isinstance(found, str):
        return found
    origin = getattr(found, "origin", None) or getattr(found, "__file__", None)
    return origin or "sys.modules"


def _one(name: str, replace: bool = False) -> Outcome:
    module = _TARGETS[name]
    found = _real(module)
    if found is not None and (not replace or module in sys.modules):
        why = "already imported" if module in sys.modules else "installed"
        return Outcome(False, f"a real {module} is {why} ({_where(found)}); left alone")
    try:
        compat = importlib.import_module(_COMPAT + module)
    except Exception as exc:  # not written (yet), or failing to import: nothing to install
        return Outcome(False, f"{_COMPAT}{module} is not available ({type(exc).__name__}: {exc})")
    entries = {module: compat} if getattr(compat, "__in_sys_modules__", True) else {}
    for alias, target in getattr(compat, "__aliases__", {}).items():
        entries[alias] = importlib.import_module(target) if isinstance(target, str) else target
    hook = getattr(compat, "__install__", None)
    done = hook() if hook is not None else None
    sys.modules.update(entries)
    reason = done or f"{module} -> {compat.__name__}"
    if found is not None:
        reason += f" (replacing the real {module} at {_where(found)})"
    return Outcome(True, reason, tuple(entries))


def install(*names: str, replace: bool = False) -> InstallReport:
    """Point ``import <name>`` at pcops' drop-in for each name (all that apply when none given).

    Args:
        names: any of ``"torch_cluster"``, ``"torch_scatter"``, ``"spconv"``, ``"pointops"`` and
            ``"pyg"`` (PyTorch Geometric's pyg-lib point-cloud ops; ``"pyg_lib"`` is the same).
        replace: use the drop-in even where the real package is installed (not yet imported), for
            the names given explicitly: e.g. spconv's CPU wheel, which has no backward pass.
            Never for ``"pyg"``: a real pyg-lib is always left alone.

    Returns:
        InstallReport ``{name: Outcome(installed, reason, modules)}``; ``.installed`` and
        ``.skipped`` list them. Calling it again is harmless (installed names stay installed).

    Call it first, before the imports it redirects::

        import pcops.compat; pcops.compat.install()
        import torch_geometric   # its fps, knn, radius, ... and DynamicEdgeConv now run on pcops
    """
    explicit = bool(names)
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {type(replace).__name__}")
    if replace and not explicit:
        raise ValueError("replace=True needs the names to replace, e.g. install('spconv', replace=True)")
    asked = names if explicit else tuple(_TARGETS)
    report = InstallReport()
    for raw in asked:
        if not isinstance(raw, str):
            raise TypeError(f"names must be strings, got {type(raw).__name__}")
        name = _ALIASES.get(raw, raw)
        if name not in _TARGETS:
            raise ValueError(f"names: unknown drop-in {raw!r}; choose from {sorted(_TARGETS)}")
        if name == "pyg" and importlib.util.find_spec("torch_geometric") is None:
            report[name] = outcome = Outcome(False, "torch_geometric is not installed")
            if explicit:
                warnings.warn(f"pcops.compat.install({raw!r}) skipped: {outcome.reason}", stacklevel=2)
            continue
        if replace and name == "pyg":
            raise ValueError("replace=True does not apply to 'pyg': a real pyg-lib is never shadowed")
        report[name] = outcome = _one(name, replace)
        if explicit and not outcome.installed:
            warnings.warn(f"pcops.compat.install({raw!r}) skipped: {outcome.reason}", stacklevel=2)
    return report
