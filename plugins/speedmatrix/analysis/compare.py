"""Cell-by-cell comparison of a run with its baseline, with a noise-aware verdict per figure.

A change is a `regression` or an `improvement` only when it exceeds BOTH the relative
threshold (recipe-configurable, default 3%) AND the combined noise of the two cells; otherwise
it is `noise`. Each cell's noise is the larger of its within-window bootstrap half-width and
1.96 x the between-run relative spread (noise.py), and for decode total tok/s at least the
counting resolution (one token per stream at the window's edges); the combined noise of a
difference is the root-sum-square of the two sides (the half-width of the difference's
interval). Where within-window intervals exist, neither value may lie inside the other's
interval either (a skewed spread, e.g. a median TTFT over a few requests, fools the symmetric
half-width). Verdicts are direction-aware: lower TTFT / time-between-tokens is better, higher
tok/s, acceptance and KV capacity are better. A KV-capacity change shows twice: as a run-level
`kv_cache_tokens` row and as `status` rows for the cells it turned over capacity (a
regression) or back (an improvement).

Everything here works on plain rows (dicts or DataFrames with records.py names), so it is
testable without a warehouse; `comparisons_table` turns rows into the Parquet table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

import pandas as pd
import pyarrow as pa

from speedmatrix.analysis.noise import CELL_KEY, Z_95, Interval, NoiseModel, frame, within_window
from speedmatrix.records import context_label

DEFAULT_THRESHOLD = 0.03
SCHEDULED_TRIGGERS = ("nightly", "commit")
VERDICTS = ("regression", "improvement", "noise", "not_comparable")


@dataclass(frozen=True)
class Metric:
    """A compared figure: the cell column it reads, the phases it applies to, its direction."""

    name: str
    column: str
    phases: tuple[str, ...]
    higher_is_better: bool
    label: str


METRICS: tuple[Metric, ...] = (
    Metric("total_tok_s", "total_tok_s", ("decode",), True, "total tok/s"),
    Metric("per_request_tok_s", "per_request_tok_s", ("decode",), True, "per request tok/s"),
    Metric("ttft_ms", "ttft_ms", ("decode",), False, "TTFT ms"),
    Metric("tbt_ms", "tbt_ms", ("decode",), False, "time between tokens ms"),
    Metric("prefill_tok_s", "total_tok_s", ("prefill",), True, "prefill tok/s"),
    Metric(
        "spec_acceptance_length", "spec_acceptance_length", ("decode",), True, "spec acceptance"
    ),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}
KV_METRIC = Metric("kv_cache_tokens", "kv_cache_tokens", ("run",), True, "KV cache tokens")
STATUS_METRIC = "status"

COMPARISONS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("baseline_run_id", pa.string(), nullable=False),
        pa.field("recipe_id", pa.string()),
        pa.field("host", pa.string()),
        pa.field("engine_commit", pa.string()),
        pa.field("baseline_engine_commit", pa.string()),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("context_tokens", pa.int64()),
        pa.field("context_label", pa.string()),
        pa.field("concurrency", pa.int64()),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("higher_is_better", pa.bool_()),
        pa.field("status", pa.string()),
        pa.field("baseline_status", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("baseline_value", pa.float64()),
        pa.field("change_abs", pa.float64()),
        pa.field("change_pct", pa.float64()),
        pa.field("threshold_pct", pa.float64()),
        pa.field("noise_pct", pa.float64()),
        pa.field("ci_low", pa.float64()),
        pa.field("ci_high", pa.float64()),
        pa.field("baseline_ci_low", pa.float64()),
        pa.field("baseline_ci_high", pa.float64()),
        pa.field("between_rel_sd", pa.float64()),
        pa.field("noise_source", pa.string()),
        pa.field("verdict", pa.string(), nullable=False),
        pa.field("reason", pa.string()),
        pa.field("compared_at", pa.timestamp("us", tz="UTC")),
    ]
)
"""One row per (run, cell, metric) plus run-level rows (phase `run`): the numbers behind
every verdict. `*_pct` columns are percentages (3.0 = 3%)."""

COMPARISON_FIELDS = tuple(COMPARISONS_SCHEMA.names)


def cell_name(phase: str | None, context: Any, concurrency: Any) -> str:
    """`64Kx16` for a decode cell, `prefill 64K` for a prefill cell (as `trend --cell` takes)."""
    if phase == "run":
        return "run"
    label = context if isinstance(context, str) else context_label(int(context))
    return f"prefill {label}" if phase == "prefill" else f"{label}x{int(concurrency)}"


def _num(value: Any) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _threshold_for(threshold: float | Mapping[str, float], metric: str) -> float:
    if isinstance(threshold, Mapping):
        return float(threshold.get(metric, threshold.get("default", DEFAULT_THRESHOLD)))
    return float(threshold)


def verdict_for(
    value: float,
    baseline: float,
    higher_is_better: bool,
    threshold: float,
    noise: float,
    intervals: tuple[Interval | None, Interval | None] = (None, None),
) -> tuple[str, float]:
    """(verdict, relative change): the rule of the module docstring, in one place.

    `intervals` are the within-window intervals of (value, baseline) where known: a change
    with either value inside the other's interval is noise whatever its size (a skewed
    spread, e.g. a median TTFT over a few restarts, fools the symmetric half-width `noise`).
    """
    if baseline == 0:
        return ("noise" if value == 0 else "not_comparable"), (0.0 if value == 0 else math.inf)
    change = (value - baseline) / abs(baseline)
    if abs(change) <= threshold or abs(change) <= noise:
        return "noise", change
    ci_value, ci_baseline = intervals
    if (ci_value is not None and ci_value.low <= baseline <= ci_value.high) or (
        ci_baseline is not None and ci_baseline.low <= value <= ci_baseline.high
    ):
        return "noise", change
    better = change > 0 if higher_is_better else change < 0
    return ("improvement" if better else "regression"), change


@dataclass
class _Side:
    run: Mapping[str, Any]
    cells: dict[tuple[Any, ...], dict[str, Any]]
    within: dict[tuple[Any, ...], dict[str, Interval]]


def _index_cells(cells: pd.DataFrame) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in cells.to_dict("records"):
        key = (row["phase"], int(row["context_tokens"]), int(row["concurrency"]))
        out[key] = row
    return out


def _within(
    cells: dict[tuple[Any, ...], dict[str, Any]], requests: pd.DataFrame
) -> dict[tuple[Any, ...], dict[str, Interval]]:
    if requests.empty:
        return {}
    out: dict[tuple[Any, ...], dict[str, Interval]] = {}
    for key, group in requests.groupby(list(CELL_KEY)):
        key = (key[0], int(key[1]), int(key[2]))
        cell = cells.get(key)
        if cell is not None and cell.get("status") == "valid":
            out[key] = within_window(group, _num(cell.get("measured_s")))
    return out


def _side(run: Mapping[str, Any], cells: Any, requests: Any) -> _Side:
    idx = _index_cells(frame(cells))
    return _Side(run, idx, _within(idx, frame(requests)))


def compare_runs(
    run: Mapping[str, Any],
    cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    baseline_run: Mapping[str, Any],
    baseline_cells: pd.DataFrame | Iterable[Mapping[str, Any]],
    *,
    requests: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    baseline_requests: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    noise: NoiseModel | None = None,
    threshold: float | Mapping[str, float] = DEFAULT_THRESHOLD,
    compared_at: datetime | None = None,
) -> list[dict[str, Any]]:
    """Compare every cell of `run` with the same cell of `baseline_run`.

    Returns comparison rows (COMPARISON_FIELDS keys). `threshold` is a fraction (0.03) or a
    mapping metric -> fraction with an optional "default". `noise` supplies between-run spread;
    requests supply within-window intervals; either may be missing (noise_source says which
    were used; with none, the threshold alone decides).
    """
    noise = noise or NoiseModel.empty()
    now = compared_at or datetime.now(UTC)
    new, old = _side(run, cells, requests), _side(baseline_run, baseline_cells, baseline_requests)
    common = {
        "run_id": run.get("run_id"),
        "baseline_run_id": baseline_run.get("run_id"),
        "recipe_id": run.get("recipe_id"),
        "host": run.get("host"),
        "engine_commit": run.get("engine_commit"),
        "baseline_engine_commit": baseline_run.get("engine_commit"),
        "compared_at": now,
    }
    rows: list[dict[str, Any]] = []

    def emit(**values: Any) -> None:
        row = {name: None for name in COMPARISON_FIELDS}
        row.update(common)
        row.update(values)
        rows.append(row)

    kv_new, kv_old = _num(run.get("kv_cache_tokens")), _num(baseline_run.get("kv_cache_tokens"))
    kv_note = ""
    if kv_new is not None and kv_old is not None:
        t = _threshold_for(threshold, KV_METRIC.name)
        verdict, change = verdict_for(kv_new, kv_old, True, t, 0.0)
        kv_note = f" (KV cache {kv_old:,.0f} -> {kv_new:,.0f} tokens)" if kv_new != kv_old else ""
        emit(
            phase="run",
            metric=KV_METRIC.name,
            higher_is_better=True,
            value=kv_new,
            baseline_value=kv_old,
            change_abs=kv_new - kv_old,
            change_pct=change * 100,
            threshold_pct=t * 100,
            noise_pct=0.0,
            noise_source="exact",
            verdict=verdict,
            reason=f"KV capacity{kv_note}" if kv_note else None,
        )

    for key in sorted(set(new.cells) | set(old.cells), key=_sort_key):
        phase, ctx, conc = key
        a, b = new.cells.get(key), old.cells.get(key)
        cell_common = {
            "phase": phase,
            "context_tokens": ctx,
            "context_label": (a or b or {}).get("context_label") or context_label(ctx),
            "concurrency": conc,
            "status": (a or {}).get("status"),
            "baseline_status": (b or {}).get("status"),
        }
        status_row = _status_change(a, b, kv_note)
        if status_row is not None:
            emit(**cell_common, metric=STATUS_METRIC, threshold_pct=None, **status_row)
            continue
        assert a is not None and b is not None
        if a.get("metric_version") != b.get("metric_version"):
            emit(
                **cell_common,
                metric=STATUS_METRIC,
                verdict="not_comparable",
                reason=f"metric_version {b.get('metric_version')} -> {a.get('metric_version')}",
            )
            continue
        if a.get("workload") != b.get("workload"):
            # an article and a continuation measure different things on a speculative
            # decoder (measurement.md rule 11): never a regression or an improvement
            emit(
                **cell_common,
                metric=STATUS_METRIC,
                verdict="not_comparable",
                reason=f"workload {b.get('workload')} -> {a.get('workload')}",
            )
            continue
        for metric in METRICS:
            if phase not in metric.phases:
                continue
            va, vb = _num(a.get(metric.column)), _num(b.get(metric.column))
            if va is None and vb is None:
                continue
            t = _threshold_for(threshold, metric.name)
            if va is None or vb is None:
                emit(
                    **cell_common,
                    metric=metric.name,
                    higher_is_better=metric.higher_is_better,
                    value=va,
                    baseline_value=vb,
                    threshold_pct=t * 100,
                    verdict="not_comparable",
                    reason="missing in " + ("this run" if va is None else "the baseline"),
                )
                continue
            ci_a = new.within.get(key, {}).get(metric.column)
            ci_b = old.within.get(key, {}).get(metric.column)
            rel_sd, sd_source = noise.lookup(
                run.get("recipe_id"), run.get("host"), phase, ctx, conc, metric.column
            )
            q_a = _resolution(a, metric) if metric.column == "total_tok_s" else 0.0
            q_b = _resolution(b, metric) if metric.column == "total_tok_s" else 0.0
            h_a = max(_half_width(ci_a, rel_sd), q_a)
            h_b = max(_half_width(ci_b, rel_sd), q_b)
            combined = math.hypot(h_a, h_b)
            verdict, change = verdict_for(
                va, vb, metric.higher_is_better, t, combined, intervals=(ci_a, ci_b)
            )
            reason = None
            if verdict == "noise" and abs(change) > max(t, combined):
                reason = "each value inside the other's confidence interval"
            sources = [
                s
                for s, on in (
                    ("within", ci_a is not None or ci_b is not None),
                    (f"between-{sd_source}", rel_sd is not None),
                    ("resolution", bool(q_a or q_b)),
                )
                if on
            ]
            emit(
                **cell_common,
                metric=metric.name,
                higher_is_better=metric.higher_is_better,
                value=va,
                baseline_value=vb,
                change_abs=va - vb,
                change_pct=change * 100 if math.isfinite(change) else None,
                threshold_pct=t * 100,
                noise_pct=combined * 100,
                ci_low=ci_a.low if ci_a else None,
                ci_high=ci_a.high if ci_a else None,
                baseline_ci_low=ci_b.low if ci_b else None,
                baseline_ci_high=ci_b.high if ci_b else None,
                between_rel_sd=rel_sd,
                noise_source="+".join(sources) or "none",
                verdict=verdict,
                reason=reason,
            )
    return rows


def _sort_key(key: tuple[Any, ...]) -> tuple[int, int, int]:
    phase, ctx, conc = key
    return (0 if phase == "prefill" else 1, ctx, conc)


def _resolution(cell: Mapping[str, Any], metric: Metric) -> float:
    """The counting resolution of a decode cell's total tok/s, relative: each of the C streams'
    in-window token count is uncertain by one token at the window's edges, so C / tokens. It
    matters for short windows and slow cells (a 3 s window of 440 tokens at C=4 is +-0.9%), and
    keeps a cell whose bootstrap and history happen to show no spread from claiming zero noise."""
    if cell.get("phase") != "decode":
        return 0.0
    tokens, conc = _num(cell.get("output_tokens")), _num(cell.get("concurrency"))
    return conc / tokens if tokens and conc else 0.0


def _half_width(ci: Interval | None, rel_sd: float | None) -> float:
    """A cell's relative noise: the wider of its bootstrap half-width and 1.96 x between-run sd."""
    within = ci.rel_halfwidth if ci is not None else 0.0
    between = Z_95 * rel_sd if rel_sd is not None else 0.0
    within = within if math.isfinite(within) else 0.0
    return max(within, between)


