"""Parse a published "Speed test matrix" page into one run record and its cell records.

One job, hence its length: reading the page's every section, each checked against the others.

The pages are scraped text (``include/reference/`` holds one). Values come from the labelled
header fields (Hardware, Engine, Run) and from the unambiguous "All measurements" table; the
summary sections (the title line, Prefill, the Sustained decode matrix) are scraped with numbers
glued to their neighbours (``6,2061,320 ms TTFT`` is 6,206 tok/s and 1,320 ms), so they are used
only as a cross-check against the table: a disagreement means a mangled page and is an error.

Also read: the Markdown this package renders (``speedmatrix.report.render.render_markdown``),
so a rendered page ingests back to the same rows and the same run id.

Scraping artefacts handled: a section heading glued to the end of the line before it
(``…--enable-prefix-cachingPrefill``), a note glued to a table header
(``…requests.| Phase | …``), a ``# Reconstructed from …`` comment line before the launch
command (dropped: not part of the command), values written ``17.7K``, ``18K``, ``6,206.0``,
``1,320 ms``, ``30.0 s``, ``—``.

Every problem raises :class:`ReportParseError` naming the line; nothing is returned half-parsed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field

from speedmatrix.published import formats as F
from speedmatrix.published.implied import apply_implied_contexts
from speedmatrix.records import (
    CELL_FIELDS,
    DEFAULT_WORKLOAD,
    INGEST_METRIC_VERSION,
    RUN_FIELDS,
    WORKLOADS,
    cell_sort_key,
    context_label,
    empty_cell,
    parse_context,
)
from speedmatrix.redact import redact

TITLE = "Speed test matrix"
SECTIONS = (
    "Hardware",
    "Engine",
    "Run",
    "Launch command",
    "Prefill",
    "Sustained decode",
    "All measurements",
)
REQUIRED_SECTIONS = {"Hardware", "Engine", "Run", "All measurements"}

# Header labels per section -> run field, in page order (the renderer writes them in this order).
HEADER_LABELS: dict[str, tuple[tuple[str, str], ...]] = {
    "Hardware": (
        ("Type", "hardware_type"),
        ("GPU", "hardware_gpu"),
        ("GPU count", "hardware_gpu_count"),
        ("VRAM", "hardware_vram_gb"),
        ("OS", "hardware_os"),
    ),
    "Engine": (
        ("Engine", "engine"),
        ("Version", "engine_version"),
        ("Quantization", "quantization"),
        ("Backend", "backend"),
        ("Repository", "engine_repository"),
        ("Build", "build"),
        ("Commit", "engine_commit"),
        ("Pull request", "engine_pr"),
    ),
    "Run": (
        ("Served model", "served_model"),
        ("Revision", "model_revision"),
        ("Benchmark tool", "bench_tool"),
        ("Decode test", "decode_test"),
        ("Prefill mode", "prefill_mode"),
        ("Time per measurement", "measure_s"),
        ("Max output", "max_output_tokens"),
    ),
}
REQUIRED_LABELS: dict[str, tuple[str, ...]] = {
    "Hardware": ("GPU", "GPU count"),
    "Engine": ("Engine", "Version"),
    "Run": ("Served model", "Time per measurement", "Max output"),
}

# metric_version of ingested cells (records.INGEST_METRIC_VERSION, re-exported for callers)


class ReportParseError(ValueError):
    """A page that is not a well-formed Speed test matrix report; names the line."""

    def __init__(self, message: str, line: int | None = None, source: str | None = None):
        self.line = line
        self.source = source
        self.reason = message
        where = source or "report"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}")


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


@dataclass
class _Line:
    no: int  # 1-based line number in the input
    text: str


_MD_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _normalise(raw: str) -> str:
    s = raw.strip().replace("\u00a0", " ")
    m = _MD_HEADING.match(s)
    if m and (m.group(1).strip("* ") in SECTIONS or m.group(1).strip("* ") == TITLE):
        s = m.group(1).strip("* ")
    if s.startswith("**") and s.endswith("**") and len(s) > 4:
        s = s[2:-2]
    return s


def _split_sections(lines: list[_Line], source: str | None) -> dict[str, list[_Line]]:
    """Find the section headings in order; split headings glued to the end of a line."""
    found: dict[str, int] = {}
    pos = 0
    work = list(lines)
    for name in SECTIONS:
        exact = next((i for i in range(pos, len(work)) if work[i].text == name), None)
        if exact is None:
            glued = next(
                (
                    i
                    for i in range(pos, len(work))
                    if work[i].text.endswith(name)
                    and len(work[i].text) > len(name)
                    and not work[i].text.startswith("|")
                ),
                None,
            )
            if glued is not None:
                ln = work[glued]
                work[glued : glued + 1] = [
                    _Line(ln.no, ln.text[: -len(name)].rstrip()),
                    _Line(ln.no, name),
                ]
                exact = glued + 1
        if exact is None:
            if name in REQUIRED_SECTIONS:
                last = work[-1].no if work else 1
                raise ReportParseError(
                    f"section {name!r} not found (truncated or not a Speed test matrix page?)",
                    last,
                    source,
                )
            continue
        found[name] = exact
        pos = exact + 1
    order = sorted(found.items(), key=lambda kv: kv[1])
    sections: dict[str, list[_Line]] = {"_head": work[: order[0][1]] if order else work}
    for k, (name, start) in enumerate(order):
        end = order[k + 1][1] if k + 1 < len(order) else len(work)
        sections[name] = [ln for ln in work[start + 1 : end] if ln.text]
    return sections


def _parse_header(
    name: str, lines: list[_Line], source: str | None, extra: dict[str, str]
) -> dict[str, tuple[str, int]]:
    known = {label for label, _ in HEADER_LABELS[name]}
    items: list[_Line] = []
    for ln in lines:
        s = ln.text
        if s.startswith(("- ", "* ")):
            s = s[2:].strip()
        elif s in ("-", "*"):
            s = ""
        s = s.replace("**", "")
        items.append(_Line(ln.no, s))
    values: dict[str, tuple[str, int]] = {}
    i = 0
    while i < len(items):
        item = items[i]
        label, sep, value = item.text.partition(": ")
        if sep and label in known:
            pair = (label, value.strip(), item.no)
            i += 1
        else:
            if i + 1 >= len(items):
                raise ReportParseError(f"{name}: field {item.text!r} has no value", item.no, source)
            pair = (item.text, items[i + 1].text.strip(), items[i + 1].no)
            i += 2
        label, value, no = pair
        if label in values:
            raise ReportParseError(f"{name}: field {label!r} given twice", no, source)
        if label not in known:
            extra[f"{name}.{label}"] = value
        values[label] = (value, no)
    for label in REQUIRED_LABELS[name]:
        if label not in values:
            at = lines[-1].no if lines else None
            raise ReportParseError(f"{name}: missing header field {label!r}", at, source)
        if values[label][0] in ("", F.DASH):
            raise ReportParseError(
                f"{name}: header field {label!r} is empty", values[label][1], source
            )
    return values


def _header_value(field_name: str, text: str, no: int, source: str | None) -> object:
    try:
        if field_name == "hardware_gpu_count":
            return F.parse_int(text)
        if field_name == "hardware_vram_gb":
            # "768 GB (8 × 96 GB)" -> 96 per GPU; "96 GB" -> 96
            m = re.search(r"\(\s*(\d+)\s*[×x]\s*([\d.,]+)\s*GB\s*\)", text)
            if m:
                return F.parse_number(m.group(2))
            m = re.fullmatch(r"([\d.,]+)\s*GB", text.strip())
            if m:
                return F.parse_number(m.group(1))
            raise F.QuantityError(f"not a VRAM size like '768 GB (8 × 96 GB)': {text!r}")
        if field_name == "engine_pr":
            return F.parse_int(text.lstrip("#"))
        if field_name == "measure_s":
            return F.parse_seconds(text)
        if field_name == "max_output_tokens":
            return F.parse_tokens(text)
    except F.QuantityError as exc:
        raise ReportParseError(str(exc), no, source) from None
    return None if text in ("", F.DASH) else text


def _cells_of_row(text: str) -> list[str] | None:
    s = text.strip()
    if not s.startswith("|"):
        return None
    if not s.endswith("|") or len(s) < 2:
        return [c.strip() for c in s[1:].split("|")] + ["<cut>"]
    return [c.strip() for c in s[1:-1].split("|")]


def _find_table(
    lines: list[_Line], first_header: str, section: str, source: str | None
) -> tuple[list[str], list[list[str]], list[_Line], list[_Line], list[_Line]]:
    """-> header cells, data rows, data row lines, lines before, lines after."""
    marker = f"| {first_header} |"
    start = None
    for i, ln in enumerate(lines):
        k = ln.text.find(marker)
        if k < 0:
            k = ln.text.find(f"|{first_header}|")
        if k >= 0:
            start = i
            before_text = ln.text[:k].strip()
            header = _cells_of_row(ln.text[k:])
            break
    if start is None:
        at = lines[0].no if lines else None
        raise ReportParseError(f"{section}: table header '{marker} …' not found", at, source)
    before = [*lines[:start], *([_Line(lines[start].no, before_text)] if before_text else [])]
    i = start + 1
    if i >= len(lines) or not re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", lines[i].text.strip()):
        at = lines[i].no if i < len(lines) else lines[start].no
        raise ReportParseError(f"{section}: expected the |---| rule under the header", at, source)
    i += 1
    rows, row_lines = [], []
    while i < len(lines) and lines[i].text.startswith("|"):
        cells = _cells_of_row(lines[i].text)
        rows.append(cells)
        row_lines.append(lines[i])
        i += 1
    return header or [], rows, row_lines, before, lines[i:]


def _parse_measurements(
    lines: list[_Line], run: dict, source: str | None
) -> tuple[list[dict], list[_Line], list[_Line]]:
    header, rows, row_lines, before, after = _find_table(lines, "Phase", "All measurements", source)
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


def _cell_from_row(row: list[str], ln: _Line, run: dict, source: str | None) -> dict:
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
    parsers = {
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
    values: dict[str, object] = {}
    for column, parser in parsers.items():
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
    if status == "valid":
        needed = ["Total tok/s", "TTFT"]
        if phase == "decode":
            needed += ["Per request tok/s", "Time between tokens", "Output tokens", "Measured for"]
        for column in needed:
            if values[column] is None:
                raise bad(column, "a valid cell needs a value")
    if status == "over_capacity":
        for column in parsers:
            if column != "Requests at once" and values[column] is not None:
                raise bad(column, "an over-capacity cell has no measurements")
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
        window_s=run.get("measure_s") if phase == "decode" else None,
    )


# ---------------------------------------------------------------------------------------------
# cross-checks against the summary sections


def _close(summary: float, table: float, text: str) -> bool:
    """Does the summary's number (written ``text``: ``6,206``, ``54.9``, ``17.7K``) round the
    table's value? The tolerance is half a unit of the summary's last written digit, plus half
    a unit of the table's own rounding (0.05)."""
    t = text.strip()
    scale = 1000.0 if t[-1:] in ("K", "k") else 1.0
    digits = t.rstrip("Kk")
    decimals = len(digits.split(".", 1)[1]) if "." in digits else 0
    tolerance = 0.5 * 10 ** (-decimals) * scale + 0.05 + 1e-9
    return abs(summary - table) <= tolerance


