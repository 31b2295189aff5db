"""The comparison as a reader sees it: short display rows, verdict counts, the markdown section.

One job: turning comparison rows (analysis/verdict.py) into what `speedmatrix compare` prints
and the report's "Comparison" section shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from speedmatrix.analysis.verdict import VERDICTS, _fmt, number
from speedmatrix.commits import engine_text
from speedmatrix.records import cell_name

_VERDICT_MARK = {
    "regression": "▼ regression",
    "improvement": "▲ improvement",
    "unverified": "? unverified",
}

FAMILIES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    # (name, its metrics, the figure's word when worse, when better); the first metric of a
    # family is the one its change is given in. Per-request tok/s is 1000 / TBT and total
    # tok/s moves with them: one family, so one slowdown is one regression of the cell.
    ("throughput", ("total_tok_s", "prefill_tok_s", "tbt_ms", "per_request_tok_s"), "down", "up"),
    ("TTFT", ("ttft_ms",), "up", "down"),
    ("spec acceptance", ("spec_acceptance_length",), "down", "up"),
)


def family_of(metric: str | None) -> str:
    """The name a badge gives a figure: its family (throughput, TTFT, spec acceptance), else
    the figure itself (KV cache tokens, status)."""
    for name, family, _, _ in FAMILIES:
        if metric in family:
            return name
    return {"kv_cache_tokens": "KV cache tokens"}.get(str(metric), str(metric))


def _cell_of(r: Mapping[str, Any]) -> str:
    return cell_name(
        r.get("phase"), r.get("context_label") or r.get("context_tokens"), r.get("concurrency")
    )


def cells_with(rows: Iterable[Mapping[str, Any]], verdict: str) -> list[str]:
    """The cells (in row order, once each) with at least one figure of `verdict`: a cell
    whose throughput, TBT and per-request tok/s all moved is one regression."""
    out: list[str] = []
    for r in rows:
        if r.get("verdict") == verdict and (name := _cell_of(r)) not in out:
            out.append(name)
    return out


def _family_part(
    rows: Sequence[Mapping[str, Any]], family: tuple[str, ...], word: str, v: str
) -> str:
    by_cell: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        if r.get("verdict") != v or r.get("metric") not in family:
            continue
        name = _cell_of(r)
        old = by_cell.get(name)
        if old is None or family.index(r["metric"]) < family.index(old["metric"]):
            by_cell[name] = r
    if not by_cell:
        return ""
    shown = []
    for name, r in by_cell.items():
        pct = number(r.get("change_pct"))
        shown.append(f"{name} {pct:+.1f}%" if pct is not None else name)
    n = len(by_cell)
    return f"{word} in {n} cell{'' if n == 1 else 's'} ({', '.join(shown)})"


def headline(rows: Sequence[Mapping[str, Any]]) -> str:
    """The run's verdict in one line that counts cells, figure family by family: "TTFT up in
    2 cells (8Kx1 +34.7%, 8Kx8 +5.7%); throughput unchanged". Unverified figures (no noise
    estimate) and cells not compared are counted after it."""
    parts, unchanged = [], []
    present = {r.get("metric") for r in rows}
    for name, family, worse, better in FAMILIES:
        if not present & set(family):
            continue
        part = _family_part(rows, family, worse, "regression") or _family_part(
            rows, family, better, "improvement"
        )
        if part:
            parts.append(f"{name} {part}")
        else:
            unchanged.append(f"{name} unchanged")
    parts += unchanged
    status = [
        r
        for r in rows
        if r.get("metric") == "status" and r.get("verdict") in ("regression", "improvement")
    ]
    if status:
        parts.append("; ".join(f"{_cell_of(r)} {r.get('reason')}" for r in status))
    text = "; ".join(parts) or "nothing compared"
    unverified = cells_with(rows, "unverified")
    if unverified:
        n = len(unverified)
        text += f"; {n} cell{'' if n == 1 else 's'} unverified (no noise estimate)"
    skipped = cells_with([r for r in rows if r.get("metric") == "status"], "not_comparable")
    if skipped:
        n = len(skipped)
        text += f"; {n} cell{'' if n == 1 else 's'} not compared"
    return text


def all_not_compared(rows: Iterable[Mapping[str, Any]]) -> str | None:
    """Why nothing was compared when no figure was (every cell not comparable), else None."""
    rows = [r for r in rows if r.get("phase") != "run"]
    if not rows or any(r.get("verdict") != "not_comparable" for r in rows):
        return None
    reasons = sorted({str(r.get("reason") or "not comparable") for r in rows})
    return "; ".join(reasons)


def notable(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows worth showing by default: everything that is not plain noise."""
    return [r for r in rows if r.get("verdict") != "noise"]


def verdict_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    for r in rows:
        verdict = r.get("verdict") or "not_comparable"
        counts[verdict] = counts.get(verdict, 0) + 1
    return counts


def interval_text(row: Mapping[str, Any]) -> str:
    """The interval a comparison row's verdict was judged with, as every page and the CLI
    show it: `[change - band, change + band]` (the band is `noise_pct`); "unknown" when the
    figure changed but no noise was known for it (never a band of zero); "—" without a change.
    """
    change, noise = number(row.get("change_pct")), number(row.get("noise_pct"))
    if change is not None and noise is not None:
        return f"[{change - noise:+.1f}%, {change + noise:+.1f}%]"
    return "unknown" if change is not None else "—"


def display_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Rows as short strings, the columns `compare` prints and the report's section shows."""
    out = []
    for r in rows:
        change, noise = number(r.get("change_pct")), number(r.get("noise_pct"))
        thr = number(r.get("threshold_pct"))
        interval = interval_text(r)
        out.append(
            {
                "Cell": cell_name(
                    r.get("phase"),
                    r.get("context_label") or r.get("context_tokens"),
                    r.get("concurrency"),
                ),
                "Metric": r.get("metric") or "",
                "Baseline": _fmt(r.get("baseline_value")),
                "This run": _fmt(r.get("value")),
                "Change": f"{change:+.1f}%" if change is not None else "—",
                "Threshold": f"{thr:.1f}%" if thr is not None else "—",
                "Noise": f"±{noise:.1f}%" if noise is not None else "unknown",
                "Interval": interval,
                "Verdict": _VERDICT_MARK.get(r.get("verdict") or "", r.get("verdict") or ""),
                "Note": r.get("reason") or "",
            }
        )
    return out


def comparison_markdown(
    rows: Sequence[Mapping[str, Any]],
    run: Mapping[str, Any],
    baseline: Mapping[str, Any],
    *,
    show_all: bool = False,
) -> str:
    """The report's "Comparison" section: counts, then a table of the notable (or all) rows."""
    counts = verdict_counts(rows)
    a = engine_text(baseline)
    b = engine_text(run)
    lines = [
        "## Comparison",
        "",
        f"Baseline: run `{baseline.get('run_id')}` (engine {a}); this run: `{run.get('run_id')}`"
        f" (engine {b}).",
        "",
        f"Verdict: {headline(rows)}.",
        "",
        ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in counts.items()) + " (figures).",
        "A change counts only when it exceeds both the threshold and the noise band (three"
        " standard deviations of a run-to-run difference in its recent history on this host,"
        " or the two cells' own intervals when wider); the interval is the change ± that band."
        " A figure without such history, or measured from one sample, is unverified.",
        "",
    ]
    shown = display_rows(rows if show_all else notable(rows))
    if not shown:
        lines.append("No cell changed beyond its noise.")
        return "\n".join(lines) + "\n"
    cols = list(shown[0])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in shown:
        lines.append("| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"
