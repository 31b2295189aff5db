"""The verdict of a landed run, as the terminal shows it at the end of `speedmatrix run`.

Why a module of its own: the terminal, the run page and the alert must tell one story, so the
facts come from one place, the warehouse's `comparisons` rows as the `regressions` task landed
them (speedmatrix.flows.notify.summarize_run, which the alert uses too); this module only lays
them out for a terminal: regressions and improvements beyond noise, the invalid and failed
cells with their reasons, and the baseline (or why there is none).
"""

from __future__ import annotations

from speedmatrix.flows.notify import MAX_LISTED, RunSummary, _cell, _change_line, summarize_run
from speedmatrix.store.protocol import WarehouseReader
from speedmatrix.words import count

EXIT_REGRESSION = 3
"""`speedmatrix run --fail-on-regression`'s exit code when a figure regressed beyond noise
(0: landed, 1: landed as failed, 2: bad input)."""


def run_verdict(warehouse: WarehouseReader, run_id: str) -> RunSummary:
    """The landed run's verdict (KeyError when the run is not in the warehouse)."""
    return summarize_run(warehouse, run_id)


def _listed(marker: str, lines: list[str]) -> list[str]:
    out = [f"  {marker} {ln}" for ln in lines[:MAX_LISTED]]
    if len(lines) > MAX_LISTED:
        out.append(f"  … and {len(lines) - MAX_LISTED} more (see the page)")
    return out


def verdict_text(s: RunSummary) -> str:
    """The verdict block: its first line is the answer, the lines after it the evidence."""
    # here, not at the top: `speedmatrix run --help` must not import pandas (analysis does)
    from speedmatrix.analysis.display import all_not_compared, cells_with, headline
    from speedmatrix.commits import shown_commit

    if s.baseline_run_id:
        against = f"against run {s.baseline_run_id}"
        commit = s.baseline_engine_commit
        if isinstance(commit, str) and commit:  # (a missing value reads back as NaN)
            against += f" (engine commit {shown_commit(commit)})"
        why = all_not_compared(s.rows)
        if why is not None:
            head = f"verdict: not compared {against}: {why}"
        elif s.regressions or s.improvements:
            # counted in cells: a cell whose throughput, TBT and per-request tok/s all moved
            # is one regression
            head = (
                f"verdict: {count(len(cells_with(s.rows, 'regression')), 'regression')}, "
                f"{count(len(cells_with(s.rows, 'improvement')), 'improvement')} beyond "
                f"noise {against}: {headline(s.rows)}"
            )
        else:
            head = f"verdict: no change beyond noise {against}: {headline(s.rows)}"
    else:
        head = (
            "verdict: not compared (no earlier successful run of "
            f"{s.recipe_id or 'this recipe'} on {s.host or 'this host'} to compare with)"
        )
    lines = [head]
    lines += _listed("▼", [_change_line(r) for r in s.regressions])
    lines += _listed("▲", [_change_line(r) for r in s.improvements])
    if s.bad_cells:
        lines.append(f"invalid or failed cells ({len(s.bad_cells)}):")
        lines += _listed(
            "×", [f"{_cell(c)} {c.get('status')}: {c.get('error') or '—'}" for c in s.bad_cells]
        )
    return "\n".join(lines)
