"""The warehouse's upkeep (issue #32): `speedmatrix export` (plain Parquet for tools that read
only files), `speedmatrix warehouse maintain` / the daily maintenance DAG's task (compaction,
checkpoint, vacuum) and `speedmatrix warehouse migrate` from the older layout."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
import urllib.parse
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from speedmatrix import cli
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_requests, make_run

OTHER = "cpu/tiny/llama-tiny"


def parquet_on_disk(root: Path, table: str) -> list[Path]:
    """The table's data files on disk (current or not; the log's checkpoints left out)."""
    return sorted(p for p in (root / table).rglob("*.parquet") if "_delta_log" not in p.parts)


@pytest.fixture
def landed(tmp_path):
    """Seven landings of six runs in two recipes (one run landed twice): many small files."""
    root = tmp_path / "wh"
    wh = Warehouse(root)
    for i in range(5):
        wh.land_run(make_run(f"a{i}", day=1 + i), make_cells(), make_requests(2))
    wh.land_run(make_run("b0", recipe_id=OTHER, day=9), make_cells(0.5), [])
    wh.land_run(make_run("a0", day=1), make_cells(2.0), make_requests(1))
    return root


def test_export_writes_a_plain_hive_parquet_snapshot(landed, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli.main(["export", "--format", "parquet", str(out), "--warehouse", str(landed)]) == 0
    assert "cells: 30 rows" in capsys.readouterr().out
    cells = pd.read_parquet(out / "cells")
    assert len(cells) == 30 and set(cells["recipe_id"].astype(str)) == {
        "sim/kimi-k2.7-nvfp4-rtxpro6k-x8",
        OTHER,
    }
    assert not (out / "cells" / "_delta_log").exists()
    got = duckdb.sql(
        f"SELECT recipe_id, count(DISTINCT run_id) FROM read_parquet('{out}/runs/*/*/*.parquet', "
        "hive_partitioning = true) GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert got == [(OTHER, 1), ("sim/kimi-k2.7-nvfp4-rtxpro6k-x8", 5)]
    assert len(pd.read_parquet(out / "requests")) == 4 * 2 + 1
    # exporting again replaces the snapshot (no rows twice)
    Warehouse(landed).delete_run("a1")
    assert cli.main(["export", str(out), "--warehouse", str(landed)]) == 0
    assert len(pd.read_parquet(out / "cells")) == 25


def test_maintain_compacts_checkpoints_and_vacuums(landed, capsys):
    wh = Warehouse(landed)
    before = wh.query("SELECT run_id, sum(total_tok_s) AS s FROM cells GROUP BY 1 ORDER BY 1")
    assert len(DeltaTable(landed / "cells").file_uris()) == 6
    assert len(parquet_on_disk(landed, "cells")) == 7  # a0's first file: no longer current
    rc = cli.main(
        ["warehouse", "maintain", "--warehouse", str(landed), "--retention-hours", "0", "--force"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "cells: 6 -> 2 files" in out, out
    # one file per recipe and month now, on disk too (older ones vacuumed), a checkpoint
    for table in ("runs", "cells"):
        assert len(DeltaTable(landed / table).file_uris()) == 2
        assert len(parquet_on_disk(landed, table)) == 2
        assert list((landed / table / "_delta_log").glob("*.checkpoint.parquet"))
    after = Warehouse(landed).query(
        "SELECT run_id, sum(total_tok_s) AS s FROM cells GROUP BY 1 ORDER BY 1"
    )
    pd.testing.assert_frame_equal(before, after)
    assert Warehouse(landed).read_run("a0")[1][0]["total_tok_s"] == 6206.0 * 2
    # and landing goes on as before, also re-landing and deleting runs of a compacted file
    # (delta-rs rewrites the rest of that file with string_view columns: readers must filter
    # over both kinds of file)
    wh.land_run(make_run("c0", day=20), make_cells(), [])
    wh.land_run(make_run("a2", day=3), make_cells(3.0), make_requests(1))
    assert wh.delete_run("a3")
    for reader in (wh, Warehouse(landed)):
        assert reader.has_run("c0") and reader.has_run("a2") and not reader.has_run("a3")
        assert reader.read_run("a2")[1][0]["total_tok_s"] == 6206.0 * 3
        assert len(reader.read_run("a4")[2]) == 2
        got = reader.query(
            "SELECT run_id, count(*) AS n FROM cells WHERE run_id IN ('a2', 'a3') GROUP BY 1"
        )
        assert got.values.tolist() == [["a2", 5]]


def test_the_maintenance_task_logs_its_figures(landed, caplog):
    from speedmatrix.flows.maintenance import run_maintenance

    with caplog.at_level(logging.INFO, logger="speedmatrix.flows.maintenance"):
        report = run_maintenance(str(landed))
    assert report["cells"]["files_before"] == 6 and report["cells"]["files_after"] == 2
    assert any(r.getMessage().startswith("cells: 6 -> 2 files") for r in caplog.records)


def test_the_maintenance_dag_is_daily_and_thin():
    from airflow.dag_processing.dagbag import DagBag

    path = Path(__file__).resolve().parents[2] / "dags" / "speedmatrix_warehouse_maintenance.py"
    bag = DagBag(dag_folder=str(path))
    assert bag.import_errors == {}
    dag = bag.dags["speedmatrix_warehouse_maintenance"]
    assert dag.timetable.expression == "0 0 * * *"  # @daily
    assert [t.task_id for t in dag.tasks] == ["maintain"]
    assert len(path.read_text().splitlines()) < 70


def land_old_layout(root: Path, run: dict, cells: list[dict], requests: list[dict]) -> None:
    """One run as the older hand-written layout filed it: one file per table, the partition
    columns in the directory names only."""
    tables = Warehouse(root / "_unused").build_tables(run, cells, requests)
    recipe = urllib.parse.quote(run["recipe_id"], safe="-_.~+=,@")
    day = tables["runs"]["run_date"][0].as_py()
    for name, data in tables.items():
        if data.num_rows == 0:
            continue
        where = root / name / f"recipe_id={recipe}" / f"run_month={day:%Y-%m}"
        where.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            data.drop_columns(["recipe_id", "run_month"]), where / f"{day}_{run['run_id']}.parquet"
        )


def landable_cells(scale: float = 1.0) -> list[dict]:
    """make_cells with figures consistent enough for the landing's cells suite."""
    cells = make_cells(scale)
    for c in cells:
        if c["status"] != "valid":
            continue
        if c["phase"] == "prefill":
            c["ttft_ms"] = 1320.0 / scale
        else:
            c.update(window_s=30.0, tbt_ms=20.0 / scale, output_tokens=round(c["total_tok_s"] * 30))
    return cells


