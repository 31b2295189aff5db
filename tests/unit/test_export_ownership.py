"""`speedmatrix export DIR` (issue #42, items 1 and 2): it writes only into a folder of its own
(new, empty, or holding its marker: the one marker rule the site uses too), never removes a
user's folders, and exports every table with a commit, an empty one as a schema-only file."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest

from speedmatrix import cli
from speedmatrix.ownership import claim_dir, marker_name
from speedmatrix.report.site import MARKER as SITE_MARKER
from speedmatrix.store.warehouse import Warehouse

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_requests, make_run


@pytest.fixture
def warehouse(tmp_path) -> Path:
    root = tmp_path / "wh"
    Warehouse(root).land_run(make_run("a0", day=1), make_cells(), make_requests(2))
    return root


def _export(out: Path, wh: Path) -> int:
    return cli.main(["export", "--format", "parquet", str(out), "--warehouse", str(wh)])


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_folder_of_the_users_is_refused_and_left_as_it_was(warehouse, tmp_path, capsys):
    thesis = tmp_path / "thesis"
    for name in ("runs/chapter1.tex", "cells/notes.md", "requests/data.csv"):
        (thesis / name).parent.mkdir(parents=True, exist_ok=True)
        (thesis / name).write_text(f"the user's own {name}\n")
    before = _tree(thesis)
    assert _export(thesis, warehouse) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert str(thesis) in err and "not empty" in err and marker_name("export") in err
    assert _tree(thesis) == before
    assert sorted(p.name for p in thesis.iterdir()) == ["cells", "requests", "runs"]


def test_a_site_folder_is_not_an_export_folder(warehouse, tmp_path, capsys):
    """A site holds `runs/` pages: an export there would replace them."""
    site = tmp_path / "site"
    (site / "runs").mkdir(parents=True)
    (site / SITE_MARKER).write_text("")
    (site / "runs" / "a0.html").write_text("<p>page</p>")
    assert _export(site, warehouse) == 2
    assert (site / "runs" / "a0.html").read_text() == "<p>page</p>"


def test_a_new_or_empty_folder_becomes_ours_and_is_exported_into_again(warehouse, tmp_path, capsys):
    for out in (tmp_path / "new" / "deeper", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        assert _export(out, warehouse) == 0
        assert (out / marker_name("export")).is_file()
        assert len(pd.read_parquet(out / "cells")) == 5
        Warehouse(warehouse).land_run(make_run("a1", day=2), make_cells(), [])
        assert _export(out, warehouse) == 0  # ours now: the snapshot is replaced
        assert len(pd.read_parquet(out / "cells")) == 10
        Warehouse(warehouse).delete_run("a1")


def test_the_one_marker_rule_is_the_sites_too(tmp_path):
    assert marker_name("site") == SITE_MARKER
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        claim_dir(mixed, "export")
    assert not (mixed / marker_name("export")).exists()


def test_an_ingest_only_warehouse_exports_every_table(tmp_path, capsys):
    """`requests` has a commit and no rows (an ingested page has none): it is exported as a
    schema-only file, and the tables after it are exported too."""
    root = tmp_path / "wh"
    wh = Warehouse(root)
    wh.land_run(make_run("p0", day=1), make_cells(), [])
    assert wh.delta_table("requests") is not None
    out = tmp_path / "out"
    assert _export(out, root) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "requests: 0 rows" in printed and "runs: 1 rows" in printed, printed
    empty = pd.read_parquet(out / "requests")
    assert len(empty) == 0 and {"run_id", "request_index", "recipe_id"} <= set(empty.columns)
    files = list((out / "requests").rglob("*.parquet"))
    assert len(files) == 1 and pq.read_schema(files[0]).names == list(empty.columns)
    got = duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/requests/**/*.parquet')")
    assert got.fetchall() == [(0,)]
    assert len(pd.read_parquet(out / "runs")) == 1 and len(pd.read_parquet(out / "cells")) == 5
    # and again, over the schema-only snapshot, once the table has rows
    wh.land_run(make_run("p1", day=2), make_cells(), make_requests(3))
    assert _export(out, root) == 0
    assert len(pd.read_parquet(out / "requests")) == 3
