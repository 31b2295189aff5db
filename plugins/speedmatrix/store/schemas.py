"""Every warehouse table's pyarrow schema, and the conversion of rows into one.

One job: what a table holds. The core tables (runs, cells, requests, landed by
store/warehouse.py) and the extra ones landed beside them (comparisons, noise, cell_repeats:
store/extra.py) are defined here, in the lowest store module, so that the warehouse, the
query layer and the analysis all take them from one place and the store never imports the
analysis (an import cycle bisect <-> compare <-> trend <-> warehouse otherwise).
:func:`build_table` checks and converts rows (records.py field names) into a table's schema.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from speedmatrix import records, renames
from speedmatrix.errors import InputError
from speedmatrix.records import (
    CELL_FIELDS,
    REQUEST_FIELDS,
    RUN_FIELDS,
    Field,
)

SCHEMA_VERSION = 8
"""Bumped when a table's columns change; stored in every row (``schema_version``).
1: the first tables; 2: cells gained ``warmup_s`` (older files read it as null);
3: runs and cells gained ``measurement_profile`` (records.MEASUREMENT_PROFILES:
``default`` or ``published``; older files read it as null, which means ``default``);
4: cells gained ``ttst_ms``, the time to the second token (older files read it as null);
5: cells gained ``ttft_samples`` and ``ttft_spread_pct`` (how many TTFTs a cell's
figure is the median of, and how far apart; older files read them as null);
6: runs gained ``kv_budget_tokens``, a manual KV budget (older files read it as
null: the server's own capacity was used); cells gained the run's ``engine_commit``, ``host``,
``trigger``, ``model`` (RUN_ON_CELLS) and ``prompt_tok_s`` (a prefill row's figure under its
own name); older rows read null.
7: runs' ``measure_s`` is ``window_s``, the measurement window's one name (speedmatrix.renames;
COLUMNS): the Delta table keeps the old column for the rows landed before, and every reader
(the query views, read_table, a row given under the old name) reads it as ``window_s``;
8: cells gained a burst cell's figures (phase ``burst``, loadgen/burst.py): ``latency_ms``,
``latency_p90_ms``, ``latency_p99_ms`` and ``e2e_per_request_tok_s`` (older files, and every
prefill and decode row, read them as null)."""


TABLES = ("runs", "cells", "requests")
"""The tables land_run writes. Other code lands more beside them, in the same layout
(EXTRA_TABLES: comparisons, noise, cell_repeats; store/extra.py): :func:`view_tables`."""
EXTRA_TABLES = ("comparisons", "noise", "cell_repeats")
"""Tables landed beside the core ones, one file per run (store/extra.py)."""
PARTITION_KEYS = ("recipe_id", "run_month")

_PA_TYPES = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}


class WarehouseError(InputError):
    """Rows that do not fit the tables, or a warehouse that cannot be used; nothing landed."""


def _field(f: Field) -> pa.Field:
    unit = records.unit_of(f.name)
    meta = {"doc": f.doc, **({"unit": unit} if unit else {})}
    return pa.field(f.name, _PA_TYPES[f.type], nullable=f.nullable, metadata=meta)


_RUN_ID = Field("run_id", "str", False, "the run this row belongs to")
_RECIPE = Field("recipe_id", "str", False, "partition key: the run's recipe")
_SCHEMA_VERSION = pa.field(
    "schema_version", pa.int32(), nullable=False, metadata={"doc": "table schema version"}
)
_RUN_DATE = pa.field(
    "run_date",
    pa.date32(),
    nullable=False,
    metadata={
        "doc": "UTC date of the run's started_at (else finished_at, else the day it was landed)"
    },
)
_RUN_MONTH = pa.field(
    "run_month",
    pa.string(),
    nullable=False,
    metadata={"doc": "partition key: run_date's YYYY-MM"},
)
_LANDED_AT = pa.field(
    "landed_at",
    pa.timestamp("us", tz="UTC"),
    nullable=False,
    metadata={"doc": "when this copy of the run was landed (UTC)"},
)

RUNS_SCHEMA = pa.schema(
    [*(_field(f) for f in RUN_FIELDS), _RUN_DATE, _RUN_MONTH, _LANDED_AT, _SCHEMA_VERSION],
    metadata={"table": "runs", "schema_version": str(SCHEMA_VERSION)},
)
RUN_ON_CELLS = ("engine_commit", "host", "trigger", "model")
"""The run's fields every cell row carries (schema 4): "by commit / host / model" without a
join. Filled by the warehouse from the run (never by the cell record); older rows read null."""
_PROMPT_TOK_S = Field(
    "prompt_tok_s",
    "float",
    True,
    "prefill: prompt tokens / TTFT, the prefill figure under its own name (total_tok_s holds "
    "the same for a prefill row); null for decode",
)
_ON_CELLS = tuple(
    Field(f.name, f.type, True, f"the run's {f.name}: {f.doc}")
    for f in RUN_FIELDS
    if f.name in RUN_ON_CELLS
)

CELLS_SCHEMA = pa.schema(
    [
        _field(_RUN_ID),
        *(_field(f) for f in CELL_FIELDS),
        _field(_RECIPE),
        _RUN_DATE,
        _RUN_MONTH,
        _SCHEMA_VERSION,
        *(_field(f) for f in (*_ON_CELLS, _PROMPT_TOK_S)),
    ],
    metadata={"table": "cells", "schema_version": str(SCHEMA_VERSION)},
)
REQUESTS_SCHEMA = pa.schema(
    [
        _field(_RUN_ID),
        *(_field(f) for f in REQUEST_FIELDS),
        _field(_RECIPE),
        _RUN_DATE,
        _RUN_MONTH,
        _SCHEMA_VERSION,
    ],
    metadata={"table": "requests", "schema_version": str(SCHEMA_VERSION)},
)
SCHEMAS: dict[str, pa.Schema] = {
    "runs": RUNS_SCHEMA,
    "cells": CELLS_SCHEMA,
    "requests": REQUESTS_SCHEMA,
}
# Columns the warehouse fills itself (callers may pass them back from read_run; overwritten).
_DERIVED = {
    "run_id",
    "recipe_id",
    "run_date",
    "run_month",
    "schema_version",
    "landed_at",
    *RUN_ON_CELLS,
    "prompt_tok_s",
}

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

NOISE_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("recipe_id", pa.string()),
        pa.field("host", pa.string()),
        pa.field("engine_commit", pa.string()),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("context_tokens", pa.int64(), nullable=False),
        pa.field("context_label", pa.string()),
        pa.field("concurrency", pa.int64(), nullable=False),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("value", pa.float64()),
        pa.field("ci_low", pa.float64()),
        pa.field("ci_high", pa.float64()),
        pa.field("ci_rel_halfwidth", pa.float64()),
        pa.field("ci_samples", pa.int64()),
        pa.field("confidence", pa.float64()),
        pa.field("between_rel_sd", pa.float64()),
        pa.field("between_source", pa.string()),
    ]
)
"""The `noise` table: one row per (run, valid cell, metric): the cell's within-window bootstrap
interval (null when the cell has fewer than two samples) and the between-run relative spread
that applied when the run was compared (`between_source`: cell, pooled or none)."""


def _cell_repeats_schema() -> pa.Schema:
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
    schemas = {
        "comparisons": COMPARISONS_SCHEMA,
        "noise": NOISE_SCHEMA,
        "cell_repeats": CELL_REPEATS_SCHEMA,
    }
    if table not in schemas:
        raise ValueError(f"unknown table {table!r}: one of {', '.join(EXTRA_TABLES)}")
    return schemas[table]


def view_tables() -> tuple[str, ...]:
    """Every table the query layer defines a view of: the three core tables, then the
    extra ones landed beside them (EXTRA_TABLES)."""
    return (*TABLES, *EXTRA_TABLES)


def view_schema(table: str) -> pa.Schema:
    """The columns of ``table``'s view: a core table's schema; an extra table's file columns
    plus ``run_date`` and ``run_month`` (from its path) where its files lack them."""
    if table in SCHEMAS:
        return SCHEMAS[table]
    schema = extra_schema(table)
    for f in (_RUN_DATE, _RUN_MONTH):
        if f.name not in schema.names:
            schema = schema.append(f)
    return schema


def _utc(value: Any, what: str) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise WarehouseError(f"{what}: not an ISO timestamp: {value!r}") from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        value = dt.datetime.fromtimestamp(value, tz=dt.UTC)
    if not isinstance(value, dt.datetime):
        raise WarehouseError(f"{what}: not a timestamp: {value!r}")
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC)


def run_date_of(run: dict) -> dt.date | None:
    """The UTC date of a run's ``started_at`` (else ``finished_at``); None when it has neither
    (an ingested page): land_run then uses the landing date."""
    for key in ("started_at", "finished_at"):
        when = _utc(run.get(key), f"runs.{key}")
        if when:
            return when.date()
    return None


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item") and not isinstance(value, str | bytes):  # numpy scalars
        with contextlib.suppress(Exception):
            return _clean(value.item())
    return value


def _renamed(table: str, i: int, row: Any) -> Any:
    """A row given under a column's old name (renames.COLUMNS: a caller of the older API)
    with that value under the new name."""
    old = renames.COLUMNS.get(table)
    if not old or not isinstance(row, dict) or not set(old) & set(row):
        return row
    try:
        return renames.renamed(row, old, where=f"{table}.")[0]
    except renames.RenameConflict as exc:
        raise WarehouseError(f"{table} row {i}: {exc}") from None


def renamed_columns(table: str, have: Iterable[str]) -> dict[str, list[str]]:
    """For each column of ``table`` whose older name (renames.COLUMNS) a table landed before
    holds (``have``: its columns), the names to read it from, newest first."""
    out: dict[str, list[str]] = {}
    have = set(have)
    for old, new in renames.COLUMNS.get(table, {}).items():
        if old in have:
            out.setdefault(new, [new] if new in have else []).append(old)
    for old, new in renames.MIRRORED.get(table, {}).items():
        names = [c for c in (old, new) if c in have]
        if names and old not in out:  # a mirror reads its twin where it is null itself
            out[old] = names
    return out


def build_table(table: str, rows: list[dict], fixed: dict[str, Any]) -> pa.Table:
    """Rows (dicts keyed by the records.py field names) -> a pyarrow table of ``table``'s
    schema, with ``fixed`` columns (run_id, partition keys, schema_version…) set on every row.

    Refuses unknown keys, missing non-nullable values, values of the wrong type, unknown
    phase / status / trigger values and duplicate cell or request keys, naming the table, the
    row and the column. Missing nullable keys are null."""
    schema = SCHEMAS[table]
    names = set(schema.names)
    rows = [_renamed(table, i, row) for i, row in enumerate(rows)]
    mirrored = renames.MIRRORED.get(table, {})
    if mirrored:  # an old name still written with its new name's value (the caller's rows kept)
        rows = [
            {**row, **{old: row.get(new) for old, new in mirrored.items()}}
            if isinstance(row, dict)
            else row
            for row in rows
        ]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise WarehouseError(f"{table} row {i}: not a dict: {type(row).__name__}")
        unknown = set(row) - names
        if unknown:
            raise WarehouseError(f"{table} row {i}: unknown fields {sorted(unknown)}")
        for key in _DERIVED & set(row) & set(fixed):
            given = _clean(row[key])
            want = fixed[key]
            if key == "run_id" and given is not None and given != want:
                raise WarehouseError(
                    f"{table} row {i}: run_id {given!r} differs from the run's {want!r}"
                )
    columns = []
    for f in schema:
        if f.name in fixed:
            values = [fixed[f.name]] * len(rows)
        else:
            values = [_clean(row.get(f.name)) for row in rows]
        if pa.types.is_timestamp(f.type):
            values = [_utc(v, f"{table}.{f.name}") for v in values]
        if not f.nullable:
            missing = next((i for i, v in enumerate(values) if v is None), None)
            if missing is not None:
                raise WarehouseError(f"{table} row {missing}: {f.name} is required (null given)")
        if pa.types.is_integer(f.type):
            for i, v in enumerate(values):
                if isinstance(v, float) and v.is_integer():
                    values[i] = int(v)
                elif isinstance(v, bool) or (v is not None and not isinstance(v, int)):
                    raise WarehouseError(f"{table} row {i}: {f.name} must be an integer, got {v!r}")
        elif pa.types.is_floating(f.type):
            for i, v in enumerate(values):
                if isinstance(v, bool) or (v is not None and not isinstance(v, int | float)):
                    raise WarehouseError(f"{table} row {i}: {f.name} must be a number, got {v!r}")
        elif pa.types.is_string(f.type):
            for i, v in enumerate(values):
                if v is not None and not isinstance(v, str):
                    raise WarehouseError(f"{table} row {i}: {f.name} must be a string, got {v!r}")
        try:
            columns.append(pa.array(values, type=f.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
            raise WarehouseError(f"{table}: column {f.name}: {exc}") from None
    out = pa.Table.from_arrays(columns, schema=schema)
    # The value sets and the unique key are the GX suites' own (records.allowed_values /
    # unique_key): a row GX passed is never refused here on a rule of another wording.
    for name, allowed in records.allowed_values(table).items():
        if name not in names:
            continue
        for i, v in enumerate(out.column(name).to_pylist()):
            if v is not None and v not in allowed:
                raise WarehouseError(f"{table} row {i}: {name} {v!r} is not one of {allowed}")
    key_cols = records.unique_key(table)
    if key_cols and len(rows) > 1:
        keys = list(zip(*(out.column(k).to_pylist() for k in key_cols), strict=True))
        seen: dict[tuple, int] = {}
        for i, key in enumerate(keys):
            if key in seen:
                raise WarehouseError(
                    f"{table} rows {seen[key]} and {i}: duplicate {dict(zip(key_cols, key, strict=True))}"
                )
            seen[key] = i
    return out
