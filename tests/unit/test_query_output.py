"""`speedmatrix query` prints values as what they are (#44 item 5): a DATE as a date in JSON,
a NULL as NULL in the table output (not NaN)."""

from __future__ import annotations

import json

from speedmatrix import cli

SQL = (
    "SELECT r.run_id, r.run_date, r.started_at, r.engine_commit, c.total_tok_s "
    "FROM runs r JOIN cells c USING (run_id) ORDER BY c.phase DESC, c.context_tokens, c.concurrency LIMIT 2"
)


def land(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_warehouse import make_cells, make_run

    from speedmatrix.store.warehouse import Warehouse

    root = tmp_path / "warehouse"
    Warehouse(root).land_run(make_run("r-1"), make_cells(), [])
    return root


def test_json_writes_dates_as_dates_and_nulls_as_null(tmp_path, capsys):
    root = land(tmp_path)
    assert cli.main(["query", SQL, "--warehouse", str(root), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["run_date"] == "2026-03-14"
    assert rows[0]["started_at"] == "2026-03-14T02:00:00+00:00"
    assert rows[0]["engine_commit"] is None and rows[0]["total_tok_s"] == 6206.0


def test_table_prints_null_as_null(tmp_path, capsys):
    root = land(tmp_path)
    assert cli.main(["query", SQL, "--warehouse", str(root)]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and "None" not in out
    assert out.splitlines()[1].split()[-2:] == ["NULL", "6206.0"]
