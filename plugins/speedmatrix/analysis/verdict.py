"""Cell-by-cell comparison of a run with its baseline, with a noise-aware verdict per figure.

A change is a `regression` or an `improvement` only when it exceeds BOTH the relative
threshold (recipe-configurable, default 3%) AND the noise band of a run-to-run difference:
the widest of Z_VERDICT (3) x sqrt(2) x the figure's between-run relative sd (noise.py: a
robust spread of its recent history on this recipe and host, strictly before the run), the
root-sum-square of the two cells' within-window bootstrap half-widths, and for decode total
tok/s the counting resolution (one token per stream at the window's edges). Where
within-window intervals exist, neither value may lie inside the other's interval either (a
skewed spread, e.g. a median TTFT over a few requests, fools the symmetric half-width). A
figure with no between-run estimate (no history on this host yet) that moved beyond the
threshold is `unverified`: its change is shown, it never gates. A regression at the same
engine commit says so (SAME_COMMIT): the host or its environment got slower. Verdicts are
direction-aware: lower TTFT / time-between-tokens is better, higher tok/s, acceptance and KV
capacity are better. A KV-capacity change shows twice: as a run-level `kv_cache_tokens` row
and as `status` rows for the cells it turned over capacity (a regression) or back (an
improvement).

Everything here works on plain rows (dicts or DataFrames with records.py names), so it is
testable without a warehouse; `comparisons_table` turns rows into the Parquet table.

One job: the verdict rule, and the text a failing `regressions` task shows
(`summarize`). Baselines: analysis/baseline.py; display rows: analysis/display.py; the
warehouse tables: store/extra.py; the orchestration: analysis/compare.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pandas as pd
import pyarrow as pa

from speedmatrix.analysis.noise import CELL_KEY, Interval, NoiseModel, frame, within_window
from speedmatrix.commits import engine_text, resolved, same_commit
from speedmatrix.records import cell_key, cell_name, cell_sort_key, not_comparable_reason
from speedmatrix.store.schemas import COMPARISON_FIELDS, COMPARISONS_SCHEMA
from speedmatrix.upstream.github import github_repo
from speedmatrix.words import count

DEFAULT_THRESHOLD = 0.03
VERDICTS = ("regression", "improvement", "noise", "unverified", "not_comparable")
Z_VERDICT = 3.0
"""How many standard deviations of a run-to-run difference a change must exceed to be judged:
three, not 1.96, because a run judges tens of figures at once and one false alarm fails the
whole run. Three would be a two-sided 0.27% chance per figure were the sd known; estimated
by the MAD of 3-9 differences it is 7-2.8% on normal noise, more on heavy-tailed noise
(benchmarks/verdict_bench.py calibrate). The factor that restores 0.27% (6-16) blinds the
verdict to 5-25% prefill slowdowns on a loaded host (benchmarks/README.md): the threshold, not
this factor, keeps a quiet figure quiet, and a disturbed run needs more evidence (repeats)."""
SAME_COMMIT = "same engine commit: the host or its environment got slower"
"""The reason of a regression at an unchanged engine commit: not the engine, the host."""


@dataclass(frozen=True)
class Metric:
    """A compared figure: the cell column it reads, the phases it applies to, its direction."""

    name: str
    column: str
    phases: tuple[str, ...]
    higher_is_better: bool
    label: str


# a burst cell (loadgen/burst.py) is judged by its own figures too, against the same burst of
# the baseline only (its phase is in its key and in the comparability rule)
METRICS: tuple[Metric, ...] = (
    Metric("total_tok_s", "total_tok_s", ("decode", "burst"), True, "total tok/s"),
    Metric(
        "per_request_tok_s", "per_request_tok_s", ("decode", "burst"), True, "per request tok/s"
    ),
    Metric("ttft_ms", "ttft_ms", ("decode", "burst"), False, "TTFT ms"),
    Metric("tbt_ms", "tbt_ms", ("decode", "burst"), False, "time between tokens ms"),
    Metric("latency_ms", "latency_ms", ("burst",), False, "completed-request latency ms"),
    Metric(
        "e2e_per_request_tok_s",
        "e2e_per_request_tok_s",
        ("burst",),
        True,
        "per user end-to-end tok/s",
    ),
    Metric("prefill_tok_s", "total_tok_s", ("prefill",), True, "prefill tok/s"),
    Metric(
        "spec_acceptance_length", "spec_acceptance_length", ("decode",), True, "spec acceptance"
    ),
)
METRIC_BY_NAME = {m.name: m for m in METRICS}
KV_METRIC = Metric("kv_cache_tokens", "kv_cache_tokens", ("run",), True, "KV cache tokens")
STATUS_METRIC = "status"


def number(value: Any) -> float | None:
    """A finite float of a stored figure, else None (null, NaN, text, a bool): the one reading
    of a comparison value the verdict, the display, the page summary and the alert share."""
    if value is None or isinstance(value, bool):
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
        out[cell_key(row)] = row
    return out


def _within(
    cells: dict[tuple[Any, ...], dict[str, Any]], requests: pd.DataFrame
) -> dict[tuple[Any, ...], dict[str, Interval]]:
    if requests.empty:
        return {}
    out: dict[tuple[Any, ...], dict[str, Interval]] = {}
    for key, group in requests.groupby(list(CELL_KEY)):
        key = cell_key(dict(zip(CELL_KEY, key, strict=True)))
        cell = cells.get(key)
        if cell is not None and cell.get("status") == "valid":
            out[key] = within_window(group, number(cell.get("measured_s")))
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
    baseline_runs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Compare every cell of `run` with the same cell of `baseline_run`.

    Returns comparison rows (COMPARISON_FIELDS keys). `threshold` is a fraction (0.03) or a
    mapping metric -> fraction with an optional "default". `noise` supplies between-run spread;
    requests supply within-window intervals; either may be missing (noise_source says which
    were used). A figure without a between-run estimate (no history on this recipe and host)
    is `unverified` when it moved beyond the threshold: its change is shown, it never gates.

    `baseline_runs` (run id -> run): when each baseline cell carries its own `run_id` (its
    latest comparable cell, analysis/baseline.py), the row names that run and its commit.
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

    kv_new, kv_old = number(run.get("kv_cache_tokens")), number(baseline_run.get("kv_cache_tokens"))
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

    # paired by label (records.cell_key): a 256K sent as 262,143 tokens is a page's 262,144
    for key in sorted(set(new.cells) | set(old.cells), key=cell_sort_key):
        phase, label, conc = key
        a, b = new.cells.get(key), old.cells.get(key)
        ctx = int((a or b or {})["context_tokens"])
        cell_common = {
            "phase": phase,
            "context_tokens": ctx,
            "context_label": label,
            "concurrency": conc,
            "status": (a or {}).get("status"),
            "baseline_status": (b or {}).get("status"),
        }
        status_row = _status_change(a, b, kv_note)
        if status_row is not None:
            emit(**cell_common, metric=STATUS_METRIC, threshold_pct=None, **status_row)
            continue
        assert a is not None and b is not None
        b_run = (baseline_runs or {}).get(str(b.get("run_id")), baseline_run)
        cell_common["baseline_run_id"] = b_run.get("run_id")
        cell_common["baseline_engine_commit"] = b_run.get("engine_commit")
        same_engine = _same_engine(run, b_run)
        # A changed metric definition or workload (records.not_comparable_reason, the one
        # rule of what may be compared): never a regression or an improvement.
        differs = not_comparable_reason(a, b)
        if differs is not None:
            emit(
                **cell_common,
                metric=STATUS_METRIC,
                verdict="not_comparable",
                reason=f"not compared: {differs}",
            )
            continue
        for metric in METRICS:
            if phase not in metric.phases:
                continue
            va, vb = number(a.get(metric.column)), number(b.get(metric.column))
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
            rel_sd, sd_source, _ = noise.lookup_dof(
                run.get("recipe_id"), run.get("host"), phase, ctx, conc, metric.column
            )
            q_a = _resolution(a, metric) if metric.column == "total_tok_s" else 0.0
            q_b = _resolution(b, metric) if metric.column == "total_tok_s" else 0.0
            p_a, p_b = _sample_spread(a, metric), _sample_spread(b, metric)
            combined = max(
                _within_half_width(ci_a, ci_b),
                math.hypot(q_a, q_b),
                math.hypot(p_a, p_b),
                Z_VERDICT * math.sqrt(2) * rel_sd if rel_sd is not None else 0.0,
            )
            verdict, change = verdict_for(
                va, vb, metric.higher_is_better, t, combined, intervals=(ci_a, ci_b)
            )
            reason = None
            if verdict == "noise" and abs(change) > max(t, combined):
                reason = "each value inside the other's confidence interval"
            single = _one_sample(a, metric) or _one_sample(b, metric)
            if rel_sd is None and verdict in ("regression", "improvement"):
                verdict = "unverified"
                reason = "no noise estimate yet: no earlier runs of this cell on this host"
            elif single and verdict in ("regression", "improvement"):
                verdict = "unverified"
                reason = "measured from one sample: one request cannot tell the host's noise apart"
            elif verdict == "regression" and same_engine:
                reason = SAME_COMMIT
            sources = [
                s
                for s, on in (
                    ("within", ci_a is not None or ci_b is not None),
                    (f"between-{sd_source}", rel_sd is not None),
                    ("resolution", bool(q_a or q_b)),
                    ("spread", bool(p_a or p_b)),
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
                noise_pct=combined * 100 if sources else None,
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


def _resolution(cell: Mapping[str, Any], metric: Metric) -> float:
    """The counting resolution of a decode cell's total tok/s, relative: each of the C streams'
    in-window token count is uncertain by one token at the window's edges, so C / tokens. It
    matters for short windows and slow cells (a 3 s window of 440 tokens at C=4 is +-0.9%), and
    keeps a cell whose bootstrap and history happen to show no spread from claiming zero noise."""
    if cell.get("phase") != "decode":
        return 0.0
    tokens, conc = number(cell.get("output_tokens")), number(cell.get("concurrency"))
    return conc / tokens if tokens and conc else 0.0


SAMPLED_COLUMNS = {"ttft_ms"}
"""Figures a single request can make alone: a cell's TTFT (the median over `ttft_samples`
requests) and everything of a prefill cell (its cold prompts, `samples`). Throughput and time
between tokens of a decode cell rest on every token of the window."""


def _sample_spread(cell: Mapping[str, Any], metric: Metric) -> float:
    """Half the range of the TTFT samples a cell's figure is the median of, relative
    (`ttft_spread_pct` / 200): for a prefill cell (its tok/s is its prompt over that TTFT) and
    a TTFT. Three cold prompts that disagree by 20% say the host was disturbed while they ran:
    their median is uncertain by about half that, whatever the history's noise."""
    if cell.get("phase") != "prefill" and metric.column not in SAMPLED_COLUMNS:
        return 0.0
    spread = number(cell.get("ttft_spread_pct"))
    return spread / 200.0 if spread is not None and spread > 0 else 0.0


