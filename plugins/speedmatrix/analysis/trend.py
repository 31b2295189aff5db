"""One cell's figure over the runs of a recipe (over commits), with each point's verdict.

Verdicts come from the `comparisons` table when it holds the point (what the run's own
comparison decided, against its own baseline); otherwise each point is compared with the
previous point of the trend using the same rule as compare.py (threshold AND between-run
noise). The first valid point's verdict is `first`; a point whose cell did not run valid
carries its status (`failed`, `over_capacity`…). The charts of a trend are drawn by speedmatrix.report.charts (analysis does not draw).

A partial run's valid cells are history like a successful run's: its points are in
the trend, marked by `run_status`; a failed run's are not (it measured nothing to keep).
Each point also says whether a change point of the whole series starts at it
(analysis.changepoints: the step's verdict, size and p-value), so a slowdown spread over
several commits, each of which read "noise" against the run before, is still reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from speedmatrix.analysis.changepoints import CHANGE_POINT_COLUMNS, change_points, describe, mark
from speedmatrix.analysis.noise import Z_95, NoiseModel, frame
from speedmatrix.analysis.verdict import DEFAULT_THRESHOLD, METRIC_BY_NAME, verdict_for
from speedmatrix.errors import InputError
from speedmatrix.records import COMPARABILITY_FIELDS, cell_name, not_comparable_reason, parse_cell

TREND_COLUMNS = (
    "run_id",
    "started_at",
    "engine_commit",
    "engine_version",
    "engine_ref",
    "host",
    "run_status",
    "status",
    "value",
    "change_pct",
    "verdict",
    *CHANGE_POINT_COLUMNS,
)
HISTORY_RUN_STATUSES = ("success", "partial")
"""Runs whose valid cells are history: a partial run's measured cells are as good as a
successful run's (the run is partial because of other cells)."""


def _column_for(metric: str, phase: str) -> str:
    spec = METRIC_BY_NAME.get(metric)
    if spec is None:
        raise InputError(f"unknown metric {metric!r}: one of {', '.join(METRIC_BY_NAME)}")
    if phase not in spec.phases:
        raise InputError(f"metric {metric} does not apply to {phase} cells")
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
    """Rows (TREND_COLUMNS) of one cell's `metric` over the recipe's successful and partial
    runs, oldest first.

    `metric` is a compare.METRICS name; prefill cells use `prefill_tok_s`.
    """
    return trends(
        runs,
        cells,
        recipe=recipe,
        names=[cell],
        metric=metric,
        host=host,
        comparisons=comparisons,
        threshold=threshold,
        noise=noise,
    )[cell]


def trends(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    recipe: str,
    names: Sequence[str],
    metric: str = "total_tok_s",
    host: str | None = None,
    comparisons: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    noise: NoiseModel | None = None,
) -> dict[str, pd.DataFrame]:
    """:func:`trend` of each named cell, from one pass over the tables.

    Why one pass: the site's recipe page draws every cell of a recipe, and filtering and
    merging the tables again for each cell takes most of its time (55 cells: 0.78 of 1.28 s;
    the page is rewritten after every run)."""
    wanted: dict[str, tuple[str, str, int, str, str]] = {}
    for name in names:
        phase, label, conc = parse_cell(name)
        m = "prefill_tok_s" if phase == "prefill" and metric == "total_tok_s" else metric
        wanted[name] = (phase, label, conc, m, _column_for(m, phase))
    rdf, cdf = frame(runs), frame(cells)
    if rdf.empty or cdf.empty:
        return {name: pd.DataFrame(columns=list(TREND_COLUMNS)) for name in wanted}
    rdf = rdf[(rdf["recipe_id"] == recipe) & rdf["status"].isin(HISTORY_RUN_STATUSES)]
    rdf = rdf.assign(run_status=rdf["status"])
    if host is not None:
        rdf = rdf[rdf["host"] == host]
    rdf = rdf[[c for c in _RUN_KEEP if c in rdf]].copy()
    for c in _RUN_KEEP:
        if c not in rdf:
            rdf[c] = None
    columns = sorted({w[4] for w in wanted.values()})
    rule = [c for c in COMPARABILITY_FIELDS if c in cdf]  # what may be compared (records)
    sel = cdf[["run_id", "phase", "context_label", "concurrency", "status", *columns, *rule]]
    sel = sel.assign(context_tokens=cdf["context_tokens"])
    merged = rdf.merge(sel, on="run_id")
    # sorted as a whole, then grouped: a stable sort keeps each cell's rows in the order its
    # own merge and sort would give them
    merged = merged.sort_values("started_at", kind="stable")
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in merged.to_dict("records"):
        conc = row["concurrency"]
        if conc is None or pd.isna(conc):
            continue
        groups.setdefault((row["phase"], row["context_label"], int(conc)), []).append(row)
    noise = noise or NoiseModel.empty()
    known: dict[str, dict[tuple[Any, ...], tuple[str, float | None]]] = {}
    out: dict[str, pd.DataFrame] = {}
    for name, (phase, label, conc, m, column) in wanted.items():
        judged = m if phase != "prefill" else "prefill_tok_s"
        if judged not in known:
            known[judged] = _known_verdicts(comparisons, judged)
        points = _points(
            groups.get((phase, label, conc), []),
            recipe=recipe,
            cell=(phase, label, conc),
            column=column,
            higher=METRIC_BY_NAME[m].higher_is_better,
            known=known[judged],
            threshold=threshold,
            noise=noise,
        )
        higher = METRIC_BY_NAME[m].higher_is_better
        out[name] = mark(points, change_points(points, higher_is_better=higher))
    return out


