"""fastattn.lab.tables: one value rule (fmt) for reports and notebook tables; every cell escaped; a hook for a cell."""

from fastattn.lab.tables import fmt, html_table, md_table, pairs_table


def test_one_value_rule():
    assert [fmt(v) for v in (True, False, None, 0.123456, float("nan"), 7, "x")] == \
        ["yes", "no", "n/a", "0.123", "n/a", "7", "x"]
    assert fmt(2_000_000, "peak bytes") == "2 MB" and fmt([1.0, 2.5]) == "1, 2.5"
    assert len(fmt("x" * 400)) == 160 and fmt("x" * 400, limit=None) == "x" * 400


def test_html_cells_are_escaped_and_the_hook_places_them():
    rows = [{"a": "<b>", "b": 1.0}, {"b": 2.5, "a": "x & y"}]  # the first row's keys order every row
    assert html_table(rows) == ("<table><tr><th>a</th><th>b</th></tr><tr><td>&lt;b&gt;</td><td>1</td></tr>"
                                "<tr><td>x &amp; y</td><td>2.5</td></tr></table>")
    bold = html_table(rows, ["a"], td=lambda r, c, s: f"<td class='k'>{s}</td>")
    assert bold.count("<td class='k'>") == 2 and "<th>b</th>" not in bold
    assert "y" * 300 in html_table([{"a": "y" * 300}]), "a notebook table keeps whole texts"
    assert pairs_table([("k<", None)], key_tag="th") == "<table><tr><th>k&lt;</th><td>n/a</td></tr></table>"
    assert html_table([]) == "<table><tr></tr></table>"


def test_markdown_escapes_pipes():
    assert md_table([{"a": "x|y", "b": 1}]) == ["| a | b |", "|---|---|", "| x\\|y | 1 |"]
    assert md_table([]) == []
