"""The extra warehouse tables: `comparisons`, `noise` and `cell_repeats`, landed and read.

One job: storing the tables other code computes beside runs / cells / requests (their schemas
are in store/schemas.py, with every other table's). Each is a Delta table at
``<root>/<table>`` like the core ones (store/delta.py), partitioned by ``recipe_id`` and
``run_month`` (the run's own), with ``run_date`` and ``run_month`` stored beside the table's
columns. Landing a run's rows again replaces them in one commit (predicate ``run_id``), so
concurrent writers of other runs never wait for each other. These land after the run itself
(the regressions task, the land task's repeats), so the run's `runs` row is already there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime
from typing import Any

import pandas as pd
import pyarrow as pa

from speedmatrix.store.delta import delete_rows, sql_literal
from speedmatrix.store.layout import run_month_of
from speedmatrix.store.protocol import Warehouse, WarehouseReader
from speedmatrix.store.schemas import (
    CELL_REPEATS_SCHEMA,
    SCHEMA_VERSION,
    WarehouseError,
    build_table,
    extra_schema,
    run_date_of,
    view_schema,
)


def landed_run_date(warehouse: WarehouseReader, run: Mapping[str, Any]) -> date:
    """The date the run is filed under: its `run_date` when the row came from the warehouse,
    else the landed run's, else its start (finish) date, else today (what land_run does for a
    run without dates). Extra rows go into the run's partition."""
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
    import pyarrow.dataset as ds

    run_id = str(run["run_id"])
    landed = warehouse.read_table(
        "runs", ds.field("run_id") == run_id, ["run_date"], f"run_id = {sql_literal(run_id)}"
    ).column("run_date")
    if len(landed):
        return landed[0].as_py()
    return run_date_of(dict(run)) or datetime.now(UTC).date()


def land_extra(warehouse: Warehouse, table: str, run: Mapping[str, Any], data: pa.Table) -> str:
    """Land one run's rows of an extra table (EXTRA_TABLES), replacing its older ones; returns
    the table's location."""
    if not data.schema.equals(extra_schema(table), check_metadata=False):
        raise ValueError(f"{table}: rows do not have the table's schema")
    day = landed_run_date(warehouse, run)
    n = data.num_rows
    schema = view_schema(table)
    cols = []
    for f in schema:
        if f.name == "run_date" and f.name not in data.column_names:
            cols.append(pa.array([day] * n, f.type))
        elif f.name == "run_month":
            cols.append(pa.array([run_month_of(day)] * n, f.type))
        elif f.name == "recipe_id":
            cols.append(pa.array([run.get("recipe_id")] * n, f.type))
        else:
            cols.append(data.column(f.name))
    run_id = str(run["run_id"])
    warehouse.land_table(table, run_id, pa.Table.from_arrays(cols, schema=schema))
    return warehouse.table_uri(table)


def delete_extra(warehouse: Warehouse, table: str, run_id: str) -> int:
    """Remove a run's rows of an extra table (one commit); returns how many there were."""
    return delete_rows(
        warehouse.table_uri(table), f"run_id = {sql_literal(run_id)}", warehouse.root
    )


def read_extra(
    warehouse: WarehouseReader,
    table: str,
    *,
    run_id: str | None = None,
    recipe_id: str | None = None,
) -> pd.DataFrame:
    """The rows of an extra table (EXTRA_TABLES) of one run, one recipe, or all, with the
    table's own columns (extra_schema)."""
    import pyarrow.dataset as ds

    where, prune = None, []
    if run_id is not None:
        where = ds.field("run_id") == run_id
        prune.append(f"run_id = {sql_literal(run_id)}")
    if recipe_id is not None:
        mine = ds.field("recipe_id") == recipe_id
        where = mine if where is None else where & mine
        prune.append(f"recipe_id = {sql_literal(recipe_id)}")
    columns = list(extra_schema(table).names)
    data = warehouse.read_table(table, where, columns, " AND ".join(prune) or None)
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
    warehouse: Warehouse, run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> str | None:
    """Land a run's repeats in `cell_repeats` (after the run itself: the file goes next to
    the run's). No rows: the run's older file, if any, is removed (landing again replaces,
    also with fewer repeats). Returns the file's path, None when there is none."""
    if not rows:
        delete_extra(warehouse, "cell_repeats", str(run["run_id"]))
        return None
    day = landed_run_date(warehouse, run)
    return land_extra(warehouse, "cell_repeats", run, cell_repeats_table(run, rows, day))
