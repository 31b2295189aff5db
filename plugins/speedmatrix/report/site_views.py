"""The site's views across configurations: per model, the Pareto view
(``models/<model>.html``) and a comparison page for every pair of its configurations
(``compare/<a>--vs--<b>.html``), linked from the index and from each other.

Why apart from site_pages.py: those pages are per run and per recipe; these are per
model, across recipes and hardware, and are written only when one of their runs changed (the
same manifest fingerprints), so a nightly rewrite stays one model's pages at most.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedmatrix.analysis.pareto import choose_series, model_ids, model_of, with_model_ids
from speedmatrix.report.pareto import build_view, models, render_pareto_html
from speedmatrix.report.slugs import slug
from speedmatrix.report.versus import render_versus_html, side_label
from speedmatrix.store.protocol import WarehouseReader

log = logging.getLogger("speedmatrix.site")

MAX_SERIES_PAIRS = 28  # comparison pages per model: every pair of up to 8 configurations


def model_page(model: str) -> str:
    return f"models/{slug(model)}.html"


def versus_page(a_key: str, b_key: str) -> str:
    return f"compare/{slug(a_key)}--vs--{slug(b_key)}.html"


def _short(series: Any) -> str:
    recipe, host = series.run.get("recipe_id") or "no recipe", series.run.get("host")
    return recipe if host in (None, "", "local") else f"{recipe} @ {host}"


@dataclass
class ModelEntry:
    """A model as the index lists it."""

    model: str
    href: str
    configurations: int
    comparisons: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ViewsResult:
    entries: list[ModelEntry] = field(default_factory=list)
    fingerprints: dict[str, str] = field(default_factory=dict)
    pages: set[str] = field(default_factory=set)  # every page of these views (relative paths)
    written: int = 0
    kept: int = 0


@dataclass
class _Views:
    """One build's views: what every model's pages are written with."""

    wh: WarehouseReader
    root: Path
    prices: Any
    fingerprint: Callable[..., str]
    run_fp: Mapping[str, str]
    old: Mapping[str, str]
    write: Callable[[Path, str], None]
    hrefs: Mapping[str, str]  # run id -> its page, relative to a view's page
    ids: Mapping[str, str] = field(default_factory=dict)  # served name -> model id
    cells: dict[str, tuple] = field(default_factory=dict)

    def read(self, run_id: str, recipe_id: str | None) -> tuple:
        if run_id not in self.cells:  # each run read once per build, for its view and its pairs
            run, cells = self.wh.read_run(run_id, recipe_id)[:2]
            self.cells[run_id] = (with_model_ids([run], self.ids)[0], cells)
        return self.cells[run_id]

    def made_from(self, *group: Any) -> list[str]:
        return [s.key + "=" + self.run_fp.get(str(s.run["run_id"]), "-") for s in group]


_UP = "../"


def write_views(
    wh: WarehouseReader,
    root: Path,
    runs: Sequence[Mapping[str, Any]],
    *,
    prices: Any,
    fingerprint: Callable[..., str],
    run_fp: Mapping[str, str],
    old: Mapping[str, str],
    write: Callable[[Path, str], None],
    run_pages: Mapping[str, str],
) -> ViewsResult:
    """Write each model's Pareto view and comparison pages under `root`, each only when what it
    is made from changed (`old`: page -> fingerprint of the last build; a Pareto view is made
    from every series' run, a comparison page from its two): after one run, its model's view
    and the comparisons with that run's series. `run_pages`: run id -> its page, relative to
    the site root, for the runs that have one. `written` / `kept` count models."""
    out = ViewsResult()
    hrefs = {rid: _UP + href for rid, href in run_pages.items()}
    # a run landed under its served name counts under the model id the warehouse knows
    ids = model_ids(runs)
    runs = with_model_ids(runs, ids)
    views = _Views(wh, root, prices, fingerprint, run_fp, old, write, hrefs, ids)
    # each model's runs, in the fleet's order, found in one pass: choosing the series per model
    # over every run of the fleet was a pass per model
    of_model: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        m = model_of(r)
        if m is not None:
            of_model.setdefault(m, []).append(r)
    for model in models(runs):
        _write_model(views, model, of_model.get(model, []), out)
    return out


def _write_model(
    views: _Views, model: str, mruns: list[Mapping[str, Any]], out: ViewsResult
) -> None:
    """One model's Pareto view and comparison pages: each written when what it is made from
    changed, its index entry and its pages' fingerprints added to `out`."""
    series = choose_series(mruns, model)
    pairs = list(itertools.combinations(series, 2))[:MAX_SERIES_PAIRS]
    comparisons = [
        (f"{side_label(b.run)} against {side_label(a.run)}", versus_page(a.key, b.key))
        for a, b in pairs
    ]
    short = [  # the index's words for the same pages: the recipes (and hosts)
        (f"{_short(b)} against {_short(a)}", href)
        for (a, b), (_t, href) in zip(pairs, comparisons, strict=True)
    ]
    page = model_page(model)
    # a view of series none of which has a GPU count has no point (tok/s per GPU would be
    # made up: analysis.pareto.points_of): the index does not link an empty table
    plottable = any((r.run.get("hardware_gpu_count") or 0) > 0 for r in series)
    out.entries.append(ModelEntry(model, page if plottable else "", len(series), short))
    todo = {page: views.fingerprint(page, views.made_from(*series), [h for _t, h in comparisons])}
    for (a, b), (_t, href) in zip(pairs, comparisons, strict=True):
        todo[href] = views.fingerprint(href, views.made_from(a, b))
    out.pages |= set(todo)
    stale = {p for p, fp in todo.items() if views.old.get(p) != fp or not (views.root / p).exists()}
    if not stale:
        out.fingerprints.update(todo)
        out.kept += 1
        return
    try:
        if page in stale:
            view = build_view(views.wh, model, prices=views.prices, runs=mruns, read=views.read)
            views.write(
                views.root / page,
                render_pareto_html(
                    view,
                    links=[("All recipes", _UP + "index.html")],
                    run_href=views.hrefs,
                    comparisons=[(t, _UP + h) for t, h in comparisons],
                ),
            )
            out.fingerprints[page] = todo[page]
        for (a, b), (_text, href) in zip(pairs, comparisons, strict=True):
            if href not in stale:
                out.fingerprints[href] = todo[href]
                continue
            views.write(
                views.root / href,
                render_versus_html(
                    views.read(str(a.run["run_id"]), a.run.get("recipe_id")),
                    views.read(str(b.run["run_id"]), b.run.get("recipe_id")),
                    prices=views.prices,
                    links=[
                        ("All recipes", _UP + "index.html"),
                        (f"Pareto view of {model}", _UP + page),
                    ],
                    run_href=views.hrefs,
                ),
            )
            out.fingerprints[href] = todo[href]
        out.written += 1
    except Exception as exc:  # one model's views must not cost the site
        log.warning("site: no views for model %s: %s", model, exc)
