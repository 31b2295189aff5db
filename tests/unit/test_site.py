"""The static site over the warehouse (speedmatrix.report.site, `speedmatrix site`): built from
a warehouse with a few landed runs (one regressed, with the verdicts the `regressions` task
lands), then opened in headless Chromium: no console message, every link resolves, nothing is
fetched from elsewhere; screenshots of the index and a trend page; rebuilt incrementally."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from browser import local_links, page_refs, walk_site

from speedmatrix.analysis.compare import judge_regressions
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.cli import main
from speedmatrix.report.site import build_site, recipe_page, run_page
from speedmatrix.report.slugs import slug
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
import contextlib

from test_compare_warehouse import _land

RECIPE = "sim/wh-test"


def _judge(wh, run_id):
    """What the DAG's `regressions` task does: land comparisons (and raise on a regression)."""
    with contextlib.suppress(RegressionError):
        judge_regressions(wh, run_id)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    wh = Warehouse(str(root / "wh"))
    _land(wh, "r0", "a" * 40, 0, seed=0)
    _land(wh, "r1", "a" * 40, 1, seed=1)
    _judge(wh, "r1")
    _land(wh, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    _judge(wh, "r2")
    result = build_site(wh, root / "site")
    yield wh, root / "site", result
    wh.close()


def test_the_index_names_each_recipe_with_its_latest_run_and_verdict(site):
    _wh, out, result = site
    assert result.failed == []
    assert (result.runs, result.run_pages_written, result.recipe_pages_written) == (3, 3, 1)
    index = (out / "index.html").read_text()
    row = re.search(r"<tr>\s*<td><a href=\"(recipes/[^\"]+)\">sim/wh-test</a>.*?</tr>", index, re.S)
    assert row, index
    assert row.group(1) == recipe_page(RECIPE)
    assert 'href="runs/r2.html">r2</a>' in row.group(0)  # the latest run
    assert "1 cell regressed (64Kx2): throughput" in row.group(0), row.group(0)
    assert "verdict regressed" in row.group(0)
    # the baseline's own verdict: it was compared with r0 and nothing moved
    assert re.search(r'href="runs/r1.html">r1</a>.*?no change beyond noise', index, re.S)


def test_the_trend_page_marks_the_regression_and_links_every_point(site):
    _wh, out, _ = site
    page = (out / recipe_page(RECIPE)).read_text()
    charts = dict(re.findall(r'<figure class="cell" id="([^"]+)">(.*?)</figure>', page, re.S))
    assert set(charts) == {"cell-prefill-8K", "cell-8Kx1", "cell-8Kx4", "cell-64Kx2"}
    regressed = charts["cell-64Kx2"]
    # the regressed point is a ▼ mark that clicks through to its run
    assert re.search(
        r'<a href="\.\./runs/r2\.html"><title>[^<]*regression</title><path[^>]*class="reg"',
        regressed,
    )
    assert 'class="band"' in regressed  # the noise band is drawn
    for name in ("cell-8Kx1", "cell-8Kx4", "cell-prefill-8K"):
        assert 'class="reg"' not in charts[name] and 'class="imp"' not in charts[name]
        hrefs = re.findall(r'<a href="([^"]+)">', charts[name])
        assert hrefs == ["../runs/r0.html", "../runs/r1.html", "../runs/r2.html"]


def test_run_pages_are_the_report_page_with_verdicts_and_a_way_back(site):
    _wh, out, _ = site
    page = (out / run_page("r2")).read_text()
    assert page.count('<nav class="site-nav"') == 1
    assert 'href="../index.html"' in page and f'href="../{recipe_page(RECIPE)}"' in page
    assert "64Kx2" in page and "regression" in page  # the landed verdict is on the page
    assert "r1" in page  # its baseline
    # the pipeline's page, verdict first: the summary with the landed regression opens it
    assert 'id="summary"' in page and page.index('id="summary"') < page.index('class="matrix')
    assert "Slower than the baseline" in page
    # each cell's change and verdict mark inside the matrix, where the eye already is (#34)
    matrix = page[page.index('<table class="matrix">') :]
    assert re.search(r'<div class="change regression"[^>]*>▼ -\d+\.\d%</div>', matrix)


def test_every_link_resolves_and_nothing_comes_from_elsewhere(site):
    _wh, out, _ = site
    reached, broken, outside = walk_site(out / "index.html")
    assert broken == []
    expected = {out / "index.html", out / "site.css", out / recipe_page(RECIPE)}
    expected |= {out / run_page(r) for r in ("r0", "r1", "r2")}
    assert {p.resolve() for p in expected} <= reached
    # links to elsewhere may only be plain hyperlinks (a commit on GitHub), never something
    # the page loads: it must work from file:// and offline
    for page in reached:
        if page.suffix == ".html":
            for tag, ref in page_refs(page):
                if "://" in ref or ref.startswith("//"):
                    assert tag == "a", (page, tag, ref)
    assert all(ref.startswith("https://") for _p, ref in outside)


def test_the_site_opens_in_chromium_without_console_messages(site, browser, tmp_path):
    _wh, out, _ = site
    shots = {
        "index": browser.open_page(
            out / "index.html", screenshot=tmp_path / "index.png", height=900
        ),
        "trend": browser.open_page(
            out / recipe_page(RECIPE), screenshot=tmp_path / "trend.png", height=1300
        ),
        "run": browser.open_page(out / run_page("r2")),
    }
    for name, load in shots.items():
        assert load.console == [], (name, load.console)
    for name in ("index", "trend"):
        png = shots[name].screenshot
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # for the author to look at (the issue asks for it): SPEEDMATRIX_SCREENSHOTS=dir/prefix-
    keep = os.environ.get("SPEEDMATRIX_SCREENSHOTS")
    if keep:
        for name in ("index", "trend"):
            shutil.copy(shots[name].screenshot, f"{keep}{name}.png")


def test_a_console_error_is_caught(browser, tmp_path):
    """The check above can fail: a page that writes to the console is seen."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>console.error('boom'); nosuch();</script></body></html>")
    load = browser.open_page(page)
    assert any("boom" in line for line in load.console)
    assert any("nosuch" in line for line in load.console)
    page.write_text('<html><body><a href="missing.html">x</a></body></html>')
    files, _ = local_links(page)
    assert files == [tmp_path / "missing.html"] and not files[0].exists()


def test_the_site_is_rebuilt_incrementally(tmp_path):
    wh = Warehouse(str(tmp_path / "wh"))
    out = tmp_path / "site"
    _land(wh, "r0", "a" * 40, 0, seed=0)
    _land(wh, "r1", "a" * 40, 1, seed=1)
    first = build_site(wh, out)
    assert (first.run_pages_written, first.recipe_pages_written) == (2, 1)
    r0_mtime = (out / run_page("r0")).stat().st_mtime_ns
    again = build_site(wh, out)
    assert (again.run_pages_written, again.run_pages_kept, again.recipe_pages_written) == (0, 2, 0)
    # the regressions task lands r1's verdicts: its page (and the recipe's) change, r0's not
    _judge(wh, "r1")
    judged = build_site(wh, out)
    assert (judged.run_pages_written, judged.recipe_pages_written) == (1, 1)
    assert "no change beyond noise" in (out / "index.html").read_text()
    # a new run: its page, the recipe's page and the index; r0's page is not touched
    _land(wh, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    new = build_site(wh, out)
    assert (new.run_pages_written, new.run_pages_kept, new.recipe_pages_written) == (1, 2, 1)
    assert (out / run_page("r2")).exists()
    assert (out / run_page("r0")).stat().st_mtime_ns == r0_mtime
    # a page deleted by hand is rendered again; a run deleted from the warehouse loses its page
    (out / run_page("r1")).unlink()
    assert build_site(wh, out).run_pages_written == 1
    wh.delete_run("r0")
    build_site(wh, out)
    assert not (out / run_page("r0")).exists()
    assert 'href="runs/r0.html"' not in (out / "index.html").read_text()
    wh.close()


def test_a_refresh_after_one_run_reads_the_fleet_by_aggregates(tmp_path):
    """Issue #32: a refresh after one new run reads the whole warehouse only through
    aggregate queries (per run counts, the regressions and improvements); the comparison
    rows it reads whole are the new run's and its recipe's, and no table is read whole."""
    wh = Warehouse(str(tmp_path / "wh"))
    out = tmp_path / "site"
    _land(wh, "r0", "a" * 40, 0, seed=0)
    _land(wh, "r1", "a" * 40, 1, seed=1)
    _judge(wh, "r1")
    build_site(wh, out)
    _land(wh, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    _judge(wh, "r2")
    seen: list[str] = []
    real = wh.query

    def recording(sql, params=None, **kw):
        seen.append(" ".join(sql.split()))
        return real(sql, params, **kw)

    wh.query = recording
    new = build_site(wh, out)
    assert (new.run_pages_written, new.recipe_pages_written) == (1, 1)
    assert "1 cell regressed (64Kx2): throughput" in (out / "index.html").read_text()
    # #44: not even `runs` is read whole (its per-run rows are one aggregate, the index's
    # newest runs a LIMIT): test_site_refresh.py holds what comes back per run
    whole = [q for q in seen if not any(w in q for w in ("WHERE", "GROUP BY", "LIMIT"))]
    assert seen and not whole, whole
    from_cmp = [q for q in seen if "FROM comparisons" in q]
    assert any("GROUP BY run_id" in q for q in from_cmp)
    assert all("WHERE" in q or "GROUP BY" in q for q in from_cmp), from_cmp
    wh.close()


def test_site_command(tmp_path, capsys):
    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "only/run", "a" * 40, 0, seed=0)
    wh.close()
    out = tmp_path / "public"
    assert main(["site", "--warehouse", str(tmp_path / "wh"), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == str(out / "index.html")
    assert "1 run, 1 recipe;" in printed.err
    # an id with a slash is a file name of its own, and linked as such
    assert (out / "runs" / f"{slug('only/run')}.html").exists()
    assert f'href="{run_page("only/run")}"' in (out / "index.html").read_text()


def test_site_dir_defaults_beside_the_warehouse(tmp_path, monkeypatch):
    from speedmatrix.report.site import default_site_dir

    monkeypatch.delenv("SPEEDMATRIX_SITE_DIR", raising=False)
    assert default_site_dir(str(tmp_path / "wh")) == str(tmp_path / "site")
    monkeypatch.setenv("SPEEDMATRIX_SITE_DIR", "/srv/site")
    assert default_site_dir(str(tmp_path / "wh")) == "/srv/site"
    monkeypatch.delenv("SPEEDMATRIX_SITE_DIR")
    with pytest.raises(ValueError, match="SPEEDMATRIX_SITE_DIR"):
        default_site_dir("s3://bucket/wh")


def test_a_long_history_fills_in_newest_first(tmp_path):
    """max_run_pages: the newest runs get their pages first; a run without a page yet is not
    linked (no broken link meanwhile); the next builds fill in the rest."""
    wh = Warehouse(str(tmp_path / "wh"))
    out = tmp_path / "site"
    for i in range(3):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    first = build_site(wh, out, max_run_pages=1)
    assert (first.run_pages_written, first.run_pages_deferred) == (1, 2)
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["r2.html"]
    assert walk_site(out / "index.html")[1] == []  # nothing links to a page not yet written
    index = (out / "index.html").read_text()
    assert 'href="runs/r2.html"' in index and "runs/r1.html" not in index
    rest = build_site(wh, out, max_run_pages=1)
    assert (rest.run_pages_written, rest.run_pages_kept, rest.run_pages_deferred) == (1, 1, 1)
    assert (out / run_page("r1")).exists() and not (out / run_page("r0")).exists()
    last = build_site(wh, out)
    assert (last.run_pages_written, last.run_pages_kept, last.recipe_pages_written) == (1, 2, 1)
    assert walk_site(out / "index.html")[1] == []
    wh.close()


def test_trend_charts_show_the_recent_window_judged_by_the_point_before(
    site, tmp_path, monkeypatch
):
    """A chart draws the last MAX_POINTS runs; the first shown point is still judged against
    the run before the window (r2's regression is marked when only r1 and r2 are shown)."""
    import speedmatrix.report.site_pages as site_module

    wh, _out, _ = site
    monkeypatch.setattr(site_module, "MAX_POINTS", 1)
    build_site(wh, tmp_path / "small", max_run_pages=0)
    page = (tmp_path / "small" / recipe_page(RECIPE)).read_text()
    charts = dict(re.findall(r'<figure class="cell" id="([^"]+)">(.*?)</figure>', page, re.S))
    assert "last 1 of 3 runs" in charts["cell-64Kx2"]
    assert 'class="reg"' in charts["cell-64Kx2"]  # r2 against r1, outside the shown window
    assert 'class="reg"' not in charts["cell-8Kx1"]


def test_the_site_never_writes_into_a_folder_that_is_not_its_own(tmp_path, capsys):
    """Issue #33 item 9: `site --out DIR` overwrote a user's index.html and site.css. It writes
    only into a new or empty folder, or one that holds its marker; otherwise it refuses,
    naming the path, and leaves every file as it was."""
    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "r0", "a" * 40, 0, seed=0)
    wh.close()
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("index.html", "site.css"):
        (mine / name).write_text("the user's own")
    args = ["site", "--warehouse", str(tmp_path / "wh"), "--out", str(mine)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(mine) in err and "not a speedmatrix site" in err
    assert sorted(p.name for p in mine.iterdir()) == ["index.html", "site.css"]
    assert (mine / "index.html").read_text() == "the user's own"
    # an empty folder is claimed; a second build refreshes its own site
    empty = tmp_path / "empty"
    empty.mkdir()
    for _ in range(2):
        assert main(["site", "--warehouse", str(tmp_path / "wh"), "--out", str(empty)]) == 0
    assert (empty / "index.html").exists() and (empty / ".speedmatrix-site").exists()


def test_the_site_of_a_missing_warehouse_is_an_error(tmp_path, capsys):
    """Issue #33 item 10: `--warehouse /nonexistent` wrote an empty site and exited 0."""
    missing = tmp_path / "no-such-warehouse"
    out = tmp_path / "site"
    assert main(["site", "--warehouse", str(missing), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no warehouse" in err
    assert not out.exists() and not missing.exists()
    assert main(["trend", "--warehouse", str(missing), "--recipe", "x", "--cell", "8Kx1"]) == 2
    assert "no warehouse" in capsys.readouterr().err
    assert main(["report", "--warehouse", str(missing), "--run-id", "x"]) == 2
    assert "no warehouse" in capsys.readouterr().err
    assert not missing.exists()


def test_a_verdict_names_its_cells_in_the_reports_order():
    """The index's verdict text lists cells by records.cell_sort_key (prefill before decode,
    then context, then concurrency), each cell once however many of its figures moved; a
    run-level row (KV capacity, no context) is named too."""
    import numpy as np
    import pandas as pd

    from speedmatrix.report.site_fleet import run_verdict

    def row(phase, tokens, label, conc, metric, verdict):
        return {
            "run_id": "r",
            "baseline_run_id": "b",
            "phase": phase,
            "context_tokens": tokens,
            "context_label": label,
            "concurrency": conc,
            "metric": metric,
            "verdict": verdict,
        }

    rows = pd.DataFrame(
        [
            row("decode", 65536, "64K", 2, "total_tok_s", "regression"),
            row("run", np.nan, None, np.nan, "kv_cache_tokens", "regression"),
            row("decode", 8192, "8K", 4, "tbt_ms", "regression"),
            row("decode", 8192, "8K", 4, "total_tok_s", "regression"),
            row("decode", 8192, "8K", 16, "total_tok_s", "regression"),
            row("prefill", 8192, "8K", 1, "prefill_tok_s", "improvement"),
        ]
    )
    verdict = run_verdict({"status": "success"}, rows)
    assert (verdict.word, verdict.baseline) == ("mixed", "b")
    assert verdict.text == (
        "4 cells regressed (8Kx4, 8Kx16, 64Kx2 and 1 more): throughput, KV cache tokens; "
        "1 cell improved (prefill 8K): throughput"
    )


def test_a_run_pages_summary_is_the_pipelines(site):
    """The site's run page shows the landed verdicts as the pipeline's page shows the same
    comparison: every change with its baseline value, this run's value, its interval and
    threshold (the site read only some of the comparison fields, and the summary showed
    dashes for the rest)."""
    from speedmatrix.report.page import render_run_page

    wh, out, _ = site

    def summary(page):
        return re.search(r'<section id="summary".*?</section>', page, re.S).group(0)

    ours = summary((out / run_page("r2")).read_text())
    assert ours == summary(render_run_page(wh, "r2"))
    assert re.search(r"<td>90\.\d</td><td>81\.\d</td>", ours)  # baseline and this run's figure


def test_a_warehouse_without_a_successful_run_still_gets_its_site(tmp_path):
    """The model views choose among successful runs only: a warehouse with none (its first run
    came out partial, as a loaded machine's run can) has no candidates, and the site is built
    all the same (Arrow's take of an empty list of indexes, typed null, failed the site task)."""
    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "r0", "a" * 40, 0, seed=0, status="partial")
    built = build_site(wh, tmp_path / "site")
    assert built.run_pages_written == 1
    assert 'href="runs/r0.html"' in (tmp_path / "site" / "index.html").read_text()
    wh.close()
