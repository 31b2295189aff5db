"""The extra warehouse tables: `comparisons`, `noise` and `cell_repeats`, landed and read.

One job: storing the tables other code computes beside runs / cells / requests (their schemas
are in store/schemas.py, with every other table's).

The `comparisons`, `noise` and `cell_repeats` tables live next to runs / cells / requests, in
the same Hive layout (<root>/<table>/recipe_id=<r>/run_month=<YYYY-MM>/<run_date>_<run_id>
.parquet: layout.partition_dirs and data_file_name, the run's own date), written through
the Warehouse's filesystem. Each file is written under _staging/ and renamed into place, so a
reader sees the old or the new file whole, and landing a run's file again replaces it. Files
of the older layout (…/recipe_id=<r>/run_date=<d>/<run_id>.parquet) are still read, and
replaced when their run lands again. As in the core tables, the partition column `recipe_id`
lives in the directory name only (the tables' schemas keep it; land_extra drops it from the
file, read_extra puts it back from the path): files that hold it too make pandas' and
pyarrow's directory readers fail ("Field recipe_id has incompatible types"). Files landed
before that (with `recipe_id` inside) are still read here.

Landing and deleting take the warehouse's writers' lock (``_warehouse.lock``,
Warehouse.writer_lock): the rename into place and the removal of the run's older file are one
step for every other writer (a landing, a delete, a recovery, another extra landing); the file
is staged outside it, as land_run stages.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from speedmatrix.store.layout import (
    STAGING,
    data_file_name,
    file_name,
    partition_dirs,
    partition_of,
    partition_value,
    run_month_of,
)
from speedmatrix.store.schemas import (
    CELL_REPEATS_SCHEMA,
    PARTITION_KEYS,
    SCHEMA_VERSION,
    WarehouseError,
    build_table,
    extra_schema,
    run_date_of,
)
from speedmatrix.store.warehouse import write_parquet


def landed_run_date(warehouse: Any, run: Mapping[str, Any]) -> date:
    """The date under which the run's files are filed: its `run_date` when the row came from
    the warehouse, else the date of its landed runs file, else its start (finish) date, else
    today (what land_run does for a run without dates). Extra files go next to the run's."""
    value = run.get("run_date")
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    if isinstance(value, str):
        try:
            return date.fromisoformat(value[:10])
        except ValueError:
            pass
    recipe = run.get("recipe_id")
    found = warehouse.find_run_files(str(run["run_id"]), recipe if recipe else None)["runs"]
    if found:
        return date.fromisoformat(posixpath.basename(found[-1])[:10])
    return run_date_of(dict(run)) or datetime.now(UTC).date()


def land_extra(warehouse: Any, table: str, run: Mapping[str, Any], data: pa.Table) -> str:
    """Land one run's file of an extra table (EXTRA_TABLES); returns its path."""
    if not data.schema.equals(extra_schema(table), check_metadata=False):
        raise ValueError(f"{table}: rows do not have the table's schema")
    # the hive convention: partition values in the directory names only (see above)
    data = data.drop_columns([c for c in PARTITION_KEYS if c in data.column_names])
    run_id = str(run["run_id"])
    day = landed_run_date(warehouse, run)
    fs, base = warehouse.fs, warehouse.base
    target = posixpath.join(
        base, table, partition_dirs(run.get("recipe_id"), day), data_file_name(run_id, day)
    )
    staged = posixpath.join(base, STAGING, f"{table}-{uuid.uuid4().hex[:12]}.parquet")
    fs.create_dir(posixpath.dirname(staged), recursive=True)
    write_parquet(data, staged, fs)
    try:
        with warehouse.writer_lock():
            fs.create_dir(posixpath.dirname(target), recursive=True)
            fs.move(staged, target)
            for old in _extra_files(warehouse, table, run_id):
                if old != target:
                    fs.delete_file(old)
    finally:
        with contextlib.suppress(FileNotFoundError, OSError):
            if fs.get_file_info(staged).type != pafs.FileType.NotFound:
                fs.delete_file(staged)  # the move did not happen: no stray staged file
    return target