def _one_sample(cell: Mapping[str, Any], metric: Metric) -> bool:
    """Whether the cell's figure was measured from exactly one sample, as its row records it
    (unknown, e.g. landed before the counts were recorded: False)."""
    if cell.get("phase") == "prefill":
        n = number(cell.get("ttft_samples"))
        n = n if n is not None else number(cell.get("samples"))
    elif metric.column in SAMPLED_COLUMNS:
        n = number(cell.get("ttft_samples"))
    else:
        return False
    return n == 1


def _within_half_width(ci_a: Interval | None, ci_b: Interval | None) -> float:
    """The half-width of the difference of two cells' bootstrap intervals (root-sum-square)."""
    halves = [
        ci.rel_halfwidth if ci is not None and math.isfinite(ci.rel_halfwidth) else 0.0
        for ci in (ci_a, ci_b)
    ]
    return math.hypot(*halves)


def _same_engine(run: Mapping[str, Any], baseline: Mapping[str, Any]) -> bool:
    """Both runs ran the same engine commit (a landed prefix of a longer ref counts)."""
    a, b = run.get("engine_commit"), baseline.get("engine_commit")
    if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
        return False
    return a == b or bool(same_commit(a, b))


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


def regression_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The comparison rows whose verdict is a regression."""
    return [r for r in rows if r.get("verdict") == "regression"]


# --------------------------------------------------------------------------- baselines


def compare_url(baseline: Mapping[str, Any], run: Mapping[str, Any]) -> str | None:
    """The repository's compare page between the two engine commits, when both are known."""
    a, b = baseline.get("engine_commit"), run.get("engine_commit")
    path = github_repo(run.get("engine_repository") or baseline.get("engine_repository"))
    if not (a and b and path):
        return None
    return f"https://github.com/{path}/compare/{a}...{b}"


def _fmt(value: Any) -> str:
    v = number(value)
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
    bad = regression_rows(rows)
    head = (
        f"{count(len(bad), 'regression')} in run {run.get('run_id')} "
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
        noise = number(r.get("noise_pct"))
        lines.append(
            f"  {where}: {r.get('metric')} {_fmt(r.get('baseline_value'))} -> {_fmt(r.get('value'))}"
            f" ({r.get('change_pct'):+.1f}%; threshold {r.get('threshold_pct'):.1f}%,"
            f" noise {f'±{noise:.1f}%' if noise is not None else 'unknown'})"
            + (f": {r.get('reason')}" if r.get("reason") else "")
        )
    # this run's commit is the last of the commits between, when GitHub listed them
    a = engine_text(baseline)
    b = engine_text({**run, "engine_commit": resolved(run.get("engine_commit"), commits or ())})
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


def fail_on_regressions(
    rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    baseline: Mapping[str, Any],
    commits: Sequence[str] | None = None,
) -> None:
    """Raise RegressionError (its text: :func:`summarize`) when any row is a regression."""
    if regression_rows(rows):
        raise RegressionError(summarize(rows, run, baseline, commits))