def _status_change(
    a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, kv_note: str
) -> dict[str, Any] | None:
    """A status row when the cell cannot be compared figure by figure; None when it can."""
    if a is None:
        return {"verdict": "not_comparable", "reason": "cell not in this run"}
    if b is None:
        return {"verdict": "not_comparable", "reason": "cell not in the baseline"}
    sa, sb = a.get("status"), b.get("status")
    if sa == "valid" and sb == "valid":
        return None
    if sa == sb == "over_capacity":
        return {"verdict": "noise", "reason": "over capacity in both"}
    if sb == "valid" and sa == "over_capacity":
        return {"verdict": "regression", "reason": "now over capacity" + kv_note}
    if sb == "over_capacity" and sa == "valid":
        return {"verdict": "improvement", "reason": "now runs, was over capacity" + kv_note}
    why = a.get("error") if sa != "valid" else b.get("error")
    return {
        "verdict": "not_comparable",
        "reason": f"status {sb} -> {sa}" + (f": {why}" if why else ""),
    }


def comparisons_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows -> a pyarrow Table with COMPARISONS_SCHEMA (columns in schema order)."""
    cols = {name: [r.get(name) for r in rows] for name in COMPARISON_FIELDS}
    return pa.Table.from_pydict(cols, schema=COMPARISONS_SCHEMA)


def regressions(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if r.get("verdict") == "regression"]


# --------------------------------------------------------------------------- baselines


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

    Without `ref`: the latest successful run of the same recipe and host that started before
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
        if r.get("status") == "success"
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


def compare_url(baseline: Mapping[str, Any], run: Mapping[str, Any]) -> str | None:
    """The repository's compare page between the two engine commits, when both are known."""
    a, b = baseline.get("engine_commit"), run.get("engine_commit")
    repo = run.get("engine_repository") or baseline.get("engine_repository")
    if not (a and b and repo) or "github.com/" not in str(repo):
        return None
    path = str(repo).split("github.com/", 1)[1].removesuffix(".git").strip("/")
    return f"https://github.com/{path}/compare/{a}...{b}"


