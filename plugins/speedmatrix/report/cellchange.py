"""Each cell's change against the baseline, worded for the cell of a matrix.

Why in the matrix: a reader looks at the decode matrix and the prefill table first; a change
shown only in a heat map further down is a change not seen. So every cell that the baseline
also measured carries its throughput change (decode total tok/s, prefill prompt tok/s) in the
page's diverging change colours (report.palette: orange worse, purple better, grey unchanged)
and its verdict mark: ▼ regression, ▲ improvement beyond noise on any of the cell's figures,
as the noise-aware comparison (analysis.compare rows) judged them. Without those rows (a page
given a baseline but no comparison) the change is the plain percentage, with no mark: a mark
is a verdict, and only the comparison gives one.

This module words; the numbers are the comparison's (or, without it, two cells' ratio).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speedmatrix.records import CellKey, cell_key
from speedmatrix.report import palette

# The figure a cell's change is given in: what its matrix shows.
THROUGHPUT_METRIC = {"decode": "total_tok_s", "prefill": "prefill_tok_s"}
MARKS = {"regression": "▼", "improvement": "▲"}


@dataclass(frozen=True)
class CellChange:
    """One cell's change as its matrix cell shows it."""

    text: str  # "-10.0%", "+0.4%"
    mark: str  # "▼", "▲" or ""
    verdict: str  # "regression", "improvement", "noise", "" (not judged)
    colour: str  # background, palette.change_colour
    fg: str  # black or white on it
    title: str  # the tooltip: every figure that moved beyond noise, and the baseline's value

    @property
    def label(self) -> str:
        return f"{self.mark} {self.text}".strip()


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _key(row: Mapping[str, Any]) -> CellKey:
    return cell_key(
        {
            "phase": row.get("phase"),
            "context_label": row.get("context_label"),
            "context_tokens": row.get("context_tokens"),
            "concurrency": row.get("concurrency"),
        }
    )


def make_change(pct: float | None, verdict: str, title: str) -> CellChange | None:
    """A change of `pct` percent (better positive) in the change colours; None: no number."""
    if pct is None:
        return None
    colour = palette.change_colour(pct)
    return CellChange(
        text=f"{pct:+.1f}%",
        mark=MARKS.get(verdict, ""),
        verdict=verdict,
        colour=colour,
        fg=palette.text_colour(colour),
        title=title,
    )


def from_comparison(rows: Iterable[Mapping[str, Any]]) -> dict[CellKey, CellChange]:
    """Cell -> its change, from noise-aware comparison rows (analysis.compare). The number is
    the cell's throughput change (higher is better for both phases' throughput); the mark is
    the worst verdict of any of its figures (a slower time between tokens is a regression of
    the cell even when total tok/s stayed within noise)."""
    from speedmatrix.report.summary import figure_label  # analysis' labels: loaded when used

    by_cell: dict[CellKey, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("phase") in THROUGHPUT_METRIC:
            by_cell.setdefault(_key(r), []).append(r)
    out: dict[CellKey, CellChange] = {}
    for key, rs in by_cell.items():
        main = next((r for r in rs if r.get("metric") == THROUGHPUT_METRIC[key[0]]), None)
        verdicts = {str(r.get("verdict")) for r in rs}
        verdict = next((v for v in ("regression", "improvement") if v in verdicts), "")
        if not verdict and main is not None:
            verdict = str(main.get("verdict") or "")
        moved = [
            f"{figure_label(r.get('metric'))} {_num(r.get('change_pct')):+.1f}% ({r.get('verdict')})"
            for r in rs
            if r.get("verdict") in MARKS and _num(r.get("change_pct")) is not None
        ]
        base = _num(main.get("baseline_value")) if main is not None else None
        title = "; ".join(
            [*(["baseline " + f"{base:,.1f} tok/s"] if base is not None else []), *moved]
        )
        pct = _num(main.get("change_pct")) if main is not None else None
        if verdict in MARKS and main is not None and main.get("verdict") != verdict:
            # the throughput figure did not move: the mark goes with the figure that did,
            # named (no ▼ beside an unchanged tok/s)
            moved = (r for r in rs if r.get("verdict") == verdict)
            moved_row = next((r for r in moved if _num(r.get("change_pct")) is not None), None)
            if moved_row is not None:
                mpct = _num(moved_row.get("change_pct"))
                higher = moved_row.get("higher_is_better")
                if higher is None:
                    higher = moved_row.get("metric") not in ("ttft_ms", "tbt_ms")
                better = mpct if higher else -mpct
                colour = palette.change_colour(better)
                out[key] = CellChange(
                    f"{figure_label(moved_row.get('metric')).split(' ')[0]} {mpct:+.1f}%",
                    MARKS[verdict],
                    verdict,
                    colour,
                    palette.text_colour(colour),
                    title,
                )
                continue
        change = make_change(pct, verdict, title)
        if change is None and verdict in MARKS:  # a status change: no number, full colour
            colour = palette.change_colour(
                palette.CHANGE_FULL_PCT * (1 if verdict == "improvement" else -1)
            )
            change = CellChange(
                "status", MARKS[verdict], verdict, colour, palette.text_colour(colour), title
            )
        if change is not None:
            out[key] = change
    return out


def from_cells(
    cells: Sequence[Mapping[str, Any]], baseline_cells: Sequence[Mapping[str, Any]]
) -> dict[CellKey, CellChange]:
    """Cell -> its throughput change against the same cell of `baseline_cells`, unjudged (no
    mark): for a page given a baseline without a noise-aware comparison, and for two runs of
    different recipes where the comparison's noise does not apply."""
    base = {cell_key(c): c for c in baseline_cells}
    out: dict[CellKey, CellChange] = {}
    for c in cells:
        b = base.get(cell_key(c))
        if b is None or c.get("status") != "valid" or b.get("status") != "valid":
            continue
        new, old = _num(c.get("total_tok_s")), _num(b.get("total_tok_s"))
        if new is None or not old:
            continue
        change = make_change((new - old) / old * 100, "", f"baseline {old:,.1f} tok/s")
        if change is not None:
            out[cell_key(c)] = change
    return out


def cell_changes(
    cells: Sequence[Mapping[str, Any]],
    baseline_cells: Sequence[Mapping[str, Any]] | None,
    rows: Sequence[Mapping[str, Any]] | None,
) -> dict[CellKey, CellChange]:
    """The page's per-cell changes: the comparison's when it was made, else the plain ratio
    against the baseline's cells, else none."""
    if rows is not None:
        return from_comparison(rows)
    if baseline_cells is not None:
        return from_cells(cells, baseline_cells)
    return {}
