"""The warehouse: schemas, landing (atomic, idempotent), reading, queries, quarantine, artifacts."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from speedmatrix.records import CELL_FIELDS, REQUEST_FIELDS, RUN_FIELDS, empty_cell
from speedmatrix.store.layout import LOCK_FILE
from speedmatrix.store.schemas import (
    CELLS_SCHEMA,
    REQUESTS_SCHEMA,
    RUNS_SCHEMA,
    SCHEMA_VERSION,
    WarehouseError,
)
from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[2]


def make_run(run_id="r-1", recipe_id="sim/kimi-k2.7-nvfp4-rtxpro6k-x8", day=14, **extra):
    run = {f.name: None for f in RUN_FIELDS}
    run.update(
        run_id=run_id,
        recipe_id=recipe_id,
        trigger="nightly",
        status="success",
        started_at=dt.datetime(2026, 3, day, 2, 0, tzinfo=dt.UTC),
        finished_at=dt.datetime(2026, 3, day, 2, 40, tzinfo=dt.UTC),
        engine="vllm",
        engine_version="0.20.1",
        hardware_gpu="sim",
        hardware_gpu_count=8,
        served_model="kimi",
        measure_s=30.0,
        max_output_tokens=4096,
    )
    run.update(extra)
    return run


def make_cells(scale=1.0):
    cells = [
        empty_cell(
            phase="prefill",
            context_tokens=8192,
            context_label="8K",
            concurrency=1,
            status="valid",
            total_tok_s=6206.0 * scale,
            ttft_ms=1320.0,
            completed_requests=1,
        )
    ]
    for c in (1, 2, 4):
        cells.append(
            empty_cell(
                phase="decode",
                context_tokens=8192,
                context_label="8K",
                concurrency=c,
                status="valid",
                total_tok_s=50.0 * c * scale,
                per_request_tok_s=50.0 * scale,
                ttft_ms=87.0,
                tbt_ms=18.2,
                avg_active_requests=float(c),
                completed_requests=0,
                output_tokens=1500 * c,
                measured_s=30.0,
                started_at=dt.datetime(2026, 3, 14, 2, 5, tzinfo=dt.UTC),
            )
        )
    cells.append(
        empty_cell(
            phase="decode",
            context_tokens=8192,
            context_label="8K",
            concurrency=8,
            status="over_capacity",
        )
    )
    return cells


def make_requests(n=3):
    return [
        {
            "phase": "decode",
            "context_tokens": 8192,
            "concurrency": 2,
            "request_index": i,
            "stream": i % 2,
            "output_tokens": 100,
            "ttft_ms": 80.0 + i,
            "tbt_ms": 18.0,
            "finished": i == 0,
        }
        for i in range(n)
    ]


def all_files(root) -> list[str]:
    """The warehouse's files, without the writers' lock file (not data: it stays once made)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in files]
    return sorted(f for f in out if f != LOCK_FILE)


def plain_rows(root, table) -> pd.DataFrame:
    """What a reader without this package sees (pyarrow dataset with hive partitioning)."""
    path = os.path.join(root, table)
    if not os.path.exists(path):
        return pd.DataFrame()
    return ds.dataset(path, format="parquet", partitioning="hive").to_table().to_pandas()


# ---- schemas --------------------------------------------------------------------------------


