"""`speedmatrix query` is read-only (issue #16 item 2).

An analyst's SQL is raw DuckDB. Before: `COPY … TO` over a landed runs file wiped a run's row,
`ATTACH` created a database, `read_text('/etc/…')` read any file and `INSTALL httpfs` reached
for the network. Each is tried here through the command itself (`speedmatrix query`, in this
process: `cli.main`), against a warehouse with a landed run, and must be refused with a
one-line reason and a non-zero exit, the warehouse byte for byte unchanged and nothing created.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from speedmatrix import cli
from speedmatrix.store.schemas import WarehouseError
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_requests, make_run


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def landed(tmp_path):
    root = tmp_path / "wh"
    Warehouse(root).land_run(make_run(), make_cells(), make_requests())
    from deltalake import DeltaTable

    runs_file = Path(DeltaTable(root / "runs").file_uris()[0].removeprefix("file://"))
    return root, runs_file


def query(root: Path, sql: str, capsys) -> tuple[int, str, str]:
    rc = cli.main(["query", sql, "--warehouse", str(root), "--format", "csv"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_reading_query_still_works(landed, capsys):
    root, _ = landed
    rc, out, err = query(root, "SELECT run_id, count(*) AS n FROM cells GROUP BY 1", capsys)
    assert (rc, out, err) == (0, "run_id,n\nr-1,5\n", "")
    rc, out, _ = query(root, "EXPLAIN SELECT * FROM runs", capsys)
    assert rc == 0 and "physical_plan" in out


def attempts(root: Path, runs_file: Path, elsewhere: Path) -> dict[str, str]:
    return {
        "copy over a landed runs file": (
            f"COPY (SELECT * FROM runs WHERE false) TO '{runs_file}' (FORMAT parquet)"
        ),
        "attach a new database": f"ATTACH '{elsewhere / 'new.duckdb'}' AS x",
        "read any file": "SELECT * FROM read_text('/etc/hostname')",
        "read any file, scalar": "SELECT content FROM read_text('/etc/passwd')",
        "install an extension": "INSTALL httpfs",
        "load an extension": "LOAD httpfs",
        "turn external access back on": "SET enable_external_access = true",
        "a write after a read": f"SELECT 1; COPY (SELECT 1) TO '{root / 'x.csv'}'",
        "explain analyze runs its statement": (
            f"EXPLAIN ANALYZE COPY (SELECT 1 AS a) TO '{root / 'runs' / 'y.parquet'}'"
        ),
        "create a table": "CREATE TABLE t AS SELECT * FROM runs",
        "export the database": f"EXPORT DATABASE '{elsewhere / 'dump'}'",
    }


@pytest.mark.parametrize(
    "what",
    list(attempts(Path("/r"), Path("/r/f"), Path("/e"))),
)
def test_a_query_cannot_write_read_outside_or_reach_out(landed, tmp_path, capsys, what):
    root, runs_file = landed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = snapshot(root)
    rc, out, err = query(root, attempts(root, runs_file, elsewhere)[what], capsys)
    assert rc != 0, out
    assert err.startswith("speedmatrix query: ") and err.count("\n") == 1, err
    assert out == ""
    assert snapshot(root) == before
    assert list(elsewhere.iterdir()) == []
    # and the run is still whole
    assert len(Warehouse(root).query("SELECT * FROM cells")) == 5


def test_the_library_query_is_read_only_too(landed):
    """compare, bisect and the CLI share Warehouse.query: it takes reading statements only."""
    root, runs_file = landed
    wh = Warehouse(root)
    with pytest.raises(WarehouseError, match="read-only"):
        wh.query(f"COPY (SELECT 1) TO '{runs_file}'")
    assert wh.query("SELECT count(*) AS n FROM runs")["n"].tolist() == [1]
