"""The analysts' read-only SQL over the warehouse: DuckDB views of every Delta table.

One job: reading with SQL. :class:`WarehouseQueries` is the part of :class:`Warehouse
<speedmatrix.store.warehouse.Warehouse>` that defines the DuckDB views (``runs``, ``cells``,
``requests`` and the extra tables), each over the Arrow dataset of the table's current Delta
version (``DeltaTable.to_pyarrow_dataset()``: the files of that version as the log lists them,
with their partition values and statistics, so a filter on recipe_id, run_month, run_date or
run_id skips the other files unopened). The tables are opened once per Warehouse; before each
query only the log entries written since are read, and a view is defined again only when its
table's version moved. DuckDB itself opens no file: the Arrow datasets read them.

Locked down: no file outside the query's own private temporary folder is readable
(DuckDB's default ``<cwd>/.tmp`` would be), nothing is attached, installed or written; a
query has a memory limit and, from ``speedmatrix query``, a timeout.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from speedmatrix.store.delta import arrow_dataset, sql_literal
from speedmatrix.store.dictionary import columns
from speedmatrix.store.schemas import (
    WarehouseError,
    renamed_columns,
    view_schema,
    view_tables,
)

_DUCK_TYPES = {
    pa.string(): "VARCHAR",
    pa.int64(): "BIGINT",
    pa.int32(): "INTEGER",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    pa.date32(): "DATE",
    pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ",
}


_OPEN: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Every query layer with a DuckDB connection open, for :func:`close_all`."""


def close_all() -> int:
    """Close every open DuckDB connection of this process's warehouses (the process's end:
    cli.exiting); returns how many were open."""
    layers = list(_OPEN.values())
    for layer in layers:
        layer.close()
    return len(layers)


class QueryLimitError(WarehouseError):
    """A query stopped by its timeout or its memory limit."""