def test_schemas_follow_records():
    assert RUNS_SCHEMA.names[: len(RUN_FIELDS)] == [f.name for f in RUN_FIELDS]
    assert CELLS_SCHEMA.names[0] == "run_id"
    assert CELLS_SCHEMA.names[1 : 1 + len(CELL_FIELDS)] == [f.name for f in CELL_FIELDS]
    assert REQUESTS_SCHEMA.names[1 : 1 + len(REQUEST_FIELDS)] == [f.name for f in REQUEST_FIELDS]
    for schema in (RUNS_SCHEMA, CELLS_SCHEMA, REQUESTS_SCHEMA):
        assert {"run_id", "recipe_id", "run_date", "schema_version"} <= set(schema.names)
        assert not schema.field("schema_version").nullable
        assert not schema.field("run_id").nullable
    for f in CELL_FIELDS:
        assert CELLS_SCHEMA.field(f.name).nullable == f.nullable
        assert CELLS_SCHEMA.field(f.name).metadata[b"doc"] == f.doc.encode()
    assert str(CELLS_SCHEMA.field("total_tok_s").type) == "double"
    assert str(CELLS_SCHEMA.field("context_tokens").type) == "int64"
    assert str(RUNS_SCHEMA.field("started_at").type) == "timestamp[us, tz=UTC]"


# ---- landing and reading --------------------------------------------------------------------


def test_land_and_read_round_trip(tmp_path):
    wh = Warehouse(tmp_path)
    run, cells, requests = make_run(), make_cells(), make_requests()
    wh.land_run(run, cells, requests)
    got_run, got_cells, got_requests = wh.read_run("r-1")
    assert {k: got_run[k] for k in run} == run
    assert got_run["run_date"] == dt.date(2026, 3, 14)
    assert got_run["schema_version"] == SCHEMA_VERSION
    assert [{k: c[k] for k in cells[0]} for c in got_cells] == cells
    assert all(c["run_id"] == "r-1" and c["recipe_id"] == run["recipe_id"] for c in got_cells)
    assert [r["request_index"] for r in got_requests] == [0, 1, 2]
    assert got_requests[0]["finished"] is True and got_requests[1]["window_tokens"] is None
    # one file per table per run, named after the run, in the recipe / date partition
    assert all_files(tmp_path) == [
        f"{t}/recipe_id=sim%2Fkimi-k2.7-nvfp4-rtxpro6k-x8/run_month=2026-03/2026-03-14_r-1.parquet"
        for t in ("cells", "requests", "runs")
    ]


def test_readable_without_this_package(tmp_path):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests())
    ingested = make_run("ing", recipe_id="published/x", started_at=None, finished_at=None)
    wh.land_run(dict(ingested, trigger="ingest"), make_cells(), [])
    today = dt.datetime.now(dt.UTC).date()
    cells = pd.read_parquet(tmp_path / "cells")
    assert len(cells) == 10
    by_run = cells.groupby("run_id", observed=True).size().to_dict()
    assert by_run == {"r-1": 5, "ing": 5}
    con = duckdb.connect()
    rows = con.execute(
        f"SELECT recipe_id, run_date, count(*) FROM read_parquet('{tmp_path}/cells/*/*/*.parquet',"
        " hive_partitioning = true) GROUP BY ALL ORDER BY 1"
    ).fetchall()
    assert rows == [
        ("published/x", today, 5),
        ("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", dt.date(2026, 3, 14), 5),
    ]
    runs = pd.read_parquet(tmp_path / "runs")
    assert sorted(runs["run_id"]) == ["ing", "r-1"]
    assert set(runs["recipe_id"]) == {"sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "published/x"}
    single = pq.read_table(next((tmp_path / "runs").rglob("*_r-1.parquet")), partitioning=None)
    assert single.column("run_id").to_pylist() == ["r-1"]
    assert "recipe_id" not in single.column_names  # partition columns live in the path


def test_land_twice_is_idempotent(tmp_path):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests())
    files = all_files(tmp_path)
    wh.land_run(make_run(), make_cells(scale=2.0), make_requests(2))
    assert all_files(tmp_path) == files
    assert len(plain_rows(tmp_path, "cells")) == 5
    assert len(plain_rows(tmp_path, "requests")) == 2
    assert len(plain_rows(tmp_path, "runs")) == 1
    _, cells, _ = wh.read_run("r-1")
    assert cells[0]["total_tok_s"] == 6206.0 * 2
    df = wh.query("SELECT count(*) AS n, count(DISTINCT run_id) AS runs FROM cells")
    assert df.to_dict("records") == [{"n": 5, "runs": 1}]


