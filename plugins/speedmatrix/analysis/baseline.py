"""Which run a run is compared with, and the history a comparison reads.

One job: choosing and reading what a run is judged against: :func:`select_baseline` (the
latest successful run of the same recipe and host, scheduled runs with scheduled runs, or a
named ref), the recipe's threshold, the recipe/host history (runs, cells, stored verdicts and
the between-run noise model) and the repository's compare URL between two engine commits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pandas as pd

from speedmatrix.analysis.noise import RUN_STATUSES, NoiseModel, frame
from speedmatrix.analysis.verdict import DEFAULT_THRESHOLD
from speedmatrix.commits import same_commit
from speedmatrix.recipes import load_recipe
from speedmatrix.records import cell_key, not_comparable_reason
from speedmatrix.store.extra import read_extra
from speedmatrix.store.protocol import WarehouseReader

SCHEDULED_TRIGGERS = ("nightly", "commit")


def _same(a: Any, b: Any) -> bool:
    na, nb = (
        a is None or (isinstance(a, float) and math.isnan(a)),
        b is None or (isinstance(b, float) and math.isnan(b)),
    )
    return (na and nb) or (not na and not nb and a == b)


def select_baseline(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    run: Mapping[str, Any],
    ref: str | None = None,
) -> dict[str, Any] | None:
    """The run to compare `run` with.

    Without `ref`: the latest successful or partial run (noise.RUN_STATUSES: a partial
    run's valid cells are history like any other) of the same recipe and host that started before
    it (for a nightly / commit run, the latest nightly / commit one). With `ref`: the run with that run_id, else the latest successful run of the same
    recipe and host whose engine commit starts with `ref` (or whose engine_ref / version equals
    it). None when nothing matches.
    """
    df = frame(runs)
    if df.empty:
        return None
    records = [r for r in df.to_dict("records") if r.get("run_id") != run.get("run_id")]
    if ref is not None:
        for r in records:
            if r.get("run_id") == ref:
                return r
    candidates = [
        r
        for r in records
        if r.get("status") in RUN_STATUSES
        and _same(r.get("recipe_id"), run.get("recipe_id"))
        and _same(r.get("host"), run.get("host"))
    ]
    if ref is None and run.get("trigger") in SCHEDULED_TRIGGERS:
        # Scheduled runs compare with scheduled runs: a manual or bisection run (often a few
        # cells at an older commit) must not become the next nightly's baseline.
        candidates = [r for r in candidates if r.get("trigger") in SCHEDULED_TRIGGERS]
    if ref is not None:
        candidates = [
            r
            for r in candidates
            if str(r.get("engine_commit") or "").startswith(ref)
            or same_commit(r.get("engine_commit"), ref)  # a longer ref of a landed prefix
            or ref in (r.get("engine_ref"), r.get("engine_version"))
        ]
    else:
        started = _ts(run.get("started_at"))
        if started is not None:
            candidates = [
                r for r in candidates if (t := _ts(r.get("started_at"))) is not None and t < started
            ]
    if not candidates:
        return None
    epoch = pd.Timestamp(0, tz="UTC")
    return max(
        candidates, key=lambda r: t if (t := _ts(r.get("started_at"))) is not None else epoch
    )


def _ts(value: Any) -> pd.Timestamp | None:
    """A UTC timestamp (naive values are taken as UTC), None when missing."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    ts = pd.Timestamp(value)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def recipe_threshold(recipe_id: str | None) -> float:
    """The recipe's `schedule.regression_threshold_pct` as a fraction; 3% when unknown."""
    if not recipe_id:
        return DEFAULT_THRESHOLD
    try:
        return float(load_recipe(recipe_id).schedule.regression_threshold_pct) / 100.0
    except Exception:  # an ingested or since-deleted recipe: the default applies
        return DEFAULT_THRESHOLD


def baseline_cells(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    run: Mapping[str, Any],
    run_cells: pd.DataFrame | Iterable[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each cell's own baseline: the latest earlier cell of the same key (records.cell_key)
    that ran (valid or over capacity) and is comparable with it (records.not_comparable_reason),
    from the runs :func:`select_baseline` would choose among. The latest run may lack a cell
    (a smaller matrix, a failed cell); an older one that has it is its baseline. A cell with
    no comparable earlier cell gets the latest earlier one that ran, so the verdict says why
    it is not compared. Returns (baseline cells, each with its run_id; run id -> run)."""
    rdf = frame(runs)
    if rdf.empty:
        return [], {}
    eligible = []
    for r in rdf.to_dict("records"):
        if select_baseline([r], run) is not None:
            eligible.append(r)
    by_id = {str(r["run_id"]): r for r in eligible}
    started = {k: _ts(r.get("started_at")) for k, r in by_id.items()}
    cdf = frame(cells)
    if cdf.empty:
        return [], by_id
    cdf = cdf[cdf["run_id"].astype(str).isin(by_id)]
    epoch = pd.Timestamp(0, tz="UTC")
    history: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in cdf.to_dict("records"):
        if c.get("status") in ("valid", "over_capacity"):
            history.setdefault(cell_key(c), []).append(c)
    out = []
    for cell in frame(run_cells).to_dict("records"):
        earlier = sorted(
            history.get(cell_key(cell), []),
            key=lambda c: started.get(str(c["run_id"])) or epoch,
            reverse=True,
        )
        match = next((c for c in earlier if not_comparable_reason(cell, c) is None), None)
        if match is None and earlier:
            match = earlier[0]
        if match is not None:
            out.append(match)
    return out, by_id


def read_history(
    warehouse: WarehouseReader,
    recipe_id: str | None,
    host: str | None = None,
    *,
    before: Mapping[str, Any] | None = None,
    noise_excludes: Callable[[Mapping[str, Any]], bool] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, NoiseModel]:
    """(runs, cells, comparisons, between-run noise model) of one recipe (and host).

    The noise model counts the runs' repeats (`cell_repeats`) as measurements too; with
    `before` (a run), it reads only the history strictly before that run: a verdict never
    uses the candidate or a later run. `noise_excludes(run)` keeps runs out of the noise (a
    bisection's own steps, which alternate between the two sides of the change it places)."""
    where, params = ["recipe_id IS NOT DISTINCT FROM ?"], [recipe_id]
    if host is not None:
        where.append("host IS NOT DISTINCT FROM ?")
        params.append(host)
    cond = " AND ".join(where)
    runs = warehouse.query(f"SELECT * FROM runs WHERE {cond}", params)
    cells = warehouse.query(
        f"SELECT c.* FROM cells c WHERE c.run_id IN (SELECT run_id FROM runs WHERE {cond})",
        params,
    )
    extra = {}
    for table in ("comparisons", "cell_repeats"):
        if recipe_id:
            extra[table] = read_extra(warehouse, table, recipe_id=recipe_id)
        else:
            rows = read_extra(warehouse, table)
            extra[table] = rows[rows["recipe_id"].isna()]
    noisy = runs
    if noise_excludes is not None and not runs.empty:
        noisy = runs[[not noise_excludes(r) for r in runs.to_dict("records")]]
    noise = NoiseModel.from_history(noisy, cells, extra["cell_repeats"], before=before)
    return runs, cells, extra["comparisons"], noise
