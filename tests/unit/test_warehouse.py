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
import pytest
from deltalake import DeltaTable, write_deltalake

from speedmatrix.records import CELL_FIELDS, REQUEST_FIELDS, RUN_FIELDS
from speedmatrix.store.schemas import (
    CELLS_SCHEMA,
    REQUESTS_SCHEMA,
    RUNS_SCHEMA,
    SCHEMA_VERSION,
    WarehouseError,
)
from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[2]
# tests/ (factories.py) on the path: also for the subprocesses that import this module by path
sys.path.insert(0, str(ROOT / "tests"))
from factories import decode_cell, prefill_cell, run_row  # noqa: E402


def make_run(run_id="r-1", recipe_id="sim/kimi-k2.7-nvfp4-rtxpro6k-x8", day=14, **extra):
    values = {
        "recipe_id": recipe_id,
        "trigger": "nightly",
        "host": None,
        "started_at": dt.datetime(2026, 3, day, 2, 0, tzinfo=dt.UTC),
        "finished_at": dt.datetime(2026, 3, day, 2, 40, tzinfo=dt.UTC),
        "engine_version": "0.20.1",
        "hardware_gpu": "sim",
        "hardware_gpu_count": 8,
        "served_model": "kimi",
        "window_s": 30.0,
        "max_output_tokens": 4096,
    }
    return run_row(run_id, **{**values, **extra})


def make_cells(scale=1.0):
    cells = [prefill_cell(8192, total_tok_s=6206.0 * scale, ttft_ms=1320.0, completed_requests=1)]
    for c in (1, 2, 4):
        cells.append(
            decode_cell(
                8192,
                c,
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
    cells.append(decode_cell(8192, 8, status="over_capacity"))
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
    """Every file under the warehouse root (data files and Delta logs)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in files]
    return sorted(out)


def data_files(root, table) -> list[str]:
    """The data files of ``table``'s current version (what its Delta log lists)."""
    return sorted(
        os.path.relpath(u.removeprefix("file://"), root)
        for u in DeltaTable(os.path.join(root, table)).file_uris()
    )


def plain_rows(root, table) -> pd.DataFrame:
    """What a reader without this package sees: the Delta table's current version."""
    path = os.path.join(root, table)
    if not DeltaTable.is_deltatable(path):
        return pd.DataFrame()
    return DeltaTable(path).to_pandas()


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
    # runs.measure_s is window_s under its old name, written beside it (renames.MIRRORED)
    assert {k: got_run[k] for k in run} == {**run, "measure_s": run["window_s"]}
    assert got_run["run_date"] == dt.date(2026, 3, 14)
    assert got_run["schema_version"] == SCHEMA_VERSION
    assert [{k: c[k] for k in cells[0]} for c in got_cells] == cells
    assert all(c["run_id"] == "r-1" and c["recipe_id"] == run["recipe_id"] for c in got_cells)
    assert [r["request_index"] for r in got_requests] == [0, 1, 2]
    assert got_requests[0]["finished"] is True and got_requests[1]["window_tokens"] is None
    # one Delta table per table, one commit and one data file per run, in the recipe /
    # month partition
    for t in ("cells", "requests", "runs"):
        assert DeltaTable(tmp_path / t).version() == 0
        (only,) = data_files(tmp_path, t)
        assert only.startswith(
            f"{t}/recipe_id=sim%2Fkimi-k2.7-nvfp4-rtxpro6k-x8/run_month=2026-03/"
        ), only


def test_readable_without_this_package(tmp_path):
    """deltalake (pandas), DuckDB through the Arrow dataset, and Polars read every table."""
    import polars as pl

    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests())
    ingested = make_run("ing", recipe_id="published/x", started_at=None, finished_at=None)
    wh.land_run(dict(ingested, trigger="ingest"), make_cells(), [])
    today = dt.datetime.now(dt.UTC).date()
    cells = DeltaTable(tmp_path / "cells").to_pandas()
    assert len(cells) == 10
    by_run = cells.groupby("run_id", observed=True).size().to_dict()
    assert by_run == {"r-1": 5, "ing": 5}
    con = duckdb.connect()
    con.register("cells", DeltaTable(tmp_path / "cells").to_pyarrow_dataset())
    rows = con.execute(
        "SELECT recipe_id, run_date, count(*) FROM cells GROUP BY ALL ORDER BY 1"
    ).fetchall()
    assert rows == [
        ("published/x", today, 5),
        ("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", dt.date(2026, 3, 14), 5),
    ]
    runs = pl.scan_delta(str(tmp_path / "runs")).collect()
    assert sorted(runs["run_id"].to_list()) == ["ing", "r-1"]
    assert set(runs["recipe_id"].to_list()) == {"sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "published/x"}


def test_land_twice_is_idempotent(tmp_path):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests())
    wh.land_run(make_run(), make_cells(scale=2.0), make_requests(2))
    for table in ("cells", "requests", "runs"):
        assert len(data_files(tmp_path, table)) == 1  # the older file left the version
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
    for t in ("cells", "runs"):
        (only,) = data_files(tmp_path, t)
        assert "/run_month=2026-04/" in only
    assert data_files(tmp_path, "requests") == []
    assert len(plain_rows(tmp_path, "cells")) == 5
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

BEFORE_ANY_COMMIT = ["built"]
UNLISTED = ["unlisted", "landed:cells", "landed:requests"]
AFTER_LAST_COMMIT = ["landed:runs"]


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


def assert_one_whole_version_or_unlisted(root, step):
    """After a landing of version 2 stopped at ``step``: version 1 whole (stopped before its
    first commit), version 2 whole (after its last), or the run not listed in ``runs`` (in
    between), and never a duplicate row in any table."""
    for table in ("cells", "requests"):
        rows = plain_rows(root, table)
        if len(rows):
            key = ["run_id", "phase", "context_tokens", "concurrency"]
            key += ["request_index"] if table == "requests" else []
            assert not rows.duplicated(key).any(), table
    wh = Warehouse(root)
    if step in BEFORE_ANY_COMMIT:
        _run, cells, requests = wh.read_run("r-1")
        assert (cells[0]["total_tok_s"], len(requests)) == (6206.0, 3)
        assert_version(root, 1.0, 3)
    elif step in UNLISTED:
        assert not wh.has_run("r-1")
        with pytest.raises(KeyError):
            wh.read_run("r-1")
        assert wh.query("SELECT count(*) AS n FROM runs")["n"].tolist() == [0]
    else:
        _run, cells, requests = wh.read_run("r-1")
        assert (cells[0]["total_tok_s"], len(requests)) == (6206.0 * 2, 1)
        assert_version(root, 2.0, 1, date="2026-04-02")


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("step", BEFORE_ANY_COMMIT + UNLISTED + AFTER_LAST_COMMIT)
def test_failure_at_each_step(tmp_path, step):
    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), make_requests(3))

    def fault(at):
        if at == step:
            raise Boom(at)

    wh._fault = fault
    with pytest.raises(Boom):
        wh.land_run(make_run(started_at=APRIL), make_cells(scale=2.0), make_requests(1))
    assert_one_whole_version_or_unlisted(tmp_path, step)
    # landing again afterwards is clean: one whole version 3
    Warehouse(tmp_path).land_run(make_run(started_at=APRIL), make_cells(scale=3.0), [])
    assert_version(tmp_path, 3.0, 0, date="2026-04-02")


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


