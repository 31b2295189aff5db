"""Each cell's change against the baseline inside the main matrices (#34 item 5): the decode
matrix and the prefill table of the run page (and so of the site's run page) carry every
compared cell's throughput change in the change colours and its verdict mark; the published
Markdown does not move."""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_run_page import REFERENCE, _regressed  # noqa: E402

from speedmatrix.published.parse import parse_report  # noqa: E402
from speedmatrix.report import palette  # noqa: E402
from speedmatrix.report.render import render_html, render_markdown  # noqa: E402


def _matrix(page: str) -> dict[str, str]:
    """{"8Kx4": the <td> of that decode cell} from the page's main matrix."""
    at = page.index('<table class="matrix">')
    table = page[at : page.index("</table>", at)]
    cols = re.findall(r"<th>(\d+)</th>", table)
    out = {}
    for label, body in re.findall(r'<tr><th class="l">([^<]+)</th>(.*?)</tr>', table, re.S):
        if label == "Context":
            continue
        tds = re.findall(r"<td.*?</td>", body, re.S)
        for col, td in zip(cols, tds, strict=True):
            out[f"{label}x{col}"] = td
    return out


def test_decode_cells_carry_their_change_and_verdict_mark():
    run, cells, base_run, base, rows = _regressed()
    page = render_html(run, cells, (base_run, base), comparison=rows)
    m = _matrix(page)
    worse = palette.change_colour(-20.0)
    # the regressed cell: its change in the worse colour, with the ▼ mark and what moved
    assert re.search(
        rf'<div class="change regression" style="background: {worse}; color: '
        rf'{palette.text_colour(worse)}" title="baseline 200\.0 tok/s; total tok/s -20\.0% '
        r'\(regression\)[^"]*">▼ -20\.0%</div>',
        m["8Kx4"],
    ), m["8Kx4"]
    # an unchanged cell: its change, neutral, no mark
    assert re.search(r'<div class="change noise" [^>]*>\+0\.0%</div>', m["8Kx1"]), m["8Kx1"]
    # the invalid cell has no change to show
    assert 'class="change' not in m["8Kx2"]
    # the legend says what the marks mean, next to the matrix
    assert "▼ a regression, ▲ an improvement beyond noise" in page


def test_prefill_table_has_a_change_column():
    run, cells, base_run, base, rows = _regressed()
    page = render_html(run, cells, (base_run, base), comparison=rows)
    at = page.index('<table class="prefill">')
    table = page[at : page.index("</table>", at)]
    assert "<th>Change</th>" in table
    assert re.search(r'<td class="change-cell"><div class="change noise"[^>]*>\+0\.0%</div>', table)


def test_without_a_comparison_the_change_has_no_mark_and_without_baseline_nothing():
    run, cells, base_run, base, _rows = _regressed()
    m = _matrix(render_html(run, cells, (base_run, base)))
    # a plain ratio: the number and its colour, but no verdict (only the comparison gives one)
    assert re.search(r'<div class="change " [^>]*>-20\.0%</div>', m["8Kx4"]), m["8Kx4"]
    assert "▼" not in m["8Kx4"]
    page = render_html(run, cells)
    assert 'class="change' not in page and "<th>Change</th>" not in page


def test_published_markdown_is_unchanged_by_the_matrix_changes():
    """The Markdown is the published format: no change marks in its matrix."""
    text = REFERENCE.read_text(encoding="utf-8")
    parsed = parse_report(text)
    md = render_markdown(parsed.run, parsed.cells, baseline=(parsed.run, parsed.cells))
    published = md[: md.index("## Change against baseline")]
    assert "▼" not in published and "▲" not in published
    assert parse_report(published).run_id == parsed.run_id