def test_migrate_from_the_older_layout_row_for_row_and_idempotent(tmp_path, capsys):
    from speedmatrix.analysis.noise import noise_table

    old = tmp_path / "old"
    # runs a landing takes (a migrated run goes through its checks: test_migrate_checks.py)
    seen = {"host": "gpu-1", "launch_command": "vllm serve kimi"}
    for i in range(4):
        land_old_layout(
            old, make_run(f"o{i}", day=1 + i, **seen), landable_cells(1 + i), make_requests(2)
        )
    land_old_layout(old, make_run("p0", recipe_id=OTHER, day=3, **seen), landable_cells(), [])
    # an extra table's file of the even older form (run_date= directory, recipe_id inside)
    noise_dir = (
        old / "noise" / "recipe_id=sim%2Fkimi-k2.7-nvfp4-rtxpro6k-x8" / "run_date=2026-03-01"
    )
    noise_dir.mkdir(parents=True)
    row = {"run_id": "o0", "recipe_id": "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "phase": "decode"}
    row.update(context_tokens=8192, concurrency=1, metric="total_tok_s", value=55.0)
    pq.write_table(noise_table([row]), noise_dir / "o0.parquet")
    (old / "_staging" / "x").mkdir(parents=True)  # a landing in progress: never migrated
    (old / "_staging" / "x" / "cells.parquet").write_bytes(b"partial")
    new = tmp_path / "new"
    for attempt in range(2):  # running it again changes nothing
        rc = cli.main(["warehouse", "migrate", "--from", str(old), "--warehouse", str(new)])
        out = capsys.readouterr()
        assert rc == 0, out.err
        report = json.loads(out.out)
        assert report["runs"]["runs"] == 5 and report["runs"]["rows"] == 5
        assert report["cells"]["rows"] == 25 and report["requests"]["rows"] == 8
        assert report["noise"]["rows"] == 1
        if attempt == 0:
            first = report
    assert report == first
    wh = Warehouse(new)
    got = wh.query("SELECT run_id, count(*) AS n FROM cells GROUP BY 1 ORDER BY 1")
    assert got.values.tolist() == [["o0", 5], ["o1", 5], ["o2", 5], ["o3", 5], ["p0", 5]]
    run, cells, requests = wh.read_run("o2")
    assert run["run_date"] == dt.date(2026, 3, 3) and cells[0]["total_tok_s"] == 6206.0 * 3
    assert len(requests) == 2
    noise = wh.query("SELECT run_id, recipe_id, run_month, value FROM noise").values.tolist()
    assert noise == [["o0", "sim/kimi-k2.7-nvfp4-rtxpro6k-x8", "2026-03", 55.0]]
    assert not os.path.exists(new / "_staging")


def test_migrate_refuses_a_missing_source(tmp_path, capsys):
    rc = cli.main(
        [
            "warehouse",
            "migrate",
            "--from",
            str(tmp_path / "nope"),
            "--warehouse",
            str(tmp_path / "w"),
        ]
    )
    assert rc == 2 and "no warehouse at" in capsys.readouterr().err
