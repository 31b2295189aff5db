"""The run page's opening summary: the answer a reader came for, before any table.

A reader asks "did this run get slower than the last one?". The summary answers in the first
screen: the baseline the run was compared with (or why there is none), every regression and
improvement beyond noise (cell, figure, change and its interval: the change ± its noise band,
analysis.display.interval_text), then the cells that did not measure (invalid, failed) with
their reasons. The numbers are the noise-aware comparison's
(speedmatrix.analysis.compare rows); this module only chooses and words them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speedmatrix.analysis.display import all_not_compared, headline, interval_text
from speedmatrix.analysis.verdict import KV_METRIC, METRIC_BY_NAME, STATUS_METRIC, number
from speedmatrix.published import formats as F
from speedmatrix.records import cell_name
from speedmatrix.report import palette
from speedmatrix.words import count

_ORDER = {"regression": 0, "improvement": 1}
PROBLEM_STATUSES = ("invalid", "failed")


def _value(v: Any) -> str:
    x = number(v)
    if x is None:
        return F.DASH
    return f"{x:,.1f}" if abs(x) < 1e5 else f"{x:,.0f}"


def figure_label(metric: str | None) -> str:
    """A comparison row's metric as the page names it."""
    if metric == STATUS_METRIC:
        return "status"
    if metric == KV_METRIC.name:
        return KV_METRIC.label
    spec = METRIC_BY_NAME.get(metric or "")
    return spec.label if spec else str(metric)


@dataclass
class Change:
    """One regression or improvement, worded for the summary table."""

    cell: str
    figure: str
    verdict: str
    baseline: str
    value: str
    change: str
    interval: str
    threshold: str
    note: str
    colour: str
    text_colour: str


@dataclass
class Problem:
    cell: str
    status: str
    reason: str


@dataclass
class Summary:
    baseline: Mapping[str, Any] | None
    no_baseline_reason: str
    changes: list[Change] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    run_status: str | None = None
    compared: bool = False
    rows: Sequence[Mapping[str, Any]] = ()

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == "regression"]

    @property
    def improvements(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == "improvement"]

    @property
    def headline(self) -> str:
        """One sentence: the verdict of the run."""
        if self.run_status == "failed":
            head = "The run failed."
        elif not self.compared:
            head = "Not compared: " + self.no_baseline_reason
        elif (why := all_not_compared(self.rows)) is not None:
            head = f"Not compared: {why}."
        elif self.regressions:
            head = f"Slower than the baseline: {headline(self.rows)}."
        elif self.improvements:
            head = f"No regression; faster than the baseline: {headline(self.rows)}."
        else:
            head = f"No change beyond noise against the baseline: {headline(self.rows)}."
        if self.problems:
            head += f" {count(len(self.problems), 'cell')} did not measure (invalid or failed)."
        return head


def _change(row: Mapping[str, Any]) -> Change:
    metric = row.get("metric")
    cell = cell_name(
        row.get("phase"),
        row.get("context_label") or row.get("context_tokens"),
        row.get("concurrency"),
    )
    change, thr = (number(row.get(k)) for k in ("change_pct", "threshold_pct"))
    higher = row.get("higher_is_better")
    better = None
    if change is not None:
        better = change if higher in (None, True) else -change
    elif row.get("verdict") in _ORDER:  # a status change: no number, full colour
        better = palette.CHANGE_FULL_PCT * (1 if row.get("verdict") == "improvement" else -1)
    colour = palette.change_colour(better)
    if metric == STATUS_METRIC:
        base, value = (
            F.fmt_status(row.get("baseline_status")),
            F.fmt_status(row.get("status")),
        )
    else:
        base, value = _value(row.get("baseline_value")), _value(row.get("value"))
    return Change(
        cell=cell,
        figure=figure_label(metric),
        verdict=str(row.get("verdict")),
        baseline=base,
        value=value,
        change=f"{change:+.1f}%" if change is not None else F.DASH,
        interval=interval_text(row),
        threshold=f"{thr:.1f}%" if thr is not None else F.DASH,
        note=str(row.get("reason") or ""),
        colour=colour,
        text_colour=palette.text_colour(colour),
    )


def problems_of(cells: Sequence[Mapping[str, Any]]) -> list[Problem]:
    """Invalid and failed cells with their recorded reason (records' `error`)."""
    out = []
    for c in cells:
        if c.get("status") not in PROBLEM_STATUSES:
            continue
        name = cell_name(
            c.get("phase"), c.get("context_label") or c.get("context_tokens"), c.get("concurrency")
        )
        reason = c.get("error")
        out.append(
            Problem(
                cell=name,
                status=F.fmt_status(c.get("status")),
                reason=reason if isinstance(reason, str) and reason else "no reason recorded",
            )
        )
    return out


def build_summary(
    run: Mapping[str, Any],
    cells: Sequence[Mapping[str, Any]],
    baseline_run: Mapping[str, Any] | None,
    rows: Sequence[Mapping[str, Any]] | None,
) -> Summary:
    """`rows`: the noise-aware comparison rows (None: the run was not compared, e.g. a page
    rendered with a baseline but without the warehouse's noise history)."""
    statuses: dict[str, int] = {}
    for c in cells:
        statuses[str(c.get("status"))] = statuses.get(str(c.get("status")), 0) + 1
    compared = baseline_run is not None and rows is not None
    if baseline_run is None:
        reason = "no earlier successful run of this recipe on this host to compare with."
    else:
        reason = "a baseline was given, but no noise-aware comparison was made for this page."
    changes = sorted(
        (_change(r) for r in rows or () if r.get("verdict") in _ORDER),
        key=lambda c: _ORDER[c.verdict],
    )
    verdicts: dict[str, int] = {}
    for r in rows or ():
        verdicts[str(r.get("verdict"))] = verdicts.get(str(r.get("verdict")), 0) + 1
    return Summary(
        baseline=baseline_run,
        no_baseline_reason=reason,
        changes=changes,
        problems=problems_of(cells),
        counts={"cells": len(cells), **{f"status_{k}": v for k, v in statuses.items()}, **verdicts},
        run_status=run.get("status"),
        compared=compared,
        rows=list(rows or ()),
    )