class WarehouseQueries:
    """The query layer of a Warehouse (mixed into it: the views need its tables, and callers
    keep one object)."""

    root: str
    _con: Any
    _view_versions: dict[str, int | None]
    _lock: threading.RLock
    memory_limit: str | None = None
    _string_view_tables: frozenset[str] = frozenset()
    """Tables read as string_view (delta.arrow_dataset): those whose plain-string view failed
    on files delta-rs rewrote; the plain one is faster where it works (filters prune files)."""
    """DuckDB's ``memory_limit`` for this Warehouse's queries (e.g. ``"2GB"``); None: DuckDB's
    default (80% of RAM). Set before the first query: the connection's settings are locked."""

    def delta_table(self, table: str, refresh: bool = True):
        raise NotImplementedError

    def connect(self, only: Iterable[str] | None = None):
        """A new DuckDB connection, locked down (:meth:`_lock_down`), with a view of every
        table (:func:`view_tables`; an empty view of the right columns while a table has no
        commit)."""
        import duckdb

        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")
        self._lock_down(con)
        self._view_versions = {}
        self._define_views(con, only)
        return con

    def _lock_down(self, con) -> None:
        """Analysts' SQL reads the warehouse's views and nothing else: no file, no database
        attached, no extension installed or loaded, and the settings locked so a query cannot
        undo this. DuckDB always allows its temporary directory; it is a fresh private folder
        of this connection's (removed with it), not ``<cwd>/.tmp`` where anything may lie."""
        spill = tempfile.mkdtemp(prefix="speedmatrix-query-")
        weakref.finalize(con, shutil.rmtree, spill, True)
        if self.memory_limit:
            try:
                con.execute("SET memory_limit = ?", [self.memory_limit])
            except Exception as exc:
                raise WarehouseError(f"memory limit {self.memory_limit!r}: {exc}") from None
        con.execute("SET temp_directory = ?", [spill])
        con.execute("SET allowed_directories = ?", [[spill + "/"]])
        con.execute("SET enable_external_access = false")
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET lock_configuration = true")

    def _define_views(self, con, only: Iterable[str] | None = None) -> None:
        """(Re)define the view of every table (of `only`, when given) whose version moved since
        the last time."""
        for table in view_tables() if only is None else [t for t in view_tables() if t in only]:
            delta = self.delta_table(table)
            version = delta.version() if delta is not None else None
            if table in self._view_versions and self._view_versions[table] == version:
                continue
            schema = view_schema(table)
            if delta is None:
                con.register(f"_{table}_src", schema.empty_table())
                con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM _{table}_src")
            else:
                data = arrow_dataset(delta, views=table in self._string_view_tables)
                con.register(f"_{table}_src", data)
                have = set(data.schema.names)
                # a renamed column of rows landed before reads under its name now
                renamed = renamed_columns(table, have)
                cols = ", ".join(_column_sql(f, have, renamed) for f in schema)
                con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT {cols} FROM _{table}_src")
            _comment_columns(con, table)
            self._view_versions[table] = version

    def query(self, sql: str, params: Iterable[Any] | None = None, timeout_s: float | None = None):
        """Run SQL over the views (``runs``, ``cells``, ``requests`` and the extra tables) of
        the tables' current versions; returns a pandas DataFrame. The connection is kept
        between calls. ``timeout_s``: interrupt the query after that long
        (:class:`QueryLimitError`); so does exceeding :attr:`memory_limit`."""
        return self._query(sql, params, timeout_s, arrow=False)

    def query_arrow(
        self,
        sql: str,
        params: Iterable[Any] | None = None,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
    ) -> pa.Table:
        """:meth:`query`, the result as a pyarrow Table: a caller that only prints or counts
        the rows does not import pandas (about half a second of a command's start).
        ``max_bytes``: the result is fetched in batches and refused (:class:`QueryLimitError`)
        once what it holds passes this many bytes."""
        return self._query(sql, params, timeout_s, arrow=True, max_bytes=max_bytes)

    def _query(
        self,
        sql: str,
        params: Iterable[Any] | None,
        timeout_s: float | None,
        arrow: bool,
        max_bytes: int | None = None,
    ):
        import duckdb

        check_read_only(sql)
        # Only the tables the SQL names are opened: each costs a read of its log and a listing
        # of its files, and registering an Arrow dataset with DuckDB imports pandas.
        only = _named_tables(sql)
        with self._lock:
            if self._con is None:
                self._con = self.connect(only=only)
                _OPEN[id(self)] = self
            else:
                self._define_views(self._con, only)
            con = self._con
            timer = None
            fired, done = threading.Event(), threading.Event()
            if timeout_s is not None:

                def interrupt(limit: float = timeout_s) -> None:
                    # Again every 50 ms until the query returns: an interrupt that comes before
                    # DuckDB has begun executing (a loaded machine) is lost, not kept.
                    if done.wait(limit):
                        return
                    fired.set()
                    while True:
                        con.interrupt()
                        if done.wait(0.05):
                            return

                timer = threading.Thread(target=interrupt, daemon=True)
                timer.start()
            try:
                try:
                    result = con.execute(sql, list(params) if params is not None else None)
                except duckdb.InvalidInputException as exc:
                    failed = re.search(r"registered as '_(\w+)_src' failed.*string_view", str(exc))
                    if not failed or failed.group(1) in self._string_view_tables:
                        raise
                    # that table mixes string and string_view files: read it as string_view
                    self._string_view_tables = self._string_view_tables | {failed.group(1)}
                    self._view_versions.pop(failed.group(1), None)
                    self._define_views(con, only)
                    return self._query(sql, params, timeout_s, arrow, max_bytes)
                if not arrow:
                    return result.df()
                if max_bytes is not None:
                    with warnings.catch_warnings():
                        # batches of the result, each checked against the cap as it comes
                        warnings.filterwarnings("ignore", "Arrow output on a DB-API result")
                        reader = result.to_arrow_reader(_BATCH_ROWS)
                    return _capped(reader, max_bytes, self.memory_limit)
                with warnings.catch_warnings():
                    # a copy of the rows, as .df() makes one: the result is what is printed
                    warnings.filterwarnings("ignore", "Arrow output on a DB-API result")
                    return result.to_arrow_table()
            except duckdb.OutOfMemoryException as exc:
                first = str(exc).strip().splitlines()[0]
                raise QueryLimitError(
                    f"the query needed more memory than its limit of "
                    f"{self.memory_limit or 'DuckDB default'} (raise it with --memory-limit, "
                    f"e.g. --memory-limit 8GB): {first}"
                ) from None
            except (duckdb.Error, RuntimeError) as exc:
                # Interrupted inside a scan of an Arrow dataset, DuckDB reports it as another
                # error ("Query interrupted" in an internal or invalid-input one, or as Python's
                # own RuntimeError: each seen on a loaded machine): whatever DuckDB raised after
                # our interrupt is the timeout, and a RuntimeError only when it says so.
                ours = isinstance(exc, duckdb.Error) or "interrupted" in str(exc).lower()
                if not (isinstance(exc, duckdb.InterruptException) or (fired.is_set() and ours)):
                    raise
                raise QueryLimitError(
                    f"the query was stopped after its timeout of {timeout_s:g} s "
                    "(give it longer with --timeout SECONDS)"
                ) from None
            finally:
                if timer is not None:
                    # joined: a timer thread left to wind down holds the connection, and a
                    # connection freed on that thread at interpreter exit aborts the process
                    done.set()
                    timer.join()

    def close(self) -> None:
        _OPEN.pop(id(self), None)
        if self._con is not None:
            self._con.close()
            self._con = None


