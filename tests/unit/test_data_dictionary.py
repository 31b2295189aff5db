"""Columns that describe themselves where analysts look (#44 item 2): DuckDB's column comments
through `speedmatrix query` and the README's DuckDB recipe, the field metadata pandas and
Polars users read, and the generated data dictionary (docs page and site page)."""

from __future__ import annotations

import csv
import io
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_requests, make_run
from test_warehouse_readme import DUCKDB, block, run_block

from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[2]
COMMENTS = (
    "SELECT table_name, column_name, comment FROM duckdb_columns() "
    "WHERE table_name IN ('runs', 'cells', 'requests', 'comparisons', 'noise', 'cell_repeats')"
)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("dictionary")
    Warehouse(root / "warehouse").land_run(make_run("r-1"), make_cells(), make_requests(2))
    return root


def check_comments(rows) -> None:
    """Every column of every table has a comment; units and enum values are in them."""
    got = {(t, c): comment for t, c, comment in rows}
    assert {t for t, _ in got} == {
        "runs", "cells", "requests", "comparisons", "noise", "cell_repeats"
    }  # fmt: skip
    missing = sorted(k for k, v in got.items() if not v)
    assert not missing, missing
    assert "[ms]" in got["cells", "ttft_ms"] and "[tok/s]" in got["cells", "total_tok_s"]
    assert "[s]" in got["runs", "window_s"]
    assert "values: valid, over_capacity, failed, invalid" in got["cells", "status"]
    assert "values: success, failed, partial" in got["runs", "status"]
    assert "exact" in got["comparisons", "noise_source"]
    assert "values: cell, pooled, none" in got["noise", "between_source"]


def test_speedmatrix_query_shows_every_column_comment(checkout, monkeypatch, capsys):
    from speedmatrix import cli

    monkeypatch.chdir(checkout)
    assert cli.main(["query", COMMENTS, "--warehouse", "warehouse", "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))[1:]
    check_comments(rows)


def test_the_readme_duckdb_recipe_carries_descriptions_and_units(checkout):
    out = run_block(block(DUCKDB), checkout, f"print(con.execute({COMMENTS!r}).fetchall())")
    rows = eval(out.splitlines()[-1])  # a list of tuples of str, printed by the block's tail
    got = {(t, c): comment for t, c, comment in rows}
    assert "[ms]" in got["cells", "ttft_ms"] and got["cells", "ttft_ms"].startswith("median")
    assert "[tok/s]" in got["cells", "total_tok_s"]


def test_pandas_and_polars_users_read_doc_and_unit_from_the_schema(checkout):
    from deltalake import DeltaTable

    fields = {
        f.name: f.metadata for f in DeltaTable(str(checkout / "warehouse/cells")).schema().fields
    }
    assert fields["ttft_ms"]["unit"] == "ms" and fields["ttft_ms"]["doc"]
    assert fields["total_tok_s"]["unit"] == "tok/s"
    out = run_block(block(".schema().fields"), checkout, "")
    assert eval(out) == {"doc": "median time to first output token", "unit": "ms"}


def test_the_data_dictionary_page_is_generated_and_current():
    from speedmatrix.store.dictionary import markdown

    page = (ROOT / "docs" / "data-dictionary.md").read_text(encoding="utf-8")
    assert page == markdown(), "regenerate: python -m speedmatrix.store.dictionary"
    assert re.search(r"\| `noise_source` \|", page) and "`over_capacity`" in page
    assert "| `ttft_ms` | double | yes | ms |" in page


def test_the_site_has_a_data_dictionary_page_linked_from_its_index(checkout, browser):
    from speedmatrix.report.site import build_site

    out = checkout / "site"
    build_site(Warehouse(checkout / "warehouse"), out)
    assert 'href="data-dictionary.html"' in (out / "index.html").read_text(encoding="utf-8")
    page = browser.open_page(out / "data-dictionary.html")
    assert page.console == []
    for table in ("runs", "cells", "requests", "comparisons", "noise", "cell_repeats"):
        assert f'<h2 id="{table}">' in page.dom
    assert re.search(r"<td><code>ttft_ms</code></td>\s*<td>double</td>\s*<td>ms</td>", page.dom)
    assert "<code>over_capacity</code>" in page.dom


def test_a_column_whose_description_changed_still_lands(tmp_path):
    """A field's doc edited in records.py must not make every existing warehouse refuse the
    next landing (delta-rs refuses to merge two values of one metadata key): the table keeps
    the description it has, new columns bring theirs."""
    import pyarrow as pa

    from speedmatrix.store.delta import replace_rows

    uri = str(tmp_path / "t")
    old = pa.schema([pa.field("run_id", pa.string(), metadata={"doc": "old words"}),
                     pa.field("recipe_id", pa.string())])  # fmt: skip
    new = pa.schema([pa.field("run_id", pa.string(), metadata={"doc": "new words", "unit": "x"}),
                     pa.field("recipe_id", pa.string()),
                     pa.field("added", pa.int64(), metadata={"doc": "a new column"})])  # fmt: skip
    replace_rows(uri, pa.table({"run_id": ["a"], "recipe_id": ["r"]}, schema=old),
                 "run_id = 'a'", str(tmp_path))  # fmt: skip
    replace_rows(uri, pa.table({"run_id": ["b"], "recipe_id": ["r"], "added": [1]}, schema=new),
                 "run_id = 'b'", str(tmp_path))  # fmt: skip
    from deltalake import DeltaTable

    table = DeltaTable(uri)
    assert table.to_pyarrow_table().num_rows == 2
    fields = {f.name: f.metadata for f in table.schema().fields}
    assert fields["run_id"]["doc"] == "old words" and fields["added"]["doc"] == "a new column"
