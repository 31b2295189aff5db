"""The warehouse: every table a Delta Lake table, a run landed whole, artifacts beside it.

One job: writing the warehouse (and reading one run back whole). Beside it in store/:
schemas.py (every table's schema, rows -> tables), delta.py (one table as a Delta table: the
commit of a run's rows and its retries), layout.py (names), query.py (the analysts' read-only
DuckDB views, mixed into :class:`Warehouse`), extra.py (comparisons / noise / cell_repeats),
maintain.py (compaction, checkpoints, vacuum), migrate.py and legacy.py (importing a warehouse
of the older hand-written layout).

Layout (``<root>`` is a local path or ``s3://bucket/prefix``; S3 settings: store/delta.py)::

    <root>/runs/           a Delta table: _delta_log/ + recipe_id=<r>/run_month=<YYYY-MM>/*.parquet
    <root>/cells/          …the same for cells, requests, comparisons, noise, cell_repeats
    <root>/artifacts/<run_id>/<name>               report.md, report.html, charts, GX results
    <root>/_quarantine/<table>/<run_id>/rows.jsonl + result.json   rows that failed validation

Landing (:meth:`Warehouse.land_run`): the rows are validated and converted first (nothing is
written on error); then, when the run is already in ``runs`` (landing again), its ``runs`` row
is deleted first, so the run is not listed while its tables change; then one commit per table
in a fixed order, ``cells``, ``requests``, ``runs`` LAST, each an overwrite of the run's rows
(predicate ``run_id = '<id>'``). Delta has no transaction across tables: a reader that starts
from ``runs`` (every query of this package, :meth:`read_run`) sees a run only once all its
tables are in, never half of it. A writer killed between two commits leaves rows of a run that
``runs`` does not list; the next landing of that run replaces them. Concurrent writers commit
through the table format's optimistic concurrency and never refuse each other (delta.py).

Stable API (used by the DAGs and the regressions code): ``Warehouse(root)``,
``land_run(run, cells, requests)``, ``read_run(run_id[, recipe_id])``, ``query(sql)``,
``has_run(run_id)``, ``delete_run(run_id)``, ``quarantine(run_id, table, rows, result)``,
``artifact_path(run_id, name)``, ``write_artifact(run_id, name, data)``,
``read_artifact(run_id, name)``; the schemas live in speedmatrix.store.schemas.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import posixpath
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from speedmatrix.store.delta import (
    arrow_dataset,
    check_partition_values,
    create_table,
    delete_rows,
    readable_log,
    replace_rows,
    sql_literal,
    storage_options,
)
from speedmatrix.store.layout import (
    ARTIFACTS,
    QUARANTINE,
    default_root,
    file_name,
    run_month_of,
)
from speedmatrix.store.query import WarehouseQueries
from speedmatrix.store.schemas import (
    EXTRA_TABLES,
    RUN_ON_CELLS,
    SCHEMA_VERSION,
    WarehouseError,
    _clean,
    build_table,
    renamed_columns,
    run_date_of,
    view_schema,
    view_tables,
)

LANDING_ORDER = ("cells", "requests", "runs")
"""The order a run's tables are committed in: ``runs`` last (see the module docstring)."""


def _rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def conform(table: pa.Table, schema: pa.Schema, name: str | None = None) -> pa.Table:
    """``table`` with exactly ``schema``'s columns in its order: a column a table written by an
    older version lacks is null; one we no longer have is left out; a renamed column
    (``name``: the table's; renames.COLUMNS) reads its old column where the new one is null."""
    n = table.num_rows
    cols = []
    renamed = renamed_columns(name, table.column_names) if name else {}
    for f in schema:
        if f.name in renamed:
            sources = [table.column(c).cast(f.type) for c in renamed[f.name]]
            cols.append(sources[0] if len(sources) == 1 else pc.coalesce(*sources))
        elif f.name in table.column_names:
            cols.append(table.column(f.name).cast(f.type))
        else:
            cols.append(pa.nulls(n, type=f.type))
    return pa.Table.from_arrays(cols, schema=schema)


