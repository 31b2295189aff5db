"""`speedmatrix ingest`: the reference page lands as one run; broken pages land nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from speedmatrix.published.parse import parse_report
from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"


def speedmatrix(*args, warehouse=None, timeout=180):
    env = dict(os.environ)
    if warehouse is not None:
        env["SPEEDMATRIX_WAREHOUSE"] = str(warehouse)
    return subprocess.run(
        [sys.executable, "-m", "speedmatrix", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def parquet_files(root: Path) -> list[Path]:
    """The data files of every table's current Delta version."""
    from deltalake import DeltaTable

    out = []
    for table in sorted(p for p in root.iterdir() if (p / "_delta_log").is_dir()):
        out += [Path(u.removeprefix("file://")) for u in DeltaTable(table).file_uris()]
    return sorted(out)


def test_ingest_reference_twice(tmp_path):
    wh_root = tmp_path / "wh"
    expected = parse_report(REFERENCE.read_text(encoding="utf-8")).run_id
    first = speedmatrix("ingest", str(REFERENCE), warehouse=wh_root)
    assert first.returncode == 0, first.stderr
    assert first.stdout == expected + "\n"  # the run id, and nothing else, on stdout
    files = parquet_files(wh_root)
    assert [p.relative_to(wh_root).parts[0] for p in files] == ["cells", "runs"]
    second = speedmatrix("ingest", str(REFERENCE), "--warehouse", str(wh_root))
    assert second.returncode == 0 and second.stdout == first.stdout
    assert len(parquet_files(wh_root)) == len(files)  # replaced, not added to
    cells = DeltaTable(wh_root / "cells").to_pandas()
    assert len(cells) == 55 and set(cells["run_id"]) == {expected}
    runs = DeltaTable(wh_root / "runs").to_pandas()
    assert runs["trigger"].tolist() == ["ingest"] and runs["source"].tolist() == [REFERENCE.name]
    wh = Warehouse(wh_root)
    assert wh.read_artifact(expected, "source.txt").decode() == REFERENCE.read_text(
        encoding="utf-8"
    )
    assert wh.query("SELECT count(DISTINCT run_id) AS n FROM runs")["n"].tolist() == [1]


def broken_pages(text: str) -> dict[str, tuple[str, int]]:
    """name -> (page text, the line the error must name)"""
    lines = text.splitlines()
    row_no = next(
        i for i, ln in enumerate(lines) if ln.startswith("| Sustained decode | 32K | 2 |")
    )
    mangled = list(lines)
    mangled[row_no] = mangled[row_no].replace(" | 589 ms | 22.4 ms |", " | 589 ms22.4 ms |")
    cut_no = next(
        i for i, ln in enumerate(lines) if ln.startswith("| Sustained decode | 64K | 4 |")
    )
    truncated = [*lines[:cut_no], lines[cut_no][:40]]
    field_no = lines.index("- Time per measurement")
    missing = lines[:field_no] + lines[field_no + 2 :]
    return {
        "mangled": ("\n".join(mangled) + "\n", row_no + 1),
        "truncated": ("\n".join(truncated), cut_no + 1),
        "missing-field": ("\n".join(missing) + "\n", None),
    }


@pytest.mark.parametrize("kind", ["mangled", "truncated", "missing-field"])
def test_broken_report_lands_nothing(tmp_path, kind):
    text, line = broken_pages(REFERENCE.read_text(encoding="utf-8"))[kind]
    page = tmp_path / f"{kind}.txt"
    page.write_text(text, encoding="utf-8")
    wh_root = tmp_path / "wh"
    # a good page given alongside is not landed either: all pages parse, or nothing lands
    result = speedmatrix("ingest", str(REFERENCE), str(page), warehouse=wh_root)
    assert result.returncode == 2
    assert result.stdout == ""
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"speedmatrix ingest: {page}:")
    if line is not None:
        assert f"{page}:{line}: " in err
    if kind == "missing-field":
        assert "missing header field 'Time per measurement'" in err
    if kind == "mangled":
        assert "11 cells, expected 12" in err
    assert not wh_root.exists() or parquet_files(wh_root) == []


