"""``make docs`` (scripts/docs.py) leaves main unchanged: every generated file is what the committed records and the
code make now. The one staleness gate; in make test, not make check, so editing a docstring or a record's shape
fails here once and ``make docs`` fixes it."""

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("seeded_fast_choice")  # fast's probe, cheap (conftest)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_docs_leaves_main_unchanged():
    docs = runpy.run_path(str(ROOT / "scripts" / "docs.py"))
    files = {**docs["targets_rejudged"](), **docs["generated"]()}
    assert {ROOT / "README.md", ROOT / "docs" / "results.md", ROOT / "data" / "upstream-prs" / "reply-293.md",
            ROOT / "data" / "results" / "headline.png"} <= set(files)
    stale = [str(p.relative_to(ROOT)) for p in docs["stale"](files)]
    assert not stale, f"generated files out of date, run make docs: {stale}"