# --------------------------------------------------------------------------- summary


def _fmt(value: Any) -> str:
    v = _num(value)
    if v is None:
        return "—"
    return f"{v:,.1f}" if abs(v) < 1e5 else f"{v:,.0f}"


def summarize(
    rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    baseline: Mapping[str, Any],
    commits: Sequence[str] | None = None,
) -> str:
    """The text a failing `regressions` task shows: cells, baseline, commits between them."""
    bad = regressions(rows)
    head = (
        f"{len(bad)} regression(s) in run {run.get('run_id')} "
        f"(recipe {run.get('recipe_id')}, host {run.get('host')}) "
        f"against baseline {baseline.get('run_id')}"
    )
    lines = [head]
    for r in bad:
        where = cell_name(
            r.get("phase"), r.get("context_label") or r.get("context_tokens"), r.get("concurrency")
        )
        if r.get("metric") == STATUS_METRIC:
            lines.append(f"  {where}: {r.get('reason')}")
            continue
        lines.append(
            f"  {where}: {r.get('metric')} {_fmt(r.get('baseline_value'))} -> {_fmt(r.get('value'))}"
            f" ({r.get('change_pct'):+.1f}%; threshold {r.get('threshold_pct'):.1f}%,"
            f" noise ±{(r.get('noise_pct') or 0):.1f}%)"
        )
    a = baseline.get("engine_commit") or baseline.get("engine_version") or "?"
    b = run.get("engine_commit") or run.get("engine_version") or "?"
    lines.append(f"engine: baseline {a} -> this run {b}")
    if commits:
        shown = list(commits)
        lines.append(f"commits between ({len(shown)}): " + ", ".join(c[:12] for c in shown[:50]))
        if len(shown) > 50:
            lines.append(f"  … and {len(shown) - 50} more")
    url = compare_url(baseline, run)
    if url:
        lines.append(f"compare: {url}")
    return "\n".join(lines)


