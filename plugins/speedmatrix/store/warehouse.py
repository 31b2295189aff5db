"""The Parquet warehouse: atomic and idempotent landing, recovery, the writers' lock, artifacts.

One job: writing the warehouse safely (and reading one run back whole). Beside it in store/:
schemas.py (every table's schema, rows -> tables), layout.py (directory and file names),
query.py (the analysts' read-only DuckDB views, mixed into :class:`Warehouse`), extra.py (the
comparisons / noise / cell_repeats tables, landed under this module's lock).

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
``write_artifact(run_id, name, data)``, ``read_artifact(run_id, name)``, ``writer_lock()``; the
schemas ``RUNS_SCHEMA``, ``CELLS_SCHEMA``, ``REQUESTS_SCHEMA`` and ``SCHEMA_VERSION`` live in
speedmatrix.store.schemas.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import glob
import json
import os
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from speedmatrix.store.layout import (
    ARTIFACTS,
    LOCK_FILE,
    QUARANTINE,
    STAGING,
    _is_data_file_of,
    data_file_name,
    default_root,
    file_name,
    partition_dirs,
    partition_of,
    partition_value,
    run_month_of,
)
from speedmatrix.store.query import DEFAULT_VIEWS, WarehouseQueries
from speedmatrix.store.schemas import (
    PARTITION_KEYS,
    SCHEMA_VERSION,
    SCHEMAS,
    TABLES,
    WarehouseError,
    _clean,
    build_table,
    run_date_of,
    view_tables,
)

ABANDONED_AFTER_S = 3600.0
"""An uncommitted staging directory older than this is a crashed landing and is removed."""
WRITER_LIVE_S = 600.0
"""Non-local filesystems (s3://): a staging directory with a file younger than this is another
writer's landing in progress (a landing stages, commits and moves in seconds); older, its writer
is taken for dead and recovery may roll it forward."""


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


class Warehouse(WarehouseQueries):
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
        try:
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.fs.move(tmp, path)
        except BaseException:
            # a full disk (ENOSPC) must not leave a half-written file aside (issue #33)
            with contextlib.suppress(OSError):
                self.fs.delete_file(tmp)
            raise

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
    def writer_lock(self) -> Iterator[None]:
        """Hold the writers' lock (this process's threads and every other process): for code
        that writes files beside the core tables (store/extra.py), so that its rename and its
        removal of older copies never interleave with a landing, a delete or a recovery.
        Not re-entrant across calls: never take it while holding it."""
        with self._lock, self._writer_lock():
            yield

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
