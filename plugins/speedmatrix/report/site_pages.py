"""The pages of the site: every run's page, each recipe's trends, the index; where each lives.

Why apart from the build (report.site): the build decides which pages to write again; this
module only turns what it read into a page, so a page's look changes here and nowhere else.

- ``runs/<run>.html``: the run's page as report.page renders it (the pipeline's page, not a
  copy), with the baseline and the verdicts the `regressions` task landed, and a line of
  navigation back to the site;
- ``recipes/<recipe>.html``: per host, every cell's trend across engine commits (its figure per
  run, the noise band of analysis.trend.noise_band, regressions and improvements marked,
  every point a link to its run), then the recipe's runs;
- ``index.html``: every recipe x host with its latest run and that run's verdict, the models'
  views, then the latest runs.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from speedmatrix.analysis.changepoints import describe
from speedmatrix.analysis.trend import HISTORY_RUN_STATUSES, noise_band, trends
from speedmatrix.records import cell_name, cell_sort_key
from speedmatrix.report.site_fleet import RecipeHistory, Verdict
from speedmatrix.report.site_text import clean, engine, gpu, text, when
from speedmatrix.report.site_trend import fmt_value, trend_svg
from speedmatrix.report.slugs import slug
from speedmatrix.store.protocol import WarehouseReader

MAX_POINTS = 120  # points per trend chart: the most recent runs (the run table has them all)
LATEST_RUNS = 25  # runs listed on the index


def run_page(run_id: str) -> str:
    """The run page's path relative to the site root (what links and the DAG's link use)."""
    return f"runs/{slug(run_id)}.html"


def recipe_page(recipe_id: str | None) -> str:
    return f"recipes/{slug(recipe_id or 'no-recipe')}.html"


# ---------------------------------------------------------------------------------------------
# run pages


def render_landed_run_page(
    wh: WarehouseReader, run_id: str, recipe_id: str | None, rows: pd.DataFrame | None
) -> str:
    """The run's page, the pipeline's own (report.page.render_page: verdict summary first),
    from the baseline and the verdicts the `regressions` task landed (`rows`: read, not
    recomputed as report.page.render_run_page does, so a site build stays cheap) and the
    diff heat map when the task drew one."""
    from speedmatrix.analysis.display import display_rows, notable
    from speedmatrix.report.charts import inline
    from speedmatrix.report.page import RunPage, deployment_prices, kept_charts, render_page

    run, cells, _ = wh.read_run(run_id, recipe_id)
    page = RunPage(run=run, cells=cells, prices=deployment_prices())
    if rows is not None and not rows.empty:
        base_ids = rows["baseline_run_id"].dropna()
        if not base_ids.empty:
            try:
                b_run, b_cells, _ = wh.read_run(str(base_ids.iloc[0]), recipe_id)
                page.baseline = (b_run, b_cells)
            except KeyError:  # the baseline was deleted since: the verdicts still stand
                page.baseline = None
        records = [{k: clean(v) for k, v in r.items()} for r in rows.to_dict("records")]
        page.rows = records
        page.verdicts = display_rows(notable(records))
        try:
            svg = wh.read_artifact(run_id, "comparison.svg").decode("utf-8")
            page.figures = [
                {
                    "id": "diff-heatmap",
                    "title": "Total tok/s against the baseline",
                    "svg": inline(svg),
                }
            ]
        except (FileNotFoundError, OSError):
            page.figures = []
    page.charts = kept_charts(wh, page)  # the `report` task's, when drawn from these cells
    return render_page(page)


def site_run_page(page: str, recipe_id: str | None) -> str:
    """A run page as the site serves it: with the way back to the index and the recipe."""
    return with_nav(
        page,
        nav(
            [
                ("../index.html", "All recipes"),
                ("../" + recipe_page(recipe_id), f"Trends of {recipe_id or 'no recipe'}"),
            ]
        ),
    )


def nav(links: Iterable[tuple[str, str]]) -> str:
    items = " · ".join(f'<a href="{html.escape(h)}">{html.escape(t)}</a>' for h, t in links)
    return (
        '<nav class="site-nav" style="font-size:.9rem;margin:0 0 1rem 0;padding:.4rem .6rem;'
        f'background:#f5f5f7;border-radius:4px">{items}</nav>'
    )


_BODY = re.compile(r"<body[^>]*>", re.I)


def with_nav(page: str, nav: str) -> str:
    """The run page as render_html made it, with the site's navigation right after <body>
    (the page itself stays the renderer's: nothing else of it is touched)."""
    m = _BODY.search(page)
    if m is None:
        return nav + page
    return page[: m.end()] + "\n" + nav + page[m.end() :]


# ---------------------------------------------------------------------------------------------
# recipe pages


def render_recipe_page(
    env: Any,
    recipe: str | None,
    rruns: pd.DataFrame,
    history: RecipeHistory,
    verdicts: Mapping[str, Verdict],
    paged: Mapping[str, Any],
) -> str:
    """The recipe's page: a section per host (its trends, then its runs). `paged`: the runs
    that have a page on the site (the others are neither linked nor listed)."""
    link = {rid: "../" + run_page(rid) for rid in paged}
    sections = [
        {
            "host": host_key or "—",
            "gpu": gpu(hruns.iloc[-1].to_dict()),
            "charts": _host_charts(recipe, host_key or None, hruns, history, link),
            "runs": _run_table(hruns, verdicts, paged),
        }
        for host_key, hruns in rruns.groupby(rruns["host"].fillna(""), sort=True)
    ]
    return env.get_template("site_recipe.html.j2").render(
        recipe=recipe or "(no recipe)",
        sections=sections,
        threshold=f"{history.threshold * 100:.1f}%",
        max_points=MAX_POINTS,
    )


def _named_cells(cells: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """The prefill and decode cells measured, by name, in the report's order
    (records.cell_sort_key); a name's first key (its fewest context tokens) stands for it."""
    keys = (
        cells[["phase", "context_tokens", "context_label", "concurrency"]]
        .drop_duplicates()
        .to_dict("records")
    )
    keys.sort(key=cell_sort_key)
    named: dict[str, dict[str, Any]] = {}
    for k in keys:
        if k["phase"] in ("prefill", "decode"):
            named.setdefault(cell_name(k["phase"], k["context_label"], k["concurrency"]), k)
    return named


def _host_charts(
    recipe: str | None,
    host: str | None,
    hruns: pd.DataFrame,
    history: RecipeHistory,
    link: Mapping[str, str],
) -> list[dict[str, Any]]:
    """One host's trend charts, a chart per cell that was ever valid.

    The charts show the last MAX_POINTS successful or partial runs (a partial run's valid
    cells are history, marked): their trend is computed over those and the one before (which
    judges the first shown point), not over years of history (the cost of a recipe page stays
    flat as history grows)."""
    ok = hruns[hruns["status"].isin(HISTORY_RUN_STATUSES)]
    window = ok.tail(MAX_POINTS + 1)
    hcells = history.cells[history.cells["run_id"].isin(set(hruns["run_id"]))]
    wcells = hcells[hcells["run_id"].isin(set(window["run_id"]))]
    named = _named_cells(hcells)
    by_cell = trends(
        window,
        wcells,
        recipe=recipe,
        names=list(named),
        host=host,
        comparisons=history.comparisons,
        threshold=history.threshold,
        noise=history.noise,
    )
    charts = []
    for name, k in named.items():
        pts = by_cell[name]
        if pts.empty or pts["value"].notna().sum() == 0:
            continue  # never valid (e.g. always over capacity): no trend to draw
        charts.append(_chart(recipe, host, name, k, pts, history, link, total=len(ok)))
    return charts


def _chart(
    recipe: str | None,
    host: str | None,
    name: str,
    key: Mapping[str, Any],
    pts: pd.DataFrame,
    history: RecipeHistory,
    link: Mapping[str, str],
    *,
    total: int,
) -> dict[str, Any]:
    """One cell's chart and the figures beside it; its band is the verdicts' own
    (analysis.trend.noise_band), so a point outside it is a point judged a change."""
    band, source = noise_band(
        history.noise,
        history.threshold,
        recipe,
        host,
        key["phase"],
        int(key["context_tokens"]),
        int(key["concurrency"]),
        "total_tok_s",
    )
    shown = pts.tail(MAX_POINTS)
    last = shown.iloc[-1].to_dict()
    figure = "prompt" if key["phase"] == "prefill" else "total"
    return {
        "name": name,
        "id": "cell-" + slug(name.replace(" ", "-")),
        "svg": trend_svg(shown, band, title=f"{name}: {figure} tok/s", link=link, total=total),
        "band": f"±{band * 100:.1f}%",
        "band_source": ("threshold" if source == "threshold" else f"between-run noise ({source})"),
        "last": fmt_value(last["value"]) if clean(last["value"]) else "—",
        "last_verdict": text(last.get("verdict")),
        "change_points": [
            f"change point {describe(r)}" for r in shown.to_dict("records") if describe(r)
        ],
        "regressions": int((pts["verdict"] == "regression").sum()),
        "improvements": int((pts["verdict"] == "improvement").sum()),
    }


def _run_table(
    hruns: pd.DataFrame, verdicts: Mapping[str, Verdict], paged: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """A host's runs, newest first, those with a page (chosen before the rows are made: a
    refresh fills in pages over several builds while years of runs have none yet)."""
    hruns = hruns[[str(rid) in paged for rid in hruns["run_id"]]]
    return [
        {
            "run_id": str(r["run_id"]),
            "href": "../" + run_page(str(r["run_id"])),
            "when": when(r.get("started_at")),
            "trigger": text(r.get("trigger")),
            "engine": engine(r),
            "status": text(r.get("status")),
            "verdict": verdicts[str(r["run_id"])],
        }
        for r in hruns.iloc[::-1].to_dict("records")
    ]


# ---------------------------------------------------------------------------------------------
# the index


def index_rows(
    latest: Sequence[Mapping[str, Any]], verdicts: Mapping[str, Verdict]
) -> list[dict[str, Any]]:
    """The index's rows: one per recipe x host (`latest`: its latest run, with
    ``runs_of_host``, site_fleet.latest_per_host), by recipe then host."""
    rows = []
    for row in latest:
        run = {k: v for k, v in row.items() if k not in ("runs_of_host", "newest")}
        recipe = clean(run.get("recipe_id")) or None
        rows.append(
            {
                "recipe": recipe or "(none)",
                "recipe_href": recipe_page(recipe),
                "host": text(run.get("host")) or "—",
                "gpu": gpu(run),
                "runs": int(row["runs_of_host"]),
                "latest": run,
                "latest_href": run_page(str(run["run_id"])),
                "when": when(run.get("started_at")),
                "engine": engine(run),
                "verdict": verdicts[str(run["run_id"])],
            }
        )
    return rows


def render_index(
    env: Any,
    rows: list[dict[str, Any]],
    latest: Sequence[Mapping[str, Any]],
    total: int,
    verdicts: Mapping[str, Verdict],
    paged: Mapping[str, Any],
    *,
    models: Any,
    built: str,
) -> str:
    """The index: `rows` (index_rows), the models' views, the latest runs (`latest`: the
    fleet's LATEST_RUNS newest, newest first; `total`: how many runs the fleet has). A run
    without a page yet is not linked."""
    latest_runs = [
        {
            "run_id": str(r["run_id"]),
            "href": run_page(str(r["run_id"])),
            "recipe": text(r.get("recipe_id")) or "(none)",
            "recipe_href": recipe_page(clean(r.get("recipe_id"))),
            "host": text(r.get("host")) or "—",
            "when": when(r.get("started_at")),
            "engine": engine(r),
            "status": text(r.get("status")),
            "verdict": verdicts[str(r["run_id"])],
        }
        for r in latest
        if str(r["run_id"]) in paged
    ]
    for row in rows:
        if str(row["latest"]["run_id"]) not in paged:
            row["latest_href"] = None
    return env.get_template("site_index.html.j2").render(
        rows=rows, latest=latest_runs, models=models, runs=total, built=built
    )
