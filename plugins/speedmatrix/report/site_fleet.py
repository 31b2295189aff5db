"""What the site reads from the warehouse, and each run's verdict as the site shows it.

Why by aggregates: the site refreshes after every run of a fleet, so a build reads the whole
warehouse only through aggregate queries (the runs; per run the count, the newest time and
the baseline of its comparison rows; only the rows with a regression or an improvement). A
run's own comparison rows and a recipe's rows are read when its page is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from speedmatrix.records import COMPARABILITY_FIELDS, cell_name, cell_sort_key
from speedmatrix.report.site_text import clean, text
from speedmatrix.store.protocol import WarehouseReader
from speedmatrix.store.schemas import COMPARISON_FIELDS
from speedmatrix.words import count

RUN_COLUMNS = (
    "run_id",
    "recipe_id",
    "host",
    "trigger",
    "status",
    "started_at",
    "engine_commit",
    "engine_version",
    "engine_ref",
    "hardware_gpu",
    "hardware_gpu_count",
    "served_model",
    "model",
    "landed_at",
    "sim_profile",
)
CELL_COLUMNS = tuple(
    dict.fromkeys(  # each column once: the rule names `phase` too
        (
            "run_id",
            "phase",
            "context_tokens",
            "context_label",
            "concurrency",
            "status",
            "total_tok_s",
            *COMPARABILITY_FIELDS,  # the trends apply the verdicts' rule of what may be compared
        )
    )
)
COMPARISON_COLUMNS = (
    "run_id",
    "baseline_run_id",
    "phase",
    "context_tokens",
    "context_label",
    "concurrency",
    "metric",
    "change_pct",
    "verdict",
    "compared_at",
)


# ---------------------------------------------------------------------------------------------
# reading the warehouse


def load_fleet(wh: WarehouseReader) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(runs oldest first, per run the count, newest time and baseline of its comparison
    rows, the comparison rows with a regression or an improvement): what every build needs."""
    cols = ", ".join(RUN_COLUMNS)
    runs = wh.query(f"SELECT {cols} FROM runs")
    summary = wh.query(
        "SELECT run_id, count(*) AS n, max(compared_at) AS compared_at, "
        "min(baseline_run_id) AS baseline_run_id FROM comparisons GROUP BY run_id"
    )
    cols = ", ".join(COMPARISON_COLUMNS)
    hits = wh.query(
        f"SELECT {cols} FROM comparisons WHERE verdict IN ('regression', 'improvement')"
    )
    runs = runs.sort_values("started_at", kind="stable").reset_index(drop=True)
    return runs, summary, hits


def run_comparisons(wh: WarehouseReader, run_id: str) -> pd.DataFrame | None:
    """One run's comparison rows, every field (None when it has none), for its page: the
    page's summary shows each change's values, interval and threshold, as the pipeline's
    page does from the same rows."""
    cols = ", ".join(COMPARISON_FIELDS)
    rows = wh.query(f"SELECT {cols} FROM comparisons WHERE run_id = ?", [run_id])
    return rows if len(rows) else None


def recipe_comparisons(wh: WarehouseReader, recipe: str | None) -> pd.DataFrame:
    """One recipe's comparison rows (its partition), for its page's trends."""
    cols = ", ".join(COMPARISON_COLUMNS)
    return wh.query(
        f"SELECT {cols} FROM comparisons WHERE recipe_id IS NOT DISTINCT FROM ?", [recipe]
    )


def recipe_rows(
    wh: WarehouseReader, table: str, recipe: str | None, since: str | None = None
) -> pd.DataFrame:
    """One recipe's rows of `table` (the recipe_id partition: DuckDB reads only its files),
    from the month `since` (YYYY-MM, the run_month partition) on when given."""
    cols = ", ".join(CELL_COLUMNS)
    sql = f"SELECT {cols} FROM {table} WHERE recipe_id IS NOT DISTINCT FROM ?"
    if since is None:
        return wh.query(sql, [recipe])
    return wh.query(sql + " AND run_month >= ?", [recipe, since])


@dataclass
class RecipeHistory:
    """What a recipe page's trends are drawn from: its runs' cells and comparison rows, the
    between-run noise of its cells (repeats counted) and its regression threshold."""

    cells: pd.DataFrame
    comparisons: pd.DataFrame
    noise: Any  # analysis.noise.NoiseModel
    threshold: float


def read_recipe(
    wh: WarehouseReader, recipe: str | None, rruns: pd.DataFrame, window: int | None = None
) -> RecipeHistory:
    """The history of `recipe` over its runs `rruns` (the runs the site lists); with `window`,
    only each host's last `window` successful or partial runs (what its trends draw, the one
    before the first shown point included) and their noise: the read stays flat as years of
    history grow (the months before the window's are not opened)."""
    from speedmatrix.analysis.baseline import recipe_threshold
    from speedmatrix.analysis.noise import NoiseModel, between_run_noise
    from speedmatrix.analysis.trend import HISTORY_RUN_STATUSES

    since = None
    if window is not None:
        ok = rruns[rruns["status"].isin(HISTORY_RUN_STATUSES)]
        rruns = ok.groupby(ok["host"].fillna(""), sort=False).tail(window)
        if len(rruns):
            since = pd.Timestamp(rruns["started_at"].min()).strftime("%Y-%m")
    ids = set(rruns["run_id"])
    cells = recipe_rows(wh, "cells", recipe, since)
    cells = cells[cells["run_id"].isin(ids)]
    comparisons = recipe_comparisons(wh, recipe)
    comparisons = comparisons[comparisons["run_id"].isin(ids)]
    repeats = recipe_rows(wh, "cell_repeats", recipe, since)
    repeats = repeats[repeats["run_id"].isin(ids)]
    noise = NoiseModel(between_run_noise(rruns, cells, repeats, columns=("total_tok_s",)))
    return RecipeHistory(cells, comparisons, noise, recipe_threshold(recipe))


