"""How much a cell's figures move when nothing changed: the noise that a verdict must beat.

Two estimates, because neither alone is enough:

* **Within the window** (one run): bootstrap confidence intervals from the per-request rows
  (records.REQUEST_FIELDS). Total tok/s is resampled by *stream* (a stream's in-window tokens
  are its share of the throughput; requests of one stream are not independent), the median
  time-between-tokens and TTFT by *request*. This sees sampling noise only, and nothing when a
  cell has one stream or one request (prefill, C=1 decode).
* **Between runs**: a robust spread of the cell's recent history on the same
  recipe and host, whatever the engine commits: the log ratios of consecutive measurements
  over the last WINDOW comparable ones (records.not_comparable_reason), scaled by their median
  absolute value (1.4826 x median / sqrt 2: one measurement's relative sd). A main branch with
  a new commit every night has noise; one outlier or one regressed run is one or two large
  differences among many and barely moves the median; old runs age out of the window. A
  verdict reads only the history strictly before its run (and the run's own repeats, which
  measure the host at its time and cannot hold the run's change). This sees what the window
  cannot: server warm-up, clocks, thermal state, placement, a loaded host.

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
    "latency_ms",  # a burst's (loadgen/burst.py)
    "e2e_per_request_tok_s",
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
    if measured_s and "window_tokens" in req and req["window_tokens"].notna().any():
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

WINDOW = 10
"""Measurements of a cell (runs and their repeats, any engine commit) the between-run noise
looks back over: older ones age out, so a host that got quieter (or noisier) shows it within
a window's runs."""

MIN_DIFFS_CELL = 3
"""Consecutive differences a cell needs for its own spread; with fewer it borrows the pooled
spread of its recipe/host's cells of the same phase (which needs MIN_DIFFS_POOLED)."""

MIN_DIFFS_POOLED = 2

MAD_TO_SD = 1.482602218505602
"""Turns the median absolute value of normal differences into their standard deviation."""

RUN_STATUSES = ("success", "partial")
"""Runs whose valid cells are history: a partial run's measured cells are as good as any."""


def _engine_identity(runs: pd.DataFrame) -> pd.Series:
    commit = runs.get("engine_commit", pd.Series(index=runs.index, dtype=object))
    version = runs.get("engine_version", pd.Series(index=runs.index, dtype=object))
    ident = commit.where(commit.notna(), version)
    return ident.astype(object).where(ident.notna(), "?")


def _utc(value: Any) -> pd.Timestamp | None:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    ts = pd.Timestamp(value)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def history_before(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]], before: Mapping[str, Any] | None
) -> pd.DataFrame:
    """The runs a verdict of `before` may read: success or partial runs that started strictly
    before it (never the candidate itself, never a later run). None: every such run."""
    rdf = frame(runs)
    if rdf.empty:
        return rdf
    if "status" in rdf:
        rdf = rdf[rdf["status"].isin(RUN_STATUSES)]
    if before is None:
        return rdf
    rdf = rdf[rdf["run_id"] != before.get("run_id")]
    cutoff = _utc(before.get("started_at"))
    if cutoff is None or "started_at" not in rdf:
        return rdf
    started = rdf["started_at"].map(_utc)
    return rdf[started.map(lambda t: t is not None and t < cutoff).astype(bool)]


DIFF_COLUMNS = ("recipe_id", "host", *CELL_KEY, "metric", "diff", "engine")