@pytest.mark.parametrize("step", ["built", "unlisted", "landed:cells", "landed:requests"])
def test_kill_halfway(tmp_path, step):
    """A landing process SIGKILLed between its commits: the run is version 1 whole or not
    listed, never half of version 2, never duplicated; landing it again is clean."""
    Warehouse(tmp_path).land_run(make_run(), make_cells(), make_requests(3))
    code = KILLER.format(tests=str(Path(__file__).parent), root=str(tmp_path), step=step)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert_one_whole_version_or_unlisted(tmp_path, step)
    Warehouse(tmp_path).land_run(make_run(started_at=APRIL), make_cells(scale=3.0), [])
    assert_version(tmp_path, 3.0, 0, date="2026-04-02")


def test_an_overlong_partition_value_lands_nothing_and_blocks_nothing(tmp_path):
    """Issue #33: a recipe id too long for a directory name is refused before anything is
    written, and the next landing goes through."""
    wh = Warehouse(tmp_path)
    with pytest.raises(WarehouseError, match="too long for a partition directory"):
        wh.land_run(make_run("long", recipe_id="r" * 300), make_cells(), make_requests())
    assert all_files(tmp_path) == []
    wh.land_run(make_run(), make_cells(), [])
    assert wh.query("SELECT run_id FROM runs")["run_id"].tolist() == ["r-1"]


