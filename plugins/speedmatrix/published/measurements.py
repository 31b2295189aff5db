"""The "All measurements" table read into cell records: one full cell record per row.

The table is the page's unambiguous source of every figure (the summary sections above it are
only checked against it: ``crosscheck``). Values are written as the pages write them
(``17.7K``, ``18K``, ``6,206.0``, ``1,320 ms``, ``30.0 s``, ``—``: ``formats``); a row cut
off, a duplicate row, an unknown phase or status, a valid cell without its figures or an
over-capacity cell with figures is an error naming the line.
"""

from __future__ import annotations

from collections.abc import Callable

from speedmatrix.published import formats as F
from speedmatrix.published.pagetext import Line, ReportParseError, find_table
from speedmatrix.records import INGEST_METRIC_VERSION, empty_cell, parse_context

# the table's figure columns, each read as the pages write it
_PARSERS = {
    "Requests at once": F.parse_int,
    "Total tok/s": F.parse_number,
    "Per request tok/s": F.parse_number,
    "TTFT": F.parse_ms,
    "Time between tokens": F.parse_ms,
    "Average active requests": F.parse_number,
    "Completed requests": F.parse_int,
    "Output tokens": F.parse_int,
    "Measured for": F.parse_seconds,
}


def parse_measurements(
    lines: list[Line], run: dict, source: str | None
) -> tuple[list[dict], list[Line], list[Line]]:
    """(one cell record per row, in table order; the lines before the table; the lines after
    it): the notes around the table, for the caller's checks."""
    header, rows, row_lines, before, after = find_table(lines, "Phase", "All measurements", source)
    expected = [h for h, _ in F.TABLE_COLUMNS]
    hdr_no = (before[-1].no if before else row_lines[0].no - 2) if row_lines else None
    if header != expected:
        raise ReportParseError(
            f"All measurements: unexpected columns {header}, expected {expected}", hdr_no, source
        )
    if not rows:
        raise ReportParseError("All measurements: the table has no rows", hdr_no, source)
    cells: list[dict] = []
    seen: dict[tuple, int] = {}
    for ln, row in zip(row_lines, rows, strict=True):
        if len(row) != len(expected) or "<cut>" in row:
            raise ReportParseError(
                f"All measurements: row has {len([c for c in row if c != '<cut>'])} cells, "
                f"expected {len(expected)}"
                + (" (the row is cut off)" if "<cut>" in row else "")
                + f": {ln.text[:80]!r}",
                ln.no,
                source,
            )
        cells.append(_cell_from_row(row, ln, run, source))
        key = (cells[-1]["phase"], cells[-1]["context_tokens"], cells[-1]["concurrency"])
        if key in seen:
            raise ReportParseError(
                f"All measurements: duplicate row for {row[0]} {row[1]} x {row[2]} "
                f"(first on line {seen[key]})",
                ln.no,
                source,
            )
        seen[key] = ln.no
    return cells, before, after


def _cell_from_row(row: list[str], ln: Line, run: dict, source: str | None) -> dict:
    col = dict(zip([h for h, _ in F.TABLE_COLUMNS], row, strict=True))

    def bad(column: str, why: str) -> ReportParseError:
        return ReportParseError(
            f"All measurements: column {column!r}: {why} in row {ln.text[:80]!r}", ln.no, source
        )

    phase = F.PHASE_FROM_LABEL.get(col["Phase"].lower())
    if phase is None:
        raise bad("Phase", f"unknown phase {col['Phase']!r}")
    status_text = col["Status"]
    status = F.STATUS_FROM_LABEL.get(status_text.lower())
    error = None
    if status is None:
        head, _, reason = status_text.partition(":")
        status = F.STATUS_FROM_LABEL.get(head.strip().lower())
        error = reason.strip() or None
        if status is None:
            raise bad("Status", f"unknown status {status_text!r}")
    values: dict[str, object] = {}
    for column, parser in _PARSERS.items():
        try:
            values[column] = parser(col[column])
        except F.QuantityError as exc:
            raise bad(column, str(exc)) from None
    try:
        context_tokens = parse_context(col["Context"])
    except ValueError as exc:
        raise bad("Context", str(exc)) from None
    concurrency = values["Requests at once"]
    if concurrency is None or concurrency < 1:
        raise bad("Requests at once", f"needs a positive count, got {col['Requests at once']!r}")
    if phase == "prefill" and concurrency != 1:
        raise bad("Requests at once", "a prefill cell has 1 request")
    _check_figures(phase, status, values, bad)
    max_out = run.get("max_output_tokens")
    return empty_cell(
        phase=phase,
        context_tokens=context_tokens,
        context_label=col["Context"],
        concurrency=concurrency,
        status=status,
        total_tok_s=values["Total tok/s"],
        per_request_tok_s=values["Per request tok/s"],
        ttft_ms=values["TTFT"],
        tbt_ms=values["Time between tokens"],
        avg_active_requests=values["Average active requests"],
        completed_requests=values["Completed requests"],
        output_tokens=values["Output tokens"],
        measured_s=values["Measured for"],
        error=error,
        metric_version=INGEST_METRIC_VERSION,
        max_output_tokens=1 if phase == "prefill" else max_out,
        window_s=run.get("window_s") if phase == "decode" else None,
    )


def _check_figures(
    phase: str, status: str, values: dict[str, object], bad: Callable[[str, str], Exception]
) -> None:
    """A valid cell has the figures of its phase; an over-capacity cell has none."""
    if status == "valid":
        needed = ["Total tok/s", "TTFT"]
        if phase == "decode":
            needed += ["Per request tok/s", "Time between tokens", "Output tokens", "Measured for"]
        for column in needed:
            if values[column] is None:
                raise bad(column, "a valid cell needs a value")
    if status == "over_capacity":
        for column in _PARSERS:
            if column != "Requests at once" and values[column] is not None:
                raise bad(column, "an over-capacity cell has no measurements")
