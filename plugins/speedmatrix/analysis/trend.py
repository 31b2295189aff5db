"""One cell's figure over the runs of a recipe (over commits), with each point's verdict.

Verdicts come from the `comparisons` table when it holds the point (what the run's own
comparison decided, against its own baseline); otherwise each point is compared with the
previous point of the trend using the same rule as compare.py (threshold AND between-run
noise). The first valid point's verdict is `first`; a point whose cell did not run valid
carries its status (`failed`, `over_capacity`…). The chart marks regressions and improvements so a reader sees where a cell moved.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from speedmatrix.analysis.noise import Z_95, NoiseModel, frame
from speedmatrix.analysis.verdict import DEFAULT_THRESHOLD, METRIC_BY_NAME, verdict_for
from speedmatrix.records import parse_cell

TREND_COLUMNS = (
    "run_id",
    "started_at",
    "engine_commit",
    "engine_version",
    "host",
    "status",
    "value",
    "change_pct",
    "verdict",
)


def _column_for(metric: str, phase: str) -> str:
    spec = METRIC_BY_NAME.get(metric)
    if spec is None:
        raise ValueError(f"unknown metric {metric!r}: one of {', '.join(METRIC_BY_NAME)}")
    if phase not in spec.phases:
        raise ValueError(f"metric {metric} does not apply to {phase} cells")
    return spec.column


def trend(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    recipe: str,
    cell: str,
    metric: str = "total_tok_s",
    host: str | None = None,
    comparisons: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    noise: NoiseModel | None = None,
) -> pd.DataFrame:
    """Rows (TREND_COLUMNS) of one cell's `metric` over the recipe's successful runs, oldest first.

    `metric` is a compare.METRICS name; prefill cells use `prefill_tok_s`.
    """
    phase, label, conc = parse_cell(cell)
    if phase == "prefill" and metric == "total_tok_s":
        metric = "prefill_tok_s"
    column = _column_for(metric, phase)
    higher = METRIC_BY_NAME[metric].higher_is_better
    rdf, cdf = frame(runs), frame(cells)
    if rdf.empty or cdf.empty:
        return pd.DataFrame(columns=list(TREND_COLUMNS))
    rdf = rdf[(rdf["recipe_id"] == recipe) & (rdf["status"] == "success")]
    if host is not None:
        rdf = rdf[rdf["host"] == host]
    sel = cdf[
        (cdf["phase"] == phase) & (cdf["context_label"] == label) & (cdf["concurrency"] == conc)
    ]
    keep = ["run_id", "started_at", "engine_commit", "engine_version", "host"]
    rdf = rdf[[c for c in keep if c in rdf]].copy()
    for c in keep:
        if c not in rdf:
            rdf[c] = None
    merged = rdf.merge(sel[["run_id", "status", column, "context_tokens"]], on="run_id")
    merged = merged.sort_values("started_at", kind="stable").reset_index(drop=True)
    known = _known_verdicts(comparisons, metric if phase != "prefill" else "prefill_tok_s")
    noise = noise or NoiseModel.empty()
    out: list[dict[str, Any]] = []
    prev: float | None = None
    for row in merged.to_dict("records"):
        value = row[column] if row["status"] == "valid" else None
        value = None if value is None or pd.isna(value) else float(value)
        verdict, change = None, None
        key = (row["run_id"], phase, label, conc)
        if key in known:
            verdict, change = known[key]
        elif value is not None and prev is not None:
            rel_sd, _ = noise.lookup(
                recipe, row["host"], phase, row["context_tokens"], conc, column
            )
            combined = math.sqrt(2) * Z_95 * rel_sd if rel_sd is not None else 0.0
            verdict, c = verdict_for(value, prev, higher, threshold, combined)
            change = c * 100 if math.isfinite(c) else None
        elif row["status"] != "valid":
            verdict = row["status"]
        elif prev is None:
            verdict = "first"
        out.append(
            {
                **{k: row.get(k) for k in keep},
                "status": row["status"],
                "value": value,
                "change_pct": change,
                "verdict": verdict,
            }
        )
        if value is not None:
            prev = value
    return pd.DataFrame(out, columns=list(TREND_COLUMNS))


def _known_verdicts(
    comparisons: pd.DataFrame | Iterable[Mapping[str, Any]] | None, metric: str
) -> dict[tuple[Any, ...], tuple[str, float | None]]:
    cmp = frame(comparisons)
    if cmp.empty:
        return {}
    cmp = cmp[cmp["metric"] == metric]
    out: dict[tuple[Any, ...], tuple[str, float | None]] = {}
    for r in cmp.to_dict("records"):
        change = r.get("change_pct")
        change = None if change is None or pd.isna(change) else float(change)
        key = (r["run_id"], r["phase"], r["context_label"], int(r["concurrency"]))
        out[key] = (r["verdict"], change)
    return out


_MARKERS = {
    "regression": ("v", "#d62728"),
    "improvement": ("^", "#2ca02c"),
}


def trend_chart_svg(points: pd.DataFrame, *, title: str, ylabel: str) -> str:
    """An inline SVG line chart of the trend, regressions and improvements marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    try:
        pts = points[points["value"].notna()].reset_index(drop=True)
        xs = list(range(len(pts)))
        ax.plot(xs, pts["value"], color="#1f77b4", marker="o", markersize=3, linewidth=1.2)
        for verdict, (marker, color) in _MARKERS.items():
            sel = pts.index[pts["verdict"] == verdict]
            if len(sel):
                ax.scatter(
                    sel,
                    pts.loc[sel, "value"],
                    marker=marker,
                    s=70,
                    color=color,
                    label=verdict,
                    zorder=3,
                )
        ticks = [
            str(c or v or r)[:9]
            for c, v, r in zip(
                pts["engine_commit"], pts["engine_version"], pts["run_id"], strict=True
            )
        ]
        ax.set_xticks(xs, ticks, rotation=45, ha="right", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
        return buf.getvalue()
    finally:
        plt.close(fig)


def diff_heatmap_svg(
    comparisons: pd.DataFrame | Iterable[Mapping[str, Any]], *, metric: str = "total_tok_s"
) -> str | None:
    """The HTML report's diff heat map: decode matrix coloured by the change of `metric`
    (green better, red worse, direction-aware), regressions and improvements labelled.
    None when the comparison has no decode rows for the metric."""
    cmp = frame(comparisons)
    if cmp.empty:
        return None
    rows = cmp[(cmp["metric"] == metric) & (cmp["phase"] == "decode")]
    rows = rows[rows["change_pct"].notna()]
    if rows.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    higher = METRIC_BY_NAME[metric].higher_is_better
    contexts = sorted(set(zip(rows["context_tokens"], rows["context_label"], strict=True)))
    concs = sorted(set(rows["concurrency"]))
    grid = [[math.nan] * len(concs) for _ in contexts]
    text = [[""] * len(concs) for _ in contexts]
    for r in rows.to_dict("records"):
        i = contexts.index((r["context_tokens"], r["context_label"]))
        j = concs.index(r["concurrency"])
        better_pct = r["change_pct"] if higher else -r["change_pct"]
        grid[i][j] = better_pct
        mark = {"regression": " ▼", "improvement": " ▲"}.get(r["verdict"], "")
        text[i][j] = f"{r['change_pct']:+.1f}%{mark}"
    span = max(5.0, max(abs(v) for row in grid for v in row if not math.isnan(v)))
    fig, ax = plt.subplots(figsize=(1.1 * len(concs) + 2, 0.5 * len(contexts) + 1.5), dpi=100)
    try:
        ax.imshow(grid, cmap="RdYlGn", vmin=-span, vmax=span, aspect="auto")
        for i, row in enumerate(text):
            for j, label in enumerate(row):
                if label:
                    ax.text(j, i, label, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(concs)), [str(c) for c in concs])
        ax.set_yticks(range(len(contexts)), [lbl for _, lbl in contexts])
        ax.set_xlabel("simultaneous requests")
        ax.set_ylabel("context")
        ax.set_title(f"{metric}: change vs baseline", fontsize=10)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
        return buf.getvalue()
    finally:
        plt.close(fig)