def test_relanding_in_another_partition_replaces(tmp_path):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(day=14), make_cells(), make_requests())
    april = dt.datetime(2026, 4, 2, 2, tzinfo=dt.UTC)
    wh.land_run(make_run(started_at=april), make_cells(), [])
    assert all_files(tmp_path) == [
        f"{t}/recipe_id=sim%2Fkimi-k2.7-nvfp4-rtxpro6k-x8/run_month=2026-04/2026-04-02_r-1.parquet"
        for t in ("cells", "runs")
    ]
    assert wh.read_run("r-1")[0]["run_date"] == dt.date(2026, 4, 2)
    assert wh.read_run("r-1")[0]["run_month"] == "2026-04"
    assert wh.read_run("r-1")[2] == []


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda r, c, q: c[1].update(context_tokens="8K"),
            r"cells row 1: context_tokens must be an integer",
        ),
        (lambda r, c, q: c[0].update(tok_s=1.0), r"cells row 0: unknown fields \['tok_s'\]"),
        (lambda r, c, q: c[2].update(status=None), r"cells row 2: status is required"),
        (lambda r, c, q: c[2].update(status="great"), r"cells row 2: status 'great' is not one of"),
        (lambda r, c, q: c.append(dict(c[1])), r"cells rows 1 and 5: duplicate"),
        (lambda r, c, q: r.update(trigger="cron"), r"runs row 0: trigger 'cron'"),
        (
            lambda r, c, q: r.update(started_at="yesterday"),
            r"runs.started_at: not an ISO timestamp",
        ),
        (
            lambda r, c, q: q[0].update(request_index=None),
            r"requests row 0: request_index is required",
        ),
        (lambda r, c, q: c[0].update(run_id="other"), r"run_id 'other' differs"),
        (lambda r, c, q: r.update(recipe_id=None), r"recipe_id is required"),
    ],
)
def test_bad_rows_land_nothing(tmp_path, mutate, message):
    wh = Warehouse(tmp_path)
    run, cells, requests = make_run(), make_cells(), make_requests()
    mutate(run, cells, requests)
    with pytest.raises(WarehouseError, match=message):
        wh.land_run(run, cells, requests)
    assert all_files(tmp_path) == []


def test_values_are_coerced_sensibly(tmp_path):
    """JSON-ish input (what crosses Airflow XCom) lands: ISO strings, whole floats, NaN."""
    wh = Warehouse(tmp_path)
    run = make_run(started_at="2026-03-14T02:00:00+00:00", hardware_gpu_count=8.0)
    cells = make_cells()
    cells[0]["per_request_tok_s"] = float("nan")
    wh.land_run(run, cells, [])
    got, cells_back, _ = wh.read_run("r-1")
    assert got["started_at"] == dt.datetime(2026, 3, 14, 2, tzinfo=dt.UTC)
    assert got["hardware_gpu_count"] == 8
    assert cells_back[0]["per_request_tok_s"] is None


# ---- atomicity: failures and kills halfway -------------------------------------------------

PRE_COMMIT = ["staged:cells", "staged:requests", "staged:runs"]
POST_COMMIT = ["committed", "moved:cells", "moved:requests", "moved:runs", "deleted"]


def snapshot(root):
    return {t: plain_rows(root, t) for t in ("runs", "cells", "requests")}


APRIL = dt.datetime(2026, 4, 2, 2, tzinfo=dt.UTC)  # version 2 lands in another partition


