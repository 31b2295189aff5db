"""The analyst queries in warehouse/README.md run as written: plain DuckDB, plain pandas, and
`speedmatrix query` over the same warehouse."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_run

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "warehouse" / "README.md").read_text(encoding="utf-8")
RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A directory with warehouse/ in it: nightly runs of two recipes, March 2025 to March 2026."""
    root = tmp_path_factory.mktemp("checkout")
    wh = Warehouse(root / "warehouse")
    day = dt.date(2025, 3, 10)
    while day <= dt.date(2026, 3, 14):
        if day.day in (10, 14):
            for recipe in (RECIPE, "cpu/tiny/llama-tiny"):
                prefix = "nightly" if recipe == RECIPE else "tiny"
                run = make_run(
                    f"{prefix}-{day.isoformat()}",
                    recipe_id=recipe,
                    started_at=dt.datetime(day.year, day.month, day.day, 2, tzinfo=dt.UTC),
                )
                cells = make_cells(scale=1 + day.toordinal() % 7 / 100)
                cells[2]["context_label"], cells[2]["context_tokens"] = "32K", 32768
                cells[3]["context_label"], cells[3]["context_tokens"] = "32K", 32768
                requests = [
                    {
                        "phase": "decode",
                        "context_tokens": 8192,
                        "concurrency": 2,
                        "request_index": i,
                    }
                    for i in range(2)
                ]
                wh.land_run(run, cells, requests)
        day += dt.timedelta(days=1)
    return root


def test_readme_sql_runs_with_plain_duckdb(checkout, monkeypatch):
    monkeypatch.chdir(checkout)
    sql = blocks("sql")
    assert len(sql) == 5  # the views, the three questions, the three again as narrow globs
    con = duckdb.connect()
    con.execute(sql[0])
    q1, q2, q3 = (con.execute(q).fetchall() for q in sql[1:4])
    assert len(q1) == 20  # the 10th and 14th of each month of 2025 from March on
    assert all(r[0].year == 2025 for r in q1)
    assert len(q2) == 5
    assert {r[0] for r in q3} == {RECIPE, "cpu/tiny/llama-tiny"}
    assert len(q3) == 2 * 3  # 3 valid decode cells per run
    narrow = [st for st in sql[4].split(";") if st.strip()]
    assert len(narrow) == 3
    assert con.execute(narrow[0]).fetchall() == q1
    assert con.execute(narrow[1]).fetchall() == q2
    assert con.execute(narrow[2]).fetchall() == q3


def test_readme_pandas_runs(checkout):
    code = blocks("python")[0]
    code += "\nprint(len(trend), len(matrix), sorted(set(day['run_id'])))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "20 5 ['nightly-2026-03-14', 'tiny-2026-03-14']"


def test_readme_queries_through_speedmatrix_query(checkout):
    wh = Warehouse(checkout / "warehouse")
    sql = blocks("sql")
    assert len(wh.query(sql[1])) == 20
    assert len(wh.query(sql[2])) == 5
    assert len(wh.query(sql[3])) == 6


def test_readme_queries_through_the_read_only_command(checkout, monkeypatch, capsys):
    """The command itself (read-only since issue #16): the three questions over its views, and
    the narrow globs, which read inside the warehouse and so are allowed too."""
    from speedmatrix import cli

    monkeypatch.chdir(checkout)
    sql = blocks("sql")
    narrow = [st for st in sql[4].split(";") if st.strip()]
    for question, rows in (
        (sql[1], 20),
        (sql[2], 5),
        (sql[3], 6),
        *zip(narrow, (20, 5, 6), strict=True),
    ):
        rc = cli.main(["query", question, "--warehouse", "warehouse", "--format", "csv"])
        out = capsys.readouterr()
        assert (rc, out.err) == (0, ""), question
        assert len(out.out.splitlines()) == rows + 1, question
