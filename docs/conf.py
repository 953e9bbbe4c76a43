"""Sphinx configuration: the Markdown pages of docs/ (MyST) and the API pages from the docstrings.

Build: ``python -m sphinx -W --keep-going -b html docs build/docs`` (``pip install '.[docs]'``);
tests/test_docs_build.py runs the same build and fails on any warning (a broken link, a page left out).
"""
import os
import sys

# The qgcli of this checkout, whether or not it is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qgcli import __version__  # noqa: E402

project = "qgcli"
release = version = __version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Anchors for headings, so that [text](page.md#a-heading) links resolve as they do on GitHub, and are checked.
myst_heading_anchors = 3
autodoc_member_order = "bysource"
napoleon_google_docstring = False
html_theme = "alabaster"
html_title = f"qgcli {release}"