def assert_version(root, scale, n_requests, date="2026-03-14"):
    snap = snapshot(root)
    assert len(snap["runs"]) == 1
    assert snap["runs"]["run_date"].astype(str).tolist() == [date]
    assert len(snap["cells"]) == 5
    assert set(snap["cells"]["run_date"].astype(str)) == {date}
    assert snap["cells"]["total_tok_s"].max() == pytest.approx(6206.0 * scale)
    assert len(snap["requests"]) == n_requests


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("step", PRE_COMMIT + POST_COMMIT)
def test_failure_at_each_step(tmp_path, step):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests(3))
    before = all_files(tmp_path)

    def fault(at):
        if at == step:
            raise Boom(at)

    wh._fault = fault
    with pytest.raises(Boom):
        wh.land_run(make_run(started_at=APRIL), make_cells(scale=2.0), make_requests(1))
    wh._fault = None
    if step in PRE_COMMIT:
        # nothing changed, nothing left behind
        assert all_files(tmp_path) == before
        assert_version(tmp_path, 1.0, 3)
    # whatever happened, the next use of the warehouse shows one whole version
    fresh = Warehouse(tmp_path)
    _run, cells, requests = fresh.read_run("r-1")
    if step in PRE_COMMIT:
        assert (cells[0]["total_tok_s"], len(requests)) == (6206.0, 3)
        assert_version(tmp_path, 1.0, 3)
    else:
        assert (cells[0]["total_tok_s"], len(requests)) == (6206.0 * 2, 1)
        assert_version(tmp_path, 2.0, 1, date="2026-04-02")
    assert not any(f.startswith("_staging/") for f in all_files(tmp_path))


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_warehouse import APRIL, make_run, make_cells, make_requests
    from speedmatrix.store.warehouse import Warehouse
    wh = Warehouse({root!r})
    def fault(at):
        if at == {step!r}:
            os.kill(os.getpid(), signal.SIGKILL)
    wh._fault = fault
    wh.land_run(make_run(started_at=APRIL), make_cells(scale=2.0), make_requests(1))
    print("not killed")
    """
)


@pytest.mark.parametrize(
    "step", ["staged:requests", "committed", "moved:cells", "moved:requests", "moved:runs"]
)
def test_kill_halfway(tmp_path, step):
    """A landing process SIGKILLed halfway: before the commit point the warehouse is untouched;
    after it, the next user rolls the landing forward. Never half a run, never duplicates."""
    Warehouse(tmp_path).land_run(make_run(), make_cells(), make_requests(3))
    before = all_files(tmp_path)
    code = KILLER.format(tests=str(Path(__file__).parent), root=str(tmp_path), step=step)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if step in PRE_COMMIT:
        assert [f for f in all_files(tmp_path) if not f.startswith("_staging/")] == before
        assert_version(tmp_path, 1.0, 3)
    wh = Warehouse(tmp_path)
    _, cells, requests = wh.read_run("r-1")
    if step in PRE_COMMIT:
        assert (cells[0]["total_tok_s"], len(requests)) == (6206.0, 3)
        assert_version(tmp_path, 1.0, 3)
    else:
        assert (cells[0]["total_tok_s"], len(requests)) == (6206.0 * 2, 1)
        assert_version(tmp_path, 2.0, 1, date="2026-04-02")
        assert not any(f.startswith("_staging/") for f in all_files(tmp_path))
    # and landing again afterwards is clean
    wh.land_run(make_run(started_at=APRIL), make_cells(scale=3.0), [])
    assert_version(tmp_path, 3.0, 0, date="2026-04-02")


def test_abandoned_staging_is_cleaned(tmp_path, monkeypatch):
    import speedmatrix.store.warehouse as W

    wh = Warehouse(tmp_path)
    wh._fault = lambda at: (_ for _ in ()).throw(SystemExit(1)) if at == "staged:cells" else None
    with pytest.raises(SystemExit):
        wh.land_run(make_run(), make_cells(), [])
    # a crash that skipped the cleanup: fake an orphaned staging directory
    orphan = tmp_path / "_staging" / "r-1.deadbeef"
    orphan.mkdir(parents=True)
    (orphan / "cells.parquet").write_bytes(b"partial")
    wh._fault = None
    Warehouse(tmp_path).recover()
    assert orphan.exists()  # young: may be another worker's landing in progress
    monkeypatch.setattr(W, "ABANDONED_AFTER_S", -1.0)
    Warehouse(tmp_path).recover()
    assert not orphan.exists()


# ---- queries --------------------------------------------------------------------------------


def test_query_views(tmp_path):
    wh = Warehouse(tmp_path)
    empty = wh.query("SELECT count(*) AS n FROM cells")
    assert empty["n"].tolist() == [0]
    assert "total_tok_s" in wh.query("SELECT * FROM cells").columns
    wh.land_run(make_run("a", day=14), make_cells(), make_requests())
    wh.land_run(make_run("b", day=15, recipe_id="cpu/tiny/llama-tiny"), make_cells(0.5), [])
    df = wh.query(
        "SELECT r.recipe_id, r.run_date, c.total_tok_s FROM cells c JOIN runs r USING (run_id) "
        "WHERE c.phase = 'decode' AND c.concurrency = 2 ORDER BY r.run_date"
    )
    assert df["recipe_id"].tolist() == ["sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "cpu/tiny/llama-tiny"]
    assert df["total_tok_s"].tolist() == [100.0, 50.0]
    assert wh.query("SELECT count(*) AS n FROM requests")["n"].tolist() == [3]
    # partition pruning: a recipe filter reads one file (plain DuckDB views)
    plan = (
        Warehouse(tmp_path, views="glob")
        .query("EXPLAIN ANALYZE SELECT * FROM cells WHERE recipe_id = 'cpu/tiny/llama-tiny'")
        .to_string()
    )
    assert "Total Files Read: 1" in plan


@pytest.mark.parametrize("views", ["glob", "dataset"])
def test_query_sees_landings_from_elsewhere(tmp_path, views):
    """The kept connection's views follow landings and deletes, also from another process."""
    wh = Warehouse(tmp_path, views=views)
    wh.land_run(make_run("a"), make_cells(), [])
    assert wh.query("SELECT count(DISTINCT run_id) AS n FROM cells")["n"].tolist() == [1]
    other = Warehouse(tmp_path)
    other.land_run(make_run("b", day=20), make_cells(), [])
    assert wh.query("SELECT count(DISTINCT run_id) AS n FROM cells")["n"].tolist() == [2]
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]);"
        "from test_warehouse import make_run, make_cells;"
        "from speedmatrix.store.warehouse import Warehouse;"
        "w = Warehouse(sys.argv[1]); w.land_run(make_run('c', day=21), make_cells(), []);"
        "w.delete_run('a')"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent)],
        check=True,
        timeout=120,
    )
    got = wh.query("SELECT DISTINCT run_id FROM cells ORDER BY 1")["run_id"].tolist()
    assert got == ["b", "c"]


