"""Every chart speedmatrix draws, as SVG strings (matplotlib, Agg backend; no server).

- a run's charts (render_all): prefill tok/s and TTFT against context; decode total and
  per-request tok/s against concurrency, one line per context; a baseline dashed behind;
- the comparison's charts: the diff heat map of the decode matrix (diff_heatmap_svg) and a
  cell's trend over engine commits with its verdicts marked (trend_chart_svg), drawn for the
  run page (comparison_figures) and next to the run for the alert (write_comparison_charts).

Analysis computes (speedmatrix.analysis.compare / trend), this module draws: the colours are
the page's (speedmatrix.report.palette), so a colour means the same in a table and a chart.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pandas as pd

from speedmatrix.commits import commit_label
from speedmatrix.records import cell_key, cell_name, cell_sort_key
from speedmatrix.report import palette
from speedmatrix.store.protocol import Warehouse, WarehouseReader

_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _ok(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _figure():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "speedmatrix"  # deterministic ids in the SVG
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _svg(plt, fig) -> str:
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.find("<svg") :]  # drop the XML prolog / doctype: inline in HTML
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)


def _spread(ticks: list[float], min_log2: float = 0.3) -> list[float]:
    """Drop ticks too close (on the log2 axis) to the previous one: 251K next to 256K."""
    out: list[float] = []
    for t in ticks:
        if out and math.log2(t) - math.log2(out[-1]) < min_log2:
            continue
        out.append(t)
    return out


def _context_k(tokens: int) -> float:
    return tokens / 1024


def prefill_chart(
    cells: Sequence[dict], metric: str, baseline: Sequence[dict] | None = None
) -> str | None:
    """``metric``: ``total_tok_s`` (prompt tok/s) or ``ttft_ms``, against context."""
    series = []
    for who, group in (("this run", cells), ("baseline", baseline or [])):
        pts = sorted(
            (_context_k(c["context_tokens"]), c[metric] / (1000 if metric == "ttft_ms" else 1))
            for c in group
            if c.get("phase") == "prefill" and c.get("status") == "valid" and _ok(c.get(metric))
        )
        if pts:
            series.append((who, pts))
    if not series:
        return None
    plt, fig, ax = _figure()
    for who, pts in series:
        xs, ys = zip(*pts, strict=True)
        if who == "baseline":
            ax.plot(xs, ys, "--", color="#999999", marker="o", markersize=3, label="baseline")
        else:
            ax.plot(xs, ys, "-", color=_COLOURS[0], marker="o", label=who)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ticks = _spread(sorted({x for _, pts in series for x, _ in pts}))
    ax.set_xticks(ticks, [f"{t:g}K" for t in ticks])
    ax.minorticks_off()
    if metric == "ttft_ms":
        ax.set_ylabel("TTFT (s)")
        ax.set_title("Prefill: time to first token")
    else:
        ax.set_ylabel("prompt tok/s")
        ax.set_title("Prefill: prompt tok/s")
    ax.set_ylim(bottom=0)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _svg(plt, fig)


def decode_chart(
    cells: Sequence[dict], metric: str, baseline: Sequence[dict] | None = None
) -> str | None:
    """``metric``: ``total_tok_s`` or ``per_request_tok_s`` against concurrency, one line per
    context."""

    def lines(group):
        by_ctx: dict[int, list[tuple[int, float]]] = {}
        labels: dict[int, str] = {}
        for c in group:
            if c.get("phase") == "decode" and c.get("status") == "valid" and _ok(c.get(metric)):
                by_ctx.setdefault(c["context_tokens"], []).append((c["concurrency"], c[metric]))
                labels[c["context_tokens"]] = cell_key(c)[1]
        return {k: (labels[k], sorted(v)) for k, v in sorted(by_ctx.items())}

    mine = lines(cells)
    base = lines(baseline or [])
    if not mine:
        return None
    plt, fig, ax = _figure()
    for i, (_tokens, (label, pts)) in enumerate(mine.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, "-", color=colour, marker="o", markersize=4, label=label)
        b = next((bp for bl, bp in base.values() if bl == label), None)
        if b:
            bx, by = zip(*b, strict=True)
            ax.plot(bx, by, "--", color=colour, alpha=0.45, linewidth=1)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for _, pts in mine.values() for x, _ in pts})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("simultaneous requests")
    if metric == "total_tok_s":
        ax.set_ylabel("total tok/s")
        ax.set_title("Sustained decode: total tok/s")
    else:
        ax.set_ylabel("tok/s per request")
        ax.set_title("Sustained decode: per-request tok/s")
    ax.set_ylim(bottom=0)
    ax.legend(
        title="context" + (" (dashed: baseline)" if base else ""), fontsize=8, title_fontsize=8
    )
    return _svg(plt, fig)


def render_all(cells: Sequence[dict], baseline: Sequence[dict] | None = None) -> list[dict]:
    """[{id, title, svg}] for the charts that have data."""
    specs = [
        ("prefill-tok-s", "Prefill tok/s by context", prefill_chart, "total_tok_s"),
        ("prefill-ttft", "Prefill TTFT by context", prefill_chart, "ttft_ms"),
        ("decode-total", "Decode total tok/s by concurrency", decode_chart, "total_tok_s"),
        (
            "decode-per-request",
            "Decode per-request tok/s by concurrency",
            decode_chart,
            "per_request_tok_s",
        ),
    ]
    out = []
    for chart_id, title, fn, metric in specs:
        svg = fn(cells, metric, baseline)
        if svg:
            out.append({"id": chart_id, "title": title, "svg": svg})
    return out


def charts_fingerprint(cells: Sequence[dict], baseline: Sequence[dict] | None = None) -> str:
    """One digest of everything a run's charts are drawn from: the cells and the baseline's
    cells (as render_all gets them) and the code that draws them (this module, the palette,
    matplotlib's version). The drawing is deterministic (svg.hashsalt, no date), so an equal
    key means the same SVG: a page may show charts kept under the key instead of drawing them
    again (else the `site` task draws the run's charts again, just after the `report` task
    drew them: 1.3-1.6 s of its ~3 s)."""
    h = hashlib.sha256(version("matplotlib").encode())
    for module in (Path(__file__), Path(palette.__file__)):
        h.update(module.read_bytes())
    h.update(json.dumps([list(cells), list(baseline or [])], default=str, sort_keys=True).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- comparison charts

MAX_TREND_FIGURES = 6  # a page for a reader, not every cell: the CLI's `trend` gives the rest
HEATMAP_FONT_PT = 12.0  # the heat map's cell labels; the page shows the SVG at about 1:1

_MARKERS = {
    "regression": ("v", palette.WORSE),
    "improvement": ("^", palette.BETTER),
}


def trend_chart_svg(points: pd.DataFrame, *, title: str, ylabel: str) -> str:
    """An SVG line chart of a trend (analysis.trend.trend rows), regressions (orange ▼) and
    improvements (purple ▲) marked, partial runs' points hollow, and each change point of the
    history as a dashed line labelled with its size and commit range."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    with plt.rc_context({"svg.hashsalt": "speedmatrix"}):
        return _trend_chart(plt, points, title=title, ylabel=ylabel)


def _trend_chart(plt, points: pd.DataFrame, *, title: str, ylabel: str) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    try:
        pts = points[points["value"].notna()].reset_index(drop=True)
        xs = list(range(len(pts)))
        ax.plot(xs, pts["value"], color="#2171b5", marker="o", markersize=3, linewidth=1.2)
        for verdict, (marker, color) in _MARKERS.items():
            sel = pts.index[pts["verdict"] == verdict]
            if len(sel):
                ax.scatter(
                    sel,
                    pts.loc[sel, "value"],
                    marker=marker,
                    s=70,
                    color=color,
                    label=verdict,
                    zorder=3,
                )
        if "run_status" in pts:
            sel = pts.index[pts["run_status"] == "partial"]
            if len(sel):
                ax.scatter(sel, pts.loc[sel, "value"], marker="o", s=40, facecolors="white",
                           edgecolors="#2171b5", label="partial run", zorder=4)  # fmt: skip
        _mark_change_points(ax, pts)
        ticks = [  # whole enough to tell commits apart (speedmatrix.commits)
            commit_label(point)
            for point in pts.reindex(
                columns=["engine_commit", "engine_version", "engine_ref", "run_id"]
            ).to_dict("records")
        ]
        # a commit is named where its runs start: the same label on every tick said nothing
        ticks = [t if i == 0 or t != ticks[i - 1] else "" for i, t in enumerate(ticks)]
        ax.set_xticks(xs, ticks, rotation=45, ha="right", fontsize=8)
        if len(pts) == 1:  # a lone dot is no trend: say what there is
            ax.annotate(
                f"One run so far ({pts['value'].iloc[0]:,.1f}): the trend starts with the next",
                (0, pts["value"].iloc[0]),
                xytext=(0, 12),
                textcoords="offset points",
                ha="center",
                fontsize=9,
            )
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})  # same data, same bytes
        return buf.getvalue()
    finally:
        plt.close(fig)


