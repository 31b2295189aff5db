"""A damaged Delta log (issue #42 item 12): a truncated `_delta_log/*.json` gave a Python and a
Rust traceback (45 lines) from `query` and `ingest`. Now: one line naming the table and the
file, and the way to recover (warehouse/README.md, "A damaged log"), which works."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from speedmatrix import cli
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_requests, make_run

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"


@pytest.fixture
def damaged(tmp_path) -> tuple[Path, Path]:
    """Two runs landed; the newest entry of cells' log cut short (a full disk, a bad copy)."""
    root = tmp_path / "wh"
    wh = Warehouse(root)
    for i in range(2):
        wh.land_run(make_run(f"a{i}", day=1 + i), make_cells(), make_requests(1))
    entry = sorted((root / "cells" / "_delta_log").glob("*.json"))[-1]
    entry.write_bytes(entry.read_bytes()[:40])
    return root, entry


def _one_line(err: str, entry: Path) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "cells" in err and entry.name in err, err
    assert "warehouse/README.md" in err, err


def test_query_says_which_table_and_file_in_one_line(damaged, capsys):
    root, entry = damaged
    rc = cli.main(["query", "SELECT count(*) AS n FROM cells", "--warehouse", str(root)])
    err = capsys.readouterr().err
    assert rc == 2
    _one_line(err, entry)


def test_ingest_says_which_table_and_file_in_one_line(damaged, capsys):
    root, entry = damaged
    rc = cli.main(["ingest", str(REFERENCE), "--warehouse", str(root)])
    err = capsys.readouterr().err
    assert rc == 2
    _one_line(err, entry)


def test_maintain_names_it_too(damaged, capsys):
    root, entry = damaged
    assert cli.main(["warehouse", "maintain", "--warehouse", str(root)]) == 1
    err = capsys.readouterr().err
    assert "cells" in err and entry.name in err and "Traceback" not in err, err


def test_the_documented_recovery_gives_the_earlier_version(damaged, capsys):
    """warehouse/README.md: move the damaged newest entry out of the log; the table is its
    earlier version again (the run that entry landed is to be landed again)."""
    root, entry = damaged
    readme = (ROOT / "warehouse" / "README.md").read_text()
    assert "### A damaged log" in readme and "_delta_log" in readme
    entry.rename(root / "damaged-entry.json")
    rc = cli.main(
        ["query", "SELECT run_id, count(*) AS n FROM cells GROUP BY 1", "--warehouse", str(root)]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "a0" in out and "a1" not in out, out
    Warehouse(root).land_run(make_run("a1", day=2), make_cells(), make_requests(1))
    rows = Warehouse(root).query("SELECT run_id, count(*) AS n FROM cells GROUP BY 1 ORDER BY 1")
    assert rows.values.tolist() == [["a0", 5], ["a1", 5]]


def test_the_maintenance_task_fails_after_maintaining_the_other_tables(damaged, caplog):
    import logging

    from speedmatrix.flows.maintenance import run_maintenance

    root, _entry = damaged
    with (
        caplog.at_level(logging.INFO, logger="speedmatrix.flows.maintenance"),
        # every table exists from the first landing: runs, cells, requests and the extra ones
        pytest.raises(RuntimeError, match=r"1 of 6 tables not maintained \(cells: table cells"),
    ):
        run_maintenance(str(root))
    logged = [r.getMessage() for r in caplog.records]
    for table in ("runs", "requests", "comparisons", "noise", "cell_repeats"):
        assert any(m.startswith(f"{table}: ") and "vacuumed" in m for m in logged), logged


@pytest.fixture
def damaged_checkpoint(tmp_path) -> tuple[Path, Path]:
    """Two runs landed and maintained (a checkpoint written); the checkpoint then cut short.
    The same class as a cut entry: it gave a Python and a Rust traceback ("Corrupt footer")."""
    root = tmp_path / "wh"
    wh = Warehouse(root)
    for i in range(2):
        wh.land_run(make_run(f"a{i}", day=1 + i), make_cells(), make_requests(1))
    assert cli.main(["warehouse", "maintain", "--warehouse", str(root)]) == 0
    checkpoint = sorted((root / "cells" / "_delta_log").glob("*.checkpoint.parquet"))[-1]
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    return root, checkpoint


def test_a_damaged_checkpoint_is_named_in_one_line_by_query_and_ingest(damaged_checkpoint, capsys):
    root, checkpoint = damaged_checkpoint
    capsys.readouterr()
    assert cli.main(["query", "SELECT count(*) AS n FROM cells", "--warehouse", str(root)]) == 2
    _one_line(capsys.readouterr().err, checkpoint)
    assert cli.main(["ingest", str(REFERENCE), "--warehouse", str(root)]) == 2
    err = capsys.readouterr().err
    _one_line(err, checkpoint)
    assert "_last_checkpoint aside" in err, err


def test_the_documented_recovery_of_a_checkpoint_keeps_every_run(damaged_checkpoint, capsys):
    """warehouse/README.md: move the checkpoint and `_last_checkpoint` aside; the entries
    before it are read instead, so nothing is lost, and the next maintenance checkpoints again."""
    root, checkpoint = damaged_checkpoint
    readme = (ROOT / "warehouse" / "README.md").read_text()
    assert "_last_checkpoint" in readme, "the recovery of a checkpoint is not documented"
    checkpoint.rename(root / "damaged.checkpoint.parquet")
    (root / "cells" / "_delta_log" / "_last_checkpoint").rename(root / "last_checkpoint")
    rows = Warehouse(root).query("SELECT run_id, count(*) AS n FROM cells GROUP BY 1 ORDER BY 1")
    assert rows.values.tolist() == [["a0", 5], ["a1", 5]]
    assert cli.main(["warehouse", "maintain", "--warehouse", str(root)]) == 0
    assert (root / "cells" / "_delta_log" / "_last_checkpoint").exists()