def test_query_cli_formats(tmp_path):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), [])
    env = dict(os.environ, SPEEDMATRIX_WAREHOUSE=str(tmp_path))
    sql = "SELECT concurrency, total_tok_s FROM cells WHERE phase = 'decode' ORDER BY 1"

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "speedmatrix", "query", sql, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    csv = run("--format", "csv")
    assert csv.returncode == 0, csv.stderr
    assert csv.stdout.splitlines()[:3] == ["concurrency,total_tok_s", "1,50.0", "2,100.0"]
    js = run("--format", "json")
    assert js.stdout.startswith('[{"concurrency":1,"total_tok_s":50.0}')
    table = run()
    assert "concurrency" in table.stdout.splitlines()[0]
    bad = subprocess.run(
        [sys.executable, "-m", "speedmatrix", "query", "SELECT nope FROM cells"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("speedmatrix query: ") and len(bad.stderr.splitlines()) == 1


# ---- quarantine and artifacts ---------------------------------------------------------------


def test_quarantine_and_artifacts(tmp_path):
    wh = Warehouse(tmp_path)
    rows = [dict(make_cells()[1], total_tok_s=-5.0)]
    where = wh.quarantine("r-1", "cells", rows, {"success": False, "failed": ["tok_s >= 0"]})
    assert where.endswith("_quarantine/cells/r-1")
    back, doc = wh.read_quarantine("r-1", "cells")
    assert back[0]["total_tok_s"] == -5.0 and doc["result"]["failed"] == ["tok_s >= 0"]
    assert wh.query("SELECT count(*) AS n FROM cells")["n"].tolist() == [0]
    path = wh.write_artifact("r-1", "report.md", "# Speed test matrix\n")
    assert path == wh.artifact_path("r-1", "report.md") == str(tmp_path / "artifacts/r-1/report.md")
    assert Path(path).read_text() == "# Speed test matrix\n"
    wh.write_artifact("r-1", "charts/decode.svg", b"<svg/>")
    assert wh.read_artifact("r-1", "charts/decode.svg") == b"<svg/>"
    with pytest.raises(WarehouseError):
        wh.write_artifact("r-1", "../escape", "x")
    assert not any(".tmp-" in f for f in all_files(tmp_path))


# ---- any pyarrow filesystem (s3:// in production; an in-memory one here) --------------------


def test_other_filesystem(tmp_path):
    from pyarrow._fs import _MockFileSystem

    fs = _MockFileSystem()
    wh = Warehouse("wh", filesystem=fs)
    assert not wh.is_local
    wh.land_run(make_run(), make_cells(), make_requests())
    wh.land_run(make_run(), make_cells(2.0), make_requests(2))
    wh.land_run(make_run("b", day=16), make_cells(), [])
    _run, cells, requests = wh.read_run("r-1")
    assert cells[0]["total_tok_s"] == 6206.0 * 2 and len(requests) == 2
    df = wh.query(
        "SELECT run_id, count(*) AS n FROM cells WHERE run_date = DATE '2026-03-14' GROUP BY 1"
    )
    assert df.to_dict("records") == [{"run_id": "r-1", "n": 5}]
    assert wh.query("SELECT count(*) AS n FROM runs")["n"].tolist() == [2]
    wh.write_artifact("r-1", "report.html", "<html></html>")
    assert wh.read_artifact("r-1", "report.html") == b"<html></html>"
    from pyarrow.fs import FileSelector

    names = sorted(
        i.path for i in fs.get_file_info(FileSelector("wh", recursive=True)) if i.is_file
    )
    assert not any("_staging" in n and n.endswith(".parquet") for n in names)


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SPEEDMATRIX_WAREHOUSE", str(tmp_path / "w"))
    assert Warehouse().root == str(tmp_path / "w")
    monkeypatch.delenv("SPEEDMATRIX_WAREHOUSE")
    assert Warehouse().root == str(ROOT / "warehouse")


def test_delete_run(tmp_path):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests())
    assert wh.has_run("r-1")
    assert wh.delete_run("r-1")
    assert not wh.has_run("r-1")
    with pytest.raises(KeyError):
        wh.read_run("r-1")
    assert [f for f in all_files(tmp_path) if f.endswith(".parquet")] == []


def test_query_connection_sees_a_replaced_run(tmp_path):
    """The kept DuckDB connection caches Parquet metadata; a re-landed run is still read anew."""
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), [])
    assert wh.query("SELECT max(total_tok_s) AS m FROM cells")["m"].tolist() == [6206.0]
    wh.land_run(make_run(), make_cells(2.0), [])
    assert wh.query("SELECT max(total_tok_s) AS m FROM cells")["m"].tolist() == [12412.0]
    wh.land_run(make_run(), make_cells(3.0)[:2], [])
    got = wh.query("SELECT max(total_tok_s) AS m, count(*) AS n FROM cells")
    assert got.to_dict("records") == [{"m": 18618.0, "n": 2}]