def _strip_separators(s: str) -> str:
    s = s.replace("<br>", " ").replace("<br/>", " ").replace("·", " ").replace("|", " ")
    return s.strip(" ,:\t")


def _check_glued(
    text: str, total: float | None, ttft_ms: float | None, decimals: int
) -> str | None:
    """``54.987 ms TTFT`` against total 54.9 and TTFT 87 ms; None when they agree."""
    if total is None or ttft_ms is None:
        return "the table has no tok/s or TTFT for it"
    s = _strip_separators(text)
    if not s.endswith("ms TTFT"):
        return f"{text!r} does not end in 'ms TTFT'"
    s = s[: -len("ms TTFT")].rstrip()
    ttft = F.fmt_ms(ttft_ms, 0)[: -len(" ms")]
    if not s.endswith(ttft):
        return f"{text!r}: TTFT is not {ttft} ms as in the table"
    rest = _strip_separators(s[: -len(ttft)])
    try:
        value = F.parse_number(rest)
    except F.QuantityError:
        return f"{text!r}: no tok/s before the TTFT"
    if value is None or not _close(value, total, rest):
        return f"{text!r}: tok/s {rest!r} disagrees with the table's {F.fmt_rate(total)}"
    return None


def _check_prefill(lines: list[_Line], cells: list[dict], source: str | None) -> None:
    prefill = [c for c in cells if c["phase"] == "prefill"]
    text_lines = [ln for ln in lines if not ln.text.startswith("|---")]
    for cell in prefill:
        label = cell["context_label"]
        pat = re.compile(rf"(?<![\dK.,]){re.escape(label)} context")
        hit = None
        for ln in text_lines:
            m = pat.search(ln.text)
            if m:
                hit = (ln, m.end())
                break
        if hit is None:
            if cell["status"] == "valid":
                at = lines[0].no if lines else None
                raise ReportParseError(
                    f"Prefill: no '{label} context' entry for the table's prefill row",
                    at,
                    source,
                )
            continue
        ln, end = hit
        rest = ln.text[end:]
        stop = rest.find("TTFT")
        segment = rest[: stop + 4] if stop >= 0 else rest
        if cell["status"] != "valid":
            continue
        problem = _check_glued(segment, cell["total_tok_s"], cell["ttft_ms"], 0)
        if problem:
            raise ReportParseError(
                f"Prefill summary disagrees with All measurements: {label}: {problem}",
                ln.no,
                source,
            )
    labels_in_summary = set()
    for ln in text_lines:
        for m in re.finditer(r"(?<![\d.,])(\d+K) context", ln.text):
            labels_in_summary.add((m.group(1), ln.no))
    table_labels = {c["context_label"] for c in prefill}
    for label, no in sorted(labels_in_summary, key=lambda x: x[1]):
        if label not in table_labels:
            raise ReportParseError(
                f"Prefill: '{label} context' has no Prefill row in All measurements", no, source
            )


