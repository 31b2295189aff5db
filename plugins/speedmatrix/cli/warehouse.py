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
        "--warehouse", help="warehouse root (default $SPEEDMATRIX_WAREHOUSE or ./warehouse)"
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


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    from speedmatrix.cli import CliError
    from speedmatrix.store.warehouse import Warehouse

    if args.timeout <= 0:
        raise CliError("--timeout must be a number of seconds above 0")
    wh = Warehouse(args.warehouse, memory_limit=args.memory_limit)
    try:
        df = wh.query(args.sql, timeout_s=args.timeout)
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(first) from None
    sys.stdout.write(format_frame(df, args.format))
    return 0