def noise_half_width(
    noise: NoiseModel,
    recipe: str | None,
    host: str | None,
    phase: str,
    context_tokens: int,
    concurrency: int,
    column: str,
) -> tuple[float, str]:
    """(How far a cell's `column` may move from one run to the next by between-run noise
    alone, as a fraction; where that noise came from: 'cell', 'pooled' or 'none').

    The 95% half-width of the difference of two runs (√2 · z · relative sd); 0 when the noise
    is not known, so the threshold alone decides."""
    rel_sd, source = noise.lookup(recipe, host, phase, context_tokens, concurrency, column)
    return (math.sqrt(2) * Z_95 * rel_sd if rel_sd is not None else 0.0), source


def noise_band(
    noise: NoiseModel,
    threshold: float,
    recipe: str | None,
    host: str | None,
    phase: str,
    context_tokens: int,
    concurrency: int,
    column: str,
) -> tuple[float, str]:
    """(The band a point may land in around the point before and still be judged noise: the
    larger of `threshold` and :func:`noise_half_width`, the rule the trend's verdicts apply
    through verdict_for; 'threshold' when the threshold sets it, else the noise's source).

    One rule for the verdicts and for the band a chart draws, so a point outside the drawn
    band is the point judged a regression or an improvement."""
    half, source = noise_half_width(noise, recipe, host, phase, context_tokens, concurrency, column)
    band = max(threshold, half)
    return band, ("threshold" if band == threshold else source)


# the run's own columns, a trend row's first ones (the engine ref among them: a run's commit is
# shown by the longest name it knows, commits.commit_label)
_RUN_KEEP = TREND_COLUMNS[: TREND_COLUMNS.index("run_status") + 1]


def _points(
    rows: Sequence[Mapping[str, Any]],
    *,
    recipe: str,
    cell: tuple[str, str, int],
    column: str,
    higher: bool,
    known: Mapping[tuple[Any, ...], tuple[str, float | None]],
    threshold: float,
    noise: NoiseModel,
) -> pd.DataFrame:
    """One cell's rows (its runs, oldest first) judged point by point."""
    phase, label, conc = cell
    out: list[dict[str, Any]] = []
    prev: float | None = None
    prev_row: Mapping[str, Any] | None = None
    for row in rows:
        value = row[column] if row["status"] == "valid" else None
        value = None if value is None or pd.isna(value) else float(value)
        verdict, change = None, None
        key = (row["run_id"], phase, label, conc)
        if key in known:
            verdict, change = known[key]
        elif (
            value is not None
            and prev_row is not None
            and not_comparable_reason(row, prev_row) is not None
        ):
            # the verdicts' rule (records): a point measured otherwise starts a new series
            verdict = "not_comparable"
        elif value is not None and prev is not None:
            combined, _ = noise_half_width(
                noise, recipe, row["host"], phase, row["context_tokens"], conc, column
            )
            verdict, c = verdict_for(value, prev, higher, threshold, combined)
            change = c * 100 if math.isfinite(c) else None
        elif row["status"] != "valid":
            verdict = row["status"]
        elif prev is None:
            verdict = "first"
        out.append(
            {
                **{k: row.get(k) for k in _RUN_KEEP},
                "status": row["status"],
                "value": value,
                "change_pct": change,
                "verdict": verdict,
            }
        )
        if value is not None:
            prev, prev_row = value, row
    return pd.DataFrame(out, columns=[c for c in TREND_COLUMNS if c not in CHANGE_POINT_COLUMNS])


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


def new_change_points(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    recipe: str,
    run_id: str,
    host: str | None = None,
    comparisons: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    noise: NoiseModel | None = None,
) -> list[dict[str, Any]]:
    """The change points of the run's cells (their throughput: total tok/s, prefill tok/s)
    that the history up to `run_id` shows and the history before it did not: what the run
    newly makes detectable, for its alert. Each: the cell, the step's first run, its verdict,
    size, p-value and `text` (changepoints.describe).

    Why "new" is judged, not "at this run": a step is significant only once a few runs sit
    at its new level, so it is found a few runs after the commit that made it; and a step
    found once is found again by every later run, which must not alert again. A step the
    earlier history placed one run away counts as the same step (the detector may move it
    by one as the runs after it come in)."""
    rdf, cdf = frame(runs), frame(cells)
    if rdf.empty or run_id not in set(rdf["run_id"]):
        return []
    at = rdf.loc[rdf["run_id"] == run_id, "started_at"].iloc[0]
    upto = rdf[rdf["started_at"] <= at]
    before = upto[upto["run_id"] != run_id]
    mine = cdf[(cdf["run_id"] == run_id) & (cdf["status"] == "valid")]
    names = sorted({_name(r) for r in mine.to_dict("records")})
    if not names or before.empty:
        return []
    kw = {"recipe": recipe, "names": names, "host": host, "comparisons": comparisons,
          "threshold": threshold, "noise": noise}  # fmt: skip
    now, then = trends(upto, cdf, **kw), trends(before, cdf, **kw)
    out = []
    for name in names:
        pts, old = now[name], then[name]
        seen = [(i, v) for i, v in enumerate(old.get("change_point", pd.Series(dtype=object))) if v]
        for i, row in enumerate(pts.to_dict("records")):
            verdict = row.get("change_point")
            if not isinstance(verdict, str) or not verdict:
                continue
            if any(abs(i - j) <= 1 and v == verdict for j, v in seen):
                continue
            out.append(
                {
                    "cell": name,
                    "run_id": row["run_id"],
                    "verdict": verdict,
                    "change_pct": row["change_point_pct"],
                    "pvalue": row["change_point_pvalue"],
                    "text": describe(row),
                }
            )
    return out


def _name(row: Mapping[str, Any]) -> str:
    """A cell row's name as trends() takes it (records.cell_name)."""
    return cell_name(row["phase"], row["context_label"], int(row["concurrency"]))
