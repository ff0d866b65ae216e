"""Sphinx configuration of the bild-gym documentation (MyST Markdown, the furo theme).

Build (offline, warnings as errors):

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -b html docs /tmp/bild-docs

The environment pages, the option tables and the training options are generated at build time from the
code (``_ext/bild_docs.py``): the env class docstrings, the config dataclasses and the trainers' parsers.
The figures are made by ``python -m scripts.build_assets figures`` from the JSON in ``results/`` and committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))  # this folder's own extension (Sphinx has no other way to find it)
if str(ROOT) not in sys.path:  # the package, when it is not installed (pip install -e . puts it there too)
    sys.path.insert(0, str(ROOT))

project = "bild-gym"
author = "the bild-gym authors"
copyright = "the bild-gym authors, MIT license"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style "Args:" sections (load_pair, Gymnasium's Env.step)
    "bild_docs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links to sections: page.md#action-space

autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # Gymnasium's Env.step docstring is not reStructuredText; ours are the spec pages
autodoc_typehints = "description"
autodoc_class_signature = "separated"
autodoc_default_options = {"exclude-members": "__init__, __new__"}

html_theme = "furo"
html_title = "bild-gym"
html_static_path = ["_static"]
html_last_updated_fmt = None  # nothing dated in the pages
html_show_sourcelink = False
html_css_files = ["custom.css"]
smartquotes = False  # option names stay "--option", not an en dash