_BATCH_ROWS = 2048
"""Rows per batch of a capped result (one DuckDB vector)."""


def _capped(reader: pa.RecordBatchReader, max_bytes: int, limit: str | None) -> pa.Table:
    """The reader's batches as one table, refused once they hold more than max_bytes."""
    batches, held = [], 0
    for batch in reader:
        held += batch.nbytes
        if held > max_bytes:
            reader.close()
            raise QueryLimitError(
                f"the query's result is larger than its limit of {limit or max_bytes} "
                "(narrow it: LIMIT, fewer columns; or raise --memory-limit)"
            )
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)


_CATALOG = re.compile(r"\b(show|describe|summarize|information_schema|duckdb_\w+|pg_\w+)\b", re.I)
"""SQL that lists or describes what exists: every view must be there to be listed."""


def _column_sql(f: pa.Field, have: set[str], renamed: dict[str, list[str]]) -> str:
    """A view's column: the file column; for a renamed one, the first of its names (new, then
    old) that holds a value; a column the files lack, null of its type."""
    if f.name in renamed:
        names = ", ".join(f'"{c}"' for c in renamed[f.name])
        return f'COALESCE({names}) AS "{f.name}"'
    if f.name in have:
        return f'"{f.name}"'
    return f'CAST(NULL AS {_DUCK_TYPES.get(f.type, "VARCHAR")}) AS "{f.name}"'


def _comment_columns(con, table: str) -> None:
    """Each column's description, [unit] and values as DuckDB's column comment (store/
    dictionary.py): ``duckdb_columns().comment`` answers what a column is."""
    for col in columns(table):
        if col.comment:
            con.execute(f'COMMENT ON COLUMN {table}."{col.name}" IS {sql_literal(col.comment)}')


def _named_tables(sql: str) -> frozenset[str] | None:
    """The views `sql` can read: those it names as a word (quoted or not), or all of them
    (None) when it asks the catalog what exists."""
    if _CATALOG.search(sql):
        return None
    words = {w.lower() for w in re.findall(r"\w+", sql)}
    return frozenset(t for t in view_tables() if t in words)


_EXPLAIN = re.compile(r"^\s*EXPLAIN\s+(ANALY[SZ]E\s+|\([^)]*\)\s*)?", re.I)


def check_read_only(sql: str) -> None:
    """Raise WarehouseError unless every statement of ``sql`` only reads (SELECT, or EXPLAIN of
    a SELECT: ``EXPLAIN ANALYZE`` runs what it explains). DuckDB's statement types, not a
    keyword scan: ``WITH``, ``FROM x``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE`` are SELECTs."""
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise WarehouseError(str(exc).strip().splitlines()[0]) from None
    for st in statements:
        kind = st.type.name
        if kind == "EXPLAIN":
            inner = _EXPLAIN.sub("", st.query, count=1)
            if inner != st.query:
                try:
                    check_read_only(inner)
                    continue
                except WarehouseError:
                    pass
        if kind != "SELECT":
            shown = " ".join(st.query.split())[:60]
            raise WarehouseError(
                f"the warehouse is read-only: only SELECT (and EXPLAIN of one) is accepted, "
                f"not {kind} ({shown})"
            )
