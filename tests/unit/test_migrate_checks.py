"""Migrated rows go through the landing's checks (issue #42 item 9).

`speedmatrix warehouse migrate --from OLD` landed run ids of 230 characters, with a newline,
`.hidden`, `../../../../tmp/...`, a negative GPU count, NaN and -1e300 figures: it wrote the
old rows straight into the Delta tables. Now every migrated run takes the one landing path:
the names (records.path_field_problems), the numbers and the Great Expectations suites
(quality.check_for_landing), quarantine with the reason; refused runs are listed and the exit
code says so.
"""

from __future__ import annotations

import json
import math
import sys
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from speedmatrix import cli
from speedmatrix.records import path_field_problems
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_run


def landable(run_id: str, day: int = 1, **extra) -> tuple[dict, list[dict]]:
    """A run and cells that pass the landing's checks (consistent figures)."""
    run = make_run(run_id, day=day, host="gpu-1", launch_command="vllm serve kimi")
    run.update(extra)
    cells = make_cells()
    for c in cells:
        if c["phase"] == "decode" and c["status"] == "valid":
            c.update(window_s=30.0, tbt_ms=20.0, output_tokens=int(c["total_tok_s"] * 30))
    return run, cells


def land_old(root: Path, run: dict, cells: list[dict]) -> None:
    """One run as the older layout filed it (its run id percent-encoded in the file name)."""
    # built under a placeholder id: today's table builder refuses the hostile ones, the old
    # layout's writer did not
    tables = Warehouse(root / "_unused").build_tables({**run, "run_id": "placeholder"}, cells, [])
    for name, data in tables.items():
        at = data.schema.get_field_index("run_id")
        ids = pa.array([run["run_id"]] * data.num_rows, type=data.schema.field(at).type)
        tables[name] = data.set_column(at, "run_id", ids)
    day = tables["runs"]["run_date"][0].as_py()
    for name, data in tables.items():
        if data.num_rows == 0:
            continue
        where = root / name / "recipe_id=sim%2Fkimi" / f"run_month={day:%Y-%m}"
        where.mkdir(parents=True, exist_ok=True)
        leaf = urllib.parse.quote(run["run_id"], safe="")
        pq.write_table(
            data.drop_columns(["recipe_id", "run_month"]), where / f"{day}_{leaf}.parquet"
        )


@pytest.mark.parametrize(
    "run_id", ["x" * 230, "bad\nid", ".hidden", "../../../../tmp/escaped", "a/b"]
)
def test_a_run_id_that_is_no_name_is_refused(run_id):
    assert path_field_problems({"run_id": run_id})


def test_names_that_are_fine_still_are():
    assert (
        path_field_problems({"run_id": "sim~kimi__v0.32.0__nightly__20260301T020000Z__ab12cd34"})
        == []
    )
    assert (
        path_field_problems({"run_id": "ingest-0123456789abcdef", "recipe_id": "sim/kimi-k2"}) == []
    )
    assert path_field_problems({"served_model": "org/Model-7B", "engine_ref": "v0.32.0"}) == []


def test_migration_lands_only_what_a_landing_would(tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    good_run, good_cells = landable("good", day=1)
    land_old(old, good_run, good_cells)
    for i, rid in enumerate(["x" * 230, "bad\nid", ".hidden", "../../../../tmp/escaped"]):
        run, cells = landable(rid, day=2 + i)
        land_old(old, run, cells)
    land_old(old, *landable("negative-gpus", day=7, hardware_gpu_count=-8))
    land_old(old, *landable("huge-run-figure", day=8, window_s=-1e300))
    run, cells = landable("bad-figures", day=9)
    cells[1]["total_tok_s"] = math.nan  # a valid decode cell without its figure
    cells[2]["ttft_ms"] = -1e300
    cells[3].update(status="failed", error="boom", tbt_ms=math.inf)
    land_old(old, run, cells)

    rc = cli.main(["warehouse", "migrate", "--from", str(old), "--warehouse", str(new)])
    out, err = capsys.readouterr()
    assert rc == 1, err
    report = json.loads(out)
    refused = {r["run_id"]: r["reason"] for r in report["refused"]}
    assert len(refused) == 6, refused
    assert any("too long" in why for why in refused.values())
    assert any("negative" in why or "hardware_gpu_count" in why for why in refused.values())
    assert "huge-run-figure" in refused and "window_s" in refused["huge-run-figure"]
    wh = Warehouse(new)
    landed = wh.query("SELECT run_id, status FROM runs ORDER BY 1").values.tolist()
    # its status as a landing makes it: a failed cell (quarantined) makes the run failed
    assert landed == [["bad-figures", "failed"], ["good", "success"]]
    cells_landed = wh.query("SELECT count(*) AS n FROM cells WHERE run_id = 'bad-figures'")[
        "n"
    ].tolist()
    assert cells_landed == [len(cells) - 3]
    figures = wh.query("SELECT total_tok_s, ttft_ms, tbt_ms FROM cells").values.ravel()
    assert all(math.isfinite(v) and abs(v) < 1e15 for v in figures if v == v and v is not None)
    # quarantined with the reason, under names the filesystem takes
    quarantined, doc = wh.read_quarantine("bad-figures", "cells")
    assert len(quarantined) == 3 and doc["result"]
    root = new / "_quarantine" / "runs"
    assert len([p for p in root.iterdir() if p.is_dir()]) == 6
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/escaped").exists()
    for p in new.rglob("*"):
        assert "\n" not in p.name and not p.name.startswith(".hidden")
    assert "refused" in err and "6" in err
