"""How the published "Speed test matrix" pages write quantities, both ways.

One module for formatting and parsing so that the renderer writes exactly what the parser
reads back (the round trip the report contract asks for). The formats are taken from the
reference page (``include/reference/``) and docs/design.md: ``6,206.0``, ``17.7K``, ``18K``,
``1,320 ms``, ``18.2 ms``, ``1,647``, ``30.0 s``, ``—``, ``Over capacity``.
"""

from __future__ import annotations

import math
import re

from speedmatrix.errors import InputError
from speedmatrix.records import check_quantity

DASH = "—"  # an absent value, as the pages write it

PHASE_LABELS = {"prefill": "Prefill", "decode": "Sustained decode", "burst": "Burst"}
PHASE_FROM_LABEL = {v.lower(): k for k, v in PHASE_LABELS.items()}

STATUS_LABELS = {
    "valid": "Valid",
    "over_capacity": "Over capacity",
    "failed": "Failed",
    "invalid": "Invalid",
}
STATUS_FROM_LABEL = {v.lower(): k for k, v in STATUS_LABELS.items()}

# The "All measurements" columns, in page order: (header, cell field).
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("Phase", "phase"),
    ("Context", "context_label"),
    ("Requests at once", "concurrency"),
    ("Status", "status"),
    ("Total tok/s", "total_tok_s"),
    ("Per request tok/s", "per_request_tok_s"),
    ("TTFT", "ttft_ms"),
    ("Time between tokens", "tbt_ms"),
    ("Average active requests", "avg_active_requests"),
    ("Completed requests", "completed_requests"),
    ("Output tokens", "output_tokens"),
    ("Measured for", "measured_s"),
)

_NUMBER = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?$")


class QuantityError(InputError):
    """A cell of the page that is not the quantity its column holds."""