def _mark_change_points(ax: Any, pts: pd.DataFrame) -> None:
    """A dashed line before each change point's first run, its size and commit range beside."""
    if "change_point" not in pts:
        return
    for i, row in enumerate(pts.to_dict("records")):
        if not row.get("change_point"):
            continue
        since = commit_label({"engine_commit": row.get("change_point_since")})
        label = f"change point {since}..{commit_label(row)}: {row['change_point_pct']:+.1f}%"
        ax.axvline(i - 0.5, color="#d55e00", linestyle="--", linewidth=1)
        ax.annotate(label, (i - 0.5, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                    color="#d55e00", ha="right", va="top", rotation=90)  # fmt: skip


def diff_heatmap_svg(
    comparisons: pd.DataFrame | Iterable[Mapping[str, Any]], *, metric: str = "total_tok_s"
) -> str | None:
    """The decode matrix coloured by the change of `metric` against the baseline, in the
    page's diverging scale (palette.change_colour: orange worse, purple better, grey
    unchanged; direction-aware), every cell labelled with its change, ▼/▲ where the verdict
    is a regression/improvement. Labels are real SVG text at HEATMAP_FONT_PT, black or white
    for contrast on their cell. None when the comparison has no decode rows for the metric."""
    from speedmatrix.analysis.noise import frame
    from speedmatrix.analysis.verdict import METRIC_BY_NAME

    cmp = frame(comparisons)
    if cmp.empty:
        return None
    rows = cmp[(cmp["metric"] == metric) & (cmp["phase"] == "decode")]
    rows = rows[rows["change_pct"].notna()]
    if rows.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.colors import to_rgb

    higher = METRIC_BY_NAME[metric].higher_is_better
    contexts = sorted(set(zip(rows["context_tokens"], rows["context_label"], strict=True)))
    concs = sorted({int(c) for c in rows["concurrency"]})  # ints: not "2.0" on the axis
    rgb = [[to_rgb(palette.EMPTY)] * len(concs) for _ in contexts]
    cells: list[tuple[int, int, str, str]] = []
    for r in rows.to_dict("records"):
        i = contexts.index((r["context_tokens"], r["context_label"]))
        j = concs.index(int(r["concurrency"]))
        better_pct = r["change_pct"] if higher else -r["change_pct"]
        colour = palette.change_colour(better_pct)
        rgb[i][j] = to_rgb(colour)
        mark = {"regression": " ▼", "improvement": " ▲"}.get(r["verdict"], "")
        cells.append((i, j, f"{r['change_pct']:+.1f}%{mark}", palette.text_colour(colour)))
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "speedmatrix"}):
        fig, ax = plt.subplots(
            figsize=(1.05 * len(concs) + 1.6, 0.55 * len(contexts) + 1.4), dpi=100
        )
        try:
            ax.imshow(rgb, aspect="auto")
            for i, j, label, colour in cells:
                ax.text(
                    j, i, label, ha="center", va="center", fontsize=HEATMAP_FONT_PT, color=colour
                )
            ax.set_xticks(range(len(concs)), [str(c) for c in concs], fontsize=11)
            ax.set_yticks(range(len(contexts)), [lbl for _, lbl in contexts], fontsize=11)
            ax.set_xticks([x - 0.5 for x in range(1, len(concs))], minor=True)
            ax.set_yticks([y - 0.5 for y in range(1, len(contexts))], minor=True)
            ax.grid(which="minor", color="#ffffff", linewidth=2)
            ax.tick_params(which="minor", length=0)
            ax.set_xlabel("simultaneous requests", fontsize=11)
            ax.set_ylabel("context", fontsize=11)
            ax.set_title(f"{metric}: change vs baseline", fontsize=12)
            fig.tight_layout()
            buf = io.StringIO()
            fig.savefig(buf, format="svg", metadata={"Date": None})
            return buf.getvalue()
        finally:
            plt.close(fig)


