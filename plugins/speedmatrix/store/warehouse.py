"""The Parquet warehouse: table schemas, atomic and idempotent landing, the analyst query layer.

Layout (``<root>`` is a local path or any URI pyarrow's filesystems open, e.g. ``s3://bucket/wh``)::

    <root>/runs/recipe_id=<recipe>/run_month=<YYYY-MM>/<run_date>_<run_id>.parquet      one row
    <root>/cells/recipe_id=<recipe>/run_month=<YYYY-MM>/<run_date>_<run_id>.parquet     a row per cell
    <root>/requests/recipe_id=<recipe>/run_month=<YYYY-MM>/<run_date>_<run_id>.parquet  a row per request
    <root>/artifacts/<run_id>/<name>               report.md, report.html, charts, GX results
    <root>/_quarantine/<table>/<run_id>/rows.jsonl + result.json   rows that failed validation
    <root>/_staging/<txn>/                          landings in progress (never read by queries)

Why this layout: the three questions analysts ask are "one cell of one recipe across a year of
nightly runs" (prunes to one ``recipe_id=`` directory and twelve ``run_month=`` ones), "one
run's whole matrix" (one file, named after the run id) and "every recipe on one date" (prunes
to one ``run_month=`` directory per recipe; then a glob on the date in front of the file
names, or the ``run_date`` column's Parquet statistics, skips the other days). Months, not
days: every reader lists the
directories before it prunes, and 22,000 one-file day directories (three years of nightly
runs for 20 recipes) cost DuckDB seconds to list where 720 month directories cost little
(benchmarks/README.md). Hive-style directories are understood by DuckDB, pyarrow, pandas and
Polars without this package. The partition columns ``recipe_id`` and ``run_month`` live in
the directory names only, as the hive convention has it (stored in the files too, pandas' and
pyarrow's discovery refuse the clash of a string column with a dictionary-typed partition
field). ``recipe_id`` is URL-encoded in the directory name (``cpu%2Ftiny%2Fllama-tiny``; the
readers decode it). Partition values are never null (pandas cannot read null hive partitions):
``recipe_id`` is required to land a run (ingested pages get a derived
``published/<hardware>/<model>`` id); ``run_date`` is the UTC date of ``started_at`` (else
``finished_at``, else, for an ingested page that has no date, the day it was landed) and
``run_month`` its ``YYYY-MM``.
Exactly one file per table per run (the requests file is skipped when a run has no requests),
``<run_date>_<run_id>.parquet`` (the run id URL-encoded where a path needs it): the file count
grows by at most three per run, never with the number of cells.

Landing (:meth:`Warehouse.land_run`) is a small redo-log transaction:

1. validate and convert every row against the explicit schema (nothing is written on error);
2. write the files under ``_staging/<txn>/``;
3. write ``_staging/<txn>/COMMIT.json`` (the moves to make and the older copies of the run to
   delete), by writing it aside and renaming it: this rename is the commit point;
4. rename the files into place (cells, requests, then runs) and delete older copies of the run;
5. remove the staging directory.

A failure or kill before step 3 leaves the tables exactly as they were (the staging directory
is garbage, removed later). A kill during step 4 leaves a committed transaction that the next
:meth:`Warehouse.land_run`, :meth:`read_run`, :meth:`query` or :meth:`recover` rolls forward,
so readers through this class always see the old or the new run, whole. (A plain DuckDB reader
that bypasses this class could see the renames of one landing half done for the few
milliseconds between them, or until the next recovery after a kill in that window.) Each
rename replaces one whole file (POSIX rename; an S3 object PUT), so no reader ever sees a
half-written file. Landing the same run again replaces it: same paths, an older copy under another date of
the same recipe deleted (a run id belongs to one recipe: to move a run to another recipe,
``delete_run`` it first), and duplicate cell / request keys are refused.

Several processes, one warehouse: steps 3-5 of a landing, a delete, and every recovery run
under ``<root>/_warehouse.lock`` held exclusively (``flock``), so a recovery never rolls
forward a landing whose own process is still moving its files (it did: FileNotFoundError in
landings that had in fact landed). Staging (step 2, the slow part) runs outside the lock, in
the landing's own directory. Readers never wait for the lock: each file appears by one rename
and a run's runs row last, so what they read is whole without it; a reader recovers only when
it gets the lock at once (nobody is landing), and skips recovery otherwise (the holder recovers
first thing) or when it cannot open the lock file (a read-only mount). On a filesystem other
than a local or mounted one (``s3://``) there is no such lock, and one writer at a time is
the rule: a landing refuses when it finds another live landing (:meth:`Warehouse._claim`).

Stable API (used by the DAGs and the regressions code): ``Warehouse(root)``,
``land_run(run, cells, requests)``, ``read_run(run_id[, recipe_id])``, ``query(sql)``,
``has_run(run_id)``, ``delete_run(run_id)``, ``find_run_files(run_id)``, ``recover()``,
``quarantine(run_id, table, rows, result)``, ``artifact_path(run_id, name)``,
``write_artifact(run_id, name, data)``, ``read_artifact(run_id, name)``; the schemas
``RUNS_SCHEMA``, ``CELLS_SCHEMA``, ``REQUESTS_SCHEMA`` and ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import glob
import json
import math
import os
import posixpath
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from speedmatrix.records import (
    CELL_FIELDS,
    PHASES,
    REQUEST_FIELDS,
    RUN_FIELDS,
    STATUSES,
    TRIGGERS,
    Field,
)

SCHEMA_VERSION = 2
"""Bumped when a table's columns change; stored in every row (``schema_version``).
1: the first tables; 2: cells gained ``warmup_s`` (issue #19; older files read it as null)."""

TABLES = ("runs", "cells", "requests")
"""The tables land_run writes. Other code lands more beside them, in the same layout
(speedmatrix.analysis.compare.EXTRA_TABLES: comparisons, noise, cell_repeats): :func:`view_tables`."""
PARTITION_KEYS = ("recipe_id", "run_month")
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
RUN_STATUSES = ("success", "failed", "partial")
STAGING = "_staging"
QUARANTINE = "_quarantine"
ARTIFACTS = "artifacts"
VIEW_MAX_AGE_S = 60.0
"""Datasets behind the query views are discovered again at least this often."""
DEFAULT_VIEWS = "dataset"
"""How :meth:`Warehouse.query` defines its views (see :meth:`Warehouse.connect`)."""
ABANDONED_AFTER_S = 3600.0
"""An uncommitted staging directory older than this is a crashed landing and is removed."""
WRITER_LIVE_S = 600.0
"""Non-local filesystems (s3://): a staging directory with a file younger than this is another
writer's landing in progress (a landing stages, commits and moves in seconds); older, its writer
is taken for dead and recovery may roll it forward."""
LOCK_FILE = "_warehouse.lock"
"""``<root>/_warehouse.lock``: the writers' cross-process lock on a local or shared filesystem
(:meth:`Warehouse._writer_lock`)."""

_PA_TYPES = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}


