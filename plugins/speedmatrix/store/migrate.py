"""``speedmatrix warehouse migrate --from OLD``: a warehouse of the older hand-written layout
(one Parquet file per table per run, store/legacy.py) imported into the Delta tables.

One job: moving rows across, checked. Per table (``runs`` last, as a landing), the old rows
are landed in batches of runs, each batch one commit replacing those runs' rows (predicate
``run_id IN (…)``): running it again replaces, never duplicates, so an interrupted migration
is finished by running it again. Afterwards every table is checked row for row: the count and
an order-independent checksum (the sum of each row's hash over every column) of the migrated
runs' rows, old against new; a mismatch is an error naming the table.

Checked as a landing is: each old run (its runs row, cells and requests) is handed first to
``check`` (the caller's: the CLI gives it the landing's own checks, names, numbers and the
Great Expectations suites, which sit above this layer), which refuses the run with a reason,
or names the cells it quarantined and the run's status. Only what it lets through is
migrated: a refused run's rows of every table stay behind, as do quarantined cells and their
requests, and rows of no run (no runs row) are not migrated.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from speedmatrix.store.delta import replace_rows, sql_literal
from speedmatrix.store.legacy import legacy_files, read_legacy_file
from speedmatrix.store.protocol import Warehouse
from speedmatrix.store.schemas import EXTRA_TABLES, WarehouseError, view_schema

ORDER = ("cells", "requests", *EXTRA_TABLES, "runs")
BATCH_RUNS = 500
"""Runs per commit: few commits (a small log), bounded memory."""


CellKey = tuple[str, int, int]
"""(phase, context_tokens, concurrency): a cell of one run, and its requests."""


@dataclass
class Checked:
    """What the landing's checks let through of one run: its status, the cells they kept out
    (quarantined: their requests stay out too); `refused` (a reason) keeps the whole run out."""

    refused: str | None = None
    status: str | None = None
    quarantined: set[CellKey] = field(default_factory=set)


Check = Callable[[dict, list[dict], list[dict]], Checked]


def checksum(table: pa.Table) -> tuple[int, int]:
    """(rows, the sum mod 2**64 of every row's hash over all columns): independent of row
    order and of how the rows are split into files."""
    import pandas as pd

    if table.num_rows == 0:
        return 0, 0
    frame = table.to_pandas()
    hashed = pd.util.hash_pandas_object(frame, index=False)
    return table.num_rows, int(hashed.sum()) % 2**64


def _open_old(source: str) -> tuple[pafs.FileSystem, str]:
    if "://" in source:
        fs, base = pafs.FileSystem.from_uri(source)
        return fs, base.rstrip("/")
    if not os.path.isdir(source):
        raise WarehouseError(f"no warehouse at {source!r}")
    return pafs.LocalFileSystem(), os.path.abspath(source)


def _rows(fs: pafs.FileSystem, table: str, files: list[tuple[str, dict]]) -> list[dict]:
    return [
        row for path, known in files for row in read_legacy_file(fs, table, path, known).to_pylist()
    ]


def _check_runs(
    fs: pafs.FileSystem, files: dict[str, dict[str, list]], check: Check
) -> tuple[dict[str, Checked], list[dict]]:
    """Every old run through `check`: (what it let through by run id, the refused runs)."""
    passed: dict[str, Checked] = {}
    refused: list[dict] = []
    for run_id in sorted(files["runs"]):
        runs = _rows(fs, "runs", files["runs"][run_id])
        cells = _rows(fs, "cells", files["cells"].get(run_id, []))
        requests = _rows(fs, "requests", files["requests"].get(run_id, []))
        verdict = check(runs[0], cells, requests)
        if verdict.refused:
            refused.append({"run_id": run_id[:80], "reason": verdict.refused})
        else:
            passed[run_id] = verdict
    return passed, refused


def _let_through(table: str, data: pa.Table, passed: dict[str, Checked]) -> pa.Table:
    """`data` without the rows the checks kept out (quarantined cells and their requests),
    the runs' status as the checks made it."""
    rows = data.to_pylist()
    keyed = "phase" in data.column_names and "concurrency" in data.column_names
    kept = []
    for row in rows:
        verdict = passed[row["run_id"]]
        if keyed and table != "runs":
            key = (row["phase"], row["context_tokens"], row["concurrency"])
            if key in verdict.quarantined:
                continue
        if table == "runs" and verdict.status:
            row = {**row, "status": verdict.status}
        kept.append(row)
    if len(kept) == len(rows) and table != "runs":
        return data
    return pa.Table.from_pylist(kept, schema=data.schema)


def migrate(
    warehouse: Warehouse, source: str, batch_runs: int = BATCH_RUNS, check: Check | None = None
) -> dict[str, dict]:
    """Import the older-layout warehouse at ``source`` into ``warehouse``; returns per table
    the runs, rows and checksum migrated, and under ``refused`` the runs `check` refused (run
    id and reason). Raises WarehouseError when a table's rows differ."""
    fs, base = _open_old(source)
    report: dict[str, dict] = {}
    files: dict[str, dict[str, list]] = {}
    for table in ORDER:
        by_table: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        for path, known in legacy_files(fs, base, table):
            by_table[known["run_id"]].append((path, known))
        files[table] = by_table
    passed, refused = _check_runs(fs, files, check) if check is not None else (None, [])
    for table in ORDER:
        schema = view_schema(table)
        by_run = files[table]
        run_ids = sorted(r for r in by_run if passed is None or r in passed)
        old_rows, old_sum = 0, 0
        for i in range(0, len(run_ids), batch_runs):
            batch = run_ids[i : i + batch_runs]
            parts = [
                read_legacy_file(fs, table, path, known)
                for run_id in batch
                for path, known in by_run[run_id]
            ]
            data = pa.concat_tables(parts) if parts else schema.empty_table()
            if passed is not None:
                data = _let_through(table, data, passed)
            rows, total = checksum(data)
            old_rows, old_sum = old_rows + rows, (old_sum + total) % 2**64
            predicate = f"run_id IN ({', '.join(sql_literal(r) for r in batch)})"
            replace_rows(warehouse.table_uri(table), data, predicate, warehouse.root)
        new_rows, new_sum = 0, 0
        if run_ids:
            import pyarrow.dataset as ds

            landed = warehouse.read_table(table, ds.field("run_id").isin(run_ids))
            new_rows, new_sum = checksum(landed)
        if (new_rows, new_sum) != (old_rows, old_sum):
            raise WarehouseError(
                f"migrating {table}: the old layout has {old_rows} rows (checksum {old_sum:x}), "
                f"the Delta table {new_rows} (checksum {new_sum:x}) for the same runs"
            )
        report[table] = {"runs": len(run_ids), "rows": new_rows, "checksum": f"{new_sum:016x}"}
    report["refused"] = refused  # type: ignore[assignment]
    return report
