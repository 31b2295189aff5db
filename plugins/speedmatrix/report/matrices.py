"""The run page's matrices in HTML: the decode matrix (each cell in its throughput colour
with its change against the baseline), the prefill row, and the decode matrices of spec-decode
acceptance and of cost per million output tokens.

Why apart from report.render: render lays the whole page out (Markdown and HTML) from the
published format's parts; how a matrix cell is coloured, worded and marked is one job of
its own, the one the reader's eye lands on first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from speedmatrix.published import formats as F
from speedmatrix.records import cell_key
from speedmatrix.report import palette

OVER_CAPACITY_NOTE = (
    "Over capacity: not run because this many requests at this context would exceed the "
    "server's KV cache."
)


def _absent(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _v(run: dict, key: str) -> Any:
    value = run.get(key)
    return None if _absent(value) else value


def _scale_colour(fraction: float | None) -> str:
    """A throughput's colour: one hue, light = this run's slowest, dark = its fastest."""
    return palette.throughput_colour(fraction)


def _range(values: Sequence[dict]) -> tuple[float, float]:
    """The lowest and highest valid total tok/s of `values` (cells): the colour scale's ends."""
    valid = [
        c["total_tok_s"]
        for c in values
        if c.get("status") == "valid" and not _absent(c.get("total_tok_s"))
    ]
    return (min(valid), max(valid)) if valid else (0.0, 1.0)


def throughput_matrix(
    rows: list[dict], cols: list[int], grid: dict, changes: Mapping[Any, Any]
) -> list[dict]:
    """The decode matrix (report.render.decode_matrix's rows, columns and grid) as the page
    shows it: every cell coloured within this run's range, with its change (`changes`:
    report.cellchange.cell_changes)."""
    lo, hi = _range(list(grid.values()))
    return [
        {
            "label": r["label"],
            "cells": [
                _with_change(
                    _matrix_cell(grid.get((r["tokens"], c)), lo, hi),
                    _change_of(changes, grid.get((r["tokens"], c))),
                )
                for c in cols
            ],
        }
        for r in rows
    ]


def prefill_row(cells: Sequence[dict], changes: Mapping[Any, Any]) -> list[dict]:
    """The prefill cells (in `cells`' order) as the page shows them: prompt tok/s coloured
    within this run's prefill range, TTFT, and the change against the baseline."""
    prefill_cells = [c for c in cells if c.get("phase") == "prefill"]
    plo, phi = _range(prefill_cells)
    prefill = []
    for c in prefill_cells:
        t = c.get("total_tok_s")
        ok = c.get("status") == "valid" and not _absent(t)
        colour = (
            _scale_colour((t - plo) / (phi - plo) if phi > plo else 1.0) if ok else palette.EMPTY
        )
        prefill.append(
            {
                "label": f"{cell_key(c)[1]} context",
                "rate": F.fmt_rate_summary(t, 0) if ok else F.fmt_status(c.get("status")),
                "ttft": f"{F.fmt_ms(c.get('ttft_ms'), 0)} TTFT" if ok else F.DASH,
                "colour": colour,
                "fg": palette.text_colour(colour),
                "cls": "valid" if ok else str(c.get("status")),
                "change": _change_of(changes, c),
            }
        )
    return prefill


def _change_of(changes: Mapping[Any, Any], cell: dict | None) -> Any:
    return changes.get(cell_key(cell)) if cell is not None else None


def _with_change(entry: dict, change: Any) -> dict:
    """A matrix entry with its cell's change against the baseline (report.cellchange), or
    none (`change` None: not in the baseline, not compared)."""
    entry["change"] = change
    return entry


