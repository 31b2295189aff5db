"""How much a cell's figures move when nothing changed: the noise that a verdict must beat.

Two estimates, because neither alone is enough:

* **Within the window** (one run): bootstrap confidence intervals from the per-request rows
  (records.REQUEST_FIELDS). Total tok/s is resampled by *stream* (a stream's in-window tokens
  are its share of the throughput; requests of one stream are not independent), the median
  time-between-tokens and TTFT by *request*. This sees sampling noise only, and nothing when a
  cell has one stream or one request (prefill, C=1 decode).
* **Between runs** (repeated runs, or repeated cells, of an unchanged engine on the same recipe
  and host): the pooled relative standard deviation of each cell figure. This sees what the
  window cannot: server warm-up, clocks, thermal state, placement. Runs count as "unchanged"
  when recipe, host and engine commit (else engine version) are equal. The repeats a
  `speed_matrix` run makes of its own cells (`repeats` / `repeat_cells`, the `cell_repeats`
  table) are measurements of that same unchanged engine, a pass or more after the primary, so
  they count like runs: one run with repeats already gives a cell its own spread.

Both are expressed relative to the value (a fraction), so compare.py can combine them and
weigh them against a relative threshold. scipy (a pinned dependency of great-expectations)
provides the bootstrap; numpy/pandas the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from speedmatrix.store.schemas import NOISE_SCHEMA

CELL_KEY: tuple[str, ...] = ("phase", "context_tokens", "concurrency")
"""What identifies a cell within a run (the cells and requests tables share these columns)."""

NOISE_COLUMNS: tuple[str, ...] = (
    "total_tok_s",
    "per_request_tok_s",
    "ttft_ms",
    "tbt_ms",
    "spec_acceptance_length",
)
"""Cell columns whose between-run spread is estimated."""

CONFIDENCE = 0.95
Z_95 = 1.959963984540054
"""Two-sided 95% normal quantile: turns a relative standard deviation into a half-width."""


def frame(rows: pd.DataFrame | Iterable[Mapping[str, Any]] | None) -> pd.DataFrame:
    """Accept rows as a DataFrame or as dicts (records.py names); always return a DataFrame."""
    if rows is None:
        return pd.DataFrame()
    if isinstance(rows, pd.DataFrame):
        return rows
    return pd.DataFrame(list(rows))


def _finite(values: Iterable[Any]) -> np.ndarray:
    """The finite numbers among values (None, NaN and non-numbers dropped)."""
    if isinstance(values, pd.Series):
        values = values.to_numpy()
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        arr = pd.to_numeric(pd.Series(list(values), dtype="object"), errors="coerce").to_numpy(
            dtype=float, na_value=np.nan
        )
    return arr[np.isfinite(arr)]


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    samples: int
    confidence: float = CONFIDENCE

    @property
    def rel_halfwidth(self) -> float:
        """Half the interval's width relative to the estimate (0.02 = +-2%)."""
        if not self.estimate:
            return math.inf
        return abs(self.high - self.low) / 2.0 / abs(self.estimate)


