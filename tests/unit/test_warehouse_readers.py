"""Analysts read every table of the warehouse with their own tools, without this package:
pandas (deltalake), Polars (`scan_delta`) and DuckDB (over `to_pyarrow_dataset()`, no DuckDB
extension needed), each table a Delta table (issue #32); and every reader of plain files reads
`speedmatrix export --format parquet`'s snapshot."""

from __future__ import annotations

import duckdb
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from test_compare_warehouse import _land

from speedmatrix.analysis.compare import judge_regressions
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.records import empty_cell
from speedmatrix.store.extra import land_cell_repeats, read_extra
from speedmatrix.store.schemas import PARTITION_KEYS
from speedmatrix.store.warehouse import Warehouse

TABLES = ("runs", "cells", "requests", "comparisons", "noise", "cell_repeats")
RECIPE = "sim/wh-test"


@pytest.fixture(scope="module")
def wh(tmp_path_factory):
    """Three runs (the third regressed) with their verdicts, noise and a repeated cell: a
    file in every table."""
    w = Warehouse(str(tmp_path_factory.mktemp("readers") / "wh"))
    _land(w, "r0", "a" * 40, 0, seed=0)
    r1 = _land(w, "r1", "a" * 40, 1, seed=1)
    _land(w, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    judge_regressions(w, "r1")
    with pytest.raises(RegressionError):
        judge_regressions(w, "r2")
    repeat = empty_cell(
        phase="decode",
        context_tokens=8192,
        context_label="8K",
        concurrency=1,
        status="valid",
        total_tok_s=55.3,
    )
    land_cell_repeats(w, r1, [{**repeat, "repeat": 1}])
    yield w
    w.close()


def expected_rows(wh: Warehouse, table: str) -> int:
    if table in ("runs", "cells", "requests"):
        return int(wh.query(f"SELECT count(*) AS n FROM {table}")["n"].item())
    return len(read_extra(wh, table))


def test_every_table_has_rows(wh):
    for table in TABLES:
        assert expected_rows(wh, table) > 0, table


def test_partition_columns_live_in_the_directory_names_only(wh):
    """Delta's convention (and Hive's): recipe_id and run_month are the directories."""
    for table in TABLES:
        files = [u.removeprefix("file://") for u in DeltaTable(f"{wh.root}/{table}").file_uris()]
        assert files, table
        for path in files:
            assert "/recipe_id=sim%2Fwh-test/run_month=" in path
            names = pq.read_schema(path).names
            assert not set(PARTITION_KEYS) & set(names), (path, names)


@pytest.mark.parametrize("table", TABLES)
def test_pandas_reads_every_table(wh, table):
    df = DeltaTable(f"{wh.root}/{table}").to_pandas()
    assert len(df) == expected_rows(wh, table)
    assert set(df["recipe_id"].astype(str)) == {RECIPE}
    assert "run_id" in df.columns and df["run_month"].astype(str).str.match(r"^\d{4}-\d{2}$").all()


@pytest.mark.parametrize("table", TABLES)
def test_polars_reads_every_table(wh, table):
    import polars as pl

    df = pl.scan_delta(f"{wh.root}/{table}").collect()
    assert df.height == expected_rows(wh, table)
    assert set(df["recipe_id"].to_list()) == {RECIPE}
    assert "run_id" in df.columns and "run_month" in df.columns


@pytest.mark.parametrize("table", TABLES)
def test_duckdb_reads_every_table(wh, table):
    con = duckdb.connect()
    con.register("t", DeltaTable(f"{wh.root}/{table}").to_pyarrow_dataset())
    df = con.execute("SELECT * FROM t").df()
    assert len(df) == expected_rows(wh, table)
    assert set(df["recipe_id"]) == {RECIPE}
    con.close()
