"""The documentation pages read without the site, and the tables that say they list every argument do."""

from __future__ import annotations

import inspect
import re

import pytest

import gsync
import gsync.testing
from tests.support.paths import ROOT

DOCS = ROOT / "docs"


def markdown_of(page: str) -> str:
    """The page as GitHub shows it, less the directives only the site runs (its ``{eval-rst}`` blocks)."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.sub(r"```\{eval-rst\}.*?```", "", text, flags=re.DOTALL)


def table_arguments(page: str, heading: str) -> list[str]:
    """The first column's names of the table under ``heading``."""
    section = markdown_of(page).split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)


def test_the_api_page_names_every_public_name_in_its_markdown() -> None:
    # The README says the pages read on GitHub too: the API page is more than autodoc directives there.
    readable = markdown_of("api.md")
    public = [f"gsync.{name}" for name in gsync.__all__] + [f"gsync.testing.{name}" for name in gsync.testing.__all__]
    missing = [name for name in public if not re.search(rf"`{re.escape(name)}\b", readable)]
    assert not missing, f"docs/api.md's tables leave out {missing}"


@pytest.mark.parametrize(
    ("heading", "signature"),
    [("`Engine` arguments", inspect.signature(gsync.Engine)), ("`fit` arguments", inspect.signature(gsync.Engine.fit))],
)
def test_the_fit_pages_tables_list_every_argument_in_order(heading: str, signature: inspect.Signature) -> None:
    expected = [name for name in signature.parameters if name != "self"]
    assert table_arguments("fit.md", heading) == expected