class RegressionError(RuntimeError):
    """Raised by the `regressions` task so that Airflow's alerting sees a failed task."""


def raise_on_regressions(
    rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    baseline: Mapping[str, Any],
    commits: Sequence[str] | None = None,
) -> None:
    if regressions(rows):
        raise RegressionError(summarize(rows, run, baseline, commits))


# --------------------------------------------------------------------------- rendering

_VERDICT_MARK = {"regression": "▼ regression", "improvement": "▲ improvement"}


def notable(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows worth showing by default: everything that is not plain noise."""
    return [r for r in rows if r.get("verdict") != "noise"]


def verdict_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    for r in rows:
        verdict = r.get("verdict") or "not_comparable"
        counts[verdict] = counts.get(verdict, 0) + 1
    return counts


def display_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Rows as short strings, the columns `compare` prints and the report's section shows."""
    out = []
    for r in rows:
        change, noise = _num(r.get("change_pct")), _num(r.get("noise_pct"))
        thr = _num(r.get("threshold_pct"))
        out.append(
            {
                "Cell": cell_name(
                    r.get("phase"),
                    r.get("context_label") or r.get("context_tokens"),
                    r.get("concurrency"),
                ),
                "Metric": r.get("metric") or "",
                "Baseline": _fmt(r.get("baseline_value")),
                "This run": _fmt(r.get("value")),
                "Change": f"{change:+.1f}%" if change is not None else "—",
                "Threshold": f"{thr:.1f}%" if thr is not None else "—",
                "Noise": f"±{noise:.1f}%" if noise is not None else "—",
                "Verdict": _VERDICT_MARK.get(r.get("verdict") or "", r.get("verdict") or ""),
                "Note": r.get("reason") or "",
            }
        )
    return out


def comparison_markdown(
    rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    baseline: Mapping[str, Any],
    *,
    show_all: bool = False,
) -> str:
    """The report's "Comparison" section: counts, then a table of the notable (or all) rows."""
    counts = verdict_counts(rows)
    a = baseline.get("engine_commit") or baseline.get("engine_version") or "?"
    b = run.get("engine_commit") or run.get("engine_version") or "?"
    lines = [
        "## Comparison",
        "",
        f"Baseline: run `{baseline.get('run_id')}` (engine {a}); this run: `{run.get('run_id')}`"
        f" (engine {b}).",
        "",
        ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in counts.items()) + ".",
        "A change counts only when it exceeds both the threshold and the combined noise.",
        "",
    ]
    shown = display_rows(rows if show_all else notable(rows))
    if not shown:
        lines.append("No cell changed beyond its noise.")
        return "\n".join(lines) + "\n"
    cols = list(shown[0])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in shown:
        lines.append("| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- warehouse glue
# The `comparisons`, `noise` and `cell_repeats` tables live next to runs / cells / requests, in
# the same Hive layout (<root>/<table>/recipe_id=<r>/run_month=<YYYY-MM>/<run_date>_<run_id>
# .parquet: warehouse.partition_dirs and data_file_name, the run's own date), written through
# the Warehouse's filesystem. Each file is written under _staging/ and renamed into place, so a
# reader sees the old or the new file whole, and landing a run's file again replaces it. Files
# of the older layout (…/recipe_id=<r>/run_date=<d>/<run_id>.parquet) are still read, and
# replaced when their run lands again. As in the core tables, the partition column `recipe_id`
# lives in the directory name only (the tables' schemas keep it; land_extra drops it from the
# file, read_extra puts it back from the path): files that hold it too make pandas' and
# pyarrow's directory readers fail ("Field recipe_id has incompatible types"). Files landed
# before that (with `recipe_id` inside) are still read here.

EXTRA_TABLES = ("comparisons", "noise", "cell_repeats")


def _cell_repeats_schema() -> pa.Schema:
    from speedmatrix.records import CELL_FIELDS
    from speedmatrix.store.warehouse import CELLS_SCHEMA, SCHEMA_VERSION

    cell = [CELLS_SCHEMA.field(f.name) for f in CELL_FIELDS]
    repeat = pa.field(
        "repeat",
        pa.int64(),
        nullable=False,
        metadata={"doc": "which pass of the run measured it: 1, 2… (0, the primary, is in cells)"},
    )
    return pa.schema(
        [
            CELLS_SCHEMA.field("run_id"),
            *cell,
            repeat,
            CELLS_SCHEMA.field("recipe_id"),
            CELLS_SCHEMA.field("run_date"),
            CELLS_SCHEMA.field("schema_version"),
        ],
        metadata={"table": "cell_repeats", "schema_version": str(SCHEMA_VERSION)},
    )


CELL_REPEATS_SCHEMA = _cell_repeats_schema()
"""The `cell_repeats` table: the repeats (pass >= 1) of a run's cells (the speed_matrix
`repeats` option), full cell records as in `cells` plus `repeat`; the primary (pass 0) is the
row in `cells`. Key: run_id, phase, context_tokens, concurrency, repeat."""


def extra_schema(table: str) -> pa.Schema:
    """The schema of an extra table's files (the warehouse's views add `run_month`)."""
    from speedmatrix.analysis.noise import NOISE_SCHEMA

    schemas = {
        "comparisons": COMPARISONS_SCHEMA,
        "noise": NOISE_SCHEMA,
        "cell_repeats": CELL_REPEATS_SCHEMA,
    }
    if table not in schemas:
        raise ValueError(f"unknown table {table!r}: one of {', '.join(EXTRA_TABLES)}")
    return schemas[table]


_extra_schema = extra_schema


def landed_run_date(warehouse: Any, run: Mapping[str, Any]) -> date:
    """The date under which the run's files are filed: its `run_date` when the row came from
    the warehouse, else the date of its landed runs file, else its start (finish) date, else
    today (what land_run does for a run without dates). Extra files go next to the run's."""
    from speedmatrix.store.warehouse import run_date_of

    value = run.get("run_date")
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    if isinstance(value, str):
        try:
            return date.fromisoformat(value[:10])
        except ValueError:
            pass
    import posixpath

    recipe = run.get("recipe_id")
    found = warehouse.find_run_files(str(run["run_id"]), recipe if recipe else None)["runs"]
    if found:
        return date.fromisoformat(posixpath.basename(found[-1])[:10])
    return run_date_of(dict(run)) or datetime.now(UTC).date()


def land_extra(warehouse: Any, table: str, run: Mapping[str, Any], data: pa.Table) -> str:
    """Land one run's file of an extra table (EXTRA_TABLES); returns its path."""
    import posixpath
    import uuid

    from speedmatrix.store.warehouse import (
        PARTITION_KEYS,
        STAGING,
        data_file_name,
        partition_dirs,
        write_parquet,
    )

    if not data.schema.equals(extra_schema(table), check_metadata=False):
        raise ValueError(f"{table}: rows do not have the table's schema")
    # the hive convention: partition values in the directory names only (see above)
    data = data.drop_columns([c for c in PARTITION_KEYS if c in data.column_names])
    run_id = str(run["run_id"])
    day = landed_run_date(warehouse, run)
    fs, base = warehouse.fs, warehouse.base
    target = posixpath.join(
        base, table, partition_dirs(run.get("recipe_id"), day), data_file_name(run_id, day)
    )
    staged = posixpath.join(base, STAGING, f"{table}-{uuid.uuid4().hex[:12]}.parquet")
    fs.create_dir(posixpath.dirname(staged), recursive=True)
    write_parquet(data, staged, fs)
    fs.create_dir(posixpath.dirname(target), recursive=True)
    fs.move(staged, target)
    for old in _extra_files(warehouse, table, run_id):
        if old != target:
            fs.delete_file(old)
    return target


def delete_extra(warehouse: Any, table: str, run_id: str) -> int:
    """Remove a run's file(s) of an extra table; returns how many there were."""
    paths = _extra_files(warehouse, table, run_id)
    for path in paths:
        warehouse.fs.delete_file(path)
    return len(paths)


def _is_run_file(basename: str, name: str) -> bool:
    """`<run_id>.parquet` (older layout) or `<YYYY-MM-DD>_<run_id>.parquet`."""
    if basename == name:
        return True
    if len(basename) != 11 + len(name) or basename[10] != "_" or not basename.endswith(name):
        return False
    try:
        date.fromisoformat(basename[:10])
    except ValueError:
        return False
    return True


def _extra_files(
    warehouse: Any, table: str, run_id: str | None = None, recipe_id: str | None = None
) -> list[str]:
    import posixpath

    import pyarrow.fs as pafs

    from speedmatrix.store.warehouse import file_name, partition_value

    where = posixpath.join(warehouse.base, table)
    if recipe_id is not None:  # one recipe's directory, not the whole table
        where = posixpath.join(where, f"recipe_id={partition_value(recipe_id)}")
    selector = pafs.FileSelector(where, recursive=True, allow_not_found=True)
    want = file_name(run_id) if run_id is not None else None
    return sorted(
        i.path
        for i in warehouse.fs.get_file_info(selector)
        if i.type == pafs.FileType.File
        and i.path.endswith(".parquet")
        and (want is None or _is_run_file(posixpath.basename(i.path), want))
    )


def read_extra(
    warehouse: Any, table: str, *, run_id: str | None = None, recipe_id: str | None = None
) -> pd.DataFrame:
    """The rows of an extra table (EXTRA_TABLES) of one run, one recipe, or all."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from speedmatrix.store.warehouse import partition_of

    schema = extra_schema(table)
    parts = []
    for path in _extra_files(warehouse, table, run_id, recipe_id):
        t = pq.read_table(path, filesystem=warehouse.fs, partitioning=None, schema=schema)
        where = partition_of(path)
        if "recipe_id" in where:  # from the directory name (older files hold the same value)
            i = schema.get_field_index("recipe_id")
            value = pa.array([where["recipe_id"]] * t.num_rows, pa.string())
            t = t.set_column(i, schema.field(i), value)
        if recipe_id is not None:
            t = t.filter(pc.equal(t["recipe_id"], recipe_id))
        parts.append(t)
    data = pa.concat_tables(parts) if parts else schema.empty_table()
    return data.to_pandas(types_mapper=None)


def cell_repeats_table(run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], day: date):
    """Repeat rows (cell records plus `repeat` >= 1) -> a CELL_REPEATS_SCHEMA table.

    Each pass goes through the cells table's own checks (warehouse.build_table: types,
    phase/status values, one row per cell), so a repeat lands only if it would land as a cell.
    """
    from speedmatrix.store.warehouse import (
        SCHEMA_VERSION,
        WarehouseError,
        build_table,
        run_month_of,
    )

    fixed = {
        "run_id": str(run["run_id"]),
        "recipe_id": run.get("recipe_id"),
        "run_date": day,
        "run_month": run_month_of(day),
        "schema_version": SCHEMA_VERSION,
    }
    passes: dict[int, list[dict[str, Any]]] = {}
    for i, row in enumerate(rows):
        repeat = row.get("repeat")
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise WarehouseError(f"cell_repeats row {i}: repeat must be an integer >= 1")
        passes.setdefault(repeat, []).append({k: v for k, v in row.items() if k != "repeat"})
    tables = []
    for repeat, group in sorted(passes.items()):
        cells = build_table("cells", group, fixed)
        cols = {n: cells.column(n) for n in cells.column_names}
        cols["repeat"] = pa.array([repeat] * cells.num_rows, pa.int64())
        tables.append(
            pa.Table.from_arrays(
                [cols[n] for n in CELL_REPEATS_SCHEMA.names], schema=CELL_REPEATS_SCHEMA
            )
        )
    return pa.concat_tables(tables) if tables else CELL_REPEATS_SCHEMA.empty_table()


def land_cell_repeats(
    warehouse: Any, run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> str | None:
    """Land a run's repeats in `cell_repeats` (after the run itself: the file goes next to
    the run's). No rows: the run's older file, if any, is removed (landing again replaces,
    also with fewer repeats). Returns the file's path, None when there is none."""
    if not rows:
        delete_extra(warehouse, "cell_repeats", str(run["run_id"]))
        return None
    day = landed_run_date(warehouse, run)
    return land_extra(warehouse, "cell_repeats", run, cell_repeats_table(run, rows, day))


