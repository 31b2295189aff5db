"""A chart with one run and a versus page with empty cells (#44 item 9): a trend of one run
says so instead of drawing a lone dot; an axis names a commit once, not on every tick of its
runs; a status both sides share is said once per cell."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from views_fixture import H200, H200_GPU, RTX, RTX_GPU, cells_for, run_row

from speedmatrix.report.charts import trend_chart_svg

COMMIT = "9fedd24fa864" + "0" * 28


def points(commits: list[str]) -> pd.DataFrame:
    n = len(commits)
    return pd.DataFrame(
        {
            "run_id": [f"r{i}" for i in range(n)],
            "engine_commit": commits,
            "engine_version": ["0.1.dev1+g9fedd24fa"] * n,
            "value": [100.0 + i for i in range(n)],
            "verdict": [None] * n,
        }
    )


def svg_text(svg: str) -> list[str]:
    """The words an SVG of matplotlib's shows (its text is drawn as glyphs, named in comments)."""
    return re.findall(r"<!-- (.*?) -->", svg)


def test_a_trend_of_one_run_says_it_has_one_run():
    svg = trend_chart_svg(points([COMMIT]), title="t", ylabel="tok/s")
    words = " ".join(svg_text(svg))
    assert "one run so far" in words.lower()


def test_an_axis_names_each_commit_once():
    svg = trend_chart_svg(points([COMMIT, COMMIT, COMMIT, "a" * 40]), title="t", ylabel="tok/s")
    labels = [w for w in svg_text(svg) if re.fullmatch(r"[0-9a-f]{12}", w)]
    assert labels == ["9fedd24fa864", "aaaaaaaaaaaa"], labels


def test_versus_says_a_shared_status_once_per_cell():
    from speedmatrix.report.versus import render_versus_html

    over = ((65536, 8),)
    a = (run_row("a", RTX, RTX_GPU, 8, 1, COMMIT), cells_for(50.0, 0.8, over=over))
    b = (run_row("b", H200, H200_GPU, 4, 2, COMMIT), cells_for(60.0, 0.8, over=over))
    page = render_versus_html(a, b)
    assert page.count("Over capacity") == 1, page.count("Over capacity")
    assert "A: Over capacity" not in page


def test_the_site_trend_names_a_commit_once_and_says_one_run():
    from speedmatrix.report.site_trend import trend_svg

    same = trend_svg(points([COMMIT, COMMIT]), 0.03, title="t", link={}, total=2)
    texts = re.findall(r"<text[^>]*>(.*?)</text>", same)
    assert sum("9fedd24fa864" in t for t in texts) == 1, texts
    lone = trend_svg(points([COMMIT]), 0.03, title="t", link={}, total=1)
    assert "one run so far" in " ".join(re.findall(r"<text[^>]*>(.*?)</text>", lone)).lower()
    two = trend_svg(points([COMMIT, "a" * 40]), 0.03, title="t", link={}, total=2)
    texts = " ".join(re.findall(r"<text[^>]*>(.*?)</text>", two))
    assert "9fedd24fa864" in texts and "aaaaaaaaaaaa" in texts
