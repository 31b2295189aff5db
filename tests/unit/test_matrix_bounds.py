"""A matrix is bounded, and its numbers are ASCII digits (issue #42 item 11).

4,999 concurrency levels and a concurrency of 10^15 were accepted by `resolve`; Unicode digits
(`١, ٢`) and `+1` read as numbers. One rule reads a context and a concurrency
(records.parse_context / records.parse_concurrency) and one rule bounds a matrix
(plan.matrix_problems), whichever way it arrives: the conf (DAG, `speedmatrix run`), a recipe.
"""

from __future__ import annotations

import datetime as dt

import pytest

from speedmatrix import records
from speedmatrix.cli import main
from speedmatrix.flows import resolution
from speedmatrix.flows.resolution import ResolveError
from speedmatrix.plan import MAX_CELLS, MAX_CONCURRENCY, MAX_CONTEXT_TOKENS
from speedmatrix.recipes import RecipeError, load_recipe, recipes_dir

WHEN = dt.datetime(2026, 11, 29, 20, 30, 5, tzinfo=dt.UTC)
CPU = "cpu/tiny/llama-tiny"


def resolve(conf):
    return resolution.resolve(
        {"recipe": CPU, **conf}, dag_run_id="manual__2026-11-29T20:30:05+00:00", run_after=WHEN
    )


def test_the_bounds_hold_the_largest_published_matrix():
    assert MAX_CONCURRENCY >= 256 and MAX_CELLS >= 64 and MAX_CONTEXT_TOKENS >= 1024 * 1024
    resolve({"concurrencies": [1, MAX_CONCURRENCY]})  # at the bound: accepted


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"concurrencies": list(range(1, 5000))}, f"at most {MAX_CELLS} cells"),
        ({"concurrencies": "1 " * 4999}, "cells"),
        ({"concurrencies": [10**15]}, f"at most {MAX_CONCURRENCY}"),
        ({"concurrencies": [MAX_CONCURRENCY + 1]}, f"at most {MAX_CONCURRENCY}"),
        ({"contexts": [10**14]}, "at most"),
        ({"prefill_contexts": ["900000K"]}, "at most"),
        ({"concurrencies": "١, ٢"}, "concurrencies"),
        ({"concurrencies": "+1, 2"}, "concurrencies"),
        ({"concurrencies": "1, 2K"}, "concurrencies"),
        ({"contexts": "١K, 256"}, "contexts"),
        ({"contexts": ["٢٥٦"]}, "contexts"),
        ({"contexts": ["+256"]}, "contexts"),
        ({"concurrencies": ["2"]}, "concurrencies"),
    ],
)
def test_resolve_refuses_an_unbounded_or_non_ascii_matrix(conf, message):
    with pytest.raises(ResolveError, match=message):
        resolve(conf)


@pytest.mark.parametrize("text", ["١", "٢K", "+1", "-1", "1.0", "１", "²", "1e3", " "])
def test_one_reading_of_a_count_takes_ascii_digits_only(text):
    with pytest.raises(ValueError):
        records.parse_concurrency(text)
    if not text.endswith("K"):
        with pytest.raises(ValueError):
            records.parse_context(text)
    with pytest.raises(ValueError):
        records.parse_cell(f"{text}x{text}")


def test_a_count_reads_as_before():
    assert records.parse_concurrency("16") == 16 == records.parse_concurrency(16)
    assert records.parse_context("8K") == 8192
    assert records.parse_cell("64Kx16") == ("decode", "64K", 16)
    with pytest.raises(ValueError):
        records.parse_concurrency(True)


@pytest.fixture
def recipe_file(tmp_path):
    def write(matrix_line: str):
        text = (recipes_dir() / f"{CPU}.yaml").read_text()
        keys = {ln.split(":")[0].strip() for ln in matrix_line.splitlines()}
        lines = [ln for ln in text.splitlines() if ln.split(":")[0].strip() not in keys]
        at = lines.index("matrix:") + 1
        lines.insert(at, f"  {matrix_line}")
        path = tmp_path / "r.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    return write


def test_the_fixture_recipe_loads(recipe_file):
    assert load_recipe(recipe_file("concurrencies: [1, 2]")).matrix.concurrencies == (1, 2)


@pytest.mark.parametrize(
    "line",
    [
        "concurrencies: ['١', '٢']",
        "concurrencies: ['+1']",
        "concurrencies: [1000000000000000]",
        f"concurrencies: [{', '.join(str(i) for i in range(1, 400))}]",
        "concurrencies: [1, 2]\n  contexts: ['٢٥٦']",
    ],
)
def test_a_recipe_is_bounded_by_the_same_rule(recipe_file, line):
    with pytest.raises(RecipeError):
        load_recipe(recipe_file(line))


@pytest.mark.parametrize("value", ["١", "+1", str(10**15)])
def test_speedmatrix_run_refuses_them_with_a_clear_error(value, capsys, tmp_path):
    argv = ["run", "--recipe", CPU, "--warehouse", str(tmp_path), "--concurrencies", value]
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's refusal of the flag's value
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "concurrenc" in err and "Traceback" not in err