@dataclass
class ComparisonResult:
    run: dict[str, Any]
    baseline: dict[str, Any] | None
    rows: list[dict[str, Any]]
    noise: list[dict[str, Any]]


def recipe_threshold(recipe_id: str | None) -> float:
    """The recipe's `schedule.regression_threshold_pct` as a fraction; 3% when unknown."""
    if not recipe_id:
        return DEFAULT_THRESHOLD
    try:
        from speedmatrix.recipes import load_recipe

        return float(load_recipe(recipe_id).schedule.regression_threshold_pct) / 100.0
    except Exception:  # an ingested or since-deleted recipe: the default applies
        return DEFAULT_THRESHOLD


def read_history(
    warehouse: Any, recipe_id: str | None, host: str | None = None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, NoiseModel]:
    """(runs, cells, comparisons, between-run noise model) of one recipe (and host).

    The noise model counts the runs' repeats (`cell_repeats`) as measurements too."""
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
    noise = NoiseModel.from_history(runs, cells, extra["cell_repeats"])
    return runs, cells, extra["comparisons"], noise


def compare_in_warehouse(
    warehouse: Any,
    run_id: str,
    *,
    baseline_ref: str | None = None,
    threshold: float | Mapping[str, float] | None = None,
    with_noise: bool = True,
) -> ComparisonResult:
    """Compare a landed run with its baseline (see select_baseline), using the requests for
    within-window intervals and the recipe/host history for the between-run noise.

    Raises KeyError when the run is not in the warehouse; `baseline` is None (and rows empty)
    when there is nothing to compare with, or ValueError when a named baseline is not found.
    The noise rows do not need a baseline: a first run (with repeats) has its noise too.
    `with_noise=False` skips them (their bootstraps) for a caller that only shows verdicts."""
    from speedmatrix.analysis.noise import noise_rows

    run, cells, requests = warehouse.read_run(run_id)
    runs_all = warehouse.query("SELECT * FROM runs")
    baseline = select_baseline(runs_all, run, baseline_ref)
    noise = read_history(warehouse, run.get("recipe_id"), run.get("host"))[3]
    if baseline is None:
        if baseline_ref is not None:
            raise ValueError(f"no baseline {baseline_ref!r} for run {run_id}")
        rows = noise_rows(run, cells, requests, noise) if with_noise else []
        return ComparisonResult(run, None, [], rows)
    b_run, b_cells, b_requests = warehouse.read_run(baseline["run_id"])
    if threshold is None:
        threshold = recipe_threshold(run.get("recipe_id"))
    rows = compare_runs(
        run,
        cells,
        b_run,
        b_cells,
        requests=requests,
        baseline_requests=b_requests,
        noise=noise,
        threshold=threshold,
    )
    noise_table_rows = noise_rows(run, cells, requests, noise) if with_noise else []
    return ComparisonResult(run, b_run, rows, noise_table_rows)