def between_run_diffs(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    repeats: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    *,
    columns: Sequence[str] = NOISE_COLUMNS,
    before: Mapping[str, Any] | None = None,
    window: int = WINDOW,
) -> pd.DataFrame:
    """The relative differences between consecutive measurements of each cell (log ratios),
    over the last `window` measurements of the cell on its recipe and host, whatever their
    engine commits, comparable with the latest one (records.not_comparable_reason).

    Measurements are the valid cells of success and partial runs started before `before`
    (:func:`history_before`) and their repeats (`cell_repeats`), in the order they were made.
    A difference between two runs contains the host's noise and whatever the commits between
    them changed; the robust scale taken of them (:func:`between_run_noise`) lets a single
    real change or outlier through without widening the band."""
    from speedmatrix.records import not_comparable_reason

    rdf, cdf, extra = history_before(runs, before), frame(cells), frame(repeats)
    if rdf.empty or cdf.empty:
        return pd.DataFrame(columns=list(DIFF_COLUMNS))
    cdf = cdf.assign(repeat=0)
    if not extra.empty:
        cdf = pd.concat([cdf, extra], ignore_index=True)
    cdf = cdf[cdf["status"] == "valid"] if "status" in cdf else cdf
    rdf = rdf.copy()
    rdf["_engine"] = _engine_identity(rdf)
    rdf["_started"] = rdf["started_at"].map(_utc) if "started_at" in rdf else pd.NaT
    for col in ("recipe_id", "host"):
        if col not in rdf:
            rdf[col] = None
        rdf[col] = rdf[col].astype(object).where(rdf[col].notna(), "")
    cdf = cdf.drop(columns=[c for c in ("recipe_id", "host", "_engine") if c in cdf])
    merged = cdf.merge(rdf[["run_id", "recipe_id", "host", "_engine", "_started"]], on="run_id")
    if merged.empty:
        return pd.DataFrame(columns=list(DIFF_COLUMNS))
    merged["repeat"] = pd.to_numeric(merged["repeat"], errors="coerce").fillna(0)
    merged = merged.sort_values(["_started", "run_id", "repeat"], kind="stable")
    keys = ["recipe_id", "host", *CELL_KEY]
    out: list[dict[str, Any]] = []
    for key, group in merged.groupby(keys, dropna=False, sort=False):
        rows = group.to_dict("records")
        latest = rows[-1]
        rows = [r for r in rows if not_comparable_reason(r, latest) is None][-window:]
        if len(rows) < 2:
            continue
        for col in columns:
            vals = [_positive(r.get(col)) for r in rows]
            prev: float | None = None
            for r, v in zip(rows, vals, strict=True):
                if v is None:
                    continue
                if prev is not None:
                    out.append(
                        {
                            **dict(zip(keys, _key(key), strict=True)),
                            "metric": col,
                            "diff": math.log(v / prev),
                            "engine": r["_engine"],
                        }
                    )
                prev = v
    return pd.DataFrame(out, columns=list(DIFF_COLUMNS))


