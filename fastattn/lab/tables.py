"""Values and rows as a reader sees them: one value rule (:func:`fmt`), HTML tables for notebooks and the
landing page, markdown for GitHub."""

from __future__ import annotations

import math
from functools import partial
from html import escape
from typing import Callable, Optional, Sequence


def fmt(value, key: str = "", limit: Optional[int] = 160) -> str:
    """A value as a reader wants it: 3 significant digits; bytes (by the key's name) in MB; yes/no for bools;
    n/a for None and NaN; texts cut to ``limit`` characters (None: whole)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and "bytes" in key.lower() and "(mb)" not in key.lower():
        return f"{value / 1e6:.3g} MB"
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v, key, limit) for v in value)
    return short(str(value), limit)


def md_text(text: str) -> str:
    """Text for a markdown line: a ``#`` never starts a heading (``#293`` stays an issue number)."""
    return str(text).replace("#", "\\#")


def short(text: str, limit: Optional[int] = 160) -> str:
    """Long texts (a compiler error in a finding) cut to ``limit`` characters; the record keeps the whole."""
    text = " ".join(text.split())
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def _td(row: dict, col, html: str) -> str:
    return f"<td>{html}</td>"


def html_table(rows: Sequence[dict], cols: Optional[Sequence] = None, *, text: Callable = partial(fmt, limit=None),
               td: Callable = _td) -> str:
    """``rows`` over ``cols`` (default: the first row's keys): each value through ``text`` (default: :func:`fmt`
    with texts whole, as a notebook table keeps them), escaped, and put in its cell by ``td(row, col, html)``."""
    cols = list(rows[0] if cols is None and rows else cols or [])
    head = "".join(f"<th>{escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(td(r, c, escape(text(r.get(c)))) for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def pairs_table(pairs, text: Callable = fmt, key_tag: str = "td") -> str:
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