def _check_matrix(lines: list[_Line], cells: list[dict], source: str | None) -> None:
    header, rows, row_lines, _, _ = _find_table(lines, "Context", "Sustained decode", source)
    try:
        concurrencies = [F.parse_int(h) for h in header[1:]]
    except F.QuantityError as exc:
        raise ReportParseError(
            f"Sustained decode: header: {exc}", row_lines[0].no - 2 if row_lines else None, source
        ) from None
    decode = {(c["context_label"], c["concurrency"]): c for c in cells if c["phase"] == "decode"}
    seen = set()
    for ln, row in zip(row_lines, rows, strict=True):
        if len(row) != len(header) or "<cut>" in row:
            raise ReportParseError(
                f"Sustained decode: row has {len(row)} cells, expected {len(header)}",
                ln.no,
                source,
            )
        label = row[0]
        for conc, text in zip(concurrencies, row[1:], strict=True):
            cell = decode.get((label, conc))
            if cell is None and text in (F.DASH, ""):
                continue  # a cell the run did not plan
            if cell is None:
                raise ReportParseError(
                    f"Sustained decode: {label} x {conc} has no row in All measurements",
                    ln.no,
                    source,
                )
            seen.add((label, conc))
            if cell["status"] != "valid":
                if text.lower() != F.fmt_status(
                    cell["status"]
                ).lower() and not text.lower().startswith(F.fmt_status(cell["status"]).lower()):
                    raise ReportParseError(
                        f"Sustained decode: {label} x {conc} is {text!r} here but "
                        f"{F.fmt_status(cell['status'])!r} in All measurements",
                        ln.no,
                        source,
                    )
                continue
            problem = _check_glued(text, cell["total_tok_s"], cell["ttft_ms"], 1)
            if problem:
                raise ReportParseError(
                    f"Sustained decode matrix disagrees with All measurements: {label} x "
                    f"{conc}: {problem}",
                    ln.no,
                    source,
                )
    missing = sorted(set(decode) - seen, key=lambda k: cell_sort_key(("decode", *k)))
    if missing:
        at = row_lines[-1].no if row_lines else None
        label, conc = missing[0]
        raise ReportParseError(
            f"Sustained decode: the matrix lacks {label} x {conc} "
            f"({len(missing)} All measurements row(s) not in the matrix)",
            at,
            source,
        )


