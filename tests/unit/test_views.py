"""The views across configurations (#34 items 11-13): the Pareto view of a model, the cost per
million output tokens from the deployment's GPU prices, and the comparison page of two
configurations; in `speedmatrix report` and in the site, the pages checked in Chromium."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import walk_site
from views_fixture import (
    H200,
    H200_GPU,
    MODEL,
    PRICES_YAML,
    RTX,
    RTX_GPU,
    land_views,
)

from speedmatrix.analysis.cost import (
    PRICES_ENV,
    PriceError,
    cost_per_million,
    load_prices,
)
from speedmatrix.analysis.pareto import Point, choose_series, mark_frontier
from speedmatrix.cli import main
from speedmatrix.report import palette
from speedmatrix.report.page import render_run_page
from speedmatrix.report.pareto import build_view, warehouse_runs
from speedmatrix.report.render import render_markdown
from speedmatrix.report.site import build_site
from speedmatrix.report.site_views import model_page, versus_page


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    root = tmp_path_factory.mktemp("views")
    wh = land_views(root / "wh")
    prices = root / "prices.yaml"
    prices.write_text(PRICES_YAML, encoding="utf-8")
    yield wh, prices, root
    wh.close()


# ------------------------------------------------------------------------------ frontier, cost


def _pt(series, x, y, ctx="8K"):
    return Point(series, "r", ctx, 8192 if ctx == "8K" else 65536, 1, x, y, y, 1)


def test_the_frontier_is_the_points_nothing_beats_on_both_axes_per_context():
    a, b, c = _pt("s1", 10, 100), _pt("s1", 20, 50), _pt("s2", 15, 40)  # c: beaten by b
    d = _pt("s2", 10, 100)  # the same as a: neither beats the other
    far = _pt("s2", 1, 1, ctx="64K")  # alone in its context: on its frontier
    front = mark_frontier([a, b, c, d, far])
    assert (a.frontier, b.frontier, c.frontier, d.frontier, far.frontier) == (
        True,
        True,
        False,
        True,
        True,
    )
    assert [p.per_request_tok_s for p in front] == [10, 10, 20, 1]  # by context, then x


def test_cost_per_million_output_tokens_and_the_deployments_prices(tmp_path):
    # $2 per GPU-hour x 8 GPUs for 1000 tok/s: $16 per 3.6M tokens
    assert cost_per_million(1000.0, 8, 2.0) == pytest.approx(16 / 3.6)
    assert cost_per_million(1000.0, 8, None) is None  # no price: no cost, never a default
    assert cost_per_million(0.0, 8, 2.0) is None and cost_per_million(1000.0, 0, 2.0) is None
    assert load_prices({}) is None
    path = tmp_path / "p.yaml"
    path.write_text(PRICES_YAML, encoding="utf-8")
    prices = load_prices({PRICES_ENV: str(path)})
    # matched without regard to case or spacing, as the runs table names the GPU
    assert prices.for_gpu(RTX_GPU) == 2.0 and prices.for_gpu(H200_GPU) == 4.5
    assert prices.for_gpu("A100") is None and prices.source == str(path)
    for bad in ("per_gpu_hour: {H200: -1}", "per_gpu_hour: {H200: free}", "[1, 2]", "x: {"):
        path.write_text(bad, encoding="utf-8")
        with pytest.raises(PriceError, match=PRICES_ENV):
            load_prices({PRICES_ENV: str(path)})
    with pytest.raises(PriceError, match="cannot be read"):
        load_prices({PRICES_ENV: str(tmp_path / "missing.yaml")})


def test_the_run_page_has_a_cost_matrix_only_with_a_price(views, monkeypatch, caplog):
    wh, prices, root = views
    monkeypatch.delenv(PRICES_ENV, raising=False)
    assert "Cost per million output tokens" not in render_run_page(wh, "rtx-1")
    monkeypatch.setenv(PRICES_ENV, str(prices))
    page = render_run_page(wh, "rtx-1")
    at = page.index('<table class="matrix cost">')
    table = page[at : page.index("</table>", at)]
    # 8Kx1: 60 tok/s on 8 GPUs at $2: 2 x 8 / (3600 x 60) x 1e6 = $74.07
    assert '<th class="l">8K</th><td>$74.07</td>' in table
    assert "$2.00 per GPU-hour (the deployment&#39;s price for " + RTX_GPU in page
    # the published Markdown does not move
    run, cells, _ = wh.read_run("rtx-1")
    assert "Cost" not in render_markdown(run, cells)
    # a broken price file: said in the log, no cost rather than a wrong one
    broken = root / "broken.yaml"
    broken.write_text("per_gpu_hour: {H200: -1}", encoding="utf-8")
    monkeypatch.setenv(PRICES_ENV, str(broken))
    assert "Cost per million" not in render_run_page(wh, "rtx-1")
    assert any("no cost on the pages" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------- Pareto view


def test_series_are_each_recipes_latest_run_or_each_commit_on_demand(views):
    wh, _prices, _root = views
    runs = warehouse_runs(wh)
    latest = choose_series(runs, MODEL)
    assert [s.run["run_id"] for s in latest] == ["h200-1", "rtx-2"]
    assert "H200 SXM ×4" in latest[0].label
    by_commit = choose_series(runs, MODEL, by_commit=True)
    assert sorted(s.run["run_id"] for s in by_commit) == ["h200-1", "rtx-1", "rtx-2"]
    assert any("aaaaaaaaaaaa" in s.label for s in by_commit)


def test_points_are_tok_s_per_gpu_against_per_request(views):
    wh, _prices, _root = views
    view = build_view(wh, MODEL)
    h200 = {p.cell: p for p in view.points if p.run_id == "h200-1"}
    # 8Kx8 of h200-1: per request 50 x 0.9^3, total 8x that, on 4 GPUs
    assert h200["8Kx8"].per_request_tok_s == pytest.approx(50 * 0.9**3)
    assert h200["8Kx8"].tok_s_per_gpu == pytest.approx(8 * 50 * 0.9**3 / 4)
    assert "64Kx8" not in h200  # over capacity: not a point
    assert h200["8Kx8"].frontier and not h200["8Kx1"].frontier
    assert all(p.cost_per_m is None for p in view.points)  # no prices given


def test_report_pareto_command(views, monkeypatch, tmp_path, capsys):
    wh, prices, _root = views
    monkeypatch.delenv(PRICES_ENV, raising=False)
    assert main(["report", "--pareto", MODEL, "--warehouse", wh.root]) == 0
    md = capsys.readouterr().out
    assert md.startswith(f"# Pareto view: {MODEL}") and "## Frontier at 64K" in md
    assert "Cost" not in md  # no price: no cost column
    monkeypatch.setenv(PRICES_ENV, str(prices))
    out = tmp_path / "pareto.html"
    argv = ["report", "--pareto", MODEL, "--warehouse", wh.root, "--format", "html"]
    assert main([*argv, "--by-commit", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert page.count('<figure class="pareto"') == 2  # 8K and 64K
    assert page.count("<svg") == 2 and "Cost per 1M output tokens" in page
    assert "cccccccccccc" in page and "aaaaaaaaaaaa" in page  # one series per commit
    assert main(["report", "--run-id", "rtx-1", "--by-commit", "--warehouse", wh.root]) == 2
    assert "--by-commit goes with --pareto" in capsys.readouterr().err
    assert main(["report", "--pareto", "nobody/none", "--warehouse", wh.root]) == 2
    assert "no successful run of model 'nobody/none'" in capsys.readouterr().err


# --------------------------------------------------------------------------- comparison page


def test_report_versus_command_colours_b_against_a(views, monkeypatch, tmp_path, capsys):
    wh, _prices, _root = views
    monkeypatch.delenv(PRICES_ENV, raising=False)
    out = tmp_path / "versus.html"
    argv = ["report", "--warehouse", wh.root, "--format", "html", "--out", str(out)]
    assert main([*argv, "--versus", RTX, H200]) == 0  # recipes: their latest runs
    page = out.read_text(encoding="utf-8")
    assert "run rtx-2" in page and "run h200-1" in page
    # 4 GPUs against 8: the colour is the change per GPU, the fair figure; 8Kx1: 50 on 4
    # GPUs against 66 on 8 = +51.5% per GPU (better), -24.2% in total
    better = palette.change_colour(51.52)
    assert re.search(
        rf'<div class="change" style="background: {better}[^>]*>\+51\.5% per GPU</div>'
        r'<div class="s">-24\.2% total</div>',
        page,
    )
    assert main(["report", "--warehouse", wh.root, "--versus", "rtx-1", "rtx-2"]) == 0
    md = capsys.readouterr().out  # the same GPUs: the change of the total, coloured
    assert "| 8Kx1 | 66.0 | 60.0 | +10.0% | +10.0% |" in md
    assert main([*argv, "--versus", "rtx-1", "rtx-2"]) == 0
    page = out.read_text(encoding="utf-8")
    assert re.search(
        rf'<div class="change" style="background: {palette.change_colour(10.0)}[^>]*>\+10\.0%</div>',
        page,
    )
    assert main(["report", "--warehouse", wh.root, "--versus", "rtx-1", "other-1"]) == 2
    assert "a comparison is of one model" in capsys.readouterr().err
    assert main(["report", "--warehouse", wh.root, "--versus", "rtx-1", "nope"]) == 2


# ----------------------------------------------------------------------------------- site


def test_site_links_the_views_and_they_open_in_chromium(views, browser, monkeypatch, tmp_path):
    wh, prices, _root = views
    monkeypatch.setenv(PRICES_ENV, str(prices))
    out = tmp_path / "site"
    result = build_site(wh, out)
    assert result.failed == [] and result.model_pages_written == 2
    index = (out / "index.html").read_text(encoding="utf-8")
    assert f'href="{model_page(MODEL)}">Pareto view</a>' in index
    pair = versus_page(f"{H200}|local", f"{RTX}|local")
    assert f'href="{pair}"' in index
    reached, broken, outside = walk_site(out / "index.html")
    assert broken == [] and outside == []
    assert (out / model_page(MODEL)).resolve() in reached and (out / pair).resolve() in reached
    # the site's run page is priced too (the deployment's prices, as the pipeline's page)
    assert '<table class="matrix cost">' in (out / "runs/rtx-2.html").read_text(encoding="utf-8")
    pareto = (out / model_page(MODEL)).read_text(encoding="utf-8")
    assert 'href="../runs/rtx-2.html">rtx-2</a>' in pareto and "$" in pareto
    # the figures are there: one chart (inline SVG) per context, each with its frontier table
    figures = re.findall(r'<figure class="pareto" id="pareto-(\w+)">\s*<svg', pareto)
    assert figures == ["8K", "64K"] and pareto.count('<table class="frontier">') == 2
    versus = (out / pair).read_text(encoding="utf-8")
    assert '<table class="matrix versus">' in versus and versus.count('<div class="change"') == 8
    shots = {
        "index": browser.open_page(out / "index.html", screenshot=tmp_path / "i.png", height=900),
        "pareto": browser.open_page(out / model_page(MODEL), screenshot=tmp_path / "p.png"),
        "versus": browser.open_page(out / pair, screenshot=tmp_path / "v.png", height=1000),
        "run": browser.open_page(out / "runs/rtx-2.html", screenshot=tmp_path / "r.png"),
    }
    for name, load in shots.items():
        assert load.console == [], (name, load.console)
        assert load.screenshot.stat().st_size > 10_000, name
    keep = os.environ.get("SPEEDMATRIX_SCREENSHOTS")  # for the author to look at
    if keep:
        for name, load in shots.items():
            shutil.copy(load.screenshot, f"{keep}views-{name}.png")
    # incremental: nothing changed, nothing of the views written again
    again = build_site(wh, out)
    assert (again.model_pages_written, again.model_pages_kept) == (0, 2)


def test_views_are_rewritten_only_where_a_run_changed(tmp_path):
    """After a run lands, its model's Pareto view and the comparisons with its series are
    written again; a comparison of two other configurations and other models are kept."""
    from views_fixture import cells_for, run_row

    wh = land_views(tmp_path / "wh")
    out = tmp_path / "site"
    wh.land_run(
        run_row("h100-1", "sim/kimi-h100-x8", "H100", 8, 13, "a" * 40), cells_for(55.0, 0.8), []
    )
    build_site(wh, out)
    h100, h200, rtx = "sim/kimi-h100-x8|local", f"{H200}|local", f"{RTX}|local"
    pages = {
        "pareto": model_page(MODEL),
        "other": model_page("org/Other"),
        "h100-h200": versus_page(h100, h200),
        "h100-rtx": versus_page(h100, rtx),
        "h200-rtx": versus_page(h200, rtx),
    }
    before = {k: (out / p).stat().st_ino for k, p in pages.items()}
    wh.land_run(run_row("rtx-3", RTX, RTX_GPU, 8, 14, "d" * 40), cells_for(70.0, 0.85), [])
    result = build_site(wh, out)
    after = {k: (out / p).stat().st_ino for k, p in pages.items()}
    rewritten = {k for k in pages if before[k] != after[k]}
    assert rewritten == {"pareto", "h100-rtx", "h200-rtx"}
    assert (result.model_pages_written, result.model_pages_kept) == (1, 1)
    assert "rtx-3" in (out / pages["h200-rtx"]).read_text(encoding="utf-8")
    wh.close()
