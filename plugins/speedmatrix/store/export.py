"""``speedmatrix export --format parquet DIR``: a plain Parquet snapshot of every table.

One job: handing the current version of the warehouse to tools that read only files (no
Delta reader): ``DIR/<table>/recipe_id=<URL-encoded>/run_month=<YYYY-MM>/*.parquet``, the
Hive layout DuckDB's ``read_parquet(…, hive_partitioning = true)``, Spark, pandas and Polars
read. Each table is written beside its final place and renamed into it, so a reader of DIR
sees the older or the newer snapshot of a table, never half of one. A table with a commit and
no rows (``requests`` of a warehouse of ingested pages) is one schema-only file,
``DIR/<table>/part-0.parquet``, so every reader still finds the table and its columns.

DIR is written only when it is ours (speedmatrix.ownership: new, empty, or holding
``.speedmatrix-export``): the snapshot replaces ``DIR/<table>`` folders, which in a user's
folder would be the user's own.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from speedmatrix.ownership import claim_dir
from speedmatrix.store.protocol import WarehouseReader
from speedmatrix.store.schemas import PARTITION_KEYS, view_tables


def export_parquet(warehouse: WarehouseReader, out_dir: str | os.PathLike) -> dict[str, int]:
    """Write every table's current version under ``out_dir`` (a local path, ours or refused
    with a ValueError before anything is written); returns the rows written per table (tables
    with no commit yet are skipped)."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    out = os.path.abspath(os.fspath(out_dir))
    claim_dir(Path(out), "export")
    counts: dict[str, int] = {}
    for table in view_tables():
        if warehouse.delta_table(table) is None:
            continue
        data = warehouse.read_table(table)
        aside = os.path.join(out, f".{table}.{uuid.uuid4().hex[:8]}")
        if data.num_rows == 0:
            # write_dataset writes no file for no rows (and so no folder to rename)
            os.makedirs(aside)
            pq.write_table(data, os.path.join(aside, "part-0.parquet"))
        else:
            ds.write_dataset(
                data,
                aside,
                format="parquet",
                partitioning=list(PARTITION_KEYS),
                partitioning_flavor="hive",
                existing_data_behavior="error",
                max_rows_per_file=5_000_000,
            )
        final = os.path.join(out, table)
        old = None
        if os.path.exists(final):
            old = f"{aside}.old"
            os.rename(final, old)
        os.rename(aside, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        counts[table] = data.num_rows
    return counts