class Warehouse(WarehouseQueries):
    """The warehouse at ``root`` (None -> :func:`default_root`): a local path or
    ``s3://bucket/prefix`` (the AWS environment says where and as whom: store/delta.py)."""

    def __init__(self, root: str | os.PathLike | None = None, memory_limit: str | None = None):
        root = os.fspath(root) if root is not None else default_root()
        if "://" in root:
            self.fs, self.base = pafs.FileSystem.from_uri(root)
            self.base = self.base.rstrip("/")
            self.root = root.rstrip("/")
        else:
            self.fs, self.base = pafs.LocalFileSystem(), os.path.abspath(root)
            self.root = root
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self.storage_options = storage_options(self.root)
        self.memory_limit = memory_limit
        self._con = None
        self._tables: dict[str, Any] = {}
        self._view_versions: dict[str, int | None] = {}
        self._lock = threading.RLock()
        self._extra_created = False
        # test hook: called with a step name during land_run ("built", "landed:cells",
        # "landed:requests", "landed:runs"); a test raises or kills the process there.
        self._fault: Callable[[str], None] | None = None

    def __repr__(self) -> str:
        return f"Warehouse({self.root!r})"

    # -- paths ------------------------------------------------------------------------------

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.base, *parts)

    def table_uri(self, table: str) -> str:
        """Where ``table``'s Delta table is: a path, or ``s3://bucket/prefix/<table>``."""
        if self.is_local:
            return self._join(table)
        return f"{self.root}/{table}"

    def _uri(self, path: str) -> str:
        if self.is_local:
            return path
        scheme = self.root.split("://", 1)[0]
        return f"{scheme}://{path.lstrip('/')}"

    # -- filesystem helpers (quarantine, artifacts) -------------------------------------------

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def _write_bytes(self, path: str, data: bytes) -> None:
        """Locally: write aside, then rename into place. On S3 a PUT is whole already."""
        if not self.is_local:
            with self.fs.open_output_stream(path) as out:
                out.write(data)
            return
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.fs.move(tmp, path)
        except BaseException:
            # a full disk (ENOSPC) must not leave a half-written file aside
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)
            raise

    def _read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as fh:
            return fh.read()

    def _fault_at(self, step: str) -> None:
        if self._fault is not None:
            self._fault(step)

    # -- the tables -------------------------------------------------------------------------

    def delta_table(self, table: str, refresh: bool = True):
        """``table``'s DeltaTable, opened once per Warehouse and brought to its newest version
        when ``refresh`` (which reads only the log entries written since); None while the table
        has no commit yet."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        uri = self.table_uri(table)
        with self._lock, readable_log(uri, table, self.storage_options):
            found = self._tables.get(table)
            if found is not None:
                if refresh:
                    found.update_incremental()
                return found
            try:
                found = DeltaTable(uri, storage_options=self.storage_options)
            except TableNotFoundError:
                return None
            self._tables[table] = found
            return found

    def forget(self, table: str) -> None:
        """Drop the opened ``table``: the next use opens it afresh (after maintenance)."""
        with self._lock:
            self._tables.pop(table, None)
            self._view_versions.pop(table, None)

    def read_table(
        self,
        table: str,
        filter_expr=None,
        columns: list[str] | None = None,
        prune: str | None = None,
    ):
        """Rows of ``table`` (current version) matching a pyarrow ``filter_expr``, conformed to
        the table's schema (:func:`conform`); an empty table while it has no commit.
        ``prune``: a SQL predicate (``run_id = 'x'``) that picks the files from the log's
        statistics before any file is opened (a filter alone opens every file's footer: 7.5 s
        for one run among 220,000, benchmarks/README.md)."""
        schema = view_schema(table)
        delta = self.delta_table(table)
        if delta is None:
            data = schema.empty_table()
        else:
            dataset = arrow_dataset(delta, prune)
            try:
                data = conform(dataset.to_table(filter=filter_expr), schema, table)
            except pa.ArrowNotImplementedError:
                # string and string_view files mixed (see arrow_dataset): read, then filter
                data = conform(dataset.to_table(), schema, table)
                if filter_expr is not None:
                    data = data.filter(filter_expr)
        return data.select(columns) if columns else data

    # -- landing ----------------------------------------------------------------------------

    def build_tables(
        self, run: dict, cells: list[dict], requests: list[dict]
    ) -> dict[str, pa.Table]:
        """Validate and convert one run's rows; raises WarehouseError, writes nothing."""
        if not isinstance(run, dict):
            raise WarehouseError("runs: the run must be a dict")
        run_id = run.get("run_id")
        if not isinstance(run_id, str) or not run_id.strip() or run_id != run_id.strip():
            raise WarehouseError(f"runs: run_id must be a non-empty string, got {run_id!r}")
        if run_id.startswith(".") or "\n" in run_id:
            raise WarehouseError(f"runs: run_id {run_id!r} cannot name a file")
        recipe_id = _clean(run.get("recipe_id"))
        if not isinstance(recipe_id, str) or not recipe_id.strip():
            raise WarehouseError(
                f"runs: recipe_id is required to land a run (it is the partition key), got "
                f"{recipe_id!r}"
            )
        landed_at = dt.datetime.now(dt.UTC)
        run_date = run_date_of(run) or landed_at.date()
        run_month = run_month_of(run_date)
        fixed_run = {
            "run_date": run_date,
            "run_month": run_month,
            "landed_at": landed_at,
            "schema_version": SCHEMA_VERSION,
        }
        fixed = {
            "run_id": run_id,
            "recipe_id": recipe_id,
            "run_date": run_date,
            "run_month": run_month,
            "schema_version": SCHEMA_VERSION,
        }
        # every cell row carries the run's commit, host, trigger and model, and a prefill row
        # its figure under its own name (schemas.RUN_ON_CELLS, prompt_tok_s)
        on_cells = {k: _clean(run.get(k)) for k in RUN_ON_CELLS}
        cell_rows = [
            {
                **c,
                "prompt_tok_s": c.get("total_tok_s") if c.get("phase") == "prefill" else None,
            }
            for c in cells
        ]
        return {
            "runs": build_table("runs", [run], fixed_run),
            "cells": build_table("cells", cell_rows, {**fixed, **on_cells}),
            "requests": build_table("requests", list(requests), fixed),
        }

    def land_table(self, table: str, run_id: str, data: pa.Table) -> None:
        """Replace ``run_id``'s rows of ``table`` with ``data`` in one commit (delta.py)."""
        replace_rows(self.table_uri(table), data, f"run_id = {sql_literal(run_id)}", self.root)

    def land_run(self, run: dict, cells: list[dict], requests: list[dict]) -> None:
        """Land one run whole and idempotently (see the module docstring).

        ``run``: RUN_FIELDS keys (run_id required); ``cells``: CELL_FIELDS keys; ``requests``:
        REQUEST_FIELDS keys. run_id / recipe_id / run_date / run_month / schema_version of
        cells and requests are filled in. Raises WarehouseError (a ValueError) naming the
        table, row and column on rows that do not fit, or a partition value no filesystem
        takes: then nothing is written."""
        tables = self.build_tables(run, cells, requests)
        for data in tables.values():
            check_partition_values(data)
        run_id = run["run_id"]
        self._fault_at("built")
        with self._lock:
            if self.has_run(run_id):
                # landing again: the run leaves `runs` first, so no reader sees it mixed
                delete_rows(self.table_uri("runs"), f"run_id = {sql_literal(run_id)}", self.root)
                self._fault_at("unlisted")
            for table in LANDING_ORDER:
                self.land_table(table, run_id, tables[table])
                self._fault_at(f"landed:{table}")
            self._create_extra_tables()

    def _create_extra_tables(self) -> None:
        """The extra tables (comparisons, noise, cell_repeats), empty, where none is yet: every
        table exists from the first landing, once per Warehouse."""
        if self._extra_created:
            return
        for table in EXTRA_TABLES:
            if self.delta_table(table, refresh=False) is None:
                create_table(self.table_uri(table), view_schema(table), self.root)
        self._extra_created = True

    def delete_run(self, run_id: str, recipe_id: str | None = None) -> bool:
        """Remove a run from runs, cells and requests (``runs`` first: once it is gone the run
        is no longer listed; its artifacts and extra rows stay). True if it was there."""
        with self._lock:
            found = self.has_run(run_id, recipe_id)
            for table in ("runs", "cells", "requests"):
                delete_rows(self.table_uri(table), f"run_id = {sql_literal(run_id)}", self.root)
            return found

    # -- reading ----------------------------------------------------------------------------

    @staticmethod
    def _run_filter(run_id: str, recipe_id: str | None):
        """(pyarrow filter, SQL file-pruning predicate) of one run's rows."""
        import pyarrow.dataset as ds

        where = ds.field("run_id") == run_id
        prune = f"run_id = {sql_literal(run_id)}"
        if recipe_id is not None:
            where = (ds.field("recipe_id") == recipe_id) & where
            prune = f"recipe_id = {sql_literal(recipe_id)} AND {prune}"
        return where, prune

    def has_run(self, run_id: str, recipe_id: str | None = None) -> bool:
        """Is ``run_id`` listed in ``runs`` (landed whole)?"""
        where, prune = self._run_filter(run_id, recipe_id)
        return self.read_table("runs", where, ["run_id"], prune).num_rows > 0

    def read_run(
        self, run_id: str, recipe_id: str | None = None
    ) -> tuple[dict, list[dict], list[dict]]:
        """``(run, cells, requests)`` of one landed run, as dicts keyed by column name (the
        records.py fields plus run_id, recipe_id, run_date, run_month, schema_version;
        landed_at on the run), cells and requests in the order they were landed. Timestamps
        are timezone-aware UTC datetimes, missing values None. KeyError if ``runs`` does not
        list the run. ``recipe_id``, when known, prunes to one recipe's partition."""
        where, prune = self._run_filter(run_id, recipe_id)
        runs = self.read_table("runs", where, prune=prune)
        if runs.num_rows == 0:
            raise KeyError(f"run {run_id!r} is not in the warehouse {self.root}")
        out = {t: _rows(self.read_table(t, where, prune=prune)) for t in ("cells", "requests")}
        return _rows(runs)[0], out["cells"], out["requests"]

    # -- quarantine and artifacts -----------------------------------------------------------

    def quarantine(self, run_id: str, table: str, rows: list[dict], result: dict) -> str:
        """Keep rows that failed validation out of the tables: ``_quarantine/<table>/<run_id>/``
        gets ``rows.jsonl`` (the rows as given) and ``result.json`` (the validation result).
        Quarantining the same run and table again replaces both. Returns the directory."""
        if table not in view_tables():
            raise WarehouseError(f"quarantine: unknown table {table!r}")
        where = self._join(QUARANTINE, table, file_name(run_id)[: -len(".parquet")])
        lines = "".join(
            json.dumps(_clean_json(r), default=str, sort_keys=True) + "\n" for r in rows
        )
        self._write_bytes(posixpath.join(where, "rows.jsonl"), lines.encode())
        doc = {
            "run_id": run_id,
            "table": table,
            "rows": len(rows),
            "result": result,
            "quarantined_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        self._write_bytes(
            posixpath.join(where, "result.json"),
            json.dumps(_clean_json(doc), default=str, indent=2, sort_keys=True).encode(),
        )
        return self._uri(where)

    def read_quarantine(self, run_id: str, table: str) -> tuple[list[dict], dict] | None:
        where = self._join(QUARANTINE, table, file_name(run_id)[: -len(".parquet")])
        try:
            lines = self._read_bytes(posixpath.join(where, "rows.jsonl")).decode().splitlines()
            doc = json.loads(self._read_bytes(posixpath.join(where, "result.json")))
        except (FileNotFoundError, OSError):
            return None
        return [json.loads(ln) for ln in lines if ln], doc

    def _artifact(self, run_id: str, name: str) -> str:
        parts = name.replace("\\", "/").split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise WarehouseError(f"artifact name must be a relative path, got {name!r}")
        return self._join(ARTIFACTS, file_name(run_id)[: -len(".parquet")], *parts)

    def artifact_path(self, run_id: str, name: str) -> str:
        """Where artifact ``name`` of ``run_id`` lives (a local path, or a URI)."""
        return self._uri(self._artifact(run_id, name))

    def write_artifact(self, run_id: str, name: str, data: bytes | str) -> str:
        """Write (atomically: aside, then rename) an artifact next to the run; returns its path."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        self._write_bytes(self._artifact(run_id, name), data)
        return self.artifact_path(run_id, name)

    def read_artifact(self, run_id: str, name: str) -> bytes:
        return self._read_bytes(self._artifact(run_id, name))


def _clean_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_json(v) for v in value]
    value = _clean(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return value
