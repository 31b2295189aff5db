"""The page's summary sections checked against its "All measurements" table.

The summary sections (the title line, Prefill, the Sustained decode matrix) are scraped with
numbers glued to their neighbours (``6,2061,320 ms TTFT`` is 6,206 tok/s and 1,320 ms), so
they are not read for values: each is only checked against the table, and a disagreement
means a mangled page and is an error naming the line. The checks also catch a page cut
between two complete table rows (the matrix and the title line then name cells the table
lacks).
"""

from __future__ import annotations

import re

from speedmatrix.published import formats as F
from speedmatrix.published.pagetext import Line, ReportParseError, find_table
from speedmatrix.records import cell_sort_key, context_label, parse_context
from speedmatrix.words import count


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


def check_prefill(lines: list[Line], cells: list[dict], source: str | None) -> None:
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


def check_matrix(lines: list[Line], cells: list[dict], source: str | None) -> None:
    header, rows, row_lines, _, _ = find_table(lines, "Context", "Sustained decode", source)
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
            f"({count(len(missing), 'All measurements row')} not in the matrix)",
            at,
            source,
        )


def check_subtitle(head: list[Line], cells: list[dict], source: str | None) -> None:
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


def check_no_stray_rows(before: list[Line], after: list[Line], source: str | None) -> None:
    """No table row in the notes around "All measurements": one there is a broken line."""
    # anything under a further heading (a baseline comparison, a footer) is not the page's
    k = next((i for i, ln in enumerate(after) if re.match(r"^#{1,6}\s", ln.text)), len(after))
    for note in [*before, *after[:k]]:
        if note.text.startswith("|"):
            raise ReportParseError(
                "All measurements: a table row outside the table (a broken line?)", note.no, source
            )