def inline(svg: str) -> str:
    """An SVG file's text without its XML prolog and doctype, to sit inside an HTML page."""
    at = svg.find("<svg")
    return svg[at:] if at >= 0 else svg


def trend_svgs(
    warehouse: WarehouseReader, result: Any, keys: Sequence[tuple[str, str, int]], *, title: str
) -> list[tuple[str, str]]:
    """(cell name, SVG) of each cell's tok/s over the recipe's runs, verdicts marked; this
    run's verdicts (`result`, a compare.ComparisonResult) included, since the page draws them
    before `regressions` lands them."""
    from speedmatrix.analysis.baseline import read_history
    from speedmatrix.analysis.trend import trend

    runs, cells, stored, noise = read_history(
        warehouse, result.run.get("recipe_id"), result.run.get("host")
    )
    mine = pd.DataFrame(result.rows)
    if not stored.empty:
        stored = stored[stored["run_id"] != result.run["run_id"]]
    history = pd.concat([d for d in (stored, mine) if not d.empty], ignore_index=True)
    out = []
    for phase, label, conc in keys:
        name = cell_name(phase, label, conc)
        points = trend(
            runs,
            cells,
            recipe=result.run.get("recipe_id"),
            cell=name,
            metric="prefill_tok_s" if phase == "prefill" else "total_tok_s",
            host=result.run.get("host"),
            comparisons=history,
            noise=noise,
        )
        out.append((name, trend_chart_svg(points, title=title.format(name=name), ylabel="tok/s")))
    return out


