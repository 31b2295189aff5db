"""Charts of a run, as inline SVG strings (matplotlib, Agg backend; no files, no server).

- prefill: prompt tok/s against context, and TTFT against context;
- decode: total tok/s and per-request tok/s against concurrency, one line per context.

With baseline cells, the baseline is drawn dashed and grey-ish behind the run.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence

from speedmatrix.records import cell_key

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