def _check_subtitle(head: list[_Line], cells: list[dict], source: str | None) -> None:
    """``6 contexts (8K–251K) × 8 concurrency levels (1–128) · prefill at 8K, 16K, …``"""
    # by label: a label's cells carry the prompt length the page implies (published.implied)
    decode_ctx = sorted(
        {parse_context(c["context_label"]) for c in cells if c["phase"] == "decode"}
    )
    concs = sorted({c["concurrency"] for c in cells if c["phase"] == "decode"})
    prefill = [c["context_label"] for c in cells if c["phase"] == "prefill"]
    for ln in head:
        if "contexts (" in ln.text and decode_ctx:
            lo, hi = context_label(decode_ctx[0]), context_label(decode_ctx[-1])
            want = f"{len(decode_ctx)} contexts ({lo}–{hi})"
            line = re.sub("[-—−]", "–", ln.text)  # whichever dash the page used
            if want not in line:
                raise ReportParseError(
                    f"title line says other contexts than All measurements has ({want})",
                    ln.no,
                    source,
                )
            want = f"{len(concs)} concurrency levels ({concs[0]}–{concs[-1]})"
            if "concurrency levels" in line and want not in line:
                raise ReportParseError(
                    f"title line says other concurrency levels than All measurements has ({want})",
                    ln.no,
                    source,
                )
        if "prefill at " in ln.text and prefill:
            listed = ln.text.split("prefill at ", 1)[1].split("·")[0].strip()
            if [p.strip() for p in listed.split(",")] != prefill:
                raise ReportParseError(
                    f"title line lists prefill contexts {listed!r}, All measurements has "
                    f"{', '.join(prefill)}",
                    ln.no,
                    source,
                )


