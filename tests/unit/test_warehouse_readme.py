"""The analyst queries in warehouse/README.md run as written: plain DuckDB, plain pandas, and
`speedmatrix query` over the same warehouse."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from pathlib import Path

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


def run_block(code: str, cwd: Path, tail: str) -> str:
    """A README block in a fresh interpreter (no speedmatrix import), plus ``tail``."""
    out = subprocess.run(
        [sys.executable, "-c", code + "\n" + tail],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_readme_has_the_three_questions_and_three_recipes():
    assert len(blocks("sql")) == 3
    code = blocks("python")
    assert len(code) == 3
    assert "to_pyarrow_dataset()" in code[0] and "scan_delta" in code[1] and "to_pandas" in code[2]
    for block in code:
        assert "speedmatrix" not in block  # readers without the package


def test_readme_duckdb_recipe_runs_the_three_questions(checkout):
    q1, q2, q3 = blocks("sql")
    tail = "\n".join(
        [
            f"q1 = con.execute({q1!r}).fetchall()",
            f"q2 = con.execute({q2!r}).fetchall()",
            f"q3 = con.execute({q3!r}).fetchall()",
            "print(len(q1), all(r[0].year == 2025 for r in q1), len(q2), len(q3),"
            " sorted({r[0] for r in q3}))",
        ]
    )
    out = run_block(blocks("python")[0], checkout, tail)
    assert out.splitlines()[-1] == f"20 True 5 6 ['cpu/tiny/llama-tiny', '{RECIPE}']"


@pytest.mark.parametrize("which", [1, 2], ids=["polars", "pandas"])
def test_readme_polars_and_pandas_recipes_run(checkout, which):
    out = run_block(
        blocks("python")[which],
        checkout,
        "print(len(trend), len(matrix), sorted(set(day['run_id'])))",
    )
    assert out == "20 5 ['nightly-2026-03-14', 'tiny-2026-03-14']"


def test_readme_queries_through_speedmatrix_query(checkout):
    wh = Warehouse(checkout / "warehouse")
    q1, q2, q3 = blocks("sql")
    assert len(wh.query(q1)) == 20
    assert len(wh.query(q2)) == 5
    assert len(wh.query(q3)) == 6


def test_readme_queries_through_the_read_only_command(checkout, monkeypatch, capsys):
    """The command itself (read-only since issue #16): the three questions over its views."""
    from speedmatrix import cli

    monkeypatch.chdir(checkout)
    for question, rows in zip(blocks("sql"), (20, 5, 6), strict=True):
        rc = cli.main(["query", question, "--warehouse", "warehouse", "--format", "csv"])
        out = capsys.readouterr()
        assert (rc, out.err) == (0, ""), question
        assert len(out.out.splitlines()) == rows + 1, question