def _matrix_cell(cell: dict | None, lo: float, hi: float) -> dict:
    """One decode matrix cell of the HTML page: text, sub-line, colours, class, tooltip.

    Valid cells carry their throughput colour, the p99 TTFT and the time to the second
    token (our page only: the published format has none); over-capacity cells stay
    quiet (small grey text, no colour: a known limit, not a result); invalid and failed cells
    say why."""
    if cell is None:
        return {
            "text": F.DASH,
            "sub": "",
            "colour": palette.EMPTY,
            "fg": "",
            "cls": "empty",
            "title": "",
        }
    status = cell.get("status")
    if status == "over_capacity":
        return {
            "text": "over capacity",
            "sub": "",
            "colour": palette.EMPTY,
            "fg": "",
            "cls": "over_capacity",
            "title": OVER_CAPACITY_NOTE,
        }
    if status != "valid":
        reason = cell.get("error") if isinstance(cell.get("error"), str) else ""
        return {
            "text": F.fmt_status(status),
            "sub": reason or "no reason recorded",
            "colour": palette.EMPTY,
            "fg": "",
            "cls": str(status),
            "title": reason or "",
        }
    t = cell.get("total_tok_s")
    frac = None if _absent(t) else ((t - lo) / (hi - lo) if hi > lo else 1.0)
    colour = _scale_colour(frac)
    sub = f"{F.fmt_ms(cell.get('ttft_ms'), 0)} TTFT"
    if not _absent(cell.get("ttft_p99_ms")):
        sub += f" (p99 {F.fmt_ms(cell.get('ttft_p99_ms'), 0)})"
    if not _absent(cell.get("ttst_ms")):  # the first decode step, apart from the prefill
        sub += f" · 2nd token {F.fmt_ms(cell.get('ttst_ms'), 1)}"
    sub += f" · {F.fmt_rate(cell.get('per_request_tok_s'))} per request"
    return {
        "text": F.fmt_rate_summary(t, 1),
        "sub": sub,
        "colour": colour,
        "fg": palette.text_colour(colour),
        "cls": "valid",
        "title": "",
    }


ACCEPTANCE_NOTE = (
    "Mean acceptance length per cell: tokens a decode step emits, 1 + accepted / drafts from "
    "the server's spec-decode counters over the window. At 1 request one prompt decides it; "
    "more requests average it."
)


def acceptance_matrix(rows: list[dict], cols: list[int], grid: dict) -> list[dict]:
    """The decode matrix of spec_acceptance_length (HTML only: the Markdown page keeps the
    published format); empty when no cell has one (a server that does not speculate)."""
    values = [
        c["spec_acceptance_length"]
        for c in grid.values()
        if not _absent(c.get("spec_acceptance_length"))
    ]
    if not values:
        return []
    lo, hi = min(values), max(values)
    out = []
    for r in rows:
        line = []
        for c in cols:
            cell = grid.get((r["tokens"], c)) or {}
            v = cell.get("spec_acceptance_length")
            if _absent(v):
                text = (
                    F.fmt_status(cell["status"])
                    if cell.get("status") not in (None, "valid")
                    else F.DASH
                )
                line.append({"text": text, "colour": palette.EMPTY, "fg": "", "cls": "empty"})
            else:
                frac = (v - lo) / (hi - lo) if hi > lo else 1.0
                colour = _scale_colour(frac)
                line.append(
                    {
                        "text": f"{v:.2f}",
                        "colour": colour,
                        "fg": palette.text_colour(colour),
                        "cls": "valid",
                    }
                )
        out.append({"label": r["label"], "cells": line})
    return out


def cost_matrix(run: dict, rows: list[dict], cols: list[int], grid: dict, prices: Any) -> Any:
    """The decode matrix in cost per million output tokens (analysis.cost), with the price it
    was computed from; None when the deployment prices no GPU of this run's kind (or the run
    has no GPU count): no cost column, never a made-up price."""
    from speedmatrix.analysis.cost import cost_per_million, fmt_cost

    price = prices.for_run(run) if prices is not None else None
    gpus = _v(run, "hardware_gpu_count")
    if price is None or not gpus:
        return None
    lines = []
    for r in rows:
        line = []
        for c in cols:
            cell = grid.get((r["tokens"], c)) or {}
            value = (
                cost_per_million(cell.get("total_tok_s"), gpus, price)
                if cell.get("status") == "valid"
                else None
            )
            line.append(
                fmt_cost(value, prices.currency)
                if value is not None
                else (F.fmt_status(cell["status"]) if cell.get("status") else F.DASH)
            )
        lines.append({"label": r["label"], "cells": line})
    return {
        "rows": lines,
        "note": f"Cost of a million output tokens: {fmt_cost(price, prices.currency)} per "
        f"GPU-hour (the deployment's price for {_v(run, 'hardware_gpu')}, "
        f"{prices.source}) × {gpus} GPUs ÷ the cell's total output tok/s.",
    }
