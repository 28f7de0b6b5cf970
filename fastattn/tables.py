"""Rows as tables: HTML for notebooks and the landing page, markdown for GitHub, one cell rule for both."""

from __future__ import annotations

from html import escape
from typing import Callable, Optional, Sequence


def cell(v) -> str:
    """A value as table text: yes / no for booleans, empty for None, floats to 3 significant digits."""
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: ""}[v]
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _td(row: dict, col, html: str) -> str:
    return f"<td>{html}</td>"


def html_table(rows: Sequence[dict], cols: Optional[Sequence] = None, *, text: Callable = cell,
               td: Callable = _td) -> str:
    """``rows`` over ``cols`` (default: the first row's keys): each value through ``text``, escaped, and put in
    its cell by ``td(row, col, html)``."""
    cols = list(rows[0] if cols is None and rows else cols or [])
    head = "".join(f"<th>{escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(td(r, c, escape(text(r.get(c)))) for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def pairs_table(pairs, text: Callable = lambda v, k: cell(v), key_tag: str = "td") -> str:
    """(key, value) pairs as a two-column HTML table without a header row; ``text(value, key)`` formats."""
    return "<table>" + "".join(f"<tr><{key_tag}>{escape(str(k))}</{key_tag}><td>{escape(text(v, k))}</td></tr>"
                               for k, v in pairs) + "</table>"


def md_table(rows: Sequence[dict]) -> list:
    """Rows (dicts with the same keys) as markdown lines, ``|`` escaped in the cells."""
    if not rows:
        return []
    cols = list(rows[0])
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + \
           ["| " + " | ".join(esc(r[c]) for c in cols) + " |" for r in rows]
