"""``speedmatrix query "SQL" [--warehouse W] [--format table|csv|json]``: DuckDB over the views
``runs``, ``cells`` and ``requests`` of the warehouse, and ``comparisons``, ``noise`` and
``cell_repeats`` beside them (see speedmatrix.store.warehouse)."""

from __future__ import annotations

# The speedmatrix imports sit inside the command functions on purpose: `speedmatrix <cmd>
# --help` and the other commands must not pay for pyarrow, pandas, DuckDB or matplotlib;
# CliError comes from speedmatrix.cli, which imports this module (a cycle if at the top).
import argparse
import sys

DEFAULT_TIMEOUT_S = 180.0
"""A query stops after three minutes unless --timeout says otherwise: an
analyst's mistake (a join without its condition) must not hold a shared host for hours."""
DEFAULT_MEMORY_LIMIT = "2GB"
"""…and may use this much memory (DuckDB spills to its private temp folder beyond it)."""


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="read-only SQL over the runs / cells / requests tables (and comparisons / noise / "
        "cell_repeats)",
        description="Run read-only SQL (DuckDB) over the views runs, cells and requests, and "
        "comparisons, noise and cell_repeats. Only SELECT (and EXPLAIN of one) is accepted; "
        "no file outside the warehouse is readable and nothing is written.",
        epilog='Example: speedmatrix query "SELECT run_id, engine_version FROM runs ORDER BY '
        'started_at DESC LIMIT 5"',
    )
    p.add_argument("sql", help="the query")
    p.add_argument(
        "--warehouse",
        help="warehouse root (default $SPEEDMATRIX_WAREHOUSE, else the checkout's warehouse/)",
    )
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"stop the query after this long (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--memory-limit",
        default=DEFAULT_MEMORY_LIMIT,
        metavar="SIZE",
        help=f"DuckDB's memory limit for the query, e.g. 8GB (default {DEFAULT_MEMORY_LIMIT})",
    )
    p.set_defaults(func=cmd_query)


def format_frame(df, fmt: str) -> str:
    """A query result as text: an aligned table, CSV with a header, or a JSON array of rows."""
    if fmt == "csv":
        return df.to_csv(index=False)
    if fmt == "json":
        return df.to_json(orient="records", date_format="iso", force_ascii=False) + "\n"
    if df.empty:
        return "(no rows)\n" if len(df.columns) == 0 else " | ".join(df.columns) + "\n(no rows)\n"
    import pandas as pd

    with pd.option_context(
        "display.max_rows",
        None,
        "display.max_columns",
        None,
        "display.width",
        250,
        "display.max_colwidth",
        80,
    ):
        return df.to_string(index=False) + "\n"


_PLAIN = str.maketrans("", "", ',"\n\r\t\\')


def _plain_columns(table) -> list[tuple[str, bool, list[str]]] | None:
    """Each column of an Arrow result as (name, numeric, cells) when all of them print the same
    with or without pandas (integers, booleans, short strings with nothing to quote or escape,
    no nulls); None otherwise. Only those are written without pandas, whose import is about
    half of the command's start."""
    import pyarrow.types as pt

    out = []
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if column.null_count or not (
            pt.is_integer(kind) or pt.is_boolean(kind) or pt.is_string(kind)
        ):
            return None
        values = column.to_pylist()
        if pt.is_string(kind):
            if any(
                not v or len(v) > 80 or v != v.strip() or v.translate(_PLAIN) != v for v in values
            ):
                return None
            if not name or name.translate(_PLAIN) != name:
                return None
        out.append((name, not pt.is_string(kind), [str(v) for v in values]))
    return out


def _json_value(value):
    """A JSON value of a query's cell: dates as dates (2026-12-05), timestamps in ISO 8601
    with their offset, NaN as null, decimals as numbers."""
    import datetime as dt
    import decimal
    import math

    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def _json_rows(table) -> str:
    import json
    import math

    rows = table.to_pylist()
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float) and not math.isfinite(value):
                row[key] = None
    return json.dumps(rows, ensure_ascii=False, separators=(",", ":"), default=_json_value) + "\n"


def format_table(table, fmt: str) -> str:
    """:func:`format_frame` of an Arrow result: the same text, written without pandas when the
    result's columns allow it (:func:`_plain_columns`), through a DataFrame otherwise."""
    if table.num_rows == 0 and fmt == "table":
        names = table.column_names
        return "(no rows)\n" if not names else " | ".join(names) + "\n(no rows)\n"
    if fmt == "json":
        return _json_rows(table)
    plain = _plain_columns(table) if fmt in ("table", "csv") else None
    if plain is None or not plain:
        import duckdb

        # DuckDB's own conversion, as Warehouse.query makes its DataFrames
        df = duckdb.connect().from_arrow(table).df()
        if fmt == "table":  # a NULL prints as NULL (pandas shows NaN / None)
            for name, column in zip(table.column_names, table.columns, strict=True):
                if column.null_count:
                    valid = column.is_valid().to_numpy(zero_copy_only=False)
                    df[name] = df[name].astype(object).where(valid, "NULL")
        return format_frame(df, fmt)
    if fmt == "csv":
        lines = [",".join(name for name, _n, _c in plain)]
        lines += [",".join(row) for row in zip(*(cells for _n, _k, cells in plain), strict=True)]
        return "\n".join(lines) + "\n"
    # pandas' to_string(index=False): a column right-aligned to its widest cell, a numeric
    # column's header one space wider than its name, columns one space apart
    columns = []
    for name, numeric, cells in plain:
        head = (" " + name) if numeric else name
        width = max(len(head), *(len(c) for c in cells))
        columns.append([head.rjust(width), *(c.rjust(width) for c in cells)])
    return "\n".join(" ".join(row) for row in zip(*columns, strict=True)) + "\n"


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    from speedmatrix.cli import CliError
    from speedmatrix.store.warehouse import Warehouse

    if args.timeout <= 0:
        raise CliError("--timeout must be a number of seconds above 0")
    wh = Warehouse(args.warehouse, memory_limit=args.memory_limit)
    try:
        result = wh.query_arrow(args.sql, timeout_s=args.timeout)
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(first) from None
    finally:
        wh.close()
    sys.stdout.write(format_table(result, args.format))
    return 0
