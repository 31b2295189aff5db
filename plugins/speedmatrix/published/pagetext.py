"""The published page's text: its lines, section headings, header fields and Markdown tables.

The pages are scraped text (``include/reference/`` holds one) or the Markdown this package
renders. This module finds the parts of a page and hands them on as text with their line
numbers; what the text means (run fields, cell records, cross-checks) is read by the modules
that use it (``runfields``, ``measurements``, ``crosscheck``; ``parse`` puts them together).

Scraping artefacts handled here: a section heading glued to the end of the line before it
(``…--enable-prefix-cachingPrefill``), a note glued to a table header (``…requests.| Phase | …``),
a ``# Reconstructed from …`` comment line before the launch command (kept apart: not part of
the command).

Every problem raises :class:`ReportParseError` naming the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from speedmatrix.errors import InputError
from speedmatrix.published import formats as F
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
        ("Time per measurement", "window_s"),
        ("Max output", "max_output_tokens"),
    ),
}
REQUIRED_LABELS: dict[str, tuple[str, ...]] = {
    "Hardware": ("GPU", "GPU count"),
    "Engine": ("Engine", "Version"),
    "Run": ("Served model", "Time per measurement", "Max output"),
}


class ReportParseError(InputError):
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
class Line:
    """One line of the page as the parts are read: its number for the errors, its text."""

    no: int  # 1-based line number in the input
    text: str


_MD_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def normalise(raw: str) -> str:
    """A raw line stripped; a section heading or the title loses its Markdown marks."""
    s = raw.strip().replace("\u00a0", " ")
    m = _MD_HEADING.match(s)
    if m and (m.group(1).strip("* ") in SECTIONS or m.group(1).strip("* ") == TITLE):
        s = m.group(1).strip("* ")
    if s.startswith("**") and s.endswith("**") and len(s) > 4:
        s = s[2:-2]
    return s


def split_sections(lines: list[Line], source: str | None) -> dict[str, list[Line]]:
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
                    Line(ln.no, ln.text[: -len(name)].rstrip()),
                    Line(ln.no, name),
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
    sections: dict[str, list[Line]] = {"_head": work[: order[0][1]] if order else work}
    for k, (name, start) in enumerate(order):
        end = order[k + 1][1] if k + 1 < len(order) else len(work)
        sections[name] = [ln for ln in work[start + 1 : end] if ln.text]
    return sections


def parse_header(
    name: str, lines: list[Line], source: str | None, extra: dict[str, str]
) -> dict[str, tuple[str, int]]:
    """Label -> (value text, line number) of one header section, written ``Label: value`` or
    as the label and the value on two lines; labels the format does not know go to `extra` as
    ``Section.Label``."""
    known = {label for label, _ in HEADER_LABELS[name]}
    items: list[Line] = []
    for ln in lines:
        s = ln.text
        if s.startswith(("- ", "* ")):
            s = s[2:].strip()
        elif s in ("-", "*"):
            s = ""
        s = s.replace("**", "")
        items.append(Line(ln.no, s))
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


def cells_of_row(text: str) -> list[str] | None:
    """A table row's cells; a row without its closing ``|`` ends in ``"<cut>"``."""
    s = text.strip()
    if not s.startswith("|"):
        return None
    if not s.endswith("|") or len(s) < 2:
        return [c.strip() for c in s[1:].split("|")] + ["<cut>"]
    return [c.strip() for c in s[1:-1].split("|")]


def find_table(
    lines: list[Line], first_header: str, section: str, source: str | None
) -> tuple[list[str], list[list[str]], list[Line], list[Line], list[Line]]:
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
            header = cells_of_row(ln.text[k:])
            break
    if start is None:
        at = lines[0].no if lines else None
        raise ReportParseError(f"{section}: table header '{marker} …' not found", at, source)
    before = [*lines[:start], *([Line(lines[start].no, before_text)] if before_text else [])]
    i = start + 1
    if i >= len(lines) or not re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", lines[i].text.strip()):
        at = lines[i].no if i < len(lines) else lines[start].no
        raise ReportParseError(f"{section}: expected the |---| rule under the header", at, source)
    i += 1
    rows, row_lines = [], []
    while i < len(lines) and lines[i].text.startswith("|"):
        cells = cells_of_row(lines[i].text)
        rows.append(cells)
        row_lines.append(lines[i])
        i += 1
    return header or [], rows, row_lines, before, lines[i:]


def page_lines(text: str, source: str | None) -> list[Line]:
    """The page's non-blank lines, normalised (Markdown heading marks and bold dropped from
    section headings), after checking that the first is the title."""
    if not isinstance(text, str):
        raise TypeError("parse_report takes the page's text")
    lines = [Line(i + 1, normalise(r)) for i, r in enumerate(text.splitlines())]
    lines = [ln for ln in lines if ln.text]
    if not lines:
        raise ReportParseError("empty report", 1, source)
    if lines[0].text != TITLE:
        raise ReportParseError(
            f"expected the title {TITLE!r} on the first line, found {lines[0].text[:60]!r}",
            lines[0].no,
            source,
        )
    return lines


MAX_LAUNCH_CHARS = 64 * 1024
"""The longest launch command a page may hold (characters). Published ones are under 4 KB;
past this the text is no launch line, and costs the ingest its time (a 1 MB one took 25 s
more) for nothing."""


def launch_text(lines: list[Line], source: str | None = None) -> tuple[str | None, str | None]:
    """(the launch command, its comment lines) of the page's Launch command section; a
    command past MAX_LAUNCH_CHARS is refused, naming its first line."""
    size = sum(len(ln.text) for ln in lines)
    if size > MAX_LAUNCH_CHARS:
        raise ReportParseError(
            f"launch command of {size:,} characters: longer than any real one "
            f"(at most {MAX_LAUNCH_CHARS // 1024} KiB)",
            lines[0].no,
            source,
        )
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
