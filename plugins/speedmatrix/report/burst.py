"""The burst cells of a run as the page shows them: a section of their own ("Burst / E2E
decode", as the published tool calls its request-count mode), beside the sustained-decode
matrix and never inside it, so that no one reads a burst's figure as a decode cell's.

One row per burst cell: how many of its N requests completed, total tok/s over the burst,
the completed-request latency (median, p90, p99), per-user end-to-end tok/s, and the TTFT,
time to the second token and time between tokens of its requests. Markdown and HTML alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from speedmatrix.published import formats as F
from speedmatrix.records import cell_key, cell_sort_key

TITLE = "Burst / E2E decode"
NOTE = (
    "N requests sent at once and measured to their completion (the published tool's "
    "request-count mode). Latency: a request's last token - its request sent, over the "
    "completed requests (median, p90, p99). Per user e2e: a request's output tokens / its "
    "latency, the wait for its first token included. Total tok/s: every completed request's "
    "output tokens / the burst's time (first request sent to last token). Not comparable with "
    "the sustained decode cells, which measure a steady window."
)
HEADER = (
    "Context",
    "Requests at once",
    "Status",
    "Completed",
    "Total tok/s",
    "Latency",
    "Latency p90",
    "Latency p99",
    "Per user e2e tok/s",
    "TTFT",
    "Time to 2nd token",
    "Time between tokens",
    "Burst time",
)


def burst_cells(cells: Sequence[dict]) -> list[dict]:
    """The run's burst cells in page order (records.cell_sort_key)."""
    return sorted((c for c in cells if c.get("phase") == "burst"), key=cell_sort_key)


def burst_rows(cells: Sequence[dict]) -> list[list[str]]:
    """One row of HEADER's texts per burst cell; an over-capacity or failed cell says so."""
    rows = []
    for c in burst_cells(cells):
        n = c.get("concurrency")
        done = c.get("completed_requests")
        measured = c.get("status") in ("valid", "invalid")
        rows.append(
            [
                cell_key(c)[1],
                F.fmt_int(n),
                F.fmt_status(c.get("status")),
                f"{F.fmt_int(done)}/{F.fmt_int(n)}" if measured else F.DASH,
                F.fmt_rate(c.get("total_tok_s")),
                F.fmt_ms(c.get("latency_ms"), 0),
                F.fmt_ms(c.get("latency_p90_ms"), 0),
                F.fmt_ms(c.get("latency_p99_ms"), 0),
                F.fmt_rate(c.get("e2e_per_request_tok_s")),
                F.fmt_ms(c.get("ttft_ms"), 0),
                F.fmt_ms(c.get("ttst_ms"), 1),
                F.fmt_ms(c.get("tbt_ms"), 1),
                F.fmt_seconds(c.get("measured_s")),
            ]
        )
    return rows


def markdown_section(cells: Sequence[dict]) -> list[str]:
    """The section's Markdown lines; none when the run has no burst cell (a run without
    bursts keeps the published page exactly)."""
    rows = burst_rows(cells)
    if not rows:
        return []
    out = [f"## {TITLE}", "", NOTE, "", "| " + " | ".join(HEADER) + " |", F.table_rule(len(HEADER))]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return [*out, ""]
