"""`speedmatrix ingest`: the reference page lands as one run; broken pages land nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_inprocess import run_cli
from deltalake import DeltaTable

from speedmatrix.published.pagetext import ReportParseError
from speedmatrix.published.parse import parse_report
from speedmatrix.store.warehouse import Warehouse

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "include" / "reference" / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"


def speedmatrix(*args, warehouse=None):
    """`speedmatrix *args` in this process (tests/cli_inprocess.py); the process itself is
    run by the disk-full test below, which needs one of its own."""
    env = {} if warehouse is None else {"SPEEDMATRIX_WAREHOUSE": str(warehouse)}
    return run_cli(*args, env=env)


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


HUGE = "9" * 400


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("- 4,096 tokens", f"- {HUGE} tokens"),  # Max output: was an OverflowError traceback
        ("- 30 s", f"- {HUGE} s"),  # Time per measurement: landed as inf, "inf s" on the page
        ("- 768 GB (8 × 96 GB)", f"- 768 GB (8 × {HUGE} GB)"),  # VRAM: landed as inf
        ("- 768 GB (8 × 96 GB)", f"- 768 GB (8 × 1{'0' * 20} GB)"),  # finite, absurd
        ("| 32K | 2 | Valid | 90.0 |", f"| 32K | 2 | Valid | {HUGE}.0 |"),
        (
            "| 32K | 2 | Valid | 90.0 | 44.6 | 589 ms |",
            f"| 32K | 2 | Valid | 90.0 | 44.6 | {HUGE} ms |",
        ),
        ("| Sustained decode | 32K | 2 |", f"| Sustained decode | {HUGE}K | 2 |"),
    ],
)
def test_infinite_or_absurd_numbers_are_refused_naming_the_line(old, new):
    """Issue #33 item 2: a number on a page is finite and in range, or the page is refused
    with the line that holds it (no traceback, nothing infinite landed)."""
    text = REFERENCE.read_text(encoding="utf-8")
    assert old in text
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if old in ln)
    with pytest.raises(ReportParseError) as info:
        parse_report(text.replace(old, new, 1), source="page.txt")
    assert info.value.line == line, info.value
    assert "too large" in str(info.value) or "not finite" in str(info.value)


def test_ingest_of_an_overflowing_page_is_one_line(tmp_path):
    page = tmp_path / "huge.txt"
    text = REFERENCE.read_text(encoding="utf-8")
    page.write_text(text.replace("- 4,096 tokens", f"- {HUGE} tokens"), encoding="utf-8")
    result = speedmatrix("ingest", str(page), warehouse=tmp_path / "wh")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{page}:44: " in result.stderr and "Traceback" not in result.stderr


def test_a_name_too_long_for_a_file_is_refused_before_anything_lands(tmp_path):
    """Issue #33 item 1: a page whose served model is 300 characters long wrote the landing's
    commit record, then failed with ENAMETOOLONG, and every later landing failed too. Now
    the page is refused first (records.path_field_problems), naming the field and the limit;
    nothing of it lands, and the warehouse takes the next page."""
    from speedmatrix.records import MAX_PATH_VALUE

    long_model = "M" * 300
    page = tmp_path / "long.txt"
    text = REFERENCE.read_text(encoding="utf-8").replace("Kimi-K2.7-Code-NVFP4", long_model)
    page.write_text(text, encoding="utf-8")
    wh_root = tmp_path / "wh"
    for extra in ([], ["--recipe-id", "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"]):
        result = speedmatrix("ingest", str(page), *extra, warehouse=wh_root)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        err = result.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"speedmatrix ingest: {page}: ")
        assert "served_model is too long" in err and f"the limit is {MAX_PATH_VALUE}" in err
        assert not wh_root.exists() or parquet_files(wh_root) == []
    ok = speedmatrix("ingest", str(REFERENCE), warehouse=wh_root)
    assert ok.returncode == 0, ok.stderr


def test_a_disk_that_fills_during_validation_is_one_line_and_leaves_nothing(tmp_path):
    """Issue #33 item 14: a write that fails in validation (ENOSPC) gave a raw traceback and
    left 0-byte `gx-results.json.tmp-*` files. Here the write fails as on a full disk, through
    the process's file-size limit (RLIMIT_FSIZE: EFBIG from the same write, no root needed)."""
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    wh_root = tmp_path / "wh"
    env = dict(os.environ, SPEEDMATRIX_WAREHOUSE=str(wh_root))
    result = subprocess.run(
        [sys.executable, "-m", "speedmatrix", "ingest", str(REFERENCE)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        preexec_fn=small_files,
    )
    assert result.returncode == 2 and result.stdout == ""
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("speedmatrix ingest: ") and "too large" in err.lower()
    left = [p for p in wh_root.rglob("*") if p.is_file()]
    assert not [p for p in left if ".tmp-" in p.name], left
    assert parquet_files(wh_root) == []


def _short_prompt_page(shortfall: float, from_tokens: int = 64 * 1024) -> str:
    """The reference page with every prefill row from `from_tokens` on re-timed so that its
    tok/s x TTFT is `shortfall` short of the label (the published tool sizes prompts by
    characters: issue #35), rendered by our own renderer (summary sections kept consistent)."""
    from speedmatrix.records import parse_context
    from speedmatrix.report.render import render_markdown

    parsed = parse_report(REFERENCE.read_text(encoding="utf-8"))
    for c in parsed.cells:
        label = parse_context(c["context_label"])
        if c["phase"] == "prefill" and label >= from_tokens:
            c["ttft_ms"] = float(round(label * (1 - shortfall) / c["total_tok_s"] * 1000.0))
    return render_markdown(parsed.run, parsed.cells)


def test_a_page_whose_long_prompts_are_2pct_short_lands_every_row_valid(tmp_path):
    """Issue #35 part 1: long prompts 2% short of their labels (as the published tool sends
    them) land as published, every row valid, each cell recording the prompt its label's
    prefill row implies (beside the label); 4% short is more than the tool's accounting
    allows, and those rows are quarantined."""
    page = tmp_path / "short.md"
    page.write_text(_short_prompt_page(0.02), encoding="utf-8")
    result = speedmatrix("ingest", str(page), warehouse=tmp_path / "wh")
    assert result.returncode == 0, result.stderr
    wh = Warehouse(tmp_path / "wh")
    run, cells, _ = wh.read_run(result.stdout.strip())
    assert run["status"] == "success" and len(cells) == 55
    assert wh.read_quarantine(run["run_id"], "cells") is None
    by = {(c["phase"], c["context_label"], c["concurrency"]): c for c in cells}
    for label in ("64K", "128K", "251K", "256K"):
        label_tokens = int(label[:-1]) * 1024
        implied = by[("prefill", label, 1)]["context_tokens"]
        assert abs(implied / label_tokens - 0.98) < 0.001, (label, implied)
    assert (
        by[("decode", "251K", 1)]["context_tokens"] == by[("prefill", "251K", 1)]["context_tokens"]
    )
    assert by[("prefill", "8K", 1)]["context_tokens"] == 8192  # 6,206.0 x 1,320 ms

    page.write_text(_short_prompt_page(0.04), encoding="utf-8")
    result = speedmatrix("ingest", str(page), warehouse=tmp_path / "wh4")
    assert result.returncode == 0, result.stderr
    wh4 = Warehouse(tmp_path / "wh4")
    run, cells, _ = wh4.read_run(result.stdout.strip())
    assert run["status"] == "partial" and len(cells) == 55 - 4
    rows, _ = wh4.read_quarantine(run["run_id"], "cells")
    assert sorted(r["context_label"] for r in rows) == ["128K", "251K", "256K", "64K"]
    assert all(
        "expect_column_values_to_be_between(published_prompt_ratio)" in r["quarantine_reasons"]
        for r in rows
    )
