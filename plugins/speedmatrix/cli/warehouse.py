"""``speedmatrix query "SQL" [--warehouse W] [--format table|csv|json]``: DuckDB over the views
``runs``, ``cells`` and ``requests`` of the warehouse, and ``comparisons``, ``noise`` and
``cell_repeats`` beside them (see speedmatrix.store.warehouse)."""

from __future__ import annotations

# The speedmatrix imports sit inside the command functions on purpose: `speedmatrix <cmd>
# --help` and the other commands must not pay for pyarrow, pandas, DuckDB or matplotlib;
# CliError comes from speedmatrix.cli, which imports this module (a cycle if at the top).
import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Iterator

from speedmatrix.errors import InputError

DEFAULT_TIMEOUT_S = 180.0
"""A query stops after three minutes unless --timeout says otherwise: an
analyst's mistake (a join without its condition) must not hold a shared host for hours."""
DEFAULT_MEMORY_LIMIT = "2GB"
"""…and may use this much memory (DuckDB spills to its private temp folder beyond it). DuckDB's
limit governs its buffer manager only, not the vectors a query builds nor the copies that hold
and print its result: so the command also bounds its own process (`process_budget`) and the
result it holds (at most the limit, `Warehouse.query_arrow`'s max_bytes)."""
_SLACK = 256 * 2**20
"""The process's room beyond twice the limit: the printing of a result (a DataFrame, text)."""
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B|bytes)?\s*", re.I | re.ASCII)
_UNITS = {"": 1, "BYTES": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """`500MB` -> 500,000,000; `1GiB` -> 2**30: a size as DuckDB reads its memory_limit
    (KB, MB, GB in 1000s; KiB, MiB, GiB in 1024s). InputError otherwise."""
    m = _SIZE.fullmatch(text or "")
    size = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()] if m else 0
    if not m or not 0 < size < 2**62:
        raise InputError(f"--memory-limit must be a size like 2GB or 512MiB, got {text!r}")
    return int(size)


def process_budget(limit: int) -> int:
    """How much the query command's process may grow past where it stood before the query:
    DuckDB's working memory (the limit), the result held (at most the limit), and room to
    print it."""
    return 2 * limit + _SLACK


@contextlib.contextmanager
def bounded_process(budget: int) -> Iterator[None]:
    """The process's data segment (its heap and private mappings: RLIMIT_DATA) may grow by
    `budget` while the block runs; the earlier limit is restored after. Past it an allocation
    fails (DuckDB's OutOfMemoryException, Python's MemoryError) instead of the host's memory
    running out."""
    import resource

    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            used = next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        yield  # no /proc (not Linux): DuckDB's own limit only
        return
    before = resource.getrlimit(resource.RLIMIT_DATA)
    soft = used + budget
    if before[0] != resource.RLIM_INFINITY:
        soft = min(soft, before[0])
    if before[1] != resource.RLIM_INFINITY:
        soft = min(soft, before[1])
    resource.setrlimit(resource.RLIMIT_DATA, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


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
    from speedmatrix.store.query import QueryLimitError
    from speedmatrix.store.warehouse import Warehouse

    if args.timeout <= 0:
        raise CliError("--timeout must be a number of seconds above 0")
    limit = parse_size(args.memory_limit)
    wh = Warehouse(args.warehouse, memory_limit=args.memory_limit)
    too_big = (
        f"the query needed more memory than its limit of {args.memory_limit} (raise it with "
        "--memory-limit, e.g. --memory-limit 8GB, or narrow the query: LIMIT, fewer columns)"
    )
    try:
        wh.query_arrow("SELECT 1")  # connect first: DuckDB's threads are not the query's
        with bounded_process(process_budget(limit)), query_deadline(args.timeout) as left:
            result = wh.query_arrow(args.sql, timeout_s=left(), max_bytes=limit)
            text = format_table(result, args.format)
            del result
            sys.stdout.write(text)
            sys.stdout.flush()
    except MemoryError:
        raise CliError(too_big) from None
    except QueryLimitError:
        raise
    except (duckdb.Error, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # an allocation refused past the process's budget: DuckDB's OutOfMemoryException, or
        # the same words as another class (an OSError for an Arrow buffer while fetching)
        if isinstance(exc, duckdb.OutOfMemoryException) or first.startswith("Out of Memory"):
            raise CliError(f"{too_big}: {first}") from None
        if isinstance(exc, OSError):
            raise
        raise CliError(first) from None
    finally:
        wh.close()
    return 0


@contextlib.contextmanager
def query_deadline(timeout_s: float) -> Iterator[Callable[[], float]]:
    """The query's timeout covers its fetching, formatting and printing: DuckDB is interrupted
    when its part runs out (`timeout_s` given to the query), and the rest is stopped by an
    alarm in this (main) thread. Yields the seconds left."""
    import signal
    import threading
    import time

    from speedmatrix.store.query import QueryLimitError

    end = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.001, end - time.monotonic())

    if threading.current_thread() is not threading.main_thread():
        yield left  # an alarm is the main thread's: DuckDB's own interrupt only
        return

    def stop(_signum: int, _frame: object) -> None:
        raise QueryLimitError(
            f"the query was stopped after its timeout of {timeout_s:g} s "
            "(give it longer with --timeout SECONDS)"
        )

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield left
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
