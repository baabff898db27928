"""Sphinx configuration for gsync's documentation site: MyST Markdown pages and an API reference from docstrings.

Built by ``.venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html`` (the ``docs`` extra), in CI too:
every warning is an error, so a renamed function or a broken link fails the build instead of rotting.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The checkout's gsync, not whichever one the environment has installed.
sys.path.insert(0, str(ROOT))

project = "gsync"
author = "the gsync authors"
copyright = "the gsync authors"
release = version = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "gsync"
html_static_path: list[str] = []

autodoc_member_order = "bysource"
# Types go into each parameter's description, beside the words that say what it means, rather than into a
# signature too long to read (Engine takes a dozen keyword arguments).
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autoclass_content = "class"
add_module_names = False
python_use_unqualified_type_names = True


def _documented(api: str) -> set[str]:
    return set(re.findall(r"^\.\. auto(?:class|exception|function|data):: ([\w.]+)", api, re.MULTILINE))


def _check_every_public_name_is_documented(app: Any) -> None:
    """Warn (an error under -W) for a public name the API reference leaves out, so a new export cannot be forgotten."""
    import gsync
    import gsync.testing
    from sphinx.util import logging

    documented = _documented((Path(app.srcdir) / "api.md").read_text(encoding="utf-8"))
    public = {f"gsync.{name}" for name in gsync.__all__} | {f"gsync.testing.{name}" for name in gsync.testing.__all__}
    for name in sorted(public - documented):
        logging.getLogger(__name__).warning("api.md does not document %s, a public name", name)


# Handles a user gets from gsync and never builds: api.md gives them an empty signature, and their constructor's
# parameters (gsync's internals) stay out of the description too.
_NOT_BUILT_BY_USERS = ("gsync.Session",)


def _drop_internal_constructor_types(app: Any, domain: str, objtype: str, contentnode: Any) -> None:
    annotations = app.env.current_document.autodoc_annotations
    for name in _NOT_BUILT_BY_USERS:
        annotations.pop(name, None)


def setup(app: Any) -> None:
    app.connect("builder-inited", _check_every_public_name_is_documented)
    # Before autodoc merges the recorded types into the description (at the default priority, 500).
    app.connect("object-description-transform", _drop_internal_constructor_types, priority=400)
