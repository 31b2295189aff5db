"""The site's trend chart: one cell's figure over a recipe's runs as inline SVG, small, every
point a link to its run.

Why inline SVG drawn here: the site opens from ``file://`` with nothing fetched and no
script, and a recipe page draws one chart per cell (dozens), so each is a few hundred bytes of
plain markup rather than report.charts' full figure.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from speedmatrix.commits import commit_label
from speedmatrix.report.site_text import clean, engine, text

_W, _H, _L, _R, _T, _B = 360, 150, 46, 8, 10, 22  # size and margins (the colours: site.css)
_PW, _PH = _W - _L - _R, _H - _T - _B  # the plot area


def fmt_value(v: float) -> str:
    if abs(v) >= 10_000:
        return f"{v / 1000:,.1f}K"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:,.1f}"


@dataclass(frozen=True)
class _Scale:
    """Where a point goes: run i of n across, figure v between lo and hi up."""

    n: int
    lo: float
    hi: float

    @classmethod
    def of(cls, good: list[float], band: float, n: int) -> _Scale:
        """Room for every valid point and its band."""
        lo = min(good) * (1 - band)
        hi = max(good) * (1 + band)
        if hi <= lo:
            lo, hi = lo * 0.95, hi * 1.05 + 1e-9
        return cls(n, lo, hi)

    def x(self, i: int) -> float:
        return _L + (_PW * (i + 0.5) / self.n)

    def y(self, v: float) -> float:
        return _T + _PH * (1 - (v - self.lo) / (self.hi - self.lo))


def trend_svg(
    points: pd.DataFrame, band: float, *, title: str, link: Mapping[str, str], total: int
) -> str:
    """One cell's trend: a line through the valid points in run order, the noise band (each
    point's predecessor x (1 ± band)), regressions (▼, vermillion) and improvements (▲, blue)
    marked by shape and colour (colour-blind safe), failed points as × on the axis, a partial
    run's point hollow, and each change point of the history (analysis.changepoints) as a
    dashed line before its first run, its size and commit range in its tooltip. Every point
    links to its run page (`link`: run_id -> relative href)."""
    pts = points.reset_index(drop=True)
    values = [clean(v) for v in pts["value"]]
    good = [v for v in values if v is not None]
    esc = html.escape
    head = (
        f'<svg class="trend" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
        f'role="img" aria-label="{esc(title)}"><title>{esc(title)}</title>'
    )
    if not good:
        return (
            head
            + f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle">no valid point</text></svg>'
        )
    scale = _Scale.of(good, band, len(pts))
    out = [head, _axis(scale), *_band_and_line(scale, values, band)]
    out += _change_points(scale, pts)
    for i, row in enumerate(pts.to_dict("records")):
        out.append(_point(scale, i, row, values[i], link.get(str(row["run_id"]))))
    out.append(_footer(pts, total))
    out.append("</svg>")
    return "".join(out)


def _axis(scale: _Scale) -> str:
    """The axis: min / max labels and a baseline."""
    return (
        f'<line x1="{_L}" y1="{_T + _PH}" x2="{_W - _R}" y2="{_T + _PH}" class="axis"/>'
        f'<text x="{_L - 4}" y="{_T + 8}" class="tick" text-anchor="end">'
        f"{fmt_value(scale.hi)}</text>"
        f'<text x="{_L - 4}" y="{_T + _PH}" class="tick" text-anchor="end">'
        f"{fmt_value(scale.lo)}</text>"
    )


def _band_and_line(scale: _Scale, values: list[float | None], band: float) -> list[str]:
    """The noise band (around each point's predecessor) and the line through the valid
    points."""
    out = []
    upper, lower, prev = [], [], None
    for i, v in enumerate(values):
        if prev is not None:
            upper.append((scale.x(i), scale.y(prev * (1 + band))))
            lower.append((scale.x(i), scale.y(prev * (1 - band))))
        if v is not None:
            prev = v
    if len(upper) >= 1 and band > 0:
        poly = upper + lower[::-1]
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in poly)
        out.append(f'<polygon points="{coords}" class="band"/>')
    line = [(scale.x(i), scale.y(v)) for i, v in enumerate(values) if v is not None]
    if len(line) > 1:
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in line)
        out.append(f'<polyline points="{coords}" class="line"/>')
    return out


def _point(scale: _Scale, i: int, row: Mapping[str, Any], v: float | None, href: str | None) -> str:
    """Point i: its mark by verdict, its tooltip, a link to its run when it has a page."""
    esc = html.escape
    verdict = text(row.get("verdict"))
    change = clean(row.get("change_pct"))
    tip = (
        f"{row['run_id']} · {engine(row)} · "
        + (fmt_value(v) + " tok/s" if v is not None else text(row.get("status")))
        + (f" · {change:+.1f}%" if change is not None else "")
        + (f" · {verdict}" if verdict else "")
        + (" · partial run" if row.get("run_status") == "partial" else "")
    )
    if v is None:
        cx, cy = scale.x(i), _T + _PH
        mark = (
            f'<path d="M{cx - 3:.1f},{cy - 3:.1f}l6,6m0,-6l-6,6" class="failed"/>'
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" class="hit"/>'
        )
    elif verdict == "regression":
        cx, cy = scale.x(i), scale.y(v)
        mark = f'<path d="M{cx - 6:.1f},{cy - 5:.1f}h12l-6,10z" class="reg"/>'
    elif verdict == "improvement":
        cx, cy = scale.x(i), scale.y(v)
        mark = f'<path d="M{cx - 6:.1f},{cy + 5:.1f}h12l-6,-10z" class="imp"/>'
    else:
        cx, cy = scale.x(i), scale.y(v)
        partial = " partial" if row.get("run_status") == "partial" else ""
        mark = (
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" class="pt{partial}"/>'
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" class="hit"/>'
        )
    body = f"<title>{esc(tip)}</title>{mark}"
    return f'<a href="{esc(href)}">{body}</a>' if href else f"<g>{body}</g>"


def _change_points(scale: _Scale, pts: pd.DataFrame) -> list[str]:
    """A dashed line half-way between the last run at the old level and the first at the new,
    for each change point; its tooltip: direction, size, commit range, p-value."""
    if "change_point" not in pts:
        return []
    esc = html.escape
    out = []
    for i, row in enumerate(pts.to_dict("records")):
        verdict = text(row.get("change_point"))
        if not verdict:
            continue
        x = scale.x(i) - _PW / scale.n / 2
        since = commit_label({"engine_commit": row.get("change_point_since")})
        pvalue = clean(row.get("change_point_pvalue"))
        tip = (
            f"change point ({verdict}): {clean(row.get('change_point_pct')) or 0:+.1f}% "
            f"between {since}..{commit_label(row)}"
            + (f" (p = {pvalue:.1g})" if pvalue is not None else "")
        )
        out.append(
            f'<g class="cp-mark"><title>{esc(tip)}</title>'
            f'<line x1="{x:.1f}" y1="{_T}" x2="{x:.1f}" y2="{_T + _PH}" class="cp"/>'
            f'<rect x="{x - 4:.1f}" y="{_T}" width="8" height="{_PH}" class="hit"/></g>'
        )
    return out


def _footer(pts: pd.DataFrame, total: int) -> str:
    """The first and last engine commits under the axis, and how many runs are not shown."""
    esc = html.escape
    n = len(pts)
    first, last = commit_label(pts.iloc[0]), commit_label(pts.iloc[-1])
    if n == 1:  # a lone dot is no trend: say what there is
        out = (
            f'<text x="{_L}" y="{_H - 6}" class="tick">{esc(first)}</text>'
            f'<text x="{_L + _PW / 2}" y="{_T + 12}" class="tick" text-anchor="middle">'
            + ("one run so far: the trend starts with the next" if total == 1 else "one run shown")
            + "</text>"
        )
    elif first == last:  # one commit throughout: named once
        out = f'<text x="{_L}" y="{_H - 6}" class="tick">{esc(first)}: every run</text>'
    else:
        out = (
            f'<text x="{_L}" y="{_H - 6}" class="tick">{esc(first)}</text>'
            f'<text x="{_W - _R}" y="{_H - 6}" class="tick" text-anchor="end">'
            f"{esc(last)}</text>"
        )
    if total > n:
        out += (
            f'<text x="{_L + _PW / 2}" y="{_H - 6}" class="tick" text-anchor="middle">'
            f"last {n} of {total} runs</text>"
        )
    return out
