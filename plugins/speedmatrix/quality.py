"""Great Expectations suites over one run's rows, before they land.

GX Core runs inside the `validate` task (the GX Airflow provider does not install with Airflow
3.3.2): an ephemeral context (nothing written to disk by GX itself), a `cells` suite (run
scope by scope over the rows each group of expectations applies to: CELL_SCOPES) and a `runs`
suite. Consistency checks between figures (e.g. output tokens vs total tok/s x window) are
expressed as ratio columns computed here in pandas and bounded by GX expectations, so each
rule is one named expectation in the results JSON and a failing row is identified by its
position.

A failing row is quarantined (it does not land) with the names of the expectations it failed;
the rest lands. The results JSON is kept next to the run's report. Secrets: the runs suite checks
that the launch command carries none; the results JSON and quarantined rows are scrubbed so a
leaked key is never copied further by the check that found it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from speedmatrix import records
from speedmatrix.published import implied
from speedmatrix.records import (
    ACTIVE_TOLERANCE,
    CELL_FIELDS,
    RUN_FIELDS,
)
from speedmatrix.redact import SECRET_PATTERNS, redact
from speedmatrix.store.protocol import Warehouse
from speedmatrix.words import count

log = logging.getLogger(__name__)


# Tolerances: active requests within 10% of C; measured seconds within 2% of the
# window (a published-profile cell's: up to the window, _window_ratio); output tokens =
# total tok/s x window up to rounding; per-request tok/s vs 1/TBT within
# 10% (a median of reciprocals is not the reciprocal of a median for even counts); prefill
# tok/s x TTFT = prompt tokens within 2% (a cell measured here); a published page's prefill
# row (metric_version 0) is held to its label by what the published tool's own accounting and
# the page's display rounding allow instead (published.implied: up to 2.5% short).
ACTIVE_TOL = ACTIVE_TOLERANCE
WINDOW_TOL = 0.02
TOKENS_TOL = 0.01
RATE_TBT_TOL = 0.10
PREFILL_TOL = 0.02

REQUIRED_RUN_FIELDS = (
    "run_id",
    "recipe_id",
    "trigger",
    "status",
    "started_at",
    "engine",
    "served_model",
    "launch_command",
    "host",
)
MEASURED_ONLY_RUN_FIELDS = ("started_at", "host")


@dataclass
class SuiteOutcome:
    """One suite's verdict: which rows failed which expectations, and GX's JSON result."""

    suite: str
    success: bool
    failed_rows: dict[int, list[str]] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        failed = [r["expectation"] for r in self.result.get("expectations", []) if not r["success"]]
        if self.success:
            return f"{self.suite}: all {len(self.result.get('expectations', []))} expectations met"
        return f"{self.suite}: {count(len(self.failed_rows), 'row')} failed {sorted(set(failed))}"


@dataclass
class Validation:
    """Both suites applied to one run: what may land and what goes to quarantine."""

    run_ok: bool
    good_cells: list[dict]
    bad_cells: list[dict]
    cells: SuiteOutcome
    runs: SuiteOutcome
    good_repeats: list[dict] = field(default_factory=list)
    bad_repeats: list[dict] = field(default_factory=list)

    @property
    def results_json(self) -> dict[str, Any]:
        return {"cells": self.cells.result, "runs": self.runs.result}


def _ratio(num: Any, den: Any) -> float:
    try:
        num, den = float(num), float(den)
    except (TypeError, ValueError):
        return math.nan
    if math.isnan(num) or math.isnan(den) or den == 0:
        return math.nan
    return num / den


def _ingested(row: dict) -> bool:
    """A row from a published page (measured by another tool, by its own definitions)."""
    return row.get("metric_version") == records.INGEST_METRIC_VERSION


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def _window_ratio(row: dict) -> float:
    """measured_s / window_s, bounded by WINDOW_TOL. A `published` cell is measured by the
    published tool's rule, from the window's start to its last token (docs/measurement.md,
    the published profile): any part of the window up to all of it reads as 1. So does an
    adaptive window that converged (loadgen/adaptive.py: it stops before its cap, window_s);
    one that ran to its cap is held to it like a fixed window."""
    ratio = _ratio(row["measured_s"], row["window_s"])
    if row.get("measurement_profile") == "published" and 0 < ratio <= 1:
        return 1.0
    if row.get("window_stop") == "converged" and 0 < ratio <= 1:
        return 1.0
    return ratio


def cells_frame(cells: Sequence[dict], extra: Sequence[str] = ()):
    """The cells as a DataFrame plus the ratio columns the consistency expectations bound
    (and the `extra` columns, e.g. a repeat's `repeat`)."""
    import pandas as pd

    names = [f.name for f in CELL_FIELDS] + list(extra)
    df = pd.DataFrame.from_records([{k: c.get(k) for k in names} for c in cells], columns=names)
    df.insert(0, "row", range(len(df)))
    rows = df.to_dict("records")
    df["active_ratio"] = [_ratio(r["avg_active_requests"], r["concurrency"]) for r in rows]
    df["window_ratio"] = [_window_ratio(r) for r in rows]
    df["tokens_ratio"] = [
        _ratio(r["output_tokens"], _ratio(r["total_tok_s"], 1) * _ratio(r["measured_s"], 1))
        for r in rows
    ]
    df["rate_tbt_product"] = [
        _ratio(r["per_request_tok_s"], 1) * _ratio(r["tbt_ms"], 1000) for r in rows
    ]
    df["prefill_ratio"] = [
        math.nan
        if _ingested(r)
        else _ratio(_ratio(r["total_tok_s"], 1) * _ratio(r["ttft_ms"], 1000), r["context_tokens"])
        for r in rows
    ]
    # a burst (loadgen/burst.py): every one of its N requests completed; its latency tails at
    # or above the median; per-user e2e tok/s x latency = the output tokens of a request (a
    # median of reciprocals against the reciprocal of a median for an even N: RATE_TBT_TOL)
    df["completed_ratio"] = [_ratio(r["completed_requests"], r["concurrency"]) for r in rows]
    df["latency_tail_ratio"] = [
        min(
            _ratio(r["latency_p90_ms"], r["latency_ms"]),
            _ratio(r["latency_p99_ms"], r["latency_p90_ms"]),
        )
        for r in rows
    ]
    df["e2e_latency_product"] = [
        _ratio(
            _ratio(r["e2e_per_request_tok_s"], 1) * _ratio(r["latency_ms"], 1000),
            r["max_output_tokens"],
        )
        for r in rows
    ]
    df["published_prompt_ratio"] = [
        _nan_if_none(implied.label_ratio(r)) if _ingested(r) else math.nan for r in rows
    ]
    return df


def _in_set(table: str) -> list:
    """One in-set expectation per enumerated column of `table`: the value sets the table
    builder refuses on too (records.allowed_values, the one definition). GX skips nulls, so a
    cell landed before its workload was recorded passes."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeInSet(column=column, value_set=list(allowed))
        for column, allowed in records.allowed_values(table).items()
    ]


CELL_SCOPES: dict[str, dict[str, tuple[str, ...]]] = {
    "all cells": {},
    "prefill cells": {"phase": ("prefill",)},
    "failed or invalid cells": {"status": ("failed", "invalid")},
    "over-capacity cells": {"status": ("over_capacity",)},
    "valid decode cells": {"status": ("valid",), "phase": ("decode",)},
    "valid prefill cells": {"status": ("valid",), "phase": ("prefill",)},
    "burst cells": {"phase": ("burst",)},
    "valid burst cells": {"status": ("valid",), "phase": ("burst",)},
}
"""The rows each group of the cells suite's expectations applies to: column -> the values a
row must hold (every column's). Why scopes and not GX row conditions: GX applies a row
condition again for every metric of every expectation, which triples an expectation's cost
(27 conditioned expectations: 0.78 s of a 55-cell run's 0.85 s; validation runs after the
host's server has stopped, while the run's result waits). Each scope's rows are selected once,
here, and validated as a batch of their own; every result names its scope (its
expectation's ``meta.rows``) and its rows keep their ``row`` position in the whole run."""


def _cells_expectations(key: Sequence[str] | None = None) -> dict[str, list]:
    """The cells suite, by scope (CELL_SCOPES); `key` is what must be unique (default: the
    cells table's key, records.unique_key; a repeat's pass joins it)."""
    import great_expectations.expectations as gxe

    key = key or records.unique_key("cells") or ()
    valid_decode: list = []
    for col in ("total_tok_s", "per_request_tok_s", "ttft_ms", "tbt_ms", "measured_s"):
        valid_decode.append(gxe.ExpectColumnValuesToNotBeNull(column=col))
        valid_decode.append(
            gxe.ExpectColumnValuesToBeBetween(column=col, min_value=0, strict_min=True)
        )
    valid_decode.append(gxe.ExpectColumnValuesToBeBetween(column="output_tokens", min_value=1))
    for col, tol in (
        ("active_ratio", ACTIVE_TOL),
        ("window_ratio", WINDOW_TOL),
        ("tokens_ratio", TOKENS_TOL),
        ("rate_tbt_product", RATE_TBT_TOL),
    ):
        valid_decode.append(gxe.ExpectColumnValuesToNotBeNull(column=col))
        valid_decode.append(
            gxe.ExpectColumnValuesToBeBetween(column=col, min_value=1 - tol, max_value=1 + tol)
        )
    valid_prefill: list = []
    for col in ("total_tok_s", "ttft_ms"):
        valid_prefill.append(gxe.ExpectColumnValuesToNotBeNull(column=col))
        valid_prefill.append(
            gxe.ExpectColumnValuesToBeBetween(column=col, min_value=0, strict_min=True)
        )
    valid_prefill.append(
        gxe.ExpectColumnValuesToBeBetween(
            column="prefill_ratio", min_value=1 - PREFILL_TOL, max_value=1 + PREFILL_TOL
        )
    )
    valid_prefill.append(
        gxe.ExpectColumnValuesToBeBetween(
            column="published_prompt_ratio",
            min_value=1 - implied.SHORT_ALLOWANCE,
            max_value=1 + implied.LONG_ALLOWANCE,
        )
    )
    valid_burst: list = [
        gxe.ExpectColumnValuesToBeBetween(column="output_tokens", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="completed_ratio", min_value=1, max_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="latency_tail_ratio", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(
            column="tokens_ratio", min_value=1 - TOKENS_TOL, max_value=1 + TOKENS_TOL
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="e2e_latency_product",
            min_value=1 - RATE_TBT_TOL,
            max_value=1 + RATE_TBT_TOL,
        ),
    ]
    for col in (
        "total_tok_s",
        "latency_ms",
        "latency_p90_ms",
        "latency_p99_ms",
        "e2e_per_request_tok_s",
        "ttft_ms",
        "tbt_ms",
        "measured_s",
        "tokens_ratio",
        "completed_ratio",
        "latency_tail_ratio",
        "e2e_latency_product",
    ):
        valid_burst.append(gxe.ExpectColumnValuesToNotBeNull(column=col))
        if not col.endswith(("_ratio", "_product")):
            valid_burst.append(
                gxe.ExpectColumnValuesToBeBetween(column=col, min_value=0, strict_min=True)
            )
    return {
        "all cells": [
            *_in_set("cells"),
            gxe.ExpectColumnValuesToBeBetween(column="copy_share", min_value=0, max_value=1),
            # warm-up is measurement time of a decode cell: never negative, and a
            # prefill cell has none (its one cold request is what it measures); null on
            # decode: landed before it was recorded, or ingested from a published page
            gxe.ExpectColumnValuesToBeBetween(column="warmup_s", min_value=0),
            gxe.ExpectColumnValuesToNotBeNull(column="context_tokens"),
            gxe.ExpectColumnValuesToBeBetween(column="context_tokens", min_value=1),
            gxe.ExpectColumnValuesToBeBetween(column="concurrency", min_value=1),
            gxe.ExpectCompoundColumnsToBeUnique(column_list=list(key)),
        ],
        "prefill cells": [gxe.ExpectColumnValuesToBeNull(column="warmup_s")],
        "failed or invalid cells": [gxe.ExpectColumnValuesToNotBeNull(column="error")],
        "over-capacity cells": [gxe.ExpectColumnValuesToBeNull(column="output_tokens")],
        "valid decode cells": valid_decode,
        "valid prefill cells": valid_prefill,
        # a burst runs to completion: it has no window
        "burst cells": [gxe.ExpectColumnValuesToBeNull(column="window_s")],
        "valid burst cells": valid_burst,
    }


def _scope_rows(df: Any, where: dict[str, tuple[str, ...]]) -> Any:
    """The rows of `df` that hold, in every column of `where`, one of its values (a null
    holds none, as in a GX row condition)."""
    mask = None
    for column, values in where.items():
        hit = df[column].isin(values)
        mask = hit if mask is None else mask & hit
    return df if mask is None else df[mask]


def _runs_expectations(secrets: Sequence[str]) -> list:
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    exps: list = [
        gxe.ExpectTableRowCountToEqual(value=1),
        gxe.ExpectTableColumnsToMatchSet(
            column_set=["row", *[f.name for f in RUN_FIELDS]], exact_match=False
        ),
        *_in_set("runs"),
        gxe.ExpectColumnValuesToNotMatchRegexList(
            column="launch_command",
            regex_list=[*SECRET_PATTERNS, *(re.escape(s) for s in secrets if s)],
        ),
    ]
    # A published page (trigger ingest) has no date and names no host: those two are required
    # of the runs measured here only.
    measured = Column("trigger") != "ingest"
    exps += [
        gxe.ExpectColumnValuesToNotBeNull(column=c)
        if c not in MEASURED_ONLY_RUN_FIELDS
        else gxe.ExpectColumnValuesToNotBeNull(column=c, row_condition=measured)
        for c in REQUIRED_RUN_FIELDS
    ]
    return exps


def _describe(config: Any) -> str:
    kwargs = {k: v for k, v in config.kwargs.items() if k in ("column", "column_list")}
    target = kwargs.get("column") or kwargs.get("column_list") or "table"
    return f"{config.type}({target})"


def _identity(config: Any) -> tuple[str, str]:
    kwargs = {k: v for k, v in config.kwargs.items() if k != "result_format"}
    return config.type, json.dumps(kwargs, default=str, sort_keys=True)


def _detail_failed(context: Any, name: str, batch: Any, result: Any) -> None:
    """Replace, in ``result``, each failed expectation's BASIC answer by its COMPLETE one (the
    failing rows' indexes), from a second pass over the failed expectations only. Matched by
    what each expectation is, not by position: GX answers in the suite's order today, but
    nothing promises it."""
    import great_expectations as gx

    failed = [i for i, res in enumerate(result.results) if not res.success]
    if not failed:
        return
    again = context.suites.add(
        gx.ExpectationSuite(
            name=f"{name}_failed",
            expectations=[
                copy.copy(result.results[i].expectation_config.to_domain_obj()) for i in failed
            ],
        )
    )
    detail = batch.validate(
        again,
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["row"]},
    )
    answers = {_identity(res.expectation_config): res for res in detail.results}
    for i in failed:
        key = _identity(result.results[i].expectation_config)
        if key not in answers:
            raise RuntimeError(f"GX's second pass over {name} lost {key[0]}")
        result.results[i] = answers[key]


def _run_suite(context: Any, name: str, df: Any, expectations: list) -> SuiteOutcome:
    import great_expectations as gx

    source = context.data_sources.add_pandas(f"{name}_source")
    batch_def = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("all")
    # The expectations given with the suite, not added one by one: each add_expectation goes
    # through the context's store (a quarter of a run's validation time).
    suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=list(expectations)))
    batch = batch_def.get_batch(batch_parameters={"dataframe": df})
    # Two passes: BASIC for every expectation, COMPLETE (the failing rows' indexes) for the
    # ones that failed. COMPLETE computes index lists and queries for every expectation, met or
    # not, and GX's time is per expectation and per metric: a 55-cell run's cells suite took
    # 1.58 s in COMPLETE, 0.90 s in BASIC (this runs after the host is freed, while the run's
    # result waits). A met expectation's COMPLETE lists are empty anyway, and BASIC keeps its
    # counts, so the stored result loses nothing.
    result = batch.validate(suite, result_format={"result_format": "BASIC"})
    _detail_failed(context, name, batch, result)
    failed_rows: dict[int, list[str]] = {}
    summary = []
    for res in result.results:
        what = _describe(res.expectation_config)
        summary.append({"expectation": what, "success": bool(res.success)})
        if res.success:
            continue
        indexes = (res.result or {}).get("unexpected_index_list") or []
        if not indexes:  # a table-level expectation: every row is suspect
            indexes = [{"row": r} for r in df["row"]]
        for item in indexes:
            failed_rows.setdefault(int(item["row"]), []).append(what)
    return SuiteOutcome(
        suite=name,
        success=bool(result.success),
        failed_rows=failed_rows,
        result={"expectations": summary, "gx": result.to_json_dict()},
    )


def _run_scoped(context: Any, name: str, df: Any, scoped: dict[str, list]) -> SuiteOutcome:
    """One suite validated scope by scope (CELL_SCOPES), as one outcome: a row fails what any
    scope's expectations say it fails; the GX result lists every scope's results in order,
    each with its scope in its expectation's ``meta.rows``, and the statistics of them all."""
    outcomes = []
    for i, (scope, expectations) in enumerate(scoped.items()):
        where = CELL_SCOPES[scope]
        for exp in expectations:
            exp.meta = {**(exp.meta or {}), "rows": {c: list(v) for c, v in where.items()}}
        outcomes.append(_run_suite(context, f"{name}_{i}", _scope_rows(df, where), expectations))
    failed_rows: dict[int, list[str]] = {}
    for outcome in outcomes:
        for row, what in outcome.failed_rows.items():
            failed_rows.setdefault(row, []).extend(what)
    results = [r for o in outcomes for r in o.result["gx"]["results"]]
    met = sum(1 for r in results if r["success"])
    return SuiteOutcome(
        suite=name,
        success=all(o.success for o in outcomes),
        failed_rows=failed_rows,
        result={
            "expectations": [e for o in outcomes for e in o.result["expectations"]],
            "gx": {
                "success": all(o.success for o in outcomes),
                "suite_name": name,
                "statistics": {
                    "evaluated_expectations": len(results),
                    "successful_expectations": met,
                    "unsuccessful_expectations": len(results) - met,
                    "success_percent": 100.0 * met / len(results) if results else None,
                },
                "results": results,
            },
        },
    )


def _context() -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # GX logs every closure it registers at INFO: noise in the task log.
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context


def _clean(obj: Any, secrets: Sequence[str]) -> Any:
    """NaN / inf -> None and every string scrubbed of secrets, recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, str):
        return redact(obj, secrets)
    if isinstance(obj, dict):
        return {k: _clean(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v, secrets) for v in obj]
    return obj


def _json_safe(obj: Any, secrets: Sequence[str]) -> dict[str, Any]:
    """Strict JSON with every secret scrubbed (GX copies unexpected values into its result)."""
    return _clean(json.loads(json.dumps(obj, default=str)), secrets)


def validate_run(
    run: dict, cells: Sequence[dict], secrets: Sequence[str] = (), repeats: Sequence[dict] = ()
) -> Validation:
    """Apply the runs and cells suites; split cells into those that land and those quarantined.

    A quarantined cell carries `quarantine_reasons` (the expectations it failed) in the copy
    handed to quarantine; cells that land are returned unchanged. `repeats` (cell records
    plus `repeat`, the cell_repeats rows) go through the cells suite with the cells, the
    pass joining the unique key (rows after the cells; `repeat` 0 for the cells): a repeat
    measures the same thing as its primary, so the same rules decide whether it may land,
    and one suite run costs what the cells alone cost (GX's time is per expectation).
    """
    import pandas as pd

    context = _context()
    if repeats:
        rows = [*({**c, "repeat": 0} for c in cells), *repeats]
        key = (*(records.unique_key("cells") or ()), "repeat")
        cells_df, exps = cells_frame(rows, ["repeat"]), _cells_expectations(key)
    else:
        cells_df, exps = cells_frame(cells), _cells_expectations()
    cells_outcome = _run_scoped(context, "cells", cells_df, exps)
    run_row = {f.name: run.get(f.name) for f in RUN_FIELDS}
    runs_df = pd.DataFrame.from_records([run_row])
    runs_df.insert(0, "row", [0])
    runs_outcome = _run_suite(context, "runs", runs_df, _runs_expectations(secrets))
    cells_outcome.result = _json_safe(cells_outcome.result, secrets)
    runs_outcome.result = _json_safe(runs_outcome.result, secrets)
    # numbers no suite can see: GX reads NaN as a missing value, and a figure of -1e300 in a
    # cell no range applies to (failed, invalid) would land as it is
    for outcome, rows, fields in (
        (cells_outcome, cells, CELL_FIELDS),
        (runs_outcome, [run], RUN_FIELDS),
    ):
        for i, row in enumerate(rows):
            if reasons := number_problems(row, fields):
                outcome.failed_rows.setdefault(i, []).extend(reasons)
                outcome.result.setdefault("expectations", []).extend(
                    {"expectation": why, "success": False, "rows": [i]} for why in reasons
                )
    if runs_outcome.failed_rows:
        runs_outcome.success = False
    good, bad = _split(cells, cells_outcome.failed_rows)
    later = {i - len(cells): why for i, why in cells_outcome.failed_rows.items() if i >= len(cells)}
    good_repeats, bad_repeats = _split(repeats, later)
    outcome = Validation(
        run_ok=runs_outcome.success,
        good_cells=good,
        bad_cells=bad,
        cells=cells_outcome,
        runs=runs_outcome,
        good_repeats=good_repeats,
        bad_repeats=bad_repeats,
    )
    log.info("%s; %s", cells_outcome.summary(), runs_outcome.summary())
    return outcome


def number_problems(row: dict, fields: Sequence[records.Field]) -> list[str]:
    """A reason per number of `row` that cannot be a figure: not finite, past
    records.MAX_QUANTITY (records.check_quantity, the one bound), a negative GPU count."""
    out = []
    for f in fields:
        value = row.get(f.name)
        if f.type not in ("int", "float") or value is None or isinstance(value, bool):
            continue
        try:
            records.check_quantity(float(value), value)
        except (TypeError, ValueError):
            out.append(f"finite_and_at_most_1e15({f.name})")
            continue
        if f.name == "hardware_gpu_count" and value < 0:  # 0: not known (a server of another's)
            out.append(f"not_negative({f.name}): {value}")
    return out


def _split(
    rows: Sequence[dict], failed_rows: dict[int, list[str]]
) -> tuple[list[dict], list[dict]]:
    """(rows that land unchanged, copies of the failing rows with `quarantine_reasons`)."""
    good, bad = [], []
    for i, row in enumerate(rows):
        reasons = failed_rows.get(i)
        if reasons:
            bad.append({**row, "quarantine_reasons": sorted(set(reasons))})
        else:
            good.append(row)
    return good, bad


def run_status(cells: Sequence[dict], quarantined: int = 0) -> str:
    """failed: a cell failed; partial: a cell invalid or quarantined; success otherwise."""
    statuses = [c.get("status") for c in cells]
    if "failed" in statuses:
        return "failed"
    if "invalid" in statuses or quarantined:
        return "partial"
    return "success"


def check_for_landing(
    warehouse: Warehouse,
    run: dict,
    cells: Sequence[dict],
    requests: Sequence[dict],
    *,
    secrets: Sequence[str] = (),
    repeats: Sequence[dict] = (),
) -> dict[str, Any]:
    """Validate one run's rows before they land, the one way every run takes (a measured run's
    `validate` task and `speedmatrix ingest`): the suites' results go to the run's artifacts
    (``validation/gx-results.json``), failing cells (with their requests) and repeats to
    ``warehouse``'s quarantine with GX's result, and the run's status becomes its good cells'
    (``partial`` when any was quarantined). A run row that fails is quarantined and nothing
    lands (RuntimeError). Returns what lands: run, cells, requests, repeats, quarantined (each
    quarantined cell's key and reasons), gx_results (the artifact's path)."""
    checked = validate_run(run, cells, secrets=secrets, repeats=repeats)
    run_id = run["run_id"]
    gx_path = warehouse.write_artifact(
        run_id, "validation/gx-results.json", json.dumps(checked.results_json, indent=1)
    )
    log.info("GX results: %s; %s; %s", gx_path, checked.cells.summary(), checked.runs.summary())
    bad_keys = {(c["phase"], c["context_tokens"], c["concurrency"]) for c in checked.bad_cells}
    good_requests, bad_requests = [], []
    for r in requests:
        key = (r["phase"], r["context_tokens"], r["concurrency"])
        (bad_requests if key in bad_keys else good_requests).append(r)
    if checked.bad_cells:
        where = warehouse.quarantine(run_id, "cells", checked.bad_cells, checked.cells.result)
        if bad_requests:
            warehouse.quarantine(run_id, "requests", bad_requests, checked.cells.result)
        log.warning("%d cell(s) quarantined at %s", len(checked.bad_cells), where)
    if checked.bad_repeats:
        where = warehouse.quarantine(
            run_id, "cell_repeats", checked.bad_repeats, checked.cells.result
        )
        log.warning("%d repeat(s) quarantined at %s", len(checked.bad_repeats), where)
    if not checked.run_ok:
        safe = {**run, "launch_command": redact(run.get("launch_command"), secrets)}
        where = warehouse.quarantine(run_id, "runs", [safe], checked.runs.result)
        raise RuntimeError(
            f"the run row failed validation ({checked.runs.summary()}); quarantined at {where}; "
            "nothing landed"
        )
    # The run's status is its matrix's (the primaries): a quarantined or failed repeat leaves
    # the cells table whole, and a `partial` run would be dropped from baselines and from the
    # between-run noise its other repeats are for. Such a repeat is listed in `quarantined`
    # (with its `repeat`) or landed as failed in cell_repeats, and logged.
    run["status"] = run_status(checked.good_cells, quarantined=len(checked.bad_cells))
    if any(c.get("status") == "failed" for c in checked.bad_cells):
        run["status"] = "failed"
    return {
        "run": run,
        "cells": checked.good_cells,
        "requests": good_requests,
        "repeats": checked.good_repeats,
        "quarantined": [
            {
                "phase": c["phase"],
                "context_tokens": c["context_tokens"],
                "concurrency": c["concurrency"],
                "reasons": c["quarantine_reasons"],
                **({"repeat": c["repeat"]} if "repeat" in c else {}),
            }
            for c in [*checked.bad_cells, *checked.bad_repeats]
        ],
        "gx_results": gx_path,
    }
