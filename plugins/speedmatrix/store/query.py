"""The analysts' read-only SQL over the warehouse: DuckDB views of every table.

One job: reading with SQL. :class:`WarehouseQueries` is the part of :class:`Warehouse
<speedmatrix.store.warehouse.Warehouse>` that defines the DuckDB views (``runs``, ``cells``,
``requests`` and the extra tables, as globs or as pyarrow datasets that prune by path), keeps
them current after landings, and runs SQL that :func:`check_read_only` accepts. The landing,
recovery and locking stay in store/warehouse.py; the views read only whole files, so they
never need the writers' lock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import os
import posixpath
import re
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from speedmatrix.store.layout import STAGING
from speedmatrix.store.schemas import (
    SCHEMAS,
    TABLES,
    WarehouseError,
    extra_schema,
    view_schema,
    view_tables,
)

VIEW_MAX_AGE_S = 60.0
"""Datasets behind the query views are discovered again at least this often."""
DEFAULT_VIEWS = "dataset"
"""How :meth:`Warehouse.query` defines its views (see :meth:`Warehouse.connect`)."""
_HIVE_TYPES = "{'recipe_id': VARCHAR, 'run_month': VARCHAR}"


class WarehouseQueries:
    """The query layer of a Warehouse (mixed into it: the views need its filesystem, its
    paths and its reader's recovery, and callers keep one object)."""

    fs: pafs.FileSystem
    base: str
    is_local: bool
    views: str
    _con: Any
    _view_state: dict[str, Any]
    _lock: threading.RLock

    def _list(self, path: str, recursive: bool = True) -> list[pafs.FileInfo]:
        raise NotImplementedError

    def _join(self, *parts: str) -> str:
        raise NotImplementedError

    def table_dir(self, table: str) -> str:
        raise NotImplementedError

    def _recover_if_free(self) -> None:
        raise NotImplementedError

    def connect(self, views: str | None = None):
        """A new DuckDB connection with views ``runs``, ``cells``, ``requests`` over this
        warehouse, and ``comparisons``, ``noise``, ``cell_repeats`` (:func:`view_tables`; an
        empty view of the right columns while a table has no file). ``views``: ``"glob"`` (DuckDB's own Parquet reader over a glob with hive
        partitioning: what a plain DuckDB user writes; lists every file at every query) or
        ``"dataset"`` (:meth:`dataset`: the files listed once and registered as pyarrow
        datasets whose fragments know their recipe_id, run_month, run_date and run_id; DuckDB
        pushes filters into them, so a filter on any of those opens only the matching files
        and nothing is listed again until a landing; the only choice for non-local
        filesystems). Default: this Warehouse's ``views``."""
        import duckdb

        con = duckdb.connect()
        con.execute("SET enable_progress_bar = false")
        with contextlib.suppress(Exception):
            con.execute("SET parquet_metadata_cache = true")
        self._lock_down(con)
        self._define_views(con, views or self.views)
        return con

    def _lock_down(self, con) -> None:
        """Analysts' SQL reads the warehouse and nothing else: no file outside it, no
        database attached, no extension installed or loaded, and the settings locked so a
        query cannot undo this. A local warehouse is the one allowed directory (the glob
        views read it); a remote one is read through pyarrow datasets registered as views,
        so DuckDB itself needs no file access at all. Writing into the warehouse is refused
        by :func:`check_read_only` (DuckDB's own settings still allow ``COPY … TO`` there)."""
        allowed = [os.path.join(self.base, "")] if self.is_local else []
        con.execute("SET allowed_directories = ?", [allowed])
        con.execute("SET enable_external_access = false")
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET lock_configuration = true")

    def _has_files(self, table: str) -> bool:
        if self.is_local:
            # run_month=: an extra table may still hold files of its older run_date= layout,
            # which the views leave out (speedmatrix.store.extra reads them)
            pattern = posixpath.join(
                glob.escape(self.table_dir(table)), "*", "run_month=*", "*.parquet"
            )
            return next(iter(glob.iglob(pattern)), None) is not None
        return any(
            i.type == pafs.FileType.File and i.path.endswith(".parquet")
            for i in self._list(self.table_dir(table))
        )

    def table_files(self, table: str) -> list[tuple[str, str, str, dt.date, str]]:
        """Every data file of ``table`` as (path, recipe_id, run_month, run_date, run_id),
        read from the directory and file names alone (no file is opened)."""
        out = []
        base = self.table_dir(table)
        if self.is_local:
            paths = []
            with contextlib.suppress(FileNotFoundError):
                for r in os.scandir(base):
                    if not r.is_dir():
                        continue
                    for m in os.scandir(r.path):
                        if m.is_dir():
                            paths += [f.path for f in os.scandir(m.path) if f.is_file()]
        else:
            paths = [i.path for i in self._list(base) if i.type == pafs.FileType.File]
        for path in paths:
            parts = path[len(base) + 1 :].split("/")
            if len(parts) != 3 or not parts[2].endswith(".parquet") or len(parts[2]) < 20:
                continue
            recipe, month, name = parts
            if not recipe.startswith("recipe_id=") or not month.startswith("run_month="):
                continue
            try:
                day = dt.date.fromisoformat(name[:10])
            except ValueError:
                continue
            if name[10] != "_":
                continue
            out.append(
                (
                    path,
                    urllib.parse.unquote(recipe[len("recipe_id=") :]),
                    urllib.parse.unquote(month[len("run_month=") :]),
                    day,
                    urllib.parse.unquote(name[11 : -len(".parquet")]),
                )
            )
        return out

    def dataset(self, table: str):
        """``table`` as a pyarrow dataset of the full schema, one fragment per file, each
        fragment knowing its recipe_id, run_month, run_date and run_id from its path: a filter
        on any of them (one run, one date, one recipe's months) skips the other files without
        opening them. Missing partition columns are filled from the path; columns an older
        file lacks are null."""
        import pyarrow.dataset as ds

        # files are small (one run): read each whole at once instead of pre-buffering column
        # chunk ranges (measured ~25% faster on the benchmark warehouse)
        fmt = ds.ParquetFileFormat(
            default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False)
        )
        fragments = []
        partitions: dict[tuple[str, str], Any] = {}
        run_date, run_id_field = ds.field("run_date"), ds.field("run_id")
        dates: dict[dt.date, Any] = {}
        for path, recipe, month, day, run_id in self.table_files(table):
            part = partitions.get((recipe, month))
            if part is None:
                part = (ds.field("recipe_id") == recipe) & (ds.field("run_month") == month)
                partitions[(recipe, month)] = part
            on_day = dates.get(day)
            if on_day is None:
                on_day = dates[day] = run_date == pa.scalar(day, pa.date32())
            known = part & on_day & (run_id_field == run_id)
            fragments.append(
                fmt.make_fragment(path, filesystem=self.fs, partition_expression=known)
            )
        return ds.FileSystemDataset(fragments, view_schema(table), fmt, self.fs)

    def _signature(self) -> float | None:
        """Changes whenever a landing or a delete starts or ends, in any process: both create
        and remove a directory in ``_staging/``, which moves that directory's mtime."""
        if not self.is_local:
            return None
        try:
            return os.stat(self._join(STAGING)).st_mtime_ns
        except FileNotFoundError:
            return 0

    def _define_views(self, con, mode: str) -> None:
        if mode not in ("glob", "dataset"):
            raise WarehouseError(f"views must be 'glob' or 'dataset', got {mode!r}")
        if not self.is_local:
            mode = "dataset"
        state = {"mode": mode, "signature": self._signature(), "at": time.monotonic()}
        for table in view_tables():
            has = self._has_files(table)
            state[table] = has
            if not has:
                con.register(f"_{table}_empty", view_schema(table).empty_table())
                con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM _{table}_empty")
            elif mode == "glob":
                pattern = posixpath.join(
                    self.table_dir(table), "*", "run_month=*", "*.parquet"
                ).replace("'", "''")
                source = (
                    f"read_parquet('{pattern}', hive_partitioning = true, "
                    f"hive_types = {_HIVE_TYPES}, filename = true)"
                )
                con.execute(
                    f"CREATE OR REPLACE VIEW {table} AS SELECT {_glob_columns(table)} FROM {source}"
                )
            else:
                con.register(f"_{table}_dataset", self.dataset(table))
                con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM _{table}_dataset")
        self._view_state = state

    def _views_stale(self) -> bool:
        state = self._view_state
        if not all(state[t] for t in TABLES):
            return True  # a table that had no file may have one now
        if state["mode"] == "glob":
            if all(state[t] for t in view_tables()):
                return False  # DuckDB lists the files again at every query
            # an extra table without a file (many warehouses never get one): look again only
            # after a landing, not at every query
            return self._signature() != state["signature"]
        if not self.is_local or time.monotonic() - state["at"] > VIEW_MAX_AGE_S:
            return True
        return self._signature() != state["signature"]

    def query(self, sql: str, params: Iterable[Any] | None = None):
        """Run SQL over the views (``runs``, ``cells``, ``requests`` and the extra tables, see
        :meth:`connect`); returns a pandas DataFrame.

        The connection is kept between calls (DuckDB's Parquet metadata cache stays warm).
        Views follow this Warehouse's ``views`` mode (see :meth:`connect`); datasets are
        discovered again when a landing happened since (any process; see ``_signature``),
        after VIEW_MAX_AGE_S, and at every query on a non-local filesystem."""
        check_read_only(sql)
        with self._lock:
            self._recover_if_free()
            if self._con is None:
                self._con = self.connect()
            elif self._views_stale():
                self._define_views(self._con, self._view_state["mode"])
            # the connection itself, not a cursor: registered Arrow objects (empty tables,
            # pyarrow datasets) are visible to it only
            result = self._con.execute(sql, list(params) if params is not None else None)
            return result.df()

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None


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


def _glob_columns(table: str) -> str:
    """The select list of a glob view: the core tables as read (hive columns last); an extra
    table in view_schema's order, run_date from the file name when its files lack it."""
    if table in SCHEMAS:
        return "* EXCLUDE (filename)"
    stored = set(extra_schema(table).names)
    cols = []
    for name in view_schema(table).names:
        if name == "run_date" and name not in stored:
            cols.append("CAST(left(parse_filename(filename), 10) AS DATE) AS run_date")
        else:
            cols.append(f'"{name}"')
    return ", ".join(cols)
