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
import threading
import time
from pathlib import Path

import pytest

from speedmatrix import cli
from speedmatrix.cli import warehouse as warehouse_cli
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


def test_a_query_cannot_read_files_under_the_cwds_tmp(landed, tmp_path, monkeypatch, capsys):
    """Issue #33 item 4: DuckDB always allows its temporary directory, by default
    `<cwd>/.tmp`; a query must not read what lies there."""
    root, _ = landed
    work = tmp_path / "cwd"
    (work / ".tmp").mkdir(parents=True)
    (work / ".tmp" / "secret.csv").write_text("password\nhunter2\n")
    monkeypatch.chdir(work)
    for sql in (
        "SELECT * FROM read_csv('.tmp/secret.csv')",
        f"SELECT * FROM read_text('{work / '.tmp' / 'secret.csv'}')",
    ):
        rc, out, err = query(root, sql, capsys)
        assert rc != 0 and "hunter2" not in out, out
        assert err.startswith("speedmatrix query: "), err


def test_a_query_stops_at_its_timeout_with_a_clear_message(landed, capsys):
    """Issue #33 item 5: a default timeout, a flag to change it, a message that says so."""
    root, _ = landed
    endless = (
        "SELECT count(*) FROM range(100000000) a, range(100000000) b WHERE a.range + b.range < 0"
    )
    t0 = time.monotonic()
    rc = cli.main(["query", endless, "--warehouse", str(root), "--timeout", "1"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and "timeout of 1 s" in err and "--timeout" in err, err
    assert took < 30
    assert warehouse_cli.DEFAULT_TIMEOUT_S <= 300  # a few minutes at most by default


def test_a_query_stops_at_its_memory_limit_with_a_clear_message(landed, capsys):
    root, _ = landed
    hungry = "SELECT max(len(x)) FROM (SELECT list(range) AS x FROM range(50000000))"
    rc = cli.main(["query", hungry, "--warehouse", str(root), "--memory-limit", "64MB"])
    err = capsys.readouterr().err
    assert rc == 2 and "memory" in err and "--memory-limit" in err, err
    # the same with room enough
    rc = cli.main(["query", "SELECT 1 AS one", "--warehouse", str(root), "--memory-limit", "1GB"])
    assert rc == 0 and capsys.readouterr().out.strip().endswith("1")
    assert warehouse_cli.DEFAULT_MEMORY_LIMIT


class _LateStart:
    """A connection whose queries begin executing only after `delay` seconds (a loaded
    machine), so the timeout's first interrupt comes before DuckDB has begun."""

    def __init__(self, con, delay: float) -> None:
        self._con, self._delay = con, delay

    def execute(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._con.execute(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._con, name)


@pytest.mark.timeout(60)
def test_a_query_that_begins_after_its_timeout_is_still_stopped(landed):
    """DuckDB drops an interrupt that comes before a query begins executing: the query then
    ran to its end (the endless one here, for ever). The timeout interrupts again until it
    returns. Seen as a failure of the test above on a loaded machine."""
    from speedmatrix.store.query import QueryLimitError

    root, _ = landed
    queries = Warehouse(str(root))
    queries.query("SELECT 1")  # connected
    queries._con = _LateStart(queries._con, delay=0.5)
    endless = (
        "SELECT count(*) FROM range(100000000) a, range(100000000) b WHERE a.range + b.range < 0"
    )
    real = queries._con._con
    backstop = threading.Timer(15, real.interrupt)  # the old code's test fails, never hangs
    backstop.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(QueryLimitError, match=r"timeout of 0\.2 s"):
            queries.query(endless, timeout_s=0.2)
    finally:
        backstop.cancel()
    assert time.monotonic() - t0 < 10, "stopped by the backstop, not by its timeout"
    queries._con = real
    queries.close()


class _InterruptedAsRuntimeError:
    """A connection whose query, once interrupted, raises Python's RuntimeError("Query
    interrupted"), as DuckDB did from `execute` on a loaded machine (the CLI then printed an
    internal error's traceback, not the timeout)."""

    def __init__(self, con) -> None:
        self._con, self._stopped = con, threading.Event()

    def execute(self, *args, **kwargs):
        assert self._stopped.wait(10), "never interrupted"
        raise RuntimeError("Query interrupted")

    def interrupt(self) -> None:
        self._stopped.set()

    def __getattr__(self, name):
        return getattr(self._con, name)


@pytest.mark.timeout(60)
def test_a_query_interrupted_into_a_runtime_error_is_the_timeout(landed):
    from speedmatrix.store.query import QueryLimitError

    root, _ = landed
    queries = Warehouse(str(root))
    queries.query("SELECT 1")  # connected
    real = queries._con
    queries._con = _InterruptedAsRuntimeError(real)
    try:
        with pytest.raises(QueryLimitError, match=r"timeout of 0\.2 s"):
            queries.query("SELECT 1", timeout_s=0.2)
        # a RuntimeError that is not about the interrupt stays what it is
        queries._con = _Raising(real, RuntimeError("something else"))
        with pytest.raises(RuntimeError, match="something else"):
            queries.query("SELECT 1", timeout_s=30)
    finally:
        queries._con = real
        queries.close()


class _Raising:
    def __init__(self, con, exc: Exception) -> None:
        self._con, self._exc = con, exc

    def execute(self, *args, **kwargs):
        raise self._exc

    def __getattr__(self, name):
        return getattr(self._con, name)
