"""Analysts read every table of the warehouse with their own tools, over the table's
directory, without this package: pandas, Polars and DuckDB (issue #18: pandas used to fail on
`comparisons`, `noise` and `cell_repeats` with "Field recipe_id has incompatible types",
since those files held the partition column too)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
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
    for table in TABLES:
        for path in Path(wh.root, table).rglob("*.parquet"):
            names = pq.read_schema(path).names
            assert not set(PARTITION_KEYS) & set(names), (path, names)


@pytest.mark.parametrize("table", TABLES)
def test_pandas_reads_every_table_directory(wh, table):
    df = pd.read_parquet(Path(wh.root, table))
    assert len(df) == expected_rows(wh, table)
    assert set(df["recipe_id"].astype(str)) == {RECIPE}
    assert "run_id" in df.columns and df["run_month"].astype(str).str.match(r"^\d{4}-\d{2}$").all()


@pytest.mark.parametrize("table", TABLES)
def test_polars_reads_every_table_directory(wh, table):
    import polars as pl

    df = pl.read_parquet(f"{wh.root}/{table}/**/*.parquet", hive_partitioning=True)
    assert df.height == expected_rows(wh, table)
    # Polars gives the directory's value as written: URL-encoded
    assert set(df["recipe_id"].to_list()) <= {RECIPE, RECIPE.replace("/", "%2F")}
    assert "run_id" in df.columns and "run_month" in df.columns


@pytest.mark.parametrize("table", TABLES)
def test_duckdb_reads_every_table_directory(wh, table):
    glob = f"{wh.root}/{table}/*/*/*.parquet"
    con = duckdb.connect()
    df = con.execute(
        f"SELECT * FROM read_parquet('{glob}', hive_partitioning = true, "
        "hive_types = {'recipe_id': VARCHAR, 'run_month': VARCHAR})"
    ).df()
    assert len(df) == expected_rows(wh, table)
    assert set(df["recipe_id"]) <= {RECIPE, RECIPE.replace("/", "%2F")}
    con.close()


def test_files_landed_the_old_way_still_read_through_this_package(tmp_path):
    """Before issue #18, extra files held `recipe_id` inside: read_extra and the query views
    still read them (only plain pandas / pyarrow over the directory need them re-landed)."""
    from speedmatrix.analysis.noise import noise_table

    w = Warehouse(str(tmp_path / "wh"))
    _land(w, "r0", "a" * 40, 0, seed=0)
    old = Path(w.root, "noise", "recipe_id=sim%2Fwh-test", "run_month=2026-11")
    old.mkdir(parents=True)
    row = {"run_id": "r0", "recipe_id": RECIPE, "phase": "decode", "context_tokens": 8192}
    row.update(concurrency=1, metric="total_tok_s", value=55.0, between_source="none")
    pq.write_table(noise_table([row]), old / "2026-11-01_r0.parquet")  # the old way
    assert "recipe_id" in pq.read_schema(old / "2026-11-01_r0.parquet").names
    assert read_extra(w, "noise", recipe_id=RECIPE)["recipe_id"].tolist() == [RECIPE]
    got = w.query("SELECT recipe_id, value FROM noise")
    assert got.values.tolist() == [[RECIPE, 55.0]]
    w.close()