def test_ingest_missing_file(tmp_path):
    result = speedmatrix("ingest", str(tmp_path / "nope.txt"), warehouse=tmp_path / "wh")
    assert result.returncode == 2 and result.stdout == ""
    assert "nope.txt" in result.stderr


def test_ingest_recipe_id_option(tmp_path):
    result = speedmatrix(
        "ingest",
        str(REFERENCE),
        "--recipe-id",
        "sim/kimi-k2.7-nvfp4-rtxpro6k-x8",
        warehouse=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    run_id = result.stdout.strip()
    run, cells, _ = Warehouse(tmp_path).read_run(run_id)
    assert run["recipe_id"] == "sim/kimi-k2.7-nvfp4-rtxpro6k-x8" and len(cells) == 55


IMPOSSIBLE_ROW = (
    "| Sustained decode | 8K | 2 | Valid | 98.0 | 48.6 | 399 ms | 20.6 ms | 2.0 | 0 | 2,940 | 30.0 s |",
    "| Sustained decode | 8K | 2 | Valid | 0.0 | 48.6 | 0 ms | 20.6 ms | 99.0 | 0 | 2,940 | 30.0 s |",
)


def test_an_impossible_published_row_is_quarantined(tmp_path):
    """0 total tok/s with 48.6 per request, 0 ms TTFT and 99 requests active on average at C=2:
    the page parses (the matrix agrees with the table), but the row cannot be true. Ingest puts
    it through the same Great Expectations suites as a measured run: it goes to quarantine with
    the expectations it failed and GX's result, the rest lands, and the run is `partial`."""
    text = REFERENCE.read_text(encoding="utf-8")
    assert IMPOSSIBLE_ROW[0] in text and "| 98.0399 ms TTFT |" in text
    page = tmp_path / "impossible.txt"
    page.write_text(
        text.replace(*IMPOSSIBLE_ROW).replace("| 98.0399 ms TTFT |", "| 0.00 ms TTFT |"),
        encoding="utf-8",
    )
    wh_root = tmp_path / "wh"
    result = speedmatrix("ingest", str(page), warehouse=wh_root)
    assert result.returncode == 0, result.stderr
    run_id = result.stdout.strip()
    wh = Warehouse(wh_root)
    run, cells, _ = wh.read_run(run_id)
    assert run["status"] == "partial"
    assert len(cells) == 54
    assert not any(c["context_label"] == "8K" and c["concurrency"] == 2 for c in cells)
    rows, doc = wh.read_quarantine(run_id, "cells")
    assert [(r["context_label"], r["concurrency"], r["total_tok_s"]) for r in rows] == [
        ("8K", 2, 0.0)
    ]
    reasons = rows[0]["quarantine_reasons"]
    for column in ("total_tok_s", "ttft_ms", "active_ratio"):
        assert any(f"({column})" in r for r in reasons), reasons
    assert doc["result"]["gx"]["success"] is False  # GX's own result, beside the rows
    assert wh.read_artifact(run_id, "validation/gx-results.json")
    assert "quarantined" in result.stderr  # said, not only filed


def test_the_reference_page_ingests_clean(tmp_path):
    result = speedmatrix("ingest", str(REFERENCE), warehouse=tmp_path)
    assert result.returncode == 0, result.stderr
    run_id = result.stdout.strip()
    wh = Warehouse(tmp_path)
    run, cells, _ = wh.read_run(run_id)
    assert run["status"] == "success" and len(cells) == 55
    assert wh.read_quarantine(run_id, "cells") is None
    assert not (tmp_path / "_quarantine").exists()
    gx = wh.read_artifact(run_id, "validation/gx-results.json")
    assert b'"success": false' not in gx