def regressions_check(
    warehouse: Any,
    run_id: str,
    *,
    baseline_ref: str | None = None,
    commits: Sequence[str] | None = None,
    threshold: float | Mapping[str, float] | None = None,
    fetch_commits: bool = False,
    charts: Callable[[Any, ComparisonResult], None] | None = None,
) -> dict[str, Any]:
    """The `regressions` task: compare, land `comparisons` + `noise` and the markdown section
    as artifact comparison.md, then raise RegressionError (naming cells, baseline and
    commits) when any verdict is a regression. Returns counts for XCom otherwise.

    `fetch_commits`: when regressions were found and `commits` is not given, list the commits
    between the two engine commits from GitHub's compare API (best effort: on any error the
    summary keeps the compare URL only).

    `charts(warehouse, result)` draws the comparison's charts next to the run (the caller
    passes speedmatrix.report.charts.write_comparison_charts: analysis does not draw); it
    runs before a regression raises, so the alert's reader finds them."""
    result = compare_in_warehouse(warehouse, run_id, baseline_ref=baseline_ref, threshold=threshold)
    if result.noise:
        from speedmatrix.analysis.noise import noise_table

        land_extra(warehouse, "noise", result.run, noise_table(result.noise))
    if result.baseline is None:
        return {"run_id": run_id, "baseline_run_id": None, "counts": {}, "regressions": 0}
    land_extra(warehouse, "comparisons", result.run, comparisons_table(result.rows))
    warehouse.write_artifact(
        run_id, "comparison.md", comparison_markdown(result.rows, result.run, result.baseline)
    )
    if charts is not None:
        charts(warehouse, result)
    if fetch_commits and commits is None and regressions(result.rows):
        commits = _fetch_commits(result.baseline, result.run)
    raise_on_regressions(result.rows, result.run, result.baseline, commits)
    return {
        "run_id": run_id,
        "baseline_run_id": result.baseline.get("run_id"),
        "counts": verdict_counts(result.rows),
        "regressions": 0,
    }


