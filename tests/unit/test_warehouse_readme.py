"""The analyst queries in warehouse/README.md run as written: plain DuckDB, plain pandas, and
`speedmatrix query` over the same warehouse."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speedmatrix.flows.resolution import make_run_id
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_run

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "warehouse" / "README.md").read_text(encoding="utf-8")
RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"
TINY = "cpu/tiny/llama-tiny"
YEAR_RUNS = 11  # the demo recipe's runs within the last twelve months (the fixture's)


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def block(marker: str) -> str:
    """The one Python block of the README that uses ``marker``."""
    (found,) = [b for b in blocks("python") if marker in b]
    return found


DUCKDB, POLARS, PANDAS = "to_pyarrow_dataset()", "scan_delta", "to_pandas"


def demo_run(recipe: str, when: dt.datetime) -> dict:
    """A run as the speed_matrix DAG lands it for `make demo`: its run id, a manual trigger,
    a 40-character commit, the local host."""
    run_id = make_run_id(recipe, "main", "manual", when, f"manual__{when.isoformat()}")
    return make_run(
        run_id,
        recipe_id=recipe,
        trigger="manual",
        host="local",
        engine_commit="9fedd24fa0c1" + "0" * 28,
        started_at=when,
        finished_at=when + dt.timedelta(minutes=6),
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A directory with warehouse/ in it, as `make demo` leaves it, with history: the demo
    recipe's runs every 30 days over the last 300 days and two older than 500 days, another
    recipe's runs; today, a run of each (the demo recipe's the latest). No date is fixed: the
    README's questions must answer on the day the test runs."""
    root = tmp_path_factory.mktemp("checkout")
    wh = Warehouse(root / "warehouse")
    midnight = dt.datetime.combine(dt.datetime.now(dt.UTC).date(), dt.time(), tzinfo=dt.UTC)
    days = [*range(0, YEAR_RUNS * 30, 30), 500, 530]
    plan = [(RECIPE, midnight - dt.timedelta(days=d) + dt.timedelta(minutes=2)) for d in days]
    plan += [(TINY, midnight - dt.timedelta(days=d) + dt.timedelta(minutes=1)) for d in (0, 45)]
    for recipe, when in plan:
        cells = make_cells(scale=1 + when.toordinal() % 7 / 100)
        cells[2]["context_label"], cells[2]["context_tokens"] = "32K", 32768
        cells[3]["context_label"], cells[3]["context_tokens"] = "32K", 32768
        requests = [
            {"phase": "decode", "context_tokens": 8192, "concurrency": 2, "request_index": i}
            for i in range(2)
        ]
        wh.land_run(demo_run(recipe, when), cells, requests)
    return root


CELLS = len(make_cells())  # rows of one run's matrix
DECODE_VALID = sum(c["phase"] == "decode" and c["status"] == "valid" for c in make_cells())


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


def test_readme_has_the_four_questions_and_three_recipes():
    assert len(blocks("sql")) == 4
    for code in blocks("python"):
        assert "speedmatrix" not in code  # readers without the package
    assert [block(m) for m in (DUCKDB, POLARS, PANDAS)]


def test_readme_recipes_invent_no_ids_or_dates():
    """No run id, date or trigger a warehouse may not hold: the questions find them."""
    section = README[README.index("## Analyst recipes") : README.index("**Plain Parquet**")]
    assert not re.search(r"20\d\d-\d\d", section), "a hard-coded month or date"
    assert "nightly" not in section and "run_id = '" not in section


def test_readme_recipes_read_only_the_columns_they_need():
    polars, pandas_ = block(POLARS), block(PANDAS)
    for question in re.split(r"\n# \d\. ", polars)[1:]:
        assert ".select(" in question or ".agg(" in question, question
    for call in re.findall(r"to_pandas\((.*?)\)\s*$", pandas_, flags=re.S | re.M):
        assert "columns=" in call, call


def test_readme_duckdb_recipe_runs_the_four_questions(checkout):
    q0, q1, q2, q3 = blocks("sql")
    tail = "\n".join(
        [
            f"q0 = con.execute({q0!r}).fetchall()",
            f"q1 = con.execute({q1!r}).fetchall()",
            f"q2 = con.execute({q2!r}).fetchall()",
            f"q3 = con.execute({q3!r}).fetchall()",
            "print([r[:2] for r in q0], len(q1), len({r[0] for r in q2}), len(q2),"
            " sorted({r[0] for r in q3}), len(q3))",
        ]
    )
    out = run_block(block(DUCKDB), checkout, tail)
    expected = [(TINY, 2), (RECIPE, YEAR_RUNS + 2)]
    assert out.splitlines()[-1] == (
        f"{expected} {YEAR_RUNS} 1 {CELLS} {[TINY, RECIPE]} {2 * DECODE_VALID}"
    )


