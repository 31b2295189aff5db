"""The Pareto view of a model, drawn and laid out: in the site
(``models/<model>.html``) and from ``speedmatrix report --pareto MODEL``.

One chart per context length (analysis.pareto: contexts are never mixed), x = per-request
tok/s, y = total tok/s per GPU, one marker shape and colour per series (palette.series_style,
colour-blind safe), the frontier a black step line through its points, each frontier point
named by its cell. Under each chart, the frontier's points as a table with their cost per
million output tokens when the deployment prices the hardware (analysis.cost); every point in
a table after the charts.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speedmatrix.analysis.cost import Prices, fmt_cost
from speedmatrix.analysis.pareto import (
    Point,
    Series,
    choose_series,
    contexts,
    mark_frontier,
    model_of,
    points_of,
    with_model_ids,
)
from speedmatrix.report import palette
from speedmatrix.store.protocol import WarehouseReader

RUN_COLUMNS = (
    "run_id",
    "recipe_id",
    "host",
    "status",
    "started_at",
    "engine_commit",
    "engine_version",
    "hardware_gpu",
    "hardware_gpu_count",
    "model",
    "served_model",
)
AXES_NOTE = (
    "Each point is one sustained-decode cell of a series (a recipe on its hardware, its latest "
    "successful run{by}): x = per-request tok/s (what one user sees), y = total output tok/s "
    "per GPU (what the hardware yields; GPUs as the run declares them). The black line is the "
    "frontier: points no other point of the same context beats on both axes. Up and to the "
    "right is better. One chart per context length: contexts are not comparable with each other."
)


@dataclass
class ParetoView:
    model: str
    series: list[Series]
    points: list[Point]
    by_commit: bool = False
    prices: Prices | None = None
    frontier: list[Point] = field(default_factory=list)

    @property
    def has_cost(self) -> bool:
        return any(p.cost_per_m is not None for p in self.points)

    def label(self, key: str) -> str:
        return next((s.label for s in self.series if s.key == key), key)


def warehouse_runs(wh: WarehouseReader) -> list[dict[str, Any]]:
    """Every run's row with what the views group by (model, recipe, host, commit, GPUs)."""
    frame = wh.query(f"SELECT {', '.join(RUN_COLUMNS)} FROM runs")
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    # a run landed under its served name is grouped under the model id the warehouse knows
    return with_model_ids([{k: (None if v != v else v) for k, v in r.items()} for r in rows])