# ---------------------------------------------------------------------------------------------


def _launch(lines: list[_Line]) -> tuple[str | None, str | None]:
    comment, command = [], []
    for ln in lines:
        s = ln.text
        if s.startswith("```"):
            continue
        if s.startswith("#"):
            comment.append(s)
            continue
        command.append(s)
    text = "\n".join(command).strip() or None
    if text:
        text = redact(text)
    return text, ("\n".join(comment) or None)


def _from_launch(command: str | None) -> dict:
    out: dict[str, object] = {}
    if not command:
        return out
    try:
        argv = shlex.split(command.replace("\\\n", " "))
    except ValueError:
        argv = command.split()
    if "serve" in argv:
        k = argv.index("serve")
        if k + 1 < len(argv) and not argv[k + 1].startswith("-"):
            out["model"] = argv[k + 1]
    for k, arg in enumerate(argv):
        value = None
        if arg == "--max-model-len" and k + 1 < len(argv):
            value = argv[k + 1]
        elif arg.startswith("--max-model-len="):
            value = arg.split("=", 1)[1]
        if value is not None:
            with contextlib.suppress(F.QuantityError):
                out["max_model_len"] = F.parse_int(value)
    return out


_WORKLOAD_NOTE = re.compile(r"^(?P<test>.*?)\s*\((?P<workload>[a-z]+) workload\)$")


PUBLISHED_PROFILE_NOTE = " (published profile)"
"""render.decode_test_text's note on our runs measured by the `published` profile."""


def _profile_of(decode_test: object, bench_tool: object) -> tuple[object, str]:
    """(decode test without the profile note, measurement profile): a page the published tool
    made is the `published` profile by its nature; ours says so in a note, else default."""
    if isinstance(decode_test, str) and decode_test.endswith(PUBLISHED_PROFILE_NOTE):
        return decode_test[: -len(PUBLISHED_PROFILE_NOTE)], "published"
    ours = bench_tool in (None, "speedmatrix")
    return decode_test, "default" if ours else "published"


def _workload_of(decode_test: object) -> tuple[object, str]:
    """("Fixed duration (continuation workload)") -> ("Fixed duration", "continuation"): the
    note render.decode_test_text adds for a workload other than the published one. A page
    without it was measured with the published tool's workload: article."""
    if isinstance(decode_test, str):
        m = _WORKLOAD_NOTE.match(decode_test)
        if m and m.group("workload") in WORKLOADS:
            return m.group("test") or None, m.group("workload")
    return decode_test, DEFAULT_WORKLOAD


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "unknown"


def published_recipe_id(run: dict) -> str:
    """The recipe id an ingested page is filed under: ``published/<gpu>-x<count>/<model>``
    (e.g. ``published/rtx-pro-6000-blackwell-server-edition-x8/kimi-k2.7-code-nvfp4``), so
    pages of one configuration group together in the warehouse."""
    hw = _slug(str(run.get("hardware_gpu") or "unknown"))
    if run.get("hardware_gpu_count"):
        hw += f"-x{run['hardware_gpu_count']}"
    model = _slug(str(run.get("served_model") or run.get("model") or "unknown"))
    return f"published/{hw}/{model}"