def test_a_write_failing_in_delta_leaves_nothing_stuck(tmp_path):
    """Past our own check, a data file the filesystem refuses (a name too long, here by
    lifting the check) fails that commit only: no commit in the log, later landings land."""
    import speedmatrix.store.delta as delta

    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), [])
    version = DeltaTable(tmp_path / "cells").version()
    original = delta.MAX_SEGMENT_BYTES
    delta.MAX_SEGMENT_BYTES = 10_000
    try:
        with pytest.raises(Exception, match=r"(?i)name too long"):
            wh.land_run(make_run("long", recipe_id="r" * 300), make_cells(), [])
    finally:
        delta.MAX_SEGMENT_BYTES = original
    assert DeltaTable(tmp_path / "cells").version() == version
    wh.land_run(make_run("next", day=20), make_cells(), [])
    got = wh.query("SELECT run_id FROM runs ORDER BY 1")["run_id"].tolist()
    assert got == ["next", "r-1"]


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


def test_query_sees_landings_from_elsewhere(tmp_path):
    """The kept connection's views follow landings and deletes, also from another process."""
    wh = Warehouse(tmp_path)
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
    # imported here: subprocesses of other tests import this module from tests/unit/ alone
    from cli_inprocess import run_cli

    wh = Warehouse(tmp_path)
    wh.land_run(make_run(), make_cells(), [])
    env = {"SPEEDMATRIX_WAREHOUSE": str(tmp_path)}
    sql = "SELECT concurrency, total_tok_s FROM cells WHERE phase = 'decode' ORDER BY 1"

    def run(*args):  # in this process (tests/cli_inprocess.py); test_cli_imports runs it whole
        return run_cli("query", sql, *args, env=env)

    csv = run("--format", "csv")
    assert csv.returncode == 0, csv.stderr
    assert csv.stdout.splitlines()[:3] == ["concurrency,total_tok_s", "1,50.0", "2,100.0"]
    js = run("--format", "json")
    assert js.stdout.startswith('[{"concurrency":1,"total_tok_s":50.0}')
    table = run()
    assert "concurrency" in table.stdout.splitlines()[0]
    bad = run_cli("query", "SELECT nope FROM cells", env=env)
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
    assert all(data_files(tmp_path, t) == [] for t in ("runs", "cells", "requests"))
    assert not wh.delete_run("r-1")


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


def land_as_older_version(root, run_id, dropped, schema_version=None, requests=0):
    """Land ``run_id`` as an older version of this package did: into tables whose schema
    lacks the ``dropped`` columns (table -> names), so the Delta tables are created without
    them and a later landing must add them (schema evolution)."""
    wh = Warehouse(root)
    built = wh.build_tables(make_run(run_id), make_cells(), make_requests(requests))
    for table in ("cells", "requests", "runs"):
        data = built[table].drop_columns(dropped.get(table, []))
        if schema_version is not None:
            i = data.schema.get_field_index("schema_version")
            data = data.set_column(
                i, "schema_version", pa.array([schema_version] * data.num_rows, pa.int32())
            )
        write_deltalake(
            os.path.join(root, table), data, mode="append", partition_by=["recipe_id", "run_month"]
        )


def test_older_files_lacking_a_column(tmp_path):
    """Rows landed before a column was added read as null in that column (query and
    read_run), beside newer rows that have it."""
    land_as_older_version(tmp_path, "old", {"cells": ["loop_lag_p99_ms"]})
    wh = Warehouse(tmp_path)
    assert wh.query("SELECT max(loop_lag_p99_ms) AS lag FROM cells")["lag"].isna().all()
    wh.land_run(make_run("new", day=20), [dict(c, loop_lag_p99_ms=1.5) for c in make_cells()], [])
    got = wh.query("SELECT run_id, max(loop_lag_p99_ms) AS lag FROM cells GROUP BY 1 ORDER BY 1")
    assert got["lag"].isna().tolist() == [False, True]
    _, cells, _ = wh.read_run("old")
    assert all(c["loop_lag_p99_ms"] is None for c in cells)


def test_runs_landed_before_the_workload_was_recorded_still_read(tmp_path):
    """Rows landed before `workload` / `copy_share` existed read as null in them, beside
    new runs that have them, in every table that gained them."""
    dropped = {"cells": ["workload", "copy_share"], "requests": ["workload"], "runs": ["workload"]}
    land_as_older_version(tmp_path, "old", dropped, requests=3)
    wh = Warehouse(tmp_path)
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
    """`warmup_s` (issue #19) is a column added to `cells` (schema_version 2); rows of
    schema_version 1 lack it and read as null beside the new rows."""
    assert SCHEMA_VERSION >= 2
    assert CELLS_SCHEMA.field("warmup_s").nullable
    assert str(CELLS_SCHEMA.field("warmup_s").type) == "double"
    land_as_older_version(tmp_path, "old", {"cells": ["warmup_s"]}, schema_version=1)
    wh = Warehouse(tmp_path)
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