class WarehouseError(ValueError):
    """Rows that do not fit the tables, or a warehouse that cannot be used; nothing landed."""


def _field(f: Field) -> pa.Field:
    return pa.field(f.name, _PA_TYPES[f.type], nullable=f.nullable, metadata={"doc": f.doc})


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
CELLS_SCHEMA = pa.schema(
    [
        _field(_RUN_ID),
        *(_field(f) for f in CELL_FIELDS),
        _field(_RECIPE),
        _RUN_DATE,
        _RUN_MONTH,
        _SCHEMA_VERSION,
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
_DERIVED = {"run_id", "recipe_id", "run_date", "run_month", "schema_version", "landed_at"}
_KEYS = {
    "cells": ("phase", "context_tokens", "concurrency"),
    "requests": ("phase", "context_tokens", "concurrency", "request_index"),
}
_HIVE_TYPES = "{'recipe_id': VARCHAR, 'run_month': VARCHAR}"


def default_root() -> str:
    """``$SPEEDMATRIX_WAREHOUSE``, else ``warehouse/`` in the checkout (else in the cwd)."""
    env = os.environ.get("SPEEDMATRIX_WAREHOUSE")
    if env:
        return env
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists():
        return str(checkout / "warehouse")
    return str(Path.cwd() / "warehouse")


def partition_value(value: Any) -> str:
    """The directory-name form of a partition value (URL-encoded; null -> hive default)."""
    if value is None:
        return NULL_PARTITION
    if isinstance(value, dt.date):
        return value.isoformat()
    return urllib.parse.quote(str(value), safe="-_.~+=,@")


def partition_of(path: str) -> dict[str, Any]:
    """``…/recipe_id=cpu%2Ftiny/run_month=2026-03/x.parquet`` -> the decoded partition values."""
    out: dict[str, Any] = {}
    for segment in path.replace("\\", "/").split("/")[-3:-1]:
        key, sep, raw = segment.partition("=")
        if not sep or key not in PARTITION_KEYS:
            continue
        out[key] = None if raw == NULL_PARTITION else urllib.parse.unquote(raw)
    return out


def view_tables() -> tuple[str, ...]:
    """Every table :meth:`Warehouse.connect` defines a view of: the three core tables, then the
    extra ones other code lands beside them (speedmatrix.analysis.compare.EXTRA_TABLES)."""
    from speedmatrix.analysis.compare import EXTRA_TABLES

    return (*TABLES, *EXTRA_TABLES)


def view_schema(table: str) -> pa.Schema:
    """The columns of ``table``'s view: a core table's schema; an extra table's file columns
    plus ``run_date`` and ``run_month`` (from its path) where its files lack them."""
    if table in SCHEMAS:
        return SCHEMAS[table]
    from speedmatrix.analysis.compare import extra_schema

    schema = extra_schema(table)
    for f in (_RUN_DATE, _RUN_MONTH):
        if f.name not in schema.names:
            schema = schema.append(f)
    return schema


def run_month_of(run_date: dt.date) -> str:
    return f"{run_date.year:04d}-{run_date.month:02d}"


def partition_dirs(recipe_id: str, run_date: dt.date) -> str:
    """``recipe_id=<encoded>/run_month=<YYYY-MM>``: where a run's files go in every table
    (also for tables other code lands beside runs / cells / requests)."""
    return (
        f"recipe_id={partition_value(recipe_id)}/"
        f"run_month={partition_value(run_month_of(run_date))}"
    )


def data_file_name(run_id: str, run_date: dt.date) -> str:
    """``<run_date>_<run_id>.parquet``: the name of a run's file in runs / cells / requests.
    The date in front lets a plain glob pick one day's runs
    (``cells/*/run_month=2026-03/2026-03-14_*.parquet``) without opening the month's others."""
    return f"{run_date.isoformat()}_{file_name(run_id)}"


def _is_data_file_of(basename: str, name: str) -> bool:
    """Is ``basename`` ``<YYYY-MM-DD>_<name>``?"""
    return (
        len(basename) == 11 + len(name)
        and basename[10] == "_"
        and basename.endswith(name)
        and basename[4] == "-"
        and basename[7] == "-"
    )


def file_name(run_id: str) -> str:
    """``<run_id>.parquet`` with characters unsafe in a path segment URL-encoded."""
    return urllib.parse.quote(run_id, safe="-_.~+=,@:") + ".parquet"


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


def build_table(table: str, rows: list[dict], fixed: dict[str, Any]) -> pa.Table:
    """Rows (dicts keyed by the records.py field names) -> a pyarrow table of ``table``'s
    schema, with ``fixed`` columns (run_id, partition keys, schema_version…) set on every row.

    Refuses unknown keys, missing non-nullable values, values of the wrong type, unknown
    phase / status / trigger values and duplicate cell or request keys, naming the table, the
    row and the column. Missing nullable keys are null."""
    schema = SCHEMAS[table]
    names = set(schema.names)
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
    enums = {"phase": PHASES, "status": STATUSES if table != "runs" else RUN_STATUSES}
    if table == "runs":
        enums["trigger"] = TRIGGERS
    for name, allowed in enums.items():
        if name not in names:
            continue
        for i, v in enumerate(out.column(name).to_pylist()):
            if v is not None and v not in allowed:
                raise WarehouseError(f"{table} row {i}: {name} {v!r} is not one of {allowed}")
    if table in _KEYS and len(rows) > 1:
        keys = list(zip(*(out.column(k).to_pylist() for k in _KEYS[table]), strict=True))
        seen: dict[tuple, int] = {}
        for i, key in enumerate(keys):
            if key in seen:
                raise WarehouseError(
                    f"{table} rows {seen[key]} and {i}: duplicate {dict(zip(_KEYS[table], key, strict=True))}"
                )
            seen[key] = i
    return out


def file_schema(table: str) -> pa.Schema:
    """The columns stored in a file of ``table``: the table's schema without the partition
    columns, which live in the directory names only (the hive convention: a column in both
    places makes pandas' and pyarrow's dataset discovery fail on the type clash)."""
    schema = SCHEMAS[table]
    for key in PARTITION_KEYS:
        schema = schema.remove(schema.get_field_index(key))
    return schema


def without_partition_columns(table: pa.Table) -> pa.Table:
    """What goes into a file of runs / cells / requests: the partition columns are dropped
    (they are the directory names)."""
    present = [k for k in PARTITION_KEYS if k in table.column_names]
    return table.drop_columns(present) if present else table


def write_parquet(table: pa.Table, path: str, filesystem: pafs.FileSystem) -> None:
    """How every warehouse file is written (snappy, statistics, one row group); writes the
    table as given (land_run passes it through :func:`without_partition_columns` first)."""
    pq.write_table(
        table,
        path,
        filesystem=filesystem,
        compression="snappy",
        write_statistics=True,
        row_group_size=max(1, table.num_rows),
    )


def _rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


class Warehouse:
    """The warehouse at ``root`` (None -> :func:`default_root`): a local path or a URI that
    ``pyarrow.fs.FileSystem.from_uri`` opens (``s3://bucket/prefix``…). ``filesystem`` may be
    given instead of a URI scheme (root is then a path inside it; used by tests)."""

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        filesystem: pafs.FileSystem | None = None,
        views: str = DEFAULT_VIEWS,
    ):
        root = os.fspath(root) if root is not None else default_root()
        if filesystem is not None:
            self.fs, self.base = filesystem, root.rstrip("/") or "/"
        elif "://" in root:
            self.fs, self.base = pafs.FileSystem.from_uri(root)
            self.base = self.base.rstrip("/")
        else:
            self.fs, self.base = pafs.LocalFileSystem(), os.path.abspath(root)
        self.root = root
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self.views = views
        self._con = None
        self._view_state: dict[str, Any] = {}
        self._lock = threading.RLock()
        # test hook: called with a step name during land_run ("staged:cells", "committed",
        # "moved:runs", "deleted"…); a test raises or kills the process there.
        self._fault: Callable[[str], None] | None = None

    def __repr__(self) -> str:
        return f"Warehouse({self.root!r})"

    # -- paths ------------------------------------------------------------------------------

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.base, *parts)

    def table_dir(self, table: str) -> str:
        return self._join(table)

    def file_path(self, table: str, run_id: str, recipe_id: str, run_date: dt.date) -> str:
        """Where a run's file of ``table`` lives."""
        return self._join(
            table, partition_dirs(recipe_id, run_date), data_file_name(run_id, run_date)
        )

    def _uri(self, path: str) -> str:
        if self.is_local:
            return path
        if "://" in self.root:
            scheme = self.root.split("://", 1)[0]
            return f"{scheme}://{path.lstrip('/')}"
        return path

    # -- filesystem helpers -----------------------------------------------------------------

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def _write_bytes(self, path: str, data: bytes) -> None:
        """Write aside, then rename into place."""
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, path)

    def _read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as fh:
            return fh.read()

    def _list(self, path: str, recursive: bool = True) -> list[pafs.FileInfo]:
        try:
            return self.fs.get_file_info(
                pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
            )
        except FileNotFoundError:
            return []

    def _delete_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.delete_dir(path)

    def _fault_at(self, step: str) -> None:
        if self._fault is not None:
            self._fault(step)

    def _glob(self, directory: str, depth: int, name: str) -> list[str]:
        """Data files of the run whose file_name is ``name`` (``<date>_<name>``), ``depth``
        directory levels below ``directory``."""
        if self.is_local:
            parts = [glob.escape(directory), *(["*"] * depth), "*_" + glob.escape(name)]
            found = glob.glob(posixpath.join(*parts))
        else:
            found = [
                i.path
                for i in self._list(directory)
                if i.type == pafs.FileType.File and i.path[len(directory) :].count("/") == depth + 1
            ]
        return sorted(p for p in found if _is_data_file_of(posixpath.basename(p), name))

    def find_run_files(self, run_id: str, recipe_id: str | None = None) -> dict[str, list[str]]:
        """Every file of ``run_id`` in the three tables: normally one each (no requests file
        when the run had none).

        With ``recipe_id`` only that recipe's partition is searched (about a thousand
        directories for three years of nightly runs: what land_run does, a run id belongs to
        one recipe). Without it the runs table is searched (every ``run_month=`` directory) and
        the cells / requests files are those next to the runs file, in the same partition:
        landing and deleting keep the three together (a landing interrupted between its
        renames is completed by :meth:`recover` first)."""
        name = file_name(run_id)
        if recipe_id is not None:
            part = f"recipe_id={partition_value(recipe_id)}"
            return {t: self._glob(self._join(t, part), 1, name) for t in TABLES}
        runs = self._glob(self.table_dir("runs"), 2, name)
        found: dict[str, list[str]] = {"runs": runs, "cells": [], "requests": []}
        prefix = self.table_dir("runs") + "/"
        for path in runs:
            relative = path[len(prefix) :]
            for table in ("cells", "requests"):
                candidate = self._join(table, relative)
                if self._exists(candidate):
                    found[table].append(candidate)
        return found

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
        return {
            "runs": build_table("runs", [run], fixed_run),
            "cells": build_table("cells", list(cells), fixed),
            "requests": build_table("requests", list(requests), fixed),
        }

    @contextlib.contextmanager
    def _writer_lock(self, blocking: bool = True) -> Iterator[bool]:
        """Hold ``<root>/_warehouse.lock`` exclusively (yields True), or, when ``blocking`` is
        False and another process holds it, yield False at once. A kernel lock: a writer that
        dies releases it. Only for local / mounted filesystems (NFS: see warehouse/README.md);
        other filesystems yield True (their writers claim the staging area instead)."""
        if not self.is_local:
            yield True
            return
        os.makedirs(self.base, exist_ok=True)
        fd = os.open(self._join(LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock

    def _claim(self, stage: str) -> None:
        """Non-local filesystems only (no lock file there): one writer at a time. This landing
        writes ``<stage>/CLAIM``, then lists ``_staging/``: any other staging directory with a
        file younger than WRITER_LIVE_S is a landing in progress, and this one refuses
        (WarehouseError; its own staging is removed by the caller). Write first, look second:
        of two overlapping landings the later to look always sees the other's files (S3 lists
        what was written before, strongly consistent since 2020), so at most one proceeds;
        both may refuse, and a retry lands. Not a lock: a writer that stalls past
        WRITER_LIVE_S between its claim and its last move is taken for dead."""
        if self.is_local:
            return
        self._write_bytes(posixpath.join(stage, "CLAIM"), str(time.time()).encode())
        now = time.time()
        live: dict[str, float] = {}
        for info in self._list(self._join(STAGING), recursive=True):
            rel = info.path[len(self._join(STAGING)) + 1 :]
            top = rel.split("/", 1)[0]
            if "/" not in rel or posixpath.join(self._join(STAGING), top) == stage:
                continue  # a directory entry itself, or our own landing
            if info.type == pafs.FileType.File and info.mtime is not None:
                live[top] = max(live.get(top, 0.0), info.mtime.timestamp())
        others = sorted(t for t, m in live.items() if now - m < WRITER_LIVE_S)
        if others:
            raise WarehouseError(
                f"another landing into {self.root} is in progress ({STAGING}/{others[0]}): one "
                "writer at a time on a warehouse without a lock file (s3://…); try again when "
                f"it is done (a staging directory untouched for {WRITER_LIVE_S:g} s is a dead "
                "writer's and no longer counts)"
            )

    def _recover_if_free(self) -> None:
        """A reader's recovery: only when the writers' lock is free at once (a holder recovers
        first thing itself), never when it cannot be taken (a read-only mount, another
        filesystem: there only writers recover)."""
        if not self.is_local or not self._list(self._join(STAGING), recursive=False):
            return  # nothing to finish: a reader creates no lock file, takes no lock
        try:
            with self._writer_lock(blocking=False) as got:
                if got:
                    self._recover_locked()
        except OSError:
            return

    def land_run(self, run: dict, cells: list[dict], requests: list[dict]) -> None:
        """Land one run atomically and idempotently (see the module docstring).

        ``run``: RUN_FIELDS keys (run_id required); ``cells``: CELL_FIELDS keys; ``requests``:
        REQUEST_FIELDS keys. run_id / recipe_id / run_date / run_month / schema_version of cells and
        requests are filled in. Raises WarehouseError (a ValueError) naming the table, row and
        column on rows that do not fit: then nothing is written."""
        tables = self.build_tables(run, cells, requests)
        run_id = run["run_id"]
        recipe_id = tables["runs"].column("recipe_id")[0].as_py()
        run_date = tables["runs"].column("run_date")[0].as_py()
        with self._lock:
            txn = f"{file_name(run_id)[: -len('.parquet')][:80]}.{uuid.uuid4().hex[:12]}"
            stage = self._join(STAGING, txn)
            moves: list[tuple[str, str]] = []
            try:
                for table in ("cells", "requests", "runs"):
                    data = tables[table]
                    if table == "requests" and data.num_rows == 0:
                        continue
                    staged = self._join(STAGING, txn, f"{table}.parquet")
                    self.fs.create_dir(self._join(STAGING, txn), recursive=True)
                    write_parquet(without_partition_columns(data), staged, self.fs)
                    moves.append((staged, self.file_path(table, run_id, recipe_id, run_date)))
                    self._fault_at(f"staged:{table}")
                self._claim(stage)
                with self._writer_lock():
                    self._recover_locked()
                    targets = {dst for _, dst in moves}
                    old = self.find_run_files(run_id, recipe_id)
                    deletes = sorted(p for paths in old.values() for p in paths if p not in targets)
                    manifest = {
                        "run_id": run_id,
                        "moves": moves,
                        "deletes": deletes,
                        "created": time.time(),
                    }
                    self._write_bytes(
                        self._join(STAGING, txn, "COMMIT.json"), json.dumps(manifest).encode()
                    )
                    self._fault_at("committed")
                    self._apply(stage, manifest)
            except BaseException:
                if not self._exists(self._join(STAGING, txn, "COMMIT.json")):
                    self._delete_dir(stage)  # not committed: as if it never happened
                raise

    def _apply(self, stage: str, manifest: dict) -> None:
        for src, dst in manifest["moves"]:
            if self._exists(src):
                self.fs.create_dir(posixpath.dirname(dst), recursive=True)
                self.fs.move(src, dst)
            self._fault_at(f"moved:{posixpath.basename(src).split('.')[0]}")
        for path in manifest["deletes"]:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(path)
        self._fault_at("deleted")
        self._delete_dir(stage)

    def recover(self) -> list[str]:
        """Finish committed landings that were interrupted; drop abandoned uncommitted ones.
        Returns the run ids rolled forward. Safe to call any time, from any worker: it waits
        for the writers' lock, so it never finishes a landing whose process is still at it."""
        with self._lock, self._writer_lock():
            return self._recover_locked()

    def _recover_locked(self) -> list[str]:
        """:meth:`recover`, the writers' lock held by the caller. Without a lock file (s3://)
        only a committed landing older than WRITER_LIVE_S is rolled forward: a younger one may
        be its writer's, still moving its files."""
        done: list[str] = []
        now = time.time()
        for info in self._list(self._join(STAGING), recursive=False):
            if info.type != pafs.FileType.Directory:
                continue
            commit = posixpath.join(info.path, "COMMIT.json")
            try:
                manifest = json.loads(self._read_bytes(commit))
            except (FileNotFoundError, OSError, ValueError):
                mtime = info.mtime.timestamp() if info.mtime else now
                if now - mtime > ABANDONED_AFTER_S:
                    self._delete_dir(info.path)
                continue
            if not self.is_local:
                # the store's clock, not the writer's: writers on other machines may drift
                stamp = self.fs.get_file_info(commit).mtime
                committed = stamp.timestamp() if stamp else manifest.get("created", now)
                if now - committed < WRITER_LIVE_S:
                    continue
            self._apply(info.path, manifest)
            done.append(manifest["run_id"])
        return done

    def delete_run(self, run_id: str, recipe_id: str | None = None) -> bool:
        """Remove a run from the three tables (its artifacts stay), as a committed transaction
        like a landing (an interrupted delete is completed by the next :meth:`recover`).
        True if it was there."""
        with self._lock, self._writer_lock():
            self._recover_locked()
            found = self.find_run_files(run_id, recipe_id)
            # the runs row first: once it is gone the run is no longer listed
            files = [*found["runs"], *found["cells"], *found["requests"]]
            if not files:
                return False
            txn = f"{file_name(run_id)[: -len('.parquet')][:80]}.{uuid.uuid4().hex[:12]}"
            stage = self._join(STAGING, txn)
            manifest = {"run_id": run_id, "moves": [], "deletes": files, "created": time.time()}
            try:
                self._claim(stage)
            except WarehouseError:
                self._delete_dir(stage)
                raise
            self._write_bytes(posixpath.join(stage, "COMMIT.json"), json.dumps(manifest).encode())
            self._apply(stage, manifest)
            return True

    # -- reading ----------------------------------------------------------------------------

    def _read_file(self, table: str, path: str) -> pa.Table:
        """One file as a table of the full schema: partition columns from the path; columns
        an older schema_version lacks are null, columns it had and we dropped are left out."""
        data = pq.read_table(path, filesystem=self.fs, partitioning=None)
        parts = partition_of(path)
        n = data.num_rows
        cols = []
        for f in SCHEMAS[table]:
            if f.name in parts:
                cols.append(pa.array([parts[f.name]] * n, type=f.type))
            elif f.name in data.column_names:
                cols.append(data.column(f.name).cast(f.type))
            else:
                cols.append(pa.nulls(n, type=f.type))
        return pa.Table.from_arrays(cols, schema=SCHEMAS[table])

    def has_run(self, run_id: str, recipe_id: str | None = None) -> bool:
        return bool(self.find_run_files(run_id, recipe_id)["runs"])

    def read_run(
        self, run_id: str, recipe_id: str | None = None
    ) -> tuple[dict, list[dict], list[dict]]:
        """``(run, cells, requests)`` of one landed run, as dicts keyed by column name (the
        records.py fields plus run_id, recipe_id, run_date, run_month, schema_version; landed_at on the
        run), cells and requests in the order they were landed. Timestamps are timezone-aware
        UTC datetimes, missing values None. KeyError if the run is not in the warehouse.
        ``recipe_id``, when known, makes the look-up cheaper (one recipe's partition)."""
        with self._lock:
            self._recover_if_free()
            files = self.find_run_files(run_id, recipe_id)
        if not files["runs"]:
            raise KeyError(f"run {run_id!r} is not in the warehouse {self.root}")
        run = _rows(self._read_file("runs", files["runs"][-1]))[0]
        out: dict[str, list[dict]] = {}
        for table in ("cells", "requests"):
            paths = files[table]
            out[table] = _rows(self._read_file(table, paths[-1])) if paths else []
        return run, out["cells"], out["requests"]

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
            # which the views leave out (speedmatrix.analysis.compare reads them)
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
    from speedmatrix.analysis.compare import extra_schema

    stored = set(extra_schema(table).names)
    cols = []
    for name in view_schema(table).names:
        if name == "run_date" and name not in stored:
            cols.append("CAST(left(parse_filename(filename), 10) AS DATE) AS run_date")
        else:
            cols.append(f'"{name}"')
    return ", ".join(cols)


def _clean_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_json(v) for v in value]
    value = _clean(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return value