def content_run_id(run: dict, cells: list[dict]) -> str:
    """``ingest-`` + 16 hex of a SHA-256 over the parsed content (not the raw text, not the
    source path): the same page, wherever it lies and however it is laid out, is the same run.
    The published workload (`article`) is left out of the hash, so pages ingested before the
    workload was recorded keep their ids."""

    def hashed(row: dict, drop: tuple[str, ...] = ()) -> dict:
        return {
            k: v
            for k, v in row.items()
            if k not in drop and not (k == "workload" and v == DEFAULT_WORKLOAD)
        }

    keep_run = hashed(run, ("run_id", "source"))
    payload = json.dumps(
        {"run": keep_run, "cells": [hashed(c) for c in cells]},
        sort_keys=True,
        default=str,
        separators=(",", ":"),
    )
    return "ingest-" + hashlib.sha256(payload.encode()).hexdigest()[:16]


def parse_report(text: str, source: str | None = None) -> ParsedReport:
    """Parse one published Speed test matrix page (scraped text or our Markdown).

    Returns a :class:`ParsedReport`: ``.run`` holds every RUN_FIELDS key (``trigger`` =
    ``ingest``, ``status`` = ``success``, ``source`` = the given source, ``recipe_id`` =
    :func:`published_recipe_id`, ``started_at`` None: the pages carry no date); ``.cells`` one full
    cell record (every CELL_FIELDS key) per "All measurements" row, in table order.

    The page gives contexts as labels (``8K``, ``251K``); the prompt the tool really sent is
    what the label's prefill row implies (tok/s x TTFT: ``published.implied``; the tool sizes
    prompts by characters and its long ones come out 1-2.5% short), so an ingested cell's
    ``context_tokens`` is that implied count for every cell of a label with a consistent prefill
    row, else label * 1024; ``context_label`` keeps the label. Ingested cells carry ``metric_version`` 0 (measured by
    another tool), ``max_output_tokens`` from the Run section (1 for prefill) and
    ``window_s`` = the time per measurement (decode).

    Raises :class:`ReportParseError` (a ValueError) naming the line for a truncated page, a
    mangled table row, a missing header field or summary sections that contradict the table.
    """
    if not isinstance(text, str):
        raise TypeError("parse_report takes the page's text")
    raw_lines = text.splitlines()
    lines = [_Line(i + 1, _normalise(r)) for i, r in enumerate(raw_lines)]
    lines = [ln for ln in lines if ln.text]
    if not lines:
        raise ReportParseError("empty report", 1, source)
    if lines[0].text != TITLE:
        raise ReportParseError(
            f"expected the title {TITLE!r} on the first line, found {lines[0].text[:60]!r}",
            lines[0].no,
            source,
        )
    sections = _split_sections(lines[1:], source)
    head = sections["_head"]

    run: dict[str, object] = {f.name: None for f in RUN_FIELDS}
    extra: dict[str, str] = {}
    for name in ("Hardware", "Engine", "Run"):
        values = _parse_header(name, sections[name], source, extra)
        for label, field_name in HEADER_LABELS[name]:
            if label in values:
                value, no = values[label]
                run[field_name] = _header_value(field_name, value, no, source)
    tool = run.get("bench_tool")
    if isinstance(tool, str):
        m = re.fullmatch(r"(.+?)\s+v?(\d[\w.+-]*)", tool)
        if m:
            run["bench_tool"], run["bench_tool_version"] = m.group(1), m.group(2)
    command, comment = _launch(sections.get("Launch command", []))
    run["launch_command"] = command
    for k, v in _from_launch(command).items():
        run[k] = v
    decode_test, run["measurement_profile"] = _profile_of(
        run.get("decode_test"), run.get("bench_tool")
    )
    run["decode_test"], run["workload"] = _workload_of(decode_test)
    run["trigger"] = "ingest"
    run["status"] = "success"
    run["recipe_id"] = published_recipe_id(run)
    run["source"] = source

    cells, before, after = _parse_measurements(sections["All measurements"], run, source)
    for c in cells:
        c["workload"] = run["workload"]
        c["measurement_profile"] = run["measurement_profile"]
    apply_implied_contexts(cells)
    # anything under a further heading (a baseline comparison, a footer) is not the page's
    k = next((i for i, ln in enumerate(after) if re.match(r"^#{1,6}\s", ln.text)), len(after))
    after = after[:k]
    for note in [*before, *after]:
        if note.text.startswith("|"):
            raise ReportParseError(
                "All measurements: a table row outside the table (a broken line?)", note.no, source
            )
    if "Prefill" in sections:
        _check_prefill(sections["Prefill"], cells, source)
    if "Sustained decode" in sections:
        _check_matrix(sections["Sustained decode"], cells, source)
    _check_subtitle(head, cells, source)

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