def test_older_files_lacking_a_column(tmp_path):
    """A file written before a column was added reads as null in that column (query with
    the default dataset views, and read_run). Plain DuckDB globs need union_by_name for it."""
    wh = Warehouse(tmp_path)
    wh.land_run(make_run("old"), make_cells(), [])
    path = wh.find_run_files("old")["cells"][0]
    pq.write_table(pq.read_table(path, partitioning=None).drop_columns(["loop_lag_p99_ms"]), path)
    wh.land_run(make_run("new", day=20), [dict(c, loop_lag_p99_ms=1.5) for c in make_cells()], [])
    got = wh.query("SELECT run_id, max(loop_lag_p99_ms) AS lag FROM cells GROUP BY 1 ORDER BY 1")
    assert got["lag"].isna().tolist() == [False, True]
    _, cells, _ = wh.read_run("old")
    assert all(c["loop_lag_p99_ms"] is None for c in cells)


def test_runs_landed_before_the_workload_was_recorded_still_read(tmp_path):
    """Files written before `workload` / `copy_share` existed read as null in them, beside
    new runs that have them, in every table that gained them."""
    wh = Warehouse(tmp_path)
    wh.land_run(make_run("old"), make_cells(), make_requests())
    for table, dropped in (
        ("cells", ["workload", "copy_share"]),
        ("requests", ["workload"]),
        ("runs", ["workload"]),
    ):
        path = wh.find_run_files("old")[table][0]
        old = pq.read_table(path, partitioning=None)
        pq.write_table(old.drop_columns(dropped), path)
    cells = [dict(c, workload="article", copy_share=0.0) for c in make_cells()]
    rows = [dict(r, workload="article") for r in make_requests()]
    wh.land_run(make_run("new", day=20, workload="article"), cells, rows)
    got = wh.query("SELECT run_id, min(workload) AS w FROM cells GROUP BY 1 ORDER BY 1")
    assert got["w"].tolist()[0] == "article" and got["w"].isna().tolist() == [False, True]
    got = wh.query("SELECT run_id, min(workload) AS w FROM requests GROUP BY 1 ORDER BY 1")
    assert got["w"].isna().tolist() == [False, True]
    run, cells, requests = wh.read_run("old")
    assert run["workload"] is None
    assert all(c["workload"] is None and c["copy_share"] is None for c in cells)
    assert all(r["workload"] is None for r in requests)