def delete_extra(warehouse: Any, table: str, run_id: str) -> int:
    """Remove a run's file(s) of an extra table; returns how many there were."""
    with warehouse.writer_lock():
        paths = _extra_files(warehouse, table, run_id)
        for path in paths:
            warehouse.fs.delete_file(path)
    return len(paths)


def _is_run_file(basename: str, name: str) -> bool:
    """`<run_id>.parquet` (older layout) or `<YYYY-MM-DD>_<run_id>.parquet`."""
    if basename == name:
        return True
    if len(basename) != 11 + len(name) or basename[10] != "_" or not basename.endswith(name):
        return False
    try:
        date.fromisoformat(basename[:10])
    except ValueError:
        return False
    return True


def _extra_files(
    warehouse: Any, table: str, run_id: str | None = None, recipe_id: str | None = None
) -> list[str]:
    where = posixpath.join(warehouse.base, table)
    if recipe_id is not None:  # one recipe's directory, not the whole table
        where = posixpath.join(where, f"recipe_id={partition_value(recipe_id)}")
    selector = pafs.FileSelector(where, recursive=True, allow_not_found=True)
    want = file_name(run_id) if run_id is not None else None
    return sorted(
        i.path
        for i in warehouse.fs.get_file_info(selector)
        if i.type == pafs.FileType.File
        and i.path.endswith(".parquet")
        and (want is None or _is_run_file(posixpath.basename(i.path), want))
    )


def read_extra(
    warehouse: Any, table: str, *, run_id: str | None = None, recipe_id: str | None = None
) -> pd.DataFrame:
    """The rows of an extra table (EXTRA_TABLES) of one run, one recipe, or all."""
    schema = extra_schema(table)
    parts = []
    for path in _extra_files(warehouse, table, run_id, recipe_id):
        t = pq.read_table(path, filesystem=warehouse.fs, partitioning=None, schema=schema)
        where = partition_of(path)
        if "recipe_id" in where:  # from the directory name (older files hold the same value)
            i = schema.get_field_index("recipe_id")
            value = pa.array([where["recipe_id"]] * t.num_rows, pa.string())
            t = t.set_column(i, schema.field(i), value)
        if recipe_id is not None:
            t = t.filter(pc.equal(t["recipe_id"], recipe_id))
        parts.append(t)
    data = pa.concat_tables(parts) if parts else schema.empty_table()
    return data.to_pandas(types_mapper=None)


def cell_repeats_table(run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], day: date):
    """Repeat rows (cell records plus `repeat` >= 1) -> a CELL_REPEATS_SCHEMA table.

    Each pass goes through the cells table's own checks (warehouse.build_table: types,
    phase/status values, one row per cell), so a repeat lands only if it would land as a cell.
    """
    fixed = {
        "run_id": str(run["run_id"]),
        "recipe_id": run.get("recipe_id"),
        "run_date": day,
        "run_month": run_month_of(day),
        "schema_version": SCHEMA_VERSION,
    }
    passes: dict[int, list[dict[str, Any]]] = {}
    for i, row in enumerate(rows):
        repeat = row.get("repeat")
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise WarehouseError(f"cell_repeats row {i}: repeat must be an integer >= 1")
        passes.setdefault(repeat, []).append({k: v for k, v in row.items() if k != "repeat"})
    tables = []
    for repeat, group in sorted(passes.items()):
        cells = build_table("cells", group, fixed)
        cols = {n: cells.column(n) for n in cells.column_names}
        cols["repeat"] = pa.array([repeat] * cells.num_rows, pa.int64())
        tables.append(
            pa.Table.from_arrays(
                [cols[n] for n in CELL_REPEATS_SCHEMA.names], schema=CELL_REPEATS_SCHEMA
            )
        )
    return pa.concat_tables(tables) if tables else CELL_REPEATS_SCHEMA.empty_table()


def land_cell_repeats(
    warehouse: Any, run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> str | None:
    """Land a run's repeats in `cell_repeats` (after the run itself: the file goes next to
    the run's). No rows: the run's older file, if any, is removed (landing again replaces,
    also with fewer repeats). Returns the file's path, None when there is none."""
    if not rows:
        delete_extra(warehouse, "cell_repeats", str(run["run_id"]))
        return None
    day = landed_run_date(warehouse, run)
    return land_extra(warehouse, "cell_repeats", run, cell_repeats_table(run, rows, day))
