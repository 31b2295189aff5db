"""The command line imports only what the chosen command needs (issue #32: `speedmatrix query
"select 1"` starts in under a second). Held by what a fresh process has imported, not by time:
each case runs in a subprocess and lists the heavy modules in its sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_warehouse import make_cells, make_run

from speedmatrix.store.warehouse import Warehouse

HEAVY = ("pandas", "matplotlib", "great_expectations", "airflow", "deltalake", "duckdb", "pyarrow")

PROBE = """
import contextlib, io, json, sys
from speedmatrix.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as exc:
        rc = exc.code
heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps({"rc": rc, "out": out.getvalue(), "heavy": heavy}))
"""


def probe(argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "argv", [["--help"], ["query", "--help"], ["site", "--help"], ["run", "--help"]]
)
def test_help_imports_no_heavy_library(argv):
    got = probe(argv)
    assert got["rc"] == 0
    assert got["heavy"] == []


def test_query_select_1_imports_neither_pandas_nor_the_tables(tmp_path):
    # a warehouse with a run in it: the tables exist, and `select 1` needs none of them
    Warehouse(str(tmp_path)).land_run(make_run(), make_cells(), [])
    got = probe(["query", "select 1 AS one", "--warehouse", str(tmp_path)])
    assert got["rc"] == 0
    assert got["out"] == " one\n   1\n"
    assert set(got["heavy"]) <= {"duckdb", "pyarrow"}, got["heavy"]


def test_query_of_a_table_imports_no_airflow_gx_or_matplotlib(tmp_path):
    Warehouse(str(tmp_path)).land_run(make_run(), make_cells(), [])
    got = probe(["query", "SELECT count(*) AS n FROM runs", "--warehouse", str(tmp_path)])
    assert got["rc"] == 0
    assert got["out"] == " n\n 1\n"
    assert not {"matplotlib", "great_expectations", "airflow"} & set(got["heavy"]), got["heavy"]


def test_the_process_exits_cleanly_after_a_query(tmp_path):
    # a query's timeout timer once outlived the command and the process aborted at exit
    Warehouse(str(tmp_path)).land_run(make_run(), make_cells(), [])
    done = subprocess.run(
        [sys.executable, "-m", "speedmatrix", "query", "select 1", "--warehouse", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