def write_comparison_charts(warehouse: Warehouse, result: Any) -> None:
    """comparison.svg (the diff heat map of total tok/s) and one trend-<cell>.svg per
    regressed cell, next to the run's report, for the alert's reader. Passed as `charts` to
    analysis.compare.judge_regressions."""
    from speedmatrix.analysis.verdict import regression_rows

    run_id = result.run["run_id"]
    heat = diff_heatmap_svg(result.rows)
    if heat:
        warehouse.write_artifact(run_id, "comparison.svg", heat)
    bad = {
        (r["phase"], r["context_label"], r["concurrency"])
        for r in regression_rows(result.rows)
        if r.get("phase") in ("prefill", "decode")
    }
    if not bad:
        return
    title = "{name}: " + run_id.replace("{", "{{").replace("}", "}}")
    for name, svg in trend_svgs(warehouse, result, sorted(bad, key=cell_sort_key), title=title):
        warehouse.write_artifact(run_id, f"trend-{name.replace(' ', '-')}.svg", svg)


def comparison_figures(warehouse: WarehouseReader, result: Any) -> list[dict[str, str]]:
    """The run page's comparison figures ({id, title, svg}): the diff heat map of total
    tok/s, then one trend per cell that changed beyond its noise (at most MAX_TREND_FIGURES)."""
    from speedmatrix.analysis.display import notable

    out: list[dict[str, str]] = []
    heat = diff_heatmap_svg(result.rows)
    if heat:
        out.append(
            {"id": "diff-heatmap", "title": "Total tok/s against the baseline", "svg": inline(heat)}
        )
    changed = sorted(
        {
            (r["phase"], r["context_label"], r["concurrency"])
            for r in notable(result.rows)
            if r.get("phase") in ("prefill", "decode")
            and r.get("metric") in ("total_tok_s", "prefill_tok_s")
        },
        key=cell_sort_key,
    )
    for name, svg in trend_svgs(
        warehouse, result, changed[:MAX_TREND_FIGURES], title="{name} over commits"
    ):
        out.append(
            {"id": f"trend-{name.replace(' ', '-')}", "title": f"Trend: {name}", "svg": inline(svg)}
        )
    return out
