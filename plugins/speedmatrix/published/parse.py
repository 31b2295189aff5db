"""Parse a published "Speed test matrix" page into one run record and its cell records.

The pages are scraped text (``include/reference/`` holds one) or the Markdown this package
renders (``speedmatrix.report.render.render_markdown``), so a rendered page ingests back to the
same rows and the same run id. This module puts the reading together; each part has its own
module: the page's text (``pagetext``: sections, header fields, tables), the run record
(``runfields``: header fields, launch command, recipe and run id), the cell records
(``measurements``: the "All measurements" table), the prompts the page implies (``implied``)
and the summary sections checked against the table (``crosscheck``).

Every problem raises :class:`~speedmatrix.published.pagetext.ReportParseError` naming the line;
nothing is returned half-parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speedmatrix.published.crosscheck import (
    check_matrix,
    check_no_stray_rows,
    check_prefill,
    check_subtitle,
)
from speedmatrix.published.implied import apply_implied_contexts
from speedmatrix.published.measurements import parse_measurements
from speedmatrix.published.pagetext import page_lines, split_sections
from speedmatrix.published.runfields import content_run_id, run_record
from speedmatrix.records import CELL_FIELDS


@dataclass
class ParsedReport:
    """``run``: one runs-table row (RUN_FIELDS keys); ``cells``: cells-table rows (CELL_FIELDS
    keys) in the page's table order; ``run_id``: ``ingest-`` + a hash of the parsed content
    (the same page, or its re-rendered Markdown, always gives the same id)."""

    run: dict
    cells: list[dict]
    run_id: str
    source: str | None = None
    extra_fields: dict[str, str] = field(default_factory=dict)
    title: str | None = None  # the line under "Speed test matrix" (model on hardware)
    subtitle: str | None = None  # the engine · version · quantization · matrix shape line
    launch_comment: str | None = None

    @property
    def requests(self) -> list[dict]:
        """Published pages carry no per-request rows."""
        return []


def parse_report(text: str, source: str | None = None) -> ParsedReport:
    """Parse one published Speed test matrix page (scraped text or our Markdown).

    Returns a :class:`ParsedReport`: ``.run`` holds every RUN_FIELDS key (``trigger`` =
    ``ingest``, ``status`` = ``success``, ``source`` = the given source, ``recipe_id`` =
    :func:`~speedmatrix.published.runfields.published_recipe_id`, ``started_at`` None: the pages carry no date); ``.cells`` one full
    cell record (every CELL_FIELDS key) per "All measurements" row, in table order.

    The page gives contexts as labels (``8K``, ``251K``); the prompt the tool really sent is
    what the label's prefill row implies (tok/s x TTFT: ``published.implied``; the tool sizes
    prompts by characters and its long ones come out 1-2.5% short), so an ingested cell's
    ``context_tokens`` is that implied count for every cell of a label with a consistent prefill
    row, else label * 1024; ``context_label`` keeps the label. Ingested cells carry ``metric_version`` 0 (measured by
    another tool), ``max_output_tokens`` from the Run section (1 for prefill) and
    ``window_s`` = the time per measurement (decode).

    Raises :class:`~speedmatrix.published.pagetext.ReportParseError` (a ValueError) naming the line for a truncated page, a
    mangled table row, a missing header field or summary sections that contradict the table.
    """
    lines = page_lines(text, source)
    sections = split_sections(lines[1:], source)
    head = sections["_head"]
    run, extra, comment = run_record(sections, source)

    cells, before, after = parse_measurements(sections["All measurements"], run, source)
    for c in cells:
        c["workload"] = run["workload"]
        c["measurement_profile"] = run["measurement_profile"]
    apply_implied_contexts(cells)
    check_no_stray_rows(before, after, source)
    if "Prefill" in sections:
        check_prefill(sections["Prefill"], cells, source)
    if "Sustained decode" in sections:
        check_matrix(sections["Sustained decode"], cells, source)
    check_subtitle(head, cells, source)

    # a page cut inside the last row or right after the table's rule is caught above; a page
    # cut between two complete rows is caught by the matrix and title cross-checks.
    run_id = content_run_id(run, cells)
    run["run_id"] = run_id
    for f in CELL_FIELDS:
        for c in cells:
            c.setdefault(f.name, None)
    return ParsedReport(
        run=run,
        cells=cells,
        run_id=run_id,
        source=source,
        extra_fields=extra,
        title=head[0].text if head else None,
        subtitle=" ".join(ln.text for ln in head[1:]) or None,
        launch_comment=comment,
    )
