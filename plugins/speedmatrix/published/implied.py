"""What a published page implies about the prompts its tool really sent.

The published tool (llm-inference-bench, ``llm_decode_bench.py``) does not send exact contexts:
it measures characters per token once on an 8K sample and sends ``context x chars_per_token``
characters as chat text, so its long prompts come out 1-2.5% short of their labels; and its
prefill tok/s is ``usage.prompt_tokens / TTFT``. A page's own ``prefill tok/s x TTFT`` is
therefore the prompt it sent, up to the display rounding of the two figures.

One place for that reading: the ingest (``parse``) records the implied length as the cell's
``context_tokens`` (the label stays in ``context_label``), the cells suite (``quality``) bounds
it against the label by what the tool's accounting allows, and calibration uses it.
"""

from __future__ import annotations

from speedmatrix.published.formats import ms_half_unit, rate_half_unit
from speedmatrix.records import parse_context

DECODE_RATE_HALF_UNIT = 0.05
"""Half a unit of a decode rate's last digit on a page (``54.9``)."""

SHORT_ALLOWANCE = 0.025
"""A published prompt may be this share shorter than its label: the tool's chars-per-token,
measured on an 8K sample, overestimates what longer text costs (16K: 0.9% short, 256K: 1.8%
on the reference page; up to 2.5% seen on pages from other hardware)."""

LONG_ALLOWANCE = 0.005
"""A published prompt may be this share longer than its label: the chat template's own tokens
on top of text sized for the label (the 8K calibration sample lands within 0.01%)."""


def implied_tokens_range(total_tok_s: float, ttft_ms: float) -> tuple[float, float, float]:
    """(low, mid, high) prompt tokens of a prefill row: tok/s x TTFT, and its extremes when
    each figure is anywhere within half a unit of its last displayed digit."""
    rate_h, ttft_h = rate_half_unit(total_tok_s), ms_half_unit(ttft_ms)
    low = max(total_tok_s - rate_h, 0.0) * max(ttft_ms - ttft_h, 0.0) / 1000.0
    high = (total_tok_s + rate_h) * (ttft_ms + ttft_h) / 1000.0
    return low, total_tok_s * ttft_ms / 1000.0, high


def label_ratio(cell: dict) -> float | None:
    """For a valid prefill row: the ratio (implied prompt / label tokens) nearest to the
    allowed band [1 - SHORT_ALLOWANCE, 1 + LONG_ALLOWANCE] that the row's rounding admits.
    Inside the band when the row is possible; None when the row has no figures to check."""
    try:
        rate, ttft = float(cell["total_tok_s"]), float(cell["ttft_ms"])
        label = parse_context(str(cell["context_label"]))
    except (KeyError, TypeError, ValueError):
        return None
    if label <= 0:
        return None
    low, mid, high = implied_tokens_range(rate, ttft)
    band_lo, band_hi = 1.0 - SHORT_ALLOWANCE, 1.0 + LONG_ALLOWANCE
    if band_lo <= mid / label <= band_hi:
        return mid / label
    if high / label < band_lo:
        return high / label
    if low / label > band_hi:
        return low / label
    return min(max(mid / label, band_lo), band_hi)  # the rounding admits a possible prompt


def within_allowance(ratio: float | None) -> bool:
    """The one bound of a page's prompt against its label (see the allowances)."""
    return ratio is not None and 1.0 - SHORT_ALLOWANCE <= ratio <= 1.0 + LONG_ALLOWANCE


def implied_prompt_tokens(cell: dict) -> int | None:
    """A valid prefill row's prompt tokens as the page implies them (tok/s x TTFT, rounded),
    or None when the row is not one or implies what the tool could not have sent."""
    if cell.get("phase") != "prefill" or cell.get("status") != "valid":
        return None
    if not within_allowance(label_ratio(cell)):
        return None
    _, mid, _ = implied_tokens_range(float(cell["total_tok_s"]), float(cell["ttft_ms"]))
    return max(round(mid), 1)


def apply_implied_contexts(cells: list[dict]) -> None:
    """Set ``context_tokens`` of every cell whose label has a consistent prefill row to the
    prompt that row implies (the tool sends one prompt length per label, prefill and decode
    alike); cells of other labels keep label x 1024 (the page says nothing more of them)."""
    by_label: dict[str, int] = {}
    for cell in cells:
        implied = implied_prompt_tokens(cell)
        if implied is not None:
            by_label[str(cell["context_label"])] = implied
    for cell in cells:
        implied = by_label.get(str(cell["context_label"]))
        if implied is not None:
            cell["context_tokens"] = implied


def per_request_is_aggregate(cells: list[dict]) -> bool:
    """Whether the page's per-request tok/s is total / C (the published tool's current code:
    "derive per-request from aggregate") rather than a per-stream median (its older versions,
    and the reference page: 98.0 total, 48.6 per request at C=2). True when every valid decode
    cell with C > 1 (at least one) agrees to the display rounding of its two figures."""
    multi = [
        c
        for c in cells
        if c.get("phase") == "decode"
        and c.get("status") == "valid"
        and (c.get("concurrency") or 1) > 1
        and c.get("per_request_tok_s") is not None
        and c.get("total_tok_s") is not None
    ]
    return bool(multi) and all(
        abs(c["per_request_tok_s"] - c["total_tok_s"] / c["concurrency"])
        <= DECODE_RATE_HALF_UNIT * (1 + 1 / c["concurrency"]) + 1e-9
        for c in multi
    )
