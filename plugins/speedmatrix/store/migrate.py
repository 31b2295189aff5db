"""``speedmatrix warehouse migrate --from OLD``: a warehouse of the older hand-written layout
(one Parquet file per table per run, store/legacy.py) imported into the Delta tables.

One job: moving rows across, checked. Per table (``runs`` last, as a landing), the old rows
are landed in batches of runs, each batch one commit replacing those runs' rows (predicate
``run_id IN (…)``): running it again replaces, never duplicates, so an interrupted migration
is finished by running it again. Afterwards every table is checked row for row: the count and
an order-independent checksum (the sum of each row's hash over every column) of the migrated
runs' rows, old against new; a mismatch is an error naming the table.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pyarrow as pa
import pyarrow.fs as pafs

from speedmatrix.store.delta import replace_rows, sql_literal
from speedmatrix.store.legacy import legacy_files, read_legacy_file
from speedmatrix.store.protocol import Warehouse
from speedmatrix.store.schemas import EXTRA_TABLES, WarehouseError, view_schema

ORDER = ("cells", "requests", *EXTRA_TABLES, "runs")
BATCH_RUNS = 500
"""Runs per commit: few commits (a small log), bounded memory."""


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


def migrate(warehouse: Warehouse, source: str, batch_runs: int = BATCH_RUNS) -> dict[str, dict]:
    """Import the older-layout warehouse at ``source`` into ``warehouse``; returns per table
    the runs, rows and checksum migrated. Raises WarehouseError when a table's rows differ."""
    fs, base = _open_old(source)
    report: dict[str, dict] = {}
    for table in ORDER:
        schema = view_schema(table)
        by_run: dict[str, list[tuple[str, dict]]] = defaultdict(list)
        for path, known in legacy_files(fs, base, table):
            by_run[known["run_id"]].append((path, known))
        run_ids = sorted(by_run)
        old_rows, old_sum = 0, 0
        for i in range(0, len(run_ids), batch_runs):
            batch = run_ids[i : i + batch_runs]
            parts = [
                read_legacy_file(fs, table, path, known)
                for run_id in batch
                for path, known in by_run[run_id]
            ]
            data = pa.concat_tables(parts) if parts else schema.empty_table()
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
    return report