def _positive(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v > 0 else None


def robust_rel_sd(diffs: Sequence[float] | np.ndarray) -> float:
    """One measurement's relative sd from consecutive differences: 1.4826 x the median absolute
    difference (the normal scale of the differences, which one outlier or one step cannot move
    far), over sqrt(2) (a difference holds two measurements' noise)."""
    d = np.abs(np.asarray(diffs, dtype=float))
    return float(MAD_TO_SD * np.median(d) / math.sqrt(2)) if d.size else math.nan


def between_run_noise(
    runs: pd.DataFrame | Iterable[Mapping[str, Any]],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    repeats: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    *,
    columns: Sequence[str] = NOISE_COLUMNS,
    before: Mapping[str, Any] | None = None,
    window: int = WINDOW,
) -> pd.DataFrame:
    """Robust relative spread per recipe / host / cell / metric (:func:`between_run_diffs`,
    :func:`robust_rel_sd`): `rel_sd` is one measurement's relative sd, `dof` the number of
    differences it rests on, `runs` the measurements, `engines` the distinct engine commits."""
    diffs = between_run_diffs(runs, cells, repeats, columns=columns, before=before, window=window)
    return per_cell_noise(diffs)


def per_cell_noise(diffs: pd.DataFrame) -> pd.DataFrame:
    """BETWEEN_COLUMNS rows out of :func:`between_run_diffs`' differences, one per cell figure."""
    if diffs.empty:
        return pd.DataFrame(columns=list(BETWEEN_COLUMNS))
    keys = ["recipe_id", "host", *CELL_KEY, "metric"]
    g = diffs.groupby(keys, dropna=False, sort=False)
    out = g.agg(
        rel_sd=("diff", robust_rel_sd), dof=("diff", "size"), engines=("engine", "nunique")
    ).reset_index()
    out["runs"] = out["dof"] + 1
    for c in ("dof", "runs", "engines"):
        out[c] = out[c].astype(int)
    return out[list(BETWEEN_COLUMNS)]


def pooled_noise(diffs: pd.DataFrame) -> pd.DataFrame:
    """The robust spread of all of a recipe/host's cells of one phase together, per metric:
    what a cell with too short a history of its own borrows."""
    cols = ["recipe_id", "host", "phase", "metric", "rel_sd", "dof"]
    if diffs.empty:
        return pd.DataFrame(columns=cols)
    g = diffs.groupby(["recipe_id", "host", "phase", "metric"], dropna=False, sort=False)
    out = g.agg(rel_sd=("diff", robust_rel_sd), dof=("diff", "size")).reset_index()
    return out[cols]


@dataclass
class NoiseModel:
    """Looks up the between-run relative spread of a cell figure.

    The cell's own spread when it rests on MIN_DIFFS_CELL differences, else its recipe/host's
    pooled spread of that metric over all cells of the same phase (MIN_DIFFS_POOLED at least),
    else none: a figure without an estimate gets no verdict (analysis/verdict.py: unverified).
    """

    table: pd.DataFrame
    pooled: pd.DataFrame | None = None

    @classmethod
    def empty(cls) -> NoiseModel:
        return cls(pd.DataFrame(columns=list(BETWEEN_COLUMNS)))

    @classmethod
    def from_history(
        cls,
        runs: pd.DataFrame | Iterable[Mapping[str, Any]],
        cells: pd.DataFrame | Iterable[Mapping[str, Any]],
        repeats: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
        *,
        before: Mapping[str, Any] | None = None,
        window: int = WINDOW,
    ) -> NoiseModel:
        """The noise a verdict on run `before` may use: its recipe/host history strictly
        before it (None: the whole history, as a trend or the site reads it)."""
        diffs = between_run_diffs(runs, cells, repeats, before=before, window=window)
        own_runs = [
            r
            for r in frame(runs).to_dict("records")
            if r.get("run_id") == (before or {}).get("run_id")
        ]
        if own_runs and not frame(repeats).empty:
            # the run's own repeats: measurements of its engine on its host at its time, so
            # their spread is the host's noise and cannot hold the run's change (the step from
            # the history to the run is never one of these differences)
            own = between_run_diffs(own_runs, cells, repeats, window=window)
            diffs = pd.concat([d for d in (diffs, own) if not d.empty], ignore_index=True)
        return cls(per_cell_noise(diffs), pooled_noise(diffs))

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
        sd, source, _ = self.lookup_dof(recipe_id, host, phase, context_tokens, concurrency, metric)
        return sd, source

    def lookup_dof(
        self,
        recipe_id: str | None,
        host: str | None,
        phase: str,
        context_tokens: int,
        concurrency: int,
        metric: str,
    ) -> tuple[float | None, str, int]:
        """(relative sd, its source, the differences it rests on)."""
        own, pooled = self._index()
        group = (recipe_id or "", host or "", metric, phase)
        hit = own.get((*group, int(context_tokens), int(concurrency)))
        if hit is not None and hit[1] >= MIN_DIFFS_CELL:
            return hit[0], "cell", hit[1]
        pool = pooled.get(group)
        if pool is not None and pool[1] >= MIN_DIFFS_POOLED:
            return pool[0], "pooled", pool[1]
        return None, "none", 0

    def _index(
        self,
    ) -> tuple[dict[tuple[Any, ...], tuple[float, int]], dict[tuple[Any, ...], tuple[float, int]]]:
        """Dicts for lookups (built once: a comparison looks up every cell and metric)."""
        cached = getattr(self, "_cache", None)
        if cached is not None:
            return cached
        own: dict[tuple[Any, ...], tuple[float, int]] = {}
        sums: dict[tuple[Any, ...], list[float]] = {}
        for r in self.table.to_dict("records"):
            group = (r["recipe_id"], r["host"], r["metric"], r["phase"])
            dof = int(r["dof"])
            own[(*group, int(r["context_tokens"]), int(r["concurrency"]))] = (
                float(r["rel_sd"]),
                dof,
            )
            acc = sums.setdefault(group, [0.0, 0.0])
            acc[0] += dof * float(r["rel_sd"]) ** 2
            acc[1] += dof
        if self.pooled is not None:
            pooled = {
                (r["recipe_id"], r["host"], r["metric"], r["phase"]): (
                    float(r["rel_sd"]),
                    int(r["dof"]),
                )
                for r in self.pooled.to_dict("records")
            }
        else:
            pooled = {g: (math.sqrt(ss / dof), int(dof)) for g, (ss, dof) in sums.items() if dof}
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
