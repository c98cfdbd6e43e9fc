"""The documentation site builds without a warning, its API reference lists every public name, and
the docstrings' examples run.

The site build (``sphinx-build -W``) runs the gallery's examples (``examples/``) and autodoc over
every docstring of the API reference; it needs the ``docs`` extra (``pip install -e ".[docs]"``)
and is skipped, with that reason, without it.
"""

import doctest
import importlib
import importlib.util
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import pcops

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SPHINX = ("sphinx", "myst_parser", "sphinx_gallery", "furo", "matplotlib")
MISSING = [name for name in SPHINX if importlib.util.find_spec(name) is None]


def test_api_reference_lists_every_public_name():
    text = "\n".join(page.read_text() for page in sorted((DOCS / "api").glob("*.rst")))
    documented = set(re.findall(r"^\.\. auto(?:function|class):: (\w+)$", text, re.M))
    missing = sorted(set(pcops.__all__) - {"__version__"} - documented)
    assert not missing, f"public names without an entry in docs/api/*.rst: {missing}"
    for module in ("pcops.warp_op", "pcops.memory", "pcops.compat.torch_cluster", "pcops.compat.pytorch3d"):
        assert f".. automodule:: {module}\n" in text, module


def test_every_page_is_in_the_site():
    index = (DOCS / "index.md").read_text()
    pages = [p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.glob("*.md")]
    pages += [p.relative_to(DOCS).with_suffix("").as_posix() for p in (DOCS / "ops").glob("*.md")]
    missing = [page for page in pages if page != "index" and not re.search(rf"^{re.escape(page)}$", index, re.M)]
    assert not missing, f"pages of docs/ in no toctree of docs/index.md: {missing}"
    assert len(list((ROOT / "examples").glob("plot_*.py"))) >= 6


def _modules():
    yield pcops
    for info in pkgutil.walk_packages(pcops.__path__, "pcops."):
        yield importlib.import_module(info.name)


def _doctests():
    finder = doctest.DocTestFinder()
    return [test for module in _modules() for test in finder.find(module) if test.examples]


DOCTESTS = _doctests()


def test_docstrings_have_examples():
    assert DOCTESTS, "no docstring example (>>>) found in pcops"


def test_every_public_function_has_a_docstring_example():
    """Each function of pcops.__all__ shows a call of itself (``pcops.<name>(``) in a ``>>>``
    example, which the test below runs; warp_op's example defines a Warp kernel, which needs a
    source file: docs/warp_op.md holds it, run by tests/test_docs.py."""
    import inspect

    import pcops

    functions = [n for n in pcops.__all__ if callable(getattr(pcops, n)) and not inspect.isclass(getattr(pcops, n))]
    missing = [n for n in functions if n != "warp_op" and ">>> " not in (getattr(pcops, n).__doc__ or "")]
    missing += [n for n in functions if n != "warp_op" and f"pcops.{n}(" not in (getattr(pcops, n).__doc__ or "")]
    assert not missing, f"no docstring example calls {sorted(set(missing))}"


@pytest.mark.parametrize("test", DOCTESTS, ids=lambda test: test.name)
def test_docstring_example_runs(test):
    """As ``python -m pytest --doctest-modules pcops`` runs them, without a second process."""
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    output = []
    runner.run(test, out=output.append)
    assert runner.failures == 0, "".join(output)


@pytest.mark.skipif(bool(MISSING), reason=f"the docs extra is not installed ({', '.join(MISSING)}): pip install -e '.[docs]'")
def test_site_builds_without_warnings(tmp_path):
    out = tmp_path / "html"
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
        "-d", str(tmp_path / "doctrees"),
        "-D", "sphinx_gallery_conf.run_stale_examples=True",  # run every example, not only changed ones
        str(DOCS), str(out),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert (out / "index.html").is_file()
    for name in ("ops", "layers", "warp_op", "memory", "compat", "changelog"):
        assert (out / "api" / f"{name}.html").is_file(), name
    api = (out / "api" / "ops.html").read_text()
    assert 'id="pcops.knn"' in api and 'id="pcops.radius_aggregate"' in api
    for example in sorted((ROOT / "examples").glob("plot_*.py")):
        page = out / "auto_examples" / f"{example.stem}.html"
        assert page.is_file(), example.name
        assert re.search(rf'src="[^"]*sphx_glr_{example.stem}_\d+\.png"', page.read_text()), f"{example.name} drew no figure"
    assert "Version policy" in (out / "api" / "changelog.html").read_text()
