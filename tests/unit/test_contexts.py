"""Context parsing and labels: one rule (records.parse_context / context_label) for recipes,
DAG conf, cell names, the load generator's flags and ingested reports."""

from __future__ import annotations

import argparse

import pytest

from speedmatrix.loadgen.cli import parse_tokens as loadgen_tokens
from speedmatrix.plan import MatrixSpec, PlanError
from speedmatrix.published import parse as report_parse
from speedmatrix.records import context_label, label_span, parse_context

REFERENCE_LABELS = ("8K", "16K", "32K", "64K", "128K", "251K", "256K")


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("64K", 65536),
        (" 8k ", 8192),
        ("8 K", 8192),
        ("1000", 1000),
        ("1,000", 1000),
        ("4_096", 4096),
        ("251K", 257024),
        ("512k", 524288),
        (7, 7),
        (262143, 262143),
    ],
)
def test_parse_context_reads_every_written_form(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("bad", ["64M", "", "abc", "1.5K", "K", "-8K", True, "8KK"])
def test_parse_context_refuses_what_is_not_a_context(bad):
    with pytest.raises(ValueError, match="not a token count"):
        parse_context(bad)


@pytest.mark.parametrize(
    ("tokens", "label"),
    [
        (8192, "8K"),
        (257024, "251K"),
        (262143, "256K"),  # a 256K prefill sent with one token left for the output
        (262144, "256K"),
        (1024, "1K"),
        (1000, "1000"),
        (512, "512"),
    ],
)
def test_context_label_rounds_to_the_nearest_k(tokens, label):
    assert context_label(tokens) == label


def test_label_and_parse_round_trip_the_published_labels():
    for label in REFERENCE_LABELS:
        assert context_label(parse_context(label)) == label


@pytest.mark.parametrize("label", [*REFERENCE_LABELS, "1K", "2K", "3K", "63K", "507K", "512K"])
def test_a_labels_span_is_every_count_the_rule_names_so(label):
    """records.label_span, the inverse of context_label (issue #43: which label's cell a
    measured token count is): its ends are named `label`, the counts just outside are not."""
    lo, hi = label_span(label)
    assert lo <= parse_context(label) <= hi
    assert context_label(lo) == label == context_label(hi)
    assert context_label(lo - 1) != label and context_label(hi + 1) != label
    assert label_span(label.lower()) == label_span(parse_context(label)) == (lo, hi)


def test_the_plan_uses_the_rule_and_names_its_error():
    spec = MatrixSpec.build(
        prefill_contexts=["8k", "1,024"],
        contexts=["64K"],
        concurrencies=["16"],
        max_output_tokens=16,
        window_s=1.0,
    )
    assert spec.prefill_contexts == (8192, 1024) and spec.contexts == (65536,)
    for bad in ("64M", "1.5K", True):
        with pytest.raises(PlanError, match="not a token count"):
            MatrixSpec.build(
                prefill_contexts=[bad],
                contexts=[8192],
                concurrencies=[1],
                max_output_tokens=16,
                window_s=1.0,
            )


def test_the_load_generator_flag_uses_the_rule_and_stays_positive():
    assert loadgen_tokens("8 K") == 8192 == parse_context("8 K")
    for bad in ("0", "1.5K", "abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            loadgen_tokens(bad)


def test_an_ingested_report_reads_its_contexts_with_the_rule():
    """The page's labels are read by parse_context; a cell's tokens are what its label's
    prefill row implies (issue #35: the published tool's prompts run short of the label),
    never more than the label and at most 2.5% short, named by the same label."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "include" / "reference"
    text = next(page.glob("*.txt")).read_text(encoding="utf-8")
    cells = report_parse.parse_report(text, source="ref").cells
    assert cells
    for c in cells:
        label = parse_context(c["context_label"])
        assert 0.975 * label <= c["context_tokens"] <= label
        assert context_label(label) == c["context_label"]
