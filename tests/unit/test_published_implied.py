"""What a published page implies about the prompts it sent (issue #35 part 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedmatrix.published import implied
from speedmatrix.published.parse import parse_report

REFERENCE = (
    Path(__file__).resolve().parents[2]
    / "include"
    / "reference"
    / "speed-matrix-kimi-k2.7-nvfp4-rtxpro6k-x8.txt"
)


def test_the_reference_page_implies_its_real_prompts():
    """The issue's figures: tok/s x TTFT of the page's own prefill rows."""
    cells = parse_report(REFERENCE.read_text(encoding="utf-8")).cells
    got = {c["context_label"]: c["context_tokens"] for c in cells if c["phase"] == "prefill"}
    assert got["8K"] == 8192
    assert got["16K"] == 16232
    assert got["128K"] == 128799
    assert got["256K"] == 257507
    decode = {
        c["context_label"]: c["context_tokens"]
        for c in cells
        if c["concurrency"] == 8 and c["status"] == "valid"
    }
    assert decode == {"8K": 8192, "16K": 16232}  # a decode cell: its label's implied prompt


@pytest.mark.parametrize(
    ("rate", "ttft", "label", "ok"),
    [
        (3253.0, 79160.0, "256K", True),  # 1.8% short: the reference page
        (1000.0, 256.0 * 1024 * 0.976, "256K", True),  # 2.4% short
        (1000.0, 256.0 * 1024 * 0.97, "256K", False),  # 3% short: more than the tool does
        (1000.0, 8.0 * 1024 * 1.01, "8K", False),  # 1% long: no chars-per-token makes that
        (6206.0, 1320.0, "8K", True),
        (4000.0, 2.0, "8K", False),  # an impossible row
    ],
)
def test_the_allowance_is_the_tools_accounting_and_no_more(rate, ttft, label, ok):
    cell = {
        "phase": "prefill",
        "status": "valid",
        "total_tok_s": rate,
        "ttft_ms": ttft,
        "context_label": label,
    }
    assert implied.within_allowance(implied.label_ratio(cell)) is ok
    assert (implied.implied_prompt_tokens(cell) is not None) is ok


def test_display_rounding_admits_a_row_at_the_edge():
    """A short TTFT hides up to half a millisecond: 87 ms at 8K is possible at either end."""
    edge = 8192 * (1 - implied.SHORT_ALLOWANCE)
    cell = {"total_tok_s": 100_000.0, "ttft_ms": edge / 100.0 - 0.4, "context_label": "8K"}
    cell |= {"phase": "prefill", "status": "valid"}
    low, mid, high = implied.implied_tokens_range(cell["total_tok_s"], cell["ttft_ms"])
    assert low < mid < edge <= high
    assert implied.within_allowance(implied.label_ratio(cell))