@pytest.mark.parametrize("which", [POLARS, PANDAS], ids=["polars", "pandas"])
def test_readme_polars_and_pandas_recipes_run(checkout, which):
    out = run_block(
        block(which),
        checkout,
        "print(len(present), len(trend), len(matrix), len(set(matrix['run_id'])),"
        " sorted(set(day['recipe_id'])), len(day))",
    )
    assert out == f"2 {YEAR_RUNS} {CELLS} 1 {[TINY, RECIPE]} {2 * DECODE_VALID}"


def test_readme_queries_through_speedmatrix_query(checkout):
    wh = Warehouse(checkout / "warehouse")
    rows = [len(wh.query(q)) for q in blocks("sql")]
    assert rows == [2, YEAR_RUNS, CELLS, 2 * DECODE_VALID]


def test_readme_queries_through_the_read_only_command(checkout, monkeypatch, capsys):
    """The command itself (read-only since issue #16): the questions over its views."""
    from speedmatrix import cli

    monkeypatch.chdir(checkout)
    for question, rows in zip(blocks("sql"), (2, YEAR_RUNS, CELLS, 2 * DECODE_VALID), strict=True):
        rc = cli.main(["query", question, "--warehouse", "warehouse", "--format", "csv"])
        out = capsys.readouterr()
        assert (rc, out.err) == (0, ""), question
        assert len(out.out.splitlines()) == rows + 1, question


def test_every_table_exists_from_the_first_landing(tmp_path):
    """One run landed, no repeats, no verdicts: all six tables open in every reader."""
    import polars as pl
    from deltalake import DeltaTable

    from speedmatrix.store.schemas import EXTRA_TABLES, TABLES

    wh = Warehouse(tmp_path / "warehouse")
    wh.land_run(demo_run(RECIPE, dt.datetime.now(dt.UTC)), make_cells(), [])
    for table in (*TABLES, *EXTRA_TABLES):
        uri = str(tmp_path / "warehouse" / table)
        assert DeltaTable.is_deltatable(uri), table
        columns = pl.scan_delta(uri).collect_schema().names()
        assert {"run_id", "recipe_id", "run_month"} <= set(columns), table
    assert pl.scan_delta(str(tmp_path / "warehouse" / "cell_repeats")).collect().height == 0
    assert len(wh.query("SELECT * FROM cell_repeats")) == 0


def test_the_readme_tour_query_says_which_run_and_phase(checkout, monkeypatch, capsys):
    """The tour's step 2 (README.md), as written: its rows name their run and phase, so two
    runs, and prefill and decode rows, do not read as one matrix."""
    from speedmatrix import cli

    tour = (ROOT / "README.md").read_text(encoding="utf-8").split("## A 5-minute tour")[1]
    sql = re.search(r'speedmatrix query "(.*?)"', tour, flags=re.S).group(1)
    monkeypatch.chdir(checkout)
    assert cli.main(["query", sql, "--warehouse", "warehouse", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",")[:2] == ["run_id", "phase"]
    assert len(lines) - 1 == CELLS * (YEAR_RUNS + 2 + 2)


def test_the_readme_tour_runs_a_recipe_at_a_vllm_commit():
    """ "Run recipe X at vLLM commit Y", as the tour writes it, for the CLI and the DAG: the
    command line parses to that recipe and ref, the conf passes the DAG's own checks."""
    import json
    import shlex

    from speedmatrix.cli import build_parser
    from speedmatrix.flows.runconf import conf_problems

    tour = (ROOT / "README.md").read_text(encoding="utf-8").split("## A 5-minute tour")[1]
    tour = tour.split("\n## ")[0]
    line = re.search(r"uv run (speedmatrix run \S+ --engine-ref \S+)", tour).group(1)
    argv = shlex.split(line)[1:]
    args = build_parser(argv).parse_args(argv)
    assert (args.recipe, args.engine_ref) == (RECIPE, "9fedd24fa864")
    conf = json.loads(re.search(r"dags trigger speed_matrix --conf '(\{.*?\})'", tour).group(1))
    assert conf == {"recipe": RECIPE, "engine_ref": "9fedd24fa864"}
    assert conf_problems(conf) == []
    assert "Trigger DAG w/ config" in tour or "trigger form" in tour