def models(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The models with at least one successful run, sorted."""
    return sorted({m for r in runs if r.get("status") == "success" and (m := model_of(r))})


def build_view(
    wh: WarehouseReader,
    model: str,
    *,
    by_commit: bool = False,
    prices: Prices | None = None,
    runs: Sequence[Mapping[str, Any]] | None = None,
    read: Callable[[str, str | None], tuple] | None = None,
) -> ParetoView:
    """The view of `model` from the warehouse: its series, their points, the frontier.
    `read`: (run id, recipe id) -> (run, cells), when the caller keeps runs it read."""
    runs = warehouse_runs(wh) if runs is None else runs
    read = read or (lambda rid, recipe: wh.read_run(rid, recipe)[:2])
    series = choose_series(runs, model, by_commit=by_commit)
    points: list[Point] = []
    for s in series:
        _run, cells = read(str(s.run["run_id"]), s.run.get("recipe_id"))
        points += points_of(s, cells, prices)
    view = ParetoView(model, series, points, by_commit, prices)
    view.frontier = mark_frontier(points)
    return view


def chart_svg(view: ParetoView, context: str) -> str:
    """The context's chart as SVG text (matplotlib, the report's conventions)."""
    from speedmatrix.report.charts import _figure, _svg

    plt, fig, ax = _figure()
    fig.set_size_inches(6.4, 4.8)
    pts = [p for p in view.points if p.context_label == context]
    for i, s in enumerate(view.series):
        mine = [p for p in pts if p.series == s.key]
        if not mine:
            continue
        colour, marker = palette.series_style(i)
        ax.scatter(
            [p.per_request_tok_s for p in mine],
            [p.tok_s_per_gpu for p in mine],
            color=colour,
            marker=marker,
            s=36,
            label=s.label,
            zorder=3,
            edgecolors="#333333",
            linewidths=0.4,
        )
    front = sorted((p for p in pts if p.frontier), key=lambda p: p.per_request_tok_s)
    if front:
        xs = [p.per_request_tok_s for p in front]
        ys = [p.tok_s_per_gpu for p in front]
        ax.step(xs, ys, where="post", color=palette.FRONTIER, linewidth=1.2, zorder=2)
        ax.plot(
            xs,
            ys,
            linestyle="none",
            marker="o",
            markersize=9,
            markerfacecolor="none",
            markeredgecolor=palette.FRONTIER,
            zorder=4,
            label="frontier",
        )
        for p in front:
            ax.annotate(
                f"×{p.concurrency}",
                (p.per_request_tok_s, p.tok_s_per_gpu),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
    ax.set_xlabel("per-request tok/s (interactivity)")
    ax.set_ylabel("total tok/s per GPU")
    ax.set_title(f"{view.model}: decode at {context}", fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0, top=max((p.tok_s_per_gpu for p in pts), default=1.0) * 1.12)
    # below the axes, never over a point
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    return _svg(plt, fig)


def _row(view: ParetoView, p: Point) -> dict[str, str]:
    currency = view.prices.currency if view.prices is not None else "USD"
    return {
        "series": view.label(p.series),
        "cell": p.cell,
        "per_request": f"{p.per_request_tok_s:,.1f}",
        "per_gpu": f"{p.tok_s_per_gpu:,.1f}",
        "total": f"{p.total_tok_s:,.1f}",
        "gpus": str(p.gpu_count),
        "cost": fmt_cost(p.cost_per_m, currency),
        "frontier": "◆" if p.frontier else "",
        "run_id": p.run_id,
    }


def render_pareto_html(
    view: ParetoView,
    *,
    links: Sequence[tuple[str, str]] = (),
    run_href: Mapping[str, str] | None = None,
    comparisons: Sequence[tuple[str, str]] = (),
) -> str:
    """The view as one HTML page (inline SVG, no script). `links`: navigation (text, href);
    `run_href`: run id -> its page (the site); `comparisons`: (text, href) of the model's
    comparison pages."""
    from speedmatrix.report.jinja import environment

    charts = [
        {
            "context": ctx,
            "id": f"pareto-{ctx}",
            "svg": chart_svg(view, ctx),
            "frontier": [_row(view, p) for p in view.frontier if p.context_label == ctx],
        }
        for ctx in contexts(view.points)
    ]
    rows = [
        _row(view, p)
        for p in sorted(view.points, key=lambda p: (p.context_tokens, p.series, p.concurrency))
    ]
    price_note = ""
    if view.prices is not None:
        priced = sorted(
            {
                s.run.get("hardware_gpu")
                for s in view.series
                if view.prices.for_run(s.run) is not None
            }
            - {None}
        )
        if priced:
            price_note = (
                "Cost per million output tokens from the deployment's price per GPU-hour ("
                + ", ".join(
                    f"{g}: {fmt_cost(view.prices.for_gpu(g), view.prices.currency)}" for g in priced
                )
                + f"; {view.prices.source}) × GPUs ÷ total output tok/s."
            )
    return (
        environment()
        .get_template("pareto.html.j2")
        .render(
            view=view,
            note=AXES_NOTE.format(by=", or of each engine commit" if view.by_commit else ""),
            charts=charts,
            rows=rows,
            has_cost=view.has_cost,
            price_note=price_note,
            links=list(links),
            run_href=dict(run_href or {}),
            comparisons=list(comparisons),
            series=[(s.label, palette.series_style(i)[0]) for i, s in enumerate(view.series)],
            escape=html.escape,
        )
    )


def render_pareto_markdown(view: ParetoView) -> str:
    """The view as Markdown: per context, the frontier; then every point."""
    out = [
        f"# Pareto view: {view.model}",
        "",
        AXES_NOTE.format(by=", or of each engine commit" if view.by_commit else ""),
        "",
    ]
    head = ["Series", "Cell", "Per-request tok/s", "Total tok/s per GPU", "GPUs"]
    if view.has_cost:
        head.append("Cost per 1M output tokens")

    def table(points: Sequence[Point], mark: bool) -> list[str]:
        lines = [
            "| " + " | ".join(([""] if mark else []) + head) + " |",
            "|" + "---|" * (len(head) + (1 if mark else 0)),
        ]
        for p in points:
            r = _row(view, p)
            cells = [r["series"], r["cell"], r["per_request"], r["per_gpu"], r["gpus"]]
            if view.has_cost:
                cells.append(r["cost"])
            lines.append("| " + " | ".join(([r["frontier"]] if mark else []) + cells) + " |")
        return lines

    for ctx in contexts(view.points):
        out += [f"## Frontier at {ctx}", ""]
        out += table([p for p in view.frontier if p.context_label == ctx], False)
        out.append("")
    out += ["## Every point (◆ on the frontier)", ""]
    out += table(
        sorted(view.points, key=lambda p: (p.context_tokens, p.series, p.concurrency)), True
    )
    out.append("")
    return "\n".join(out)
