"""Sphinx configuration of qlab's documentation site (``make docs``: docs/_build/html/index.html).

The pages under ``_generated/`` (one findings page per notebook, the API reference, the benchmark
tables) are written at build time by the extension ``_ext/qlab_docs.py`` from the committed notebooks,
claims files, figures, benchmark result files and the package itself; the folder is ignored by git.
Notebooks are rendered as they were executed, never executed by the build (``nb_execution_mode``).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

project = "qlab"
author = "qlab"
copyright = "qlab contributors"
release = version = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "qlab_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "README.md"]
# fragments other pages include: not pages of their own (no untitled entries in the search)
exclude_patterns += [
    "_generated/results/*.md",
    "_generated/findings_table.md",
    "_generated/findings_pages.md",
]
root_doc = "index"

# notebooks render as executed (runs/ or runs/smoke/) or as committed; the build never runs them
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "undoc-members": True, "member-order": "bysource"}
autodoc_inherit_docstrings = False  # torch.autograd.Function.forward's docstring cites torch's own pages
autodoc_typehints = "none"  # the signatures carry them; annotations of torch types would not resolve
autodoc_member_order = "bysource"
autodoc_mock_imports: list[str] = []

html_theme = "sphinx_book_theme"
html_title = "qlab"
html_theme_options = {
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
html_css_files = ["qlab.css"]  # code blocks wrap
html_last_updated_fmt = None
html_show_sourcelink = False