def test_warm_up_lands_in_cells_and_older_files_read_it_as_null(tmp_path):
    """`warmup_s` (issue #19) is a column added to `cells` (schema_version 2); a file of
    schema_version 1 lacks it and reads as null beside the new rows."""
    assert SCHEMA_VERSION >= 2
    assert CELLS_SCHEMA.field("warmup_s").nullable
    assert str(CELLS_SCHEMA.field("warmup_s").type) == "double"
    wh = Warehouse(tmp_path)
    wh.land_run(make_run("old"), make_cells(), [])
    path = wh.find_run_files("old")["cells"][0]
    old = pq.read_table(path, partitioning=None).drop_columns(["warmup_s"])
    version = old.schema.get_field_index("schema_version")
    old = old.set_column(version, "schema_version", pa.array([1] * old.num_rows, pa.int32()))
    pq.write_table(old, path)
    cells = [dict(c, warmup_s=2.5 if c["phase"] == "decode" else None) for c in make_cells()]
    wh.land_run(make_run("new", day=20), cells, [])
    got = wh.query(
        "SELECT run_id, max(warmup_s) AS w, max(schema_version) AS v FROM cells GROUP BY 1 "
        "ORDER BY 1"
    )
    assert got["v"].tolist() == [SCHEMA_VERSION, 1]
    assert got["w"].tolist()[0] == 2.5 and got["w"].isna().tolist() == [False, True]
    _, old_cells, _ = wh.read_run("old")
    assert all(c["warmup_s"] is None for c in old_cells)
