"""Words (#44 item 11): one pluralising helper used wherever a count meets a noun; the run
page says why there is no baseline once; the README's demo flag is one make passes."""

from __future__ import annotations

import re
from pathlib import Path

from speedmatrix.words import count

ROOT = Path(__file__).resolve().parents[2]


def test_count_pluralises():
    assert count(0, "improvement") == "0 improvements"
    assert count(1, "recipe") == "1 recipe"
    assert count(2, "regression") == "2 regressions"
    assert count(2, "cell", "cells") == "2 cells"
    assert count(3, "row of quarantine", "rows of quarantine") == "3 rows of quarantine"


def test_no_message_writes_a_plural_in_brackets():
    """`regression(s)`, `cell(s)`: the helper says it right instead."""
    found = []
    for path in (ROOT / "plugins" / "speedmatrix").rglob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            bracketed = re.search(r"\b[a-z]+\(s\)", line) and "http(s)" not in line
            message = not line.lstrip().startswith("#") and ('f"' in line or "f'" in line)
            if bracketed and message:
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found


def test_the_site_summary_counts_one_recipe(tmp_path):
    from speedmatrix.report.site import SiteResult

    result = SiteResult(out=str(tmp_path), runs=1, recipes=1)
    assert "1 run, 1 recipe;" in result.summary()


def test_the_run_page_says_why_there_is_no_baseline_once(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_warehouse import make_cells, make_run

    from speedmatrix.report.render import render_html

    page = render_html(make_run("r-1"), make_cells())

    text = re.sub(r"<[^>]+>", "", page)
    reason = re.search(r"Not compared: ([^.]+)", text)
    assert reason, "the headline says it was not compared"
    assert text.count(reason.group(1)) == 1, reason.group(1)


def test_the_readme_names_a_demo_flag_make_passes():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`--full`" not in readme and "make demo FULL=1" in readme
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "FULL" in makefile and "--full" in makefile