@dataclass
class ReportComparison:
    """What the report shows of the comparison with the baseline.

    `baseline` is `(run, cells)` for render_markdown / render_html's "Change against baseline"
    table; `markdown` is this module's verdict section; `verdicts` the same rows for the HTML
    (display_rows of the notable cells); `figures` stays empty here: the charts are drawn by
    speedmatrix.report (report.page.load_run_page), analysis does not draw."""

    baseline: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
    markdown: str = ""
    verdicts: list[dict[str, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    figures: list[dict[str, str]] = field(default_factory=list)


def report_comparison(warehouse: Any, run_id: str) -> ReportComparison:
    """The report's view of the comparison; empty without a baseline.

    A comparison that cannot be made is logged, not raised: the report must still be written,
    and the `regressions` task that follows raises the same error where it belongs."""
    import logging

    try:
        result = compare_in_warehouse(warehouse, run_id, with_noise=False)
        if result.baseline is None:
            return ReportComparison()
        _, base_cells, _ = warehouse.read_run(result.baseline["run_id"])
    except Exception as exc:
        logging.getLogger("speedmatrix.compare").warning(
            "no comparison in the report of %s: %s", run_id, exc
        )
        return ReportComparison()
    return ReportComparison(
        baseline=(result.baseline, base_cells),
        markdown=comparison_markdown(result.rows, result.run, result.baseline),
        verdicts=display_rows(notable(result.rows)),
        counts=verdict_counts(result.rows),
    )


def _fetch_commits(baseline: Mapping[str, Any], run: Mapping[str, Any]) -> list[str] | None:
    """Commits after the baseline's engine commit up to the run's, or None when unknown."""
    import logging

    from speedmatrix.analysis.bisection import commits_between

    a, b = baseline.get("engine_commit"), run.get("engine_commit")
    repo = str(run.get("engine_repository") or baseline.get("engine_repository") or "")
    if not a or not b or a == b or "github.com/" not in repo:
        return None
    path = repo.split("github.com/", 1)[1].removesuffix(".git").strip("/")
    try:
        return commits_between(path, str(a), str(b))
    except Exception as exc:  # network, rate limit, unknown commit: the URL still names them
        logging.getLogger("speedmatrix.compare").warning(
            "could not list commits %s...%s: %s", a, b, exc
        )
        return None