def bootstrap_interval(
    values: Sequence[float] | np.ndarray,
    statistic: str,
    *,
    scale: float = 1.0,
    confidence: float = CONFIDENCE,
    n_resamples: int = 2000,
    seed: int = 0,
) -> Interval | None:
    """Percentile bootstrap of `sum` or `median` of values (times `scale`).

    None with fewer than two samples: one sample has no spread to resample. The seed is fixed
    so that landing a run twice gives the same interval (idempotent landing).
    """
    data = _finite(values)
    if data.size < 2:
        return None
    funcs = {"sum": np.sum, "median": np.median}
    if statistic not in funcs:
        raise ValueError(f"unknown statistic {statistic!r}: use sum or median")
    func = funcs[statistic]

    def stat(x: np.ndarray, axis: int = -1) -> np.ndarray:
        return func(x, axis=axis) * scale

    estimate = float(stat(data))
    if np.all(data == data[0]):
        return Interval(estimate, estimate, estimate, int(data.size), confidence)
    # imported here: scipy.stats takes seconds to import, and readers of the noise tables
    # (`speedmatrix query`, the warehouse views) never bootstrap
    from scipy import stats

    res = stats.bootstrap(
        (data,),
        stat,
        n_resamples=n_resamples,
        vectorized=True,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    return Interval(estimate, float(ci.low), float(ci.high), int(data.size), confidence)


def within_window(
    requests: pd.DataFrame | Iterable[Mapping[str, Any]],
    measured_s: float | None,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Interval]:
    """Bootstrap intervals for one cell from its request rows.

    Keys present when computable: total_tok_s (needs measured_s and window_tokens, resampled by
    stream), tbt_ms and ttft_ms (median over requests), per_request_tok_s (1000 / the tbt_ms
    interval, since the median commutes with a monotone map).
    """
    req = frame(requests)
    out: dict[str, Interval] = {}
    if req.empty:
        return out
    kw = {"n_resamples": n_resamples, "seed": seed}
    if measured_s and "window_tokens" in req:
        tokens = pd.to_numeric(req["window_tokens"], errors="coerce").fillna(0)
        if "stream" in req and req["stream"].notna().all():
            per_unit = tokens.groupby(req["stream"]).sum()
        else:
            per_unit = tokens
        ci = bootstrap_interval(per_unit.to_numpy(), "sum", scale=1.0 / measured_s, **kw)
        if ci is not None:
            out["total_tok_s"] = ci
    if "tbt_ms" in req:
        tbt = bootstrap_interval(req["tbt_ms"].to_numpy(), "median", **kw)
        if tbt is not None and tbt.low > 0:
            out["tbt_ms"] = tbt
            out["per_request_tok_s"] = Interval(
                1000.0 / tbt.estimate, 1000.0 / tbt.high, 1000.0 / tbt.low, tbt.samples
            )
    if "ttft_ms" in req:
        ttft = bootstrap_interval(req["ttft_ms"].to_numpy(), "median", **kw)
        if ttft is not None:
            out["ttft_ms"] = ttft
    return out


def _key(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Normalise a cell key so that numpy ints and Python ints hash alike."""
    return tuple(int(v) if isinstance(v, (int, np.integer)) else v for v in values)


BETWEEN_COLUMNS = (
    "recipe_id",
    "host",
    *CELL_KEY,
    "metric",
    "rel_sd",
    "dof",
    "runs",
    "engines",
)


def _engine_identity(runs: pd.DataFrame) -> pd.Series:
    commit = runs.get("engine_commit", pd.Series(index=runs.index, dtype=object))
    version = runs.get("engine_version", pd.Series(index=runs.index, dtype=object))
    ident = commit.where(commit.notna(), version)
    return ident.astype(object).where(ident.notna(), "?")


def between_run_noise(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    repeats: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    *,
    columns: Sequence[str] = NOISE_COLUMNS,
) -> pd.DataFrame:
    """Pooled relative spread per recipe / host / cell / metric from repeated measurements.

    Only successful runs and valid cells count. `repeats` (rows of `cell_repeats`: a run's
    own extra measurements of its cells) join the cells as further measurements of their
    run's engine. Measurements are grouped by (recipe, host, engine identity, cell); each
    group with n >= 2 contributes n - 1 degrees of freedom of its variance relative to its
    own mean; the pooled variance is their dof-weighted mean. Groups of one (a commit measured
    once) contribute nothing, so a history of all-different commits yields no between-run
    noise rather than a noise that contains the real changes. `runs` in the result counts
    measurements (a run with two repeats of a cell counts three).
    """
    rdf, cdf = frame(runs), frame(cells)
    extra = frame(repeats)
    if not extra.empty:
        wanted = ["run_id", "status", *CELL_KEY, *columns]
        parts = [d[[c for c in wanted if c in d]] for d in (cdf, extra) if not d.empty]
        cdf = pd.concat(parts, ignore_index=True)
    if rdf.empty or cdf.empty:
        return pd.DataFrame(columns=list(BETWEEN_COLUMNS))
    rdf = rdf.copy()
    if "status" in rdf:
        rdf = rdf[rdf["status"] == "success"]
    rdf["_engine"] = _engine_identity(rdf)
    for col in ("recipe_id", "host"):
        if col not in rdf:
            rdf[col] = None
        rdf[col] = rdf[col].astype(object).where(rdf[col].notna(), "")
    cdf = cdf[cdf["status"] == "valid"] if "status" in cdf else cdf
    cdf = cdf.drop(columns=[c for c in ("recipe_id", "host", "_engine") if c in cdf])
    merged = cdf.merge(rdf[["run_id", "recipe_id", "host", "_engine"]], on="run_id")
    keys = ["recipe_id", "host", *CELL_KEY]
    parts: list[pd.DataFrame] = []
    for col in columns:
        if col not in merged:
            continue
        values = pd.to_numeric(merged[col], errors="coerce").astype(float)
        values = values.where(np.isfinite(values))
        g = values.groupby([merged[k] for k in [*keys, "_engine"]], dropna=False)
        stats_ = pd.DataFrame({"n": g.count(), "mean": g.mean(), "var": g.var(ddof=1)})
        stats_ = stats_[(stats_["n"] >= 2) & (stats_["mean"] != 0)]
        if stats_.empty:
            continue
        # sum over the group of (x / mean - 1)^2 = var * (n - 1) / mean^2
        stats_["ss"] = stats_["var"] * (stats_["n"] - 1) / stats_["mean"] ** 2
        stats_["dof"] = stats_["n"] - 1
        per_cell = stats_.groupby(level=list(range(len(keys))), dropna=False).agg(
            ss=("ss", "sum"), dof=("dof", "sum"), runs=("n", "sum"), engines=("n", "size")
        )
        per_cell = per_cell.reset_index()
        per_cell.columns = [*keys, "ss", "dof", "runs", "engines"]
        per_cell["metric"] = col
        per_cell["rel_sd"] = np.sqrt(per_cell["ss"] / per_cell["dof"])
        parts.append(per_cell)
    if not parts:
        return pd.DataFrame(columns=list(BETWEEN_COLUMNS))
    out = pd.concat(parts, ignore_index=True)
    for c in ("dof", "runs", "engines"):
        out[c] = out[c].astype(int)
    return out[list(BETWEEN_COLUMNS)]


@dataclass
class NoiseModel:
    """Looks up the between-run relative spread of a cell figure.

    Falls back from the cell's own estimate to the recipe/host's pooled spread of that metric
    over all cells (of the same phase), so that a cell never measured twice still gets a
    realistic noise once a few other cells have been repeated.
    """

    table: pd.DataFrame

    @classmethod
    def empty(cls) -> NoiseModel:
        return cls(pd.DataFrame(columns=list(BETWEEN_COLUMNS)))

    @classmethod
    def from_history(
        cls,
        runs: pd.DataFrame | Iterable[Mapping[str, Any]],
        cells: pd.DataFrame | Iterable[Mapping[str, Any]],
        repeats: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    ) -> NoiseModel:
        return cls(between_run_noise(runs, cells, repeats))

    def lookup(
        self,
        recipe_id: str | None,
        host: str | None,
        phase: str,
        context_tokens: int,
        concurrency: int,
        metric: str,
    ) -> tuple[float | None, str]:
        """(relative sd, where it came from: 'cell', 'pooled' or 'none')."""
        own, pooled = self._index()
        group = (recipe_id or "", host or "", metric, phase)
        hit = own.get((*group, int(context_tokens), int(concurrency)))
        if hit is not None:
            return hit, "cell"
        if group in pooled:
            return pooled[group], "pooled"
        return None, "none"

    def _index(self) -> tuple[dict[tuple[Any, ...], float], dict[tuple[Any, ...], float]]:
        """Dicts for lookups (built once: a comparison looks up every cell and metric)."""
        cached = getattr(self, "_cache", None)
        if cached is not None:
            return cached
        own: dict[tuple[Any, ...], float] = {}
        sums: dict[tuple[Any, ...], list[float]] = {}
        for r in self.table.to_dict("records"):
            group = (r["recipe_id"], r["host"], r["metric"], r["phase"])
            own[(*group, int(r["context_tokens"]), int(r["concurrency"]))] = float(r["rel_sd"])
            acc = sums.setdefault(group, [0.0, 0.0])
            acc[0] += float(r["dof"]) * float(r["rel_sd"]) ** 2
            acc[1] += float(r["dof"])
        pooled = {g: math.sqrt(ss / dof) for g, (ss, dof) in sums.items() if dof}
        self._cache = (own, pooled)
        return self._cache


def noise_rows(
    run: Mapping[str, Any],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    requests: pd.DataFrame | Iterable[Mapping[str, Any]],
    model: NoiseModel | None = None,
    *,
    n_resamples: int = 2000,
) -> list[dict[str, Any]]:
    """Rows of the `noise` table for one run (NOISE_SCHEMA names)."""
    model = model or NoiseModel.empty()
    cdf, rdf = frame(cells), frame(requests)
    groups: dict[tuple[Any, ...], pd.DataFrame] = {}
    if not rdf.empty:
        groups = {_key(k): g for k, g in rdf.groupby(list(CELL_KEY))}
    rows: list[dict[str, Any]] = []
    for cell in cdf.to_dict("records"):
        if cell.get("status") != "valid":
            continue
        key = _key(tuple(cell[c] for c in CELL_KEY))
        within = {}
        if key in groups:
            within = within_window(groups[key], cell.get("measured_s"), n_resamples=n_resamples)
        for col in NOISE_COLUMNS:
            value = cell.get(col)
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                continue
            ci = within.get(col)
            sd, source = model.lookup(
                run.get("recipe_id"), run.get("host"), key[0], key[1], key[2], col
            )
            rows.append(
                {
                    "run_id": run.get("run_id"),
                    "recipe_id": run.get("recipe_id"),
                    "host": run.get("host"),
                    "engine_commit": run.get("engine_commit"),
                    "phase": key[0],
                    "context_tokens": key[1],
                    "context_label": cell.get("context_label"),
                    "concurrency": key[2],
                    "metric": col,
                    "value": float(value),
                    "ci_low": ci.low if ci else None,
                    "ci_high": ci.high if ci else None,
                    "ci_rel_halfwidth": ci.rel_halfwidth if ci else None,
                    "ci_samples": ci.samples if ci else None,
                    "confidence": ci.confidence if ci else None,
                    "between_rel_sd": sd,
                    "between_source": source,
                }
            )
    return rows


def noise_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    return pa.Table.from_pydict(
        {name: [r.get(name) for r in rows] for name in NOISE_SCHEMA.names}, schema=NOISE_SCHEMA
    )
