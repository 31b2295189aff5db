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
import pyarrow as pa

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
CELL_COLUMNS = (
    "run_id",
    "phase",
    "context_tokens",
    "context_label",
    "concurrency",
    "status",
    "total_tok_s",
    *COMPARABILITY_FIELDS,  # the trends apply the verdicts' rule of what may be compared
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


FLEET_ORDER = "started_at NULLS LAST, run_id"
"""The fleet's order, oldest first, in every query of the site: the pages of a full build and
of an incremental one list runs in the same order (ties of started_at by run id)."""
_NEWEST_FIRST = "started_at DESC NULLS FIRST, run_id DESC"
_HITS = ("regression", "improvement")


def fleet_fingerprints(wh: WarehouseReader) -> pa.Table:
    """Per run, oldest first: its id, its recipe and the fingerprint of what its page is made
    from (its landing time and status, and of its comparison rows the count, the newest time,
    the baseline and every regression or improvement: all a verdict is made of). One
    aggregate in the query engine: the only per-run read of a build, so that a refresh after
    one run costs no Python per run of the fleet beyond comparing these with the manifest."""
    hit = (
        "concat_ws('/', phase, coalesce(CAST(context_tokens AS VARCHAR), '-'), "
        "coalesce(context_label, '-'), coalesce(CAST(concurrency AS VARCHAR), '-'), metric, "
        "verdict)"
    )
    hits = ", ".join(f"'{v}'" for v in _HITS)
    return wh.query_arrow(
        f"""
        WITH c AS (
            SELECT run_id, count(*) AS n, max(compared_at) AS compared_at,
                min(baseline_run_id) AS baseline_run_id,
                string_agg(CASE WHEN verdict IN ({hits}) THEN {hit} END, ';' ORDER BY {hit})
                    AS hits
            FROM comparisons GROUP BY run_id
        )
        SELECT r.run_id, r.recipe_id, md5(CAST([
            CAST(r.landed_at AS VARCHAR), r.status, CAST(c.n AS VARCHAR),
            CAST(c.compared_at AS VARCHAR), c.baseline_run_id, c.hits
        ] AS VARCHAR)) AS fingerprint
        FROM runs AS r LEFT JOIN c ON c.run_id = r.run_id
        ORDER BY r.{FLEET_ORDER.replace(", ", ", r.")}
        """
    )


def _run_rows(wh: WarehouseReader, where: str, params: list[Any], order: str) -> pd.DataFrame:
    cols = ", ".join(RUN_COLUMNS)
    return wh.query(f"SELECT {cols} FROM runs WHERE {where} ORDER BY {order}", params)


def recipe_runs(wh: WarehouseReader, recipe_key: str) -> pd.DataFrame:
    """One recipe's runs, oldest first (`recipe_key`: its id, '' for none), for its page."""
    return _run_rows(wh, "coalesce(recipe_id, '') = ?", [recipe_key], FLEET_ORDER)


def latest_runs(wh: WarehouseReader, n: int) -> list[dict[str, Any]]:
    """The fleet's `n` newest runs, newest first (the index's latest runs)."""
    cols = ", ".join(RUN_COLUMNS)
    rows = wh.query(f"SELECT {cols} FROM runs ORDER BY {_NEWEST_FIRST} LIMIT {int(n)}")
    return rows.to_dict("records")


def latest_per_host(wh: WarehouseReader) -> list[dict[str, Any]]:
    """Per recipe x host (missing ones as ''), its latest run and how many it has: the index's
    rows, by recipe then host."""
    cols = ", ".join(RUN_COLUMNS)
    part = "PARTITION BY coalesce(recipe_id, ''), coalesce(host, '')"
    rows = wh.query(
        f"SELECT * FROM (SELECT {cols}, count(*) OVER ({part}) AS runs_of_host, "
        f"row_number() OVER ({part} ORDER BY {_NEWEST_FIRST}) AS newest FROM runs) "
        "WHERE newest = 1"
    ).to_dict("records")
    rows.sort(key=lambda r: (text(r.get("recipe_id")), text(r.get("host"))))
    return rows


def series_candidates(wh: WarehouseReader) -> list[dict[str, Any]]:
    """The runs the model views can choose from, oldest first: per model id, served name,
    recipe and host the latest successful run (analysis.pareto.choose_series picks among
    these what it would pick among all runs: its groups are unions of these)."""
    cols = ", ".join(RUN_COLUMNS)
    part = "PARTITION BY model, served_model, coalesce(recipe_id, ''), coalesce(host, '')"
    rows = wh.query(
        f"SELECT {cols} FROM (SELECT {cols}, row_number() OVER ({part} ORDER BY "
        f"{_NEWEST_FIRST}) AS newest FROM runs WHERE status = 'success') "
        f"WHERE newest = 1 ORDER BY {FLEET_ORDER}"
    )
    return [{k: clean(v) for k, v in r.items()} for r in rows.to_dict("records")]


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


def verdicts_of(wh: WarehouseReader, runs: Sequence[Mapping[str, Any]]) -> dict[str, Verdict]:
    """The verdicts of `runs` (the runs a page being written shows), from what the
    `regressions` task landed: per run the count and baseline of its comparison rows and its
    rows with a regression or an improvement, read for these runs only."""
    ids = sorted({str(r["run_id"]) for r in runs})
    if not ids:
        return {}
    summary = wh.query(
        "SELECT run_id, count(*) AS n, min(baseline_run_id) AS baseline_run_id "
        "FROM comparisons WHERE list_contains(?, run_id) GROUP BY run_id",
        [ids],
    )
    cols = ", ".join(COMPARISON_COLUMNS)
    hits = wh.query(
        f"SELECT {cols} FROM comparisons WHERE list_contains(?, run_id) "
        f"AND verdict IN ({', '.join(repr(v) for v in _HITS)})",
        [ids],
    )
    hits_of = {k: g for k, g in hits.groupby("run_id", sort=False)}
    summary_of = {str(r["run_id"]): r for r in summary.to_dict("records")}
    verdicts: dict[str, Verdict] = {}
    for r in runs:
        rid = str(r["run_id"])
        if rid in verdicts:
            continue
        agg = summary_of.get(rid)
        verdicts[rid] = run_verdict(
            r,
            hits_of.get(rid),
            compared=agg is not None,
            baseline=clean(agg["baseline_run_id"]) if agg is not None else None,
        )
    return verdicts


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