# ---------------------------------------------------------------------------------------------
# verdicts


@dataclass
class Verdict:
    """A run's verdict, as the index and the run tables show it."""

    word: str  # regressed / improved / mixed / clean / no baseline / failed / partial
    text: str
    baseline: str | None = None

    @property
    def css(self) -> str:
        return self.word.replace(" ", "-")


def run_verdict(
    run: Mapping[str, Any],
    rows: pd.DataFrame | None,
    *,
    compared: bool | None = None,
    baseline: str | None = None,
) -> Verdict:
    """From the run's landed comparisons (all metrics): regressions and improvements beyond
    noise, else clean; a run that failed says so first (its figures are not a verdict).

    ``rows`` is every comparison row of the run, or (the site's aggregate read, ``compared``
    given) only its rows with a regression or an improvement, ``compared`` saying whether
    the run has any comparison row at all and ``baseline`` against which run."""
    status = text(run.get("status"))
    reg: list[str] = []
    imp: list[str] = []
    if rows is not None and not rows.empty:
        reg, imp = _cells_with(rows, "regression"), _cells_with(rows, "improvement")
        if compared is None:
            base = rows["baseline_run_id"].dropna()
            baseline = str(base.iloc[0]) if not base.empty else None
    if compared is None:
        compared = rows is not None and not rows.empty
    if status == "failed":
        return Verdict("failed", "run failed", baseline)
    if not compared:
        return Verdict("no baseline", "not compared (no baseline)", None)
    parts = []
    if reg:
        parts.append(
            f"{count(len(reg), 'cell')} regressed ({_few(reg)}): {_families(rows, 'regression')}"
        )
    if imp:
        parts.append(
            f"{count(len(imp), 'cell')} improved ({_few(imp)}): {_families(rows, 'improvement')}"
        )
    word = "mixed" if reg and imp else "regressed" if reg else "improved" if imp else "clean"
    text_ = "; ".join(parts) if parts else "no change beyond noise"
    if status == "partial":
        text_ += " (partial run)"
    return Verdict(word, text_, baseline)


def fleet_verdicts(
    records: Sequence[Mapping[str, Any]], summary: pd.DataFrame, hits: pd.DataFrame
) -> tuple[dict[str, Verdict], dict[str, tuple[int, str, str] | None]]:
    """Each run's verdict from the fleet's aggregate read (:func:`load_fleet`), and what of
    its comparisons a page shows (row count, newest time, verdict text; None: not compared),
    the part of a run page's fingerprint the `regressions` task changes."""
    hits_of = {k: g for k, g in hits.groupby("run_id", sort=False)}
    summary_of = {str(r["run_id"]): r for r in summary.to_dict("records")}
    verdicts: dict[str, Verdict] = {}
    compared: dict[str, tuple[int, str, str] | None] = {}
    for r in records:
        rid = str(r["run_id"])
        agg = summary_of.get(rid)
        verdicts[rid] = run_verdict(
            r,
            hits_of.get(rid),
            compared=agg is not None,
            baseline=clean(agg["baseline_run_id"]) if agg is not None else None,
        )
        compared[rid] = (
            None if agg is None else (int(agg["n"]), text(agg["compared_at"]), verdicts[rid].text)
        )
    return verdicts, compared


def _cells_with(rows: pd.DataFrame, verdict: str) -> list[str]:
    """The cells (not metric rows: one slower cell moves tok/s and time between tokens
    together) with `verdict` on any metric, in the report's order (records.cell_sort_key)."""
    hit = rows[rows["verdict"] == verdict]
    cells = {
        cell_name(p, clean(lbl) if clean(lbl) is not None else clean(t), clean(c)): {
            "phase": p,
            "context_tokens": clean(t),
            "context_label": clean(lbl),
            "concurrency": clean(c),
        }
        for p, lbl, t, c in zip(
            hit["phase"],
            hit["context_label"],
            hit.get("context_tokens", hit["concurrency"] * 0),
            hit["concurrency"],
            strict=True,
        )
    }
    return sorted(cells, key=lambda name: (cell_sort_key(cells[name]), name))


def _families(rows: pd.DataFrame | None, verdict: str) -> str:
    """What moved, named (a badge names its metric): the figure families of the rows with
    `verdict`, in the order analysis.display.FAMILIES gives them."""
    from speedmatrix.analysis.display import family_of

    if rows is None:
        return ""
    names: list[str] = []
    for metric in rows.loc[rows["verdict"] == verdict, "metric"]:
        if (name := family_of(metric)) not in names:
            names.append(name)
    return ", ".join(names)


def _few(names: Sequence[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
