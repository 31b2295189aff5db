"""The comparison as a reader sees it: short display rows, verdict counts, the markdown section.

One job: turning comparison rows (analysis/verdict.py) into what `speedmatrix compare` prints
and the report's "Comparison" section shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from speedmatrix.analysis.verdict import VERDICTS, _fmt, number
from speedmatrix.records import cell_name

_VERDICT_MARK = {"regression": "▼ regression", "improvement": "▲ improvement"}


def notable(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows worth showing by default: everything that is not plain noise."""
    return [r for r in rows if r.get("verdict") != "noise"]


def verdict_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICTS, 0)
    for r in rows:
        verdict = r.get("verdict") or "not_comparable"
        counts[verdict] = counts.get(verdict, 0) + 1
    return counts


def display_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Rows as short strings, the columns `compare` prints and the report's section shows."""
    out = []
    for r in rows:
        change, noise = number(r.get("change_pct")), number(r.get("noise_pct"))
        thr = number(r.get("threshold_pct"))
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
                "Noise": f"±{noise:.1f}%" if noise is not None else "—",
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
    a = baseline.get("engine_commit") or baseline.get("engine_version") or "?"
    b = run.get("engine_commit") or run.get("engine_version") or "?"
    lines = [
        "## Comparison",
        "",
        f"Baseline: run `{baseline.get('run_id')}` (engine {a}); this run: `{run.get('run_id')}`"
        f" (engine {b}).",
        "",
        ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in counts.items()) + ".",
        "A change counts only when it exceeds both the threshold and the combined noise.",
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