def _is_absent(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def parse_number(text: str) -> float | None:
    """``6,206.0`` -> 6206.0, ``17.7K`` -> 17700.0, ``18K`` -> 18000.0, ``—`` -> None."""
    s = text.strip()
    if s in (DASH, "-", "–", ""):
        return None
    scale = 1.0
    if s[-1:] in ("K", "k"):
        scale, s = 1_000.0, s[:-1]
    elif s[-1:] == "M":
        scale, s = 1_000_000.0, s[:-1]
    if not s or not _NUMBER.match(s) or s in ("+", "-", "."):
        raise QuantityError(f"not a number: {text.strip()!r}")
    try:  # finite and in range (records.MAX_QUANTITY), or the page is refused on this line
        return check_quantity(float(s.replace(",", "")) * scale, text)
    except ValueError as exc:
        raise QuantityError(str(exc)) from None


def parse_int(text: str) -> int | None:
    value = parse_number(text)
    if value is None:
        return None
    if abs(value - round(value)) > 1e-9:
        raise QuantityError(f"not a whole number: {text.strip()!r}")
    return round(value)


def parse_with_unit(text: str, units: dict[str, float]) -> float | None:
    """``1,320 ms`` with units {"ms": 1, "s": 1000} -> 1320.0; ``—`` -> None."""
    s = text.strip()
    if s in (DASH, "-", "–", ""):
        return None
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(" " + unit) or s.endswith(unit):
            number = s[: -len(unit)].strip()
            value = parse_number(number)
            if value is None:
                break
            try:
                return check_quantity(value * factor, text)
            except ValueError as exc:
                raise QuantityError(str(exc)) from None
    raise QuantityError(f"not a quantity in {'/'.join(units)}: {s!r}")


def parse_ms(text: str) -> float | None:
    return parse_with_unit(text, {"ms": 1.0, "s": 1000.0})


def parse_seconds(text: str) -> float | None:
    return parse_with_unit(text, {"s": 1.0, "ms": 0.001, "min": 60.0})


def parse_tokens(text: str) -> int | None:
    """``4,096 tokens`` -> 4096."""
    s = text.strip()
    for suffix in (" tokens", " token"):
        if s.endswith(suffix):
            s = s[: -len(suffix)]
            break
    return parse_int(s)


# ---------------------------------------------------------------------------------------------
# formatting


def fmt_rate(value: float | None) -> str:
    """Tok/s in the table: ``54.9``, ``6,206.0``; from 10,000 on ``17.7K`` and ``18K``."""
    if _is_absent(value):
        return DASH
    v = float(value)
    if abs(v) >= 100_000:
        return f"{v / 1000:,.0f}K"
    if abs(v) >= 10_000:
        text = f"{v / 1000:.1f}"
        if text.endswith(".0"):
            text = text[:-2]
        return f"{text}K"
    return f"{v:,.1f}"


def fmt_rate_summary(value: float | None, decimals: int) -> str:
    """Tok/s in the summary sections: prefill ``6,206`` (0 decimals), decode ``54.9`` (1);
    from 10,000 on both as the table writes them, ``12.3K`` and ``20K`` (the published pages
    write large prefill rates so too, never ``12,345``)."""
    if _is_absent(value):
        return DASH
    v = float(value)
    if abs(v) >= 10_000:
        return fmt_rate(v)
    return f"{v:,.{decimals}f}"


def fmt_ms(value: float | None, decimals: int = 0) -> str:
    """``1,320 ms`` (TTFT, 0 decimals), ``18.2 ms`` (time between tokens, 1 decimal)."""
    if _is_absent(value):
        return DASH
    return f"{float(value):,.{decimals}f} ms"


def fmt_float(value: float | None, decimals: int = 1) -> str:
    if _is_absent(value):
        return DASH
    return f"{float(value):,.{decimals}f}"


def fmt_int(value: int | float | None) -> str:
    if _is_absent(value):
        return DASH
    return f"{round(float(value)):,}"


def fmt_seconds(value: float | None) -> str:
    """``30.0 s`` (table)."""
    if _is_absent(value):
        return DASH
    return f"{float(value):,.1f} s"


def fmt_seconds_header(value: float | None) -> str:
    """``30 s`` (the Run section's "Time per measurement")."""
    if _is_absent(value):
        return DASH
    return f"{float(value):g} s"


def fmt_tokens(value: int | None) -> str:
    """``4,096 tokens``."""
    if _is_absent(value):
        return DASH
    return f"{int(value):,} tokens"


def fmt_gb(value: float | None) -> str:
    if _is_absent(value):
        return DASH
    return f"{float(value):,.{0 if float(value).is_integer() else 1}f} GB"


def fmt_status(status: str | None) -> str:
    if status is None:
        return DASH
    return STATUS_LABELS.get(status, status.replace("_", " ").capitalize())


def table_cells(cell: dict) -> list[str]:
    """One "All measurements" row's cell texts, in TABLE_COLUMNS order."""
    return [
        PHASE_LABELS.get(cell.get("phase") or "", str(cell.get("phase"))),
        str(cell.get("context_label") or DASH),
        fmt_int(cell.get("concurrency")),
        fmt_status(cell.get("status")),
        fmt_rate(cell.get("total_tok_s")),
        fmt_rate(cell.get("per_request_tok_s")),
        fmt_ms(cell.get("ttft_ms"), 0),
        fmt_ms(cell.get("tbt_ms"), 1),
        fmt_float(cell.get("avg_active_requests"), 1),
        fmt_int(cell.get("completed_requests")),
        fmt_int(cell.get("output_tokens")),
        fmt_seconds(cell.get("measured_s")),
    ]


def table_row(cell: dict) -> str:
    """One "All measurements" row exactly as the published page writes it."""
    return "| " + " | ".join(table_cells(cell)) + " |"


def table_header() -> str:
    return "| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |"


def table_rule(n: int | None = None) -> str:
    return "|" + "---|" * (n or len(TABLE_COLUMNS))


# ---------------------------------------------------------------------------------------------
# display rounding (what a figure written by fmt_rate / fmt_ms can hide)


def rate_half_unit(value: float) -> float:
    """Half a unit of the last digit a page shows for a prefill rate: the true figure lies
    within this of the shown one. Below 10K the Prefill summary's whole ``6,206`` (0.5; the
    table's ``6,206.0`` always ends in .0 on published pages, so its decimal carries nothing);
    ``17.7K``: 50; ``180K``: 500 (fmt_rate's steps)."""
    v = abs(float(value))
    if v >= 100_000:
        return 500.0
    if v >= 10_000:
        return 50.0
    return 0.5


def ms_half_unit(value: float, decimals: int = 0) -> float:
    """Half a unit of the last digit of a ``fmt_ms`` figure (TTFT: 0 decimals, 0.5 ms)."""
    return 0.5 * 10.0 ** (-decimals)
