"""Change points over one cell's history: where its level stepped, between which commits, by how
much.

A run's verdict compares it with one baseline, so a slowdown spread over several commits (five
commits each 2% slower) reads "noise" at every step, and a regressed run that lands becomes the
next run's baseline. Change points look at the whole series instead: Apache Otava's e-divisive
means (Matteson and James; Hunter's split and merge over sliding windows, Fleming et al.) finds
the indices where the series' distribution changes, and keeps those its Student's t-test between
the neighbouring segments finds significant (p below `max_pvalue`). The detector is Otava's
(pyproject.toml says why that library); what is here is the series it is handed and the reading
of what it returns: the commit range of each step (the last run at the old level, the first at
the new one) and its size (mean after / mean before - 1).

Why every change point stays reported: the series is the whole comparable history, every time,
so a step found once is found again as long as its runs are in the warehouse; a regressed run
that became the baseline of the runs after it does not hide it.

One series per comparable stretch: a point the comparability rule (records, through the trend's
`not_comparable` verdict) says was measured otherwise starts a new series, so a change of
workload or profile is never read as a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

MAX_PVALUE = 0.001
"""A step is reported when Otava's t-test between its neighbouring segments gives p below this
(the library's own default: a nightly history of a few hundred points then reports a false step
about once in a thousand tests)."""
WINDOW = 30
"""Otava's sliding window (points): each step is looked for among this many neighbours, so a
long history costs windows, not its whole length squared."""
MIN_SIDE = 3
"""A step needs this many runs on each side of it: one or two odd runs at either end of the
history are an outlier (the run's own verdict judges it), not a level; Otava's t-test gives an
edge of one point a p-value that passes (a step at the second of 60 noisy nights, seen)."""
MIN_POINTS = 2 * MIN_SIDE

CHANGE_POINT_COLUMNS = (
    "change_point",
    "change_point_pct",
    "change_point_pvalue",
    "change_point_since",
)
"""What a trend row says of the step that ends at it (null where none): the verdict
(`regression` / `improvement`), the step's size in percent, its p-value, and the engine commit
of the last run at the old level (the row's own commit ends the range)."""


@dataclass(frozen=True)
class ChangePoint:
    """One step of a cell's figure: the first run at the new level and the last at the old."""

    run_id: str
    before_run_id: str
    commit_before: str | None  # engine commit of the last run at the old level
    commit_after: str | None  # engine commit of the first run at the new level
    started_at: Any
    mean_before: float
    mean_after: float
    change_pct: float  # mean after / mean before - 1, in percent
    pvalue: float
    verdict: str  # regression or improvement (by the metric's direction)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def commit_range(self) -> str:
        """`before..after` as the trend and the pages show it (short commits)."""
        return f"{_short(self.commit_before)}..{_short(self.commit_after)}"


def detect(values: Sequence[float], *, max_pvalue: float = MAX_PVALUE) -> list[tuple[int, float]]:
    """(index of the first point at the new level, p-value) of each step in `values`, by
    Otava's e-divisive means with its significance test."""
    from otava.analysis import compute_change_points

    if len(values) < MIN_POINTS:
        return []
    found, _ = compute_change_points(
        [float(v) for v in values], window_len=WINDOW, max_pvalue=max_pvalue
    )
    return [
        (int(cp.index), float(cp.stats.pvalue))
        for cp in found
        if MIN_SIDE <= cp.index <= len(values) - MIN_SIDE
    ]


def change_points(
    points: pd.DataFrame | Sequence[Mapping[str, Any]],
    *,
    higher_is_better: bool,
    max_pvalue: float = MAX_PVALUE,
) -> list[ChangePoint]:
    """The steps of one cell's trend (analysis.trend rows, oldest first), oldest first.

    Only measured points count (a failed cell has no value); each comparable stretch is a
    series of its own (module docstring)."""
    rows = points.to_dict("records") if isinstance(points, pd.DataFrame) else list(points)
    out: list[ChangePoint] = []
    for series in _stretches(rows):
        values = [float(r["value"]) for r in series]
        found = detect(values, max_pvalue=max_pvalue)
        bounds = [0, *(i for i, _ in found), len(values)]
        for k, (index, pvalue) in enumerate(found):
            before = values[bounds[k] : index]
            after = values[index : bounds[k + 2]]
            mean_before, mean_after = _mean(before), _mean(after)
            change = (mean_after / mean_before - 1.0) * 100 if mean_before else math.nan
            worse = (change < 0) if higher_is_better else (change > 0)
            first, last = series[index], series[index - 1]
            out.append(
                ChangePoint(
                    run_id=str(first["run_id"]),
                    before_run_id=str(last["run_id"]),
                    commit_before=_commit(last),
                    commit_after=_commit(first),
                    started_at=first.get("started_at"),
                    mean_before=mean_before,
                    mean_after=mean_after,
                    change_pct=change,
                    pvalue=pvalue,
                    verdict="regression" if worse else "improvement",
                )
            )
    return out


def mark(points: pd.DataFrame, found: Sequence[ChangePoint]) -> pd.DataFrame:
    """`points` with CHANGE_POINT_COLUMNS: each step on the row of its first run."""
    at = {cp.run_id: cp for cp in found}
    out = points.copy()
    ids = list(out["run_id"]) if "run_id" in out else []
    out["change_point"] = [at[r].verdict if r in at else None for r in ids]
    out["change_point_pct"] = [at[r].change_pct if r in at else None for r in ids]
    out["change_point_pvalue"] = [at[r].pvalue if r in at else None for r in ids]
    out["change_point_since"] = [at[r].commit_before if r in at else None for r in ids]
    return out


def describe(row: Mapping[str, Any]) -> str:
    """A trend row's change point as the trend, the pages and the alerts write it:
    `▼ -4.8% <commit before>..<this run's commit>` (▲ an improvement); empty where none."""
    from speedmatrix.commits import commit_label

    verdict = row.get("change_point")
    if not isinstance(verdict, str) or not verdict:
        return ""
    arrow = "▼" if verdict == "regression" else "▲"
    since = commit_label({"engine_commit": row.get("change_point_since")})
    return f"{arrow} {float(row['change_point_pct']):+.1f}% {since}..{commit_label(row)}"


def _stretches(rows: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The measured points, cut where the trend says a point is not comparable with the one
    before it (the comparability rule's word, not a rule of ours)."""
    out: list[list[Mapping[str, Any]]] = [[]]
    for r in rows:
        value = r.get("value")
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if r.get("verdict") == "not_comparable" and out[-1]:
            out.append([])
        out[-1].append(r)
    return [s for s in out if s]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _commit(row: Mapping[str, Any]) -> str | None:
    c = row.get("engine_commit")
    return None if c is None or (isinstance(c, float) and math.isnan(c)) else str(c)


def _short(commit: str | None) -> str:
    from speedmatrix.commits import shown_commit

    return shown_commit(commit) or commit or "?"
