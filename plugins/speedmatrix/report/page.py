"""One run's page from the warehouse: what the pipeline, `speedmatrix report` and a site render.

Why one function: the page a reader opens after a nightly, the one `speedmatrix report
--format html` prints and the one a static site links to must be the same page, with the same
baseline and the same noise-aware verdicts. ``load_run_page`` gathers the run, its baseline
(named, or the automatic one: analysis.compare.select_baseline), the comparison rows and the
comparison figures; ``render_run_page`` returns the HTML (report.render.render_html).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from speedmatrix.store.protocol import Warehouse, WarehouseReader

log = logging.getLogger("speedmatrix.report")

# The run's charts, kept beside it by the pipeline's `report` task with the key they were
# drawn for (report.render.run_charts_key), so the site and `speedmatrix report` show them
# without drawing them again.
CHARTS_ARTIFACT = "charts/run.json"


@dataclass
class RunPage:
    """Everything the run page shows, read once from the warehouse.

    `baseline` is `(run, cells)` or None; `rows` the comparison rows (None: not compared);
    `markdown` the comparison section the Markdown report appends after the published page;
    `verdicts` the notable rows as display strings; `figures` the heat map and trends;
    `charts` the run's own charts when already drawn (None: render_page draws them)."""

    run: dict[str, Any]
    cells: list[dict[str, Any]]
    baseline: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    rows: list[dict[str, Any]] | None = None
    markdown: str = ""
    verdicts: list[dict[str, str]] = field(default_factory=list)
    figures: list[dict[str, str]] = field(default_factory=list)
    charts: list[dict[str, str]] | None = None
    prices: Any = None  # analysis.cost.Prices: the deployment's (deployment_prices), or None

    @property
    def baseline_cells(self) -> list[dict[str, Any]] | None:
        return self.baseline[1] if self.baseline else None

    def charts_key(self) -> str:
        from speedmatrix.report.render import run_charts_key

        return run_charts_key(self.cells, self.baseline_cells)


def deployment_prices() -> Any:
    """The deployment's GPU prices (analysis.cost.load_prices), or None when it sets none or
    its price file is broken: that is logged once per problem (a site calls this for every
    page), and the page shows no cost rather than a wrong one."""
    from speedmatrix.analysis.cost import PriceError, load_prices

    try:
        return load_prices()
    except PriceError as exc:
        if str(exc) not in _SAID:
            _SAID.add(str(exc))
            log.warning("no cost on the pages: %s", exc)
        return None


_SAID: set[str] = set()  # the price files' problems already logged by this process


def keep_charts(warehouse: Warehouse, page: RunPage) -> str:
    """Draw the page's charts and keep them beside the run with their key; returns the path."""
    from speedmatrix.report.render import run_charts

    page.charts = run_charts(page.cells, page.baseline_cells)
    kept = {"key": page.charts_key(), "charts": page.charts}
    return warehouse.write_artifact(page.run["run_id"], CHARTS_ARTIFACT, json.dumps(kept))


def kept_charts(warehouse: WarehouseReader, page: RunPage) -> list[dict[str, str]] | None:
    """The charts kept beside the run when they were drawn from exactly this page's cells and
    baseline by this code; None (draw them) when none were kept or they were drawn from
    anything else (a run landed again, another baseline, a new chart design)."""
    try:
        kept = json.loads(warehouse.read_artifact(page.run["run_id"], CHARTS_ARTIFACT))
    except (OSError, KeyError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != page.charts_key():
        return None
    return kept.get("charts")


def load_run_page(
    warehouse: Warehouse,
    run_id: str,
    *,
    baseline_ref: str | None = None,
    figures: bool = True,
    result: Any = None,
    compare: bool = True,
) -> RunPage:
    """The run and its comparison with `baseline_ref` (a run id or engine commit/ref) or,
    without one, the automatic baseline. `result`: the comparison already made (the pipeline's
    `land` task makes it once and hands it on to `report` and `regressions`); without one it is
    made here, through its one owner (analysis.compare.comparison_for_run: a run `land` handed
    nothing on, e.g. `speedmatrix report` on an older run); `compare=False`: none is to be
    made, the page goes without.

    The run missing raises KeyError and a named baseline not found ValueError (the caller
    asked for it); any other failure of the comparison or of a chart is logged and the page
    goes without it: a page must still be written, and the `regressions` task raises the
    same error where it belongs."""
    from speedmatrix.analysis.compare import comparison_for_run
    from speedmatrix.analysis.display import comparison_markdown, display_rows, notable
    from speedmatrix.report.charts import comparison_figures

    run, cells, _ = warehouse.read_run(run_id)
    page = RunPage(run=run, cells=cells, prices=deployment_prices())
    if result is None and not compare:
        return page
    try:
        if result is None:
            result = comparison_for_run(
                warehouse, run_id, baseline_ref=baseline_ref, with_noise=False
            )
        if result.baseline is None:
            return page
        _, base_cells, _ = warehouse.read_run(result.baseline["run_id"])
    except ValueError:
        if baseline_ref is not None:
            raise
        log.warning("no comparison on the page of %s", run_id, exc_info=True)
        return page
    except Exception as exc:
        log.warning("no comparison on the page of %s: %s", run_id, exc)
        return page
    page.baseline = (result.baseline, base_cells)
    page.rows = result.rows
    page.markdown = comparison_markdown(result.rows, result.run, result.baseline)
    page.verdicts = display_rows(notable(result.rows))
    if figures:
        try:
            page.figures = comparison_figures(warehouse, result)
        except Exception as exc:  # a chart must never cost the page
            log.warning("no comparison charts for %s: %s", run_id, exc)
    return page


def render_page(page: RunPage, *, links: Sequence[tuple[str, str]] = ()) -> str:
    """A loaded RunPage as HTML."""
    from speedmatrix.report.render import render_html

    return render_html(
        page.run,
        page.cells,
        page.baseline,
        verdicts=page.verdicts,
        figures=page.figures,
        comparison=page.rows,
        links=links,
        charts=page.charts,
        prices=page.prices,
    )


def render_run_page(
    warehouse: Warehouse,
    run_id: str,
    *,
    baseline_ref: str | None = None,
    links: Sequence[tuple[str, str]] = (),
) -> str:
    """The HTML page of one run (verdict first), as the pipeline writes it. `links`:
    (text, href) pairs shown above the title (e.g. a static site's index)."""
    page = load_run_page(warehouse, run_id, baseline_ref=baseline_ref)
    page.charts = kept_charts(warehouse, page)
    return render_page(page, links=links)
