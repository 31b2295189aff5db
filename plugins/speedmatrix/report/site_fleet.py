"""What the site reads from the warehouse, and each run's verdict as the site shows it.

Why by aggregates: the site refreshes after every run of a fleet of years, so a build reads
the whole warehouse once, as one aggregate query (per run its fingerprint: what its page is
made from, its verdict's inputs among them), and takes everything else it needs of the fleet
from that Arrow table (:class:`Fleet`), never as a Python row per run. A verdict is made
(from the comparison rows the `regressions` task landed, not judged again) only for the runs
a page being written shows; a run's own comparison rows and a recipe's rows are read when
its page is written.
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


FLEET_ORDER = "started_at NULLS LAST, run_id"
"""The fleet's order, oldest first: the pages of a full build and of an incremental one list
runs in the same order (ties of started_at by run id)."""
_HITS = ("regression", "improvement")


def fleet_fingerprints(wh: WarehouseReader) -> pa.Table:
    """Every run, oldest first: its RUN_COLUMNS and the ``fingerprint`` of what its page is
    made from (its landing time and status, and of its comparison rows the count, the newest
    time, the baseline and every regression or improvement: all its verdict is made of).

    One aggregate in the query engine, and the build's only scan of the runs: a scan of the
    runs' files costs the same for 25 rows as for all of them, so everything else a build
    needs of the fleet (the index's rows, the latest runs, a recipe's runs, the views'
    candidates: :class:`Fleet`) is taken from this Arrow table, never as a row per run in
    Python."""
    hit = (
        "concat_ws('/', phase, coalesce(CAST(context_tokens AS VARCHAR), '-'), "
        "coalesce(context_label, '-'), coalesce(CAST(concurrency AS VARCHAR), '-'), metric, "
        "verdict)"
    )
    hits = ", ".join(f"'{v}'" for v in _HITS)
    cols = ", ".join(f"r.{c}" for c in RUN_COLUMNS)
    return wh.query_arrow(
        f"""
        WITH c AS (
            SELECT run_id, count(*) AS n, max(compared_at) AS compared_at,
                min(baseline_run_id) AS baseline_run_id,
                string_agg(CASE WHEN verdict IN ({hits}) THEN {hit} END, ';' ORDER BY {hit})
                    AS hits
            FROM comparisons GROUP BY run_id
        )
        SELECT {cols}, md5(CAST([
            CAST(r.landed_at AS VARCHAR), r.status, CAST(c.n AS VARCHAR),
            CAST(c.compared_at AS VARCHAR), c.baseline_run_id, c.hits
        ] AS VARCHAR)) AS fingerprint
        FROM runs AS r LEFT JOIN c ON c.run_id = r.run_id
        ORDER BY r.{FLEET_ORDER.replace(", ", ", r.")}
        """
    )


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    """A few runs as the pages take them (pandas' values, as a query's DataFrame gives)."""
    return table.drop_columns(["fingerprint"]).to_pandas().to_dict("records")


class Fleet:
    """The fleet as a build reads it (:func:`fleet_fingerprints`): per run its id, recipe and
    fingerprint as plain lists, and the few runs a page shows picked by Arrow's compute, not
    by a pass in Python over every run."""

    def __init__(self, table: pa.Table):
        import pyarrow.compute as pc

        self.table = table.append_column("_i", pa.array(range(table.num_rows), pa.int64()))
        self.run_ids: list[str] = table.column("run_id").to_pylist()
        self.recipes: list[str] = pc.fill_null(table.column("recipe_id"), "").to_pylist()
        self.fingerprints = dict(
            zip(self.run_ids, table.column("fingerprint").to_pylist(), strict=True)
        )

    def __len__(self) -> int:
        return len(self.run_ids)

    def _take(self, indices: Any) -> pa.Table:
        # typed: an empty Python list would be an array of type null, which Arrow cannot
        # take with (no successful run: no model-view candidates)
        if isinstance(indices, list):
            indices = pa.array(indices, pa.int64())
        return self.table.take(indices).drop_columns(["_i"])

    def latest(self, n: int) -> list[dict[str, Any]]:
        """The `n` newest runs, newest first (the index's latest runs)."""
        first = max(0, self.table.num_rows - n)
        return _rows(self._take(list(range(self.table.num_rows - 1, first - 1, -1))))

    def latest_per_host(self) -> list[dict[str, Any]]:
        """Per recipe x host (missing ones as ''), its latest run, with ``runs_of_host``: how
        many runs it has; by recipe then host (the index's rows)."""
        import pyarrow.compute as pc

        keys = pa.table(
            {
                "recipe": pc.fill_null(self.table.column("recipe_id"), ""),
                "host": pc.fill_null(self.table.column("host"), ""),
                "_i": self.table.column("_i"),
            }
        )
        groups = keys.group_by(["recipe", "host"], use_threads=False).aggregate(
            [("_i", "max"), ("_i", "count")]
        )
        groups = groups.sort_by([("recipe", "ascending"), ("host", "ascending")])
        rows = _rows(self._take(groups.column("_i_max")))
        for row, n in zip(rows, groups.column("_i_count").to_pylist(), strict=True):
            row["runs_of_host"] = n
        return rows

    def series_candidates(self) -> list[dict[str, Any]]:
        """The runs the model views choose from, oldest first: per model id, served name,
        recipe and host its latest successful run (analysis.pareto.choose_series picks among
        these what it would pick among all runs: its groups are unions of these)."""
        import pyarrow.compute as pc

        ok = self.table.filter(pc.equal(self.table.column("status"), "success"))
        keys = pa.table(
            {
                "model": ok.column("model"),
                "served": ok.column("served_model"),
                "recipe": pc.fill_null(ok.column("recipe_id"), ""),
                "host": pc.fill_null(ok.column("host"), ""),
                "_i": ok.column("_i"),
            }
        )
        newest = keys.group_by(["model", "served", "recipe", "host"], use_threads=False)
        chosen = sorted(newest.aggregate([("_i", "max")]).column("_i_max").to_pylist())
        return [{k: clean(v) for k, v in r.items()} for r in _rows(self._take(chosen))]

    def recipe_runs(self, recipe_key: str) -> pd.DataFrame:
        """One recipe's runs, oldest first (`recipe_key`: its id, '' for none), for its
        page."""
        import pyarrow.compute as pc

        mine = pc.equal(pc.fill_null(self.table.column("recipe_id"), ""), recipe_key)
        return self.table.filter(mine).drop_columns(["_i", "fingerprint"]).to_pandas()


def recipe_runs(wh: WarehouseReader, recipe_key: str) -> pd.DataFrame:
    """One recipe's runs, oldest first, read on their own (outside a build)."""
    cols = ", ".join(RUN_COLUMNS)
    sql = f"SELECT {cols} FROM runs WHERE coalesce(recipe_id, '') = ? ORDER BY {FLEET_ORDER}"
    return wh.query(sql, [recipe_key])


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
