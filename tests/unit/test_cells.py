"""Cell name / key / report order: one rule in records (cell_name, parse_cell, cell_key,
cell_sort_key) used by the plan, the report, the comparison, trend and bisection."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from speedmatrix.analysis.trend import trend
from speedmatrix.analysis.verdict import compare_runs
from speedmatrix.plan import ordered_cells
from speedmatrix.records import (
    cell_key,
    cell_name,
    cell_sort_key,
    context_label,
    empty_cell,
    parse_cell,
)
from speedmatrix.report.render import comparison_rows, sort_cells


def _cell(phase, tokens, conc=1, label=None, total=100.0, **kw):
    return empty_cell(
        phase=phase,
        context_tokens=tokens,
        concurrency=conc,
        status="valid",
        total_tok_s=total,
        ttft_ms=1000.0,
        measured_s=30.0,
        context_label=label or context_label(tokens),
        **kw,
    )


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("64Kx16", ("decode", "64K", 16)),
        ("8k X 1", ("decode", "8K", 1)),
        ("8K × 4", ("decode", "8K", 4)),
        ("prefill 251K", ("prefill", "251K", 1)),
        ("prefill@8K", ("prefill", "8K", 1)),
        ("prefill:8k", ("prefill", "8K", 1)),
        # a token count names the cell its label names (trend --cell 65536x16 used to miss)
        ("65536x16", ("decode", "64K", 16)),
        ("prefill 262143", ("prefill", "256K", 1)),
        ("512x2", ("decode", "512", 2)),
    ],
)
def test_parse_cell_gives_the_canonical_key(name, key):
    assert parse_cell(name) == key


@pytest.mark.parametrize("bad", ["64K by 16", "prefill", "x16", "", None, "64Mx2"])
def test_parse_cell_refuses_what_names_no_cell(bad):
    with pytest.raises(ValueError):
        parse_cell(bad)


def test_cell_name_round_trips_through_parse_cell():
    assert cell_name("decode", 65536, 16) == "64Kx16"
    assert cell_name("decode", "64K", 16) == "64Kx16"
    assert cell_name("prefill", 262143, 1) == "prefill 256K"
    assert cell_name("run", None, None) == "run"
    for phase, ctx, conc in [("decode", 8192, 4), ("prefill", 257024, 1), ("decode", 512, 2)]:
        assert parse_cell(cell_name(phase, ctx, conc)) == cell_key(_cell(phase, ctx, conc))


def test_cell_key_pairs_by_label_not_token_count():
    ours = _cell("prefill", 262143)  # one token left for the output
    assert cell_key({"phase": "prefill", "context_tokens": 262143}) == ("prefill", "256K", 1)
    published = _cell("prefill", 262144, label="256K")  # an ingested page
    assert cell_key(ours) == cell_key(published) == ("prefill", "256K", 1)
    assert cell_key(_cell("decode", 65536, 16)) == ("decode", "64K", 16)


def test_cell_sort_key_is_the_report_order_everywhere():
    cells = [
        _cell("decode", 131072, 1),
        _cell("decode", 16384, 2),
        _cell("decode", 16384, 1),
        _cell("prefill", 262143),
        _cell("prefill", 8192),
        _cell("decode", 8192, 16),
    ]
    want = [
        ("prefill", "8K", 1),
        ("prefill", "256K", 1),
        ("decode", "8K", 16),
        ("decode", "16K", 1),
        ("decode", "16K", 2),
        ("decode", "128K", 1),  # numeric, not the string order ("128K" < "16K")
    ]
    random.Random(1).shuffle(cells)
    assert [cell_key(c) for c in sorted(cells, key=cell_sort_key)] == want
    assert [cell_key(c) for c in ordered_cells(cells)] == want
    assert [cell_key(c) for c in sort_cells(cells)] == want
    # keys sort the same way, by label or by token count
    assert sorted([k for k in reversed(want)], key=cell_sort_key) == want
    assert cell_sort_key(("decode", 16384, 2)) == cell_sort_key(("decode", "16K", 2))


def _run(run_id, commit):
    return {
        "run_id": run_id,
        "recipe_id": "sim/x",
        "host": "local",
        "status": "success",
        "engine_commit": commit,
        "started_at": datetime(2026, 11, 2, tzinfo=UTC),
    }


def test_compare_and_report_pair_the_same_cells_by_label():
    """Our 256K prefill (262,143 tokens) against an ingested page's 256K (262,144): the verdict
    and the report's comparison table both pair them (compare used to key by token count and
    call the cell missing on both sides)."""
    ours = [_cell("prefill", 262143, total=1000.0), _cell("decode", 65536, 4, total=80.0)]
    page = [
        _cell("prefill", 262144, label="256K", total=1000.0),
        _cell("decode", 65536, 4, label="64K", total=80.0),
    ]
    rows = compare_runs(_run("new", "b"), ours, _run("page", "a"), page)
    cell_rows = [r for r in rows if r["phase"] in ("prefill", "decode")]
    assert not [r for r in cell_rows if r["verdict"] == "not_comparable"], cell_rows
    prefill = [r for r in cell_rows if r["metric"] == "prefill_tok_s"]
    assert len(prefill) == 1
    assert prefill[0]["context_label"] == "256K" and prefill[0]["context_tokens"] == 262143
    assert prefill[0]["verdict"] == "noise"
    paired_by_compare = {(r["phase"], r["context_label"], r["concurrency"]) for r in cell_rows}
    paired_by_report = {cell_key(r["cell"]) for r in comparison_rows(ours, page)}
    assert paired_by_compare == paired_by_report == {("prefill", "256K", 1), ("decode", "64K", 4)}


def test_trend_finds_a_cell_named_by_token_count():
    runs = [_run("r1", "a"), _run("r2", "b")]
    cells = [
        {**_cell("decode", 65536, 16, total=t), "run_id": rid}
        for rid, t in (("r1", 100.0), ("r2", 101.0))
    ]
    by_label = trend(runs, cells, recipe="sim/x", cell="64Kx16")
    by_tokens = trend(runs, cells, recipe="sim/x", cell="65536x16")
    assert len(by_label) == 2
    assert by_tokens["value"].tolist() == by_label["value"].tolist()
