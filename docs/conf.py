"""Sphinx configuration of the pcops documentation site.

Build it with ``pip install -e ".[docs]" && sphinx-build -b html docs docs/_build/html`` and open
``docs/_build/html/index.html``. The pages are the Markdown files of ``docs/`` (myst-parser),
the API reference is generated from the docstrings (autodoc + napoleon, ``docs/api/``), and the
gallery runs the scripts of ``examples/`` on the CPU at build time (sphinx-gallery).
"""

import importlib.metadata
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Document (and run the examples against) the source tree beside this folder, installed or not.
sys.path.insert(0, str(ROOT))

# -- Project -------------------------------------------------------------------------------------
project = "pcops"
author = "pcops developers"
copyright = "pcops developers"
try:
    release = importlib.metadata.version("pcops")
except importlib.metadata.PackageNotFoundError:
    release = "0+unknown"
version = release

# -- General -------------------------------------------------------------------------------------
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx_gallery.gen_gallery",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", "auto_examples/*.ipynb", "auto_examples/*.py"]
templates_path = []

# Markdown: the pages link to each other's headings (`compiling.md#measured-compiled-against-eager`).
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

# -- API reference (docstrings are Google style) ---------------------------------------------------
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = False

# -- Gallery: examples/ run on the CPU at build time, figures by matplotlib (Agg) -------------------
os.environ.setdefault("MPLBACKEND", "Agg")
sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "examples"),
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "within_subsection_order": "FileNameSortKey",
    "image_scrapers": ("matplotlib",),
    "reset_modules": ("matplotlib",),
    "abort_on_example_error": True,
    "download_all_examples": False,
    "show_memory": False,
    "remove_config_comments": True,
    "min_reported_time": 1,
}

# -- HTML ------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"pcops {release}"
html_static_path = []
html_show_sourcelink = False
