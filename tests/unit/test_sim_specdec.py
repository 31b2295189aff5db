"""Speculative decoding in the simulator as it behaves on hardware, and its calibration.

Ground truth: a profile with per-request acceptance (mean by context, spread) renders a
synthetic speculative-decoding page through the report's own Markdown renderer
(tests/specdec_page.py); `sim calibrate` never sees the profile, only the page, and must
reproduce every published figure within 5%.
"""

from __future__ import annotations

import itertools
import statistics

import pytest
from specdec_page import CONTEXTS, VARIANTS, spec_page, truth_profile
from specdec_page import calibrated as calibrated_page

from speedmatrix.published.parse import parse_report
from speedmatrix.records import parse_context
from speedmatrix.sim.calibrate import compare, fit_summary, smooth_part
from speedmatrix.sim.engine import Engine, Request
from speedmatrix.sim.metrics import render_metrics
from speedmatrix.sim.predict import make_prompt, predict_decode
from speedmatrix.sim.profile import Profile


@pytest.fixture(scope="module")
def page() -> str:
    return spec_page()


@pytest.fixture(scope="module")
def calibrated() -> tuple[Profile, str]:
    """One run of `speedmatrix sim calibrate PAGE --out X.yaml`: the profile and what it printed
    (shared with the replay test in tests/integration/test_loadgen_sim.py)."""
    return calibrated_page("falling")


@pytest.fixture(scope="module")
def fitted(calibrated) -> Profile:
    return calibrated[0]


def _decode(text: str) -> dict[tuple[int, int], dict]:
    """Valid decode cells by (label tokens, C): a cell's own tokens are what the page implies."""
    from speedmatrix.records import parse_context

    return {
        (parse_context(c["context_label"]), c["concurrency"]): c
        for c in parse_report(text).cells
        if c["phase"] == "decode" and c["status"] == "valid"
    }


def test_c1_cells_scatter_and_many_streams_average_out(page):
    """What real spec-decode pages look like: one prompt decides a C=1 cell."""
    cells = _decode(page)
    c1 = [cells[(ctx, 1)]["total_tok_s"] for ctx in CONTEXTS]
    jumps = [abs(b / a - 1) for a, b in itertools.pairwise(c1)]
    assert max(jumps) > 0.15, c1  # neighbouring contexts jump with no trend
    assert c1 != sorted(c1, reverse=True)  # a longer context decodes faster somewhere
    # per stream, C=8 cells sit much closer to each other than C=1 cells do
    c8 = [cells[(ctx, 8)]["total_tok_s"] / 8 for ctx in CONTEXTS if (ctx, 8) in cells]
    assert statistics.pstdev(c8) / statistics.mean(c8) < statistics.pstdev(c1) / statistics.mean(c1)


def test_same_prompt_same_acceptance_and_vllm_counters():
    """The draw is seeded by the prompt's tokens; /metrics counts it as vLLM does."""
    profile = truth_profile()
    lengths = []
    for tag in (1, 1, 2, 3):
        engine = Engine(profile)
        req = engine.add(Request("r", make_prompt(2048, tag, profile.vocab_size), 400))
        while not req.finished:
            engine.advance(engine.next_event_time())
        lengths.append(req.acc_len)
        c = engine.counters
        observed = 1 + c.spec_accepted / c.spec_drafts
        # the steps' quasi-random draws average to the request's own acceptance
        assert observed == pytest.approx(req.acc_len, rel=0.03)
    assert lengths[0] == lengths[1] and len(set(lengths)) == 3
    text = render_metrics(engine, profile)
    labels = 'model_name="sim-specdec",engine="0"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} {float(c.spec_drafts)!r}" in text
    assert (
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {float(7 * c.spec_drafts)!r}" in text
    )
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}}" in text
    per_pos = [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}}'
        for i in range(7)
    ]
    assert all(p in text for p in per_pos)
    assert sum(c.spec_accepted_per_pos) == c.spec_accepted


def _every_figure_within_5_percent(fitted: Profile, page: str, k: int) -> None:
    assert fitted.spec_decode is not None and fitted.spec_decode.num_speculative_tokens == k
    rows, bad = compare(fitted, page)
    assert not bad, "\n".join(str(m) for m in bad)
    cells = parse_report(page).cells
    assert len([r for r in rows if r["metric"] == "status"]) == len(cells)
    figures = [r for r in rows if r["metric"] != "status" and r["published"] is not None]
    prefill = [c for c in cells if c["phase"] == "prefill"]
    assert len(figures) == len(prefill) * 2 + len(_decode(page)) * 4
    assert all(abs(r["rel_error"]) <= 0.05 for r in figures)
    # every published decode cell has its own acceptance, and the smooth part is a line
    assert len(fitted.spec_decode.cells) == len(_decode(page))
    assert len(fitted.spec_decode.mean_length) == 2 and fitted.spec_decode.spread > 0


def test_first_token_output_latency_moves_ttft_continuously():
    """The continuous part of a first token's latency: held `ms` after the engine computed it,
    the request not decoding meanwhile, so the TTFT grows by exactly that much (a delay before
    the engine only moves it in whole steps: it waits for the step under way)."""

    def first_token_and_steps(ms: float) -> tuple[float, int]:
        data = truth_profile().to_dict()
        if ms:
            data["frontend"]["first_token_output_ms"] = [{"context": 2048, "requests": 1, "ms": ms}]
        engine = Engine(Profile.from_dict(data))
        req = engine.add(Request("r", make_prompt(2048, 5, 32000), 50))
        while not req.token_times or engine.now < req.token_times[0] + 0.001:
            engine.advance(engine.next_event_time())
        return req.token_times[0] - req.arrival, engine.counters.steps

    ttft, steps = first_token_and_steps(0.0)
    for ms in (3.0, 7.5, 31.0):
        held, held_steps = first_token_and_steps(ms)
        assert held - ttft == pytest.approx(ms / 1000.0, abs=1e-9)
        assert held_steps == steps  # no decode step for it while its first token is held


def test_calibrated_profile_reproduces_every_figure_of_a_spec_page(page, fitted):
    _every_figure_within_5_percent(fitted, page, 7)


NOT_HELD: dict[str, str] = {}
"""Pages the calibration does not hold within 5% yet, and why (strict xfail: one that starts
passing fails the run, so the entry goes)."""


@pytest.mark.long  # a calibration each (tens of CPU-s when the library changed)
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(v, marks=pytest.mark.xfail(reason=NOT_HELD[v], strict=True))
        if v in NOT_HELD
        else v
        for v in VARIANTS
        if v != "falling"
    ],
)
def test_calibration_meets_pages_it_was_not_tuned_on(variant):
    """Other ground truths (k = 5 with a low acceptance rising with context; k = 7 with a high,
    wide one and prompts near 10K tok/s; issue #35's published-tool shapes: per-request =
    total / C, 7.0 accepted at 64K, 507K at C=1 cut inside a restart's first-token wait, k = 8;
    k = 7 with a low (1.6 -> 1.3) and a middling (2.6 -> 2.2) acceptance):
    every figure within 5%, statuses identical. Before the first-token output latency, 7 TTFTs
    of each of the first pages stayed 9-15% off (a first token waits for the step under way);
    before the fit read each cell's rate off its total tok/s (TBT is written to 0.1 ms), the
    high-acceptance-long and eight-drafts pages missed by 13.9% and 25%."""
    fitted, printed = calibrated_page(variant)
    _every_figure_within_5_percent(fitted, spec_page(variant), VARIANTS[variant].get("k", 7))
    assert "with per-cell part:" in printed


def test_smooth_model_alone_is_printed_and_is_worse_at_c1(page, fitted):
    lines = fit_summary(fitted, page)
    assert lines[0].startswith("smooth model alone:") and lines[1].startswith("with per-cell")
    assert all("statuses identical: True" in ln for ln in lines)
    rows, _ = compare(smooth_part(fitted), page)
    c1 = [
        abs(r["rel_error"])
        for r in rows
        if r["phase"] == "decode" and r["metric"] == "tbt_ms" and r["concurrency"] == 1
    ]
    assert max(c1) > 0.05  # one prompt's acceptance decides a C=1 cell: no smooth model has it
    # The page's cells keep their per-cell part. A cell the page does not have, between two of
    # its cells of that concurrency, reads between them (issue #43: at C=4 the smooth model
    # alone gave 762 / 721 / 740 tok/s at 2K / 3K / 4K where the page's cells are 658 and 563,
    # so 3K jumped above both neighbours); beyond the page's contexts, or at a concurrency the
    # page lacks, it gets the smooth model alone.
    smooth = smooth_part(fitted)

    def total(profile: Profile, context: int, conc: int = 4) -> float:
        return predict_decode(profile, context, conc, window_s=5.0)["total_tok_s"]

    low, high = sorted([total(fitted, 2048), total(fitted, 4096)])
    assert low < total(fitted, 3072) < high
    for context in (2048, 4096):
        assert abs(total(fitted, context) / total(smooth, context) - 1) > 0.05, context
    assert total(fitted, 16384) == pytest.approx(total(smooth, 16384), rel=1e-9)
    assert total(fitted, 4096, 3) == pytest.approx(total(smooth, 4096, 3), rel=1e-9)


def test_calibrate_cli_prints_both_fits(calibrated):
    profile, printed = calibrated
    assert "smooth model alone:" in printed and "with per-cell part:" in printed
    cells = profile.to_dict()["spec_decode"]["acceptance_length"]["cells"]
    assert {"context", "concurrency", "length", "spread"} <= set(cells[0])


def test_published_tool_page_shapes_and_its_accounting():
    """Issue #35 part 2: the published tool's current code forms per-request tok/s as total / C
    (C=2: exactly total / 2) while its time between tokens is per stream, and its longest
    context runs at C=1 only. The twin reads that accounting off the page (it is no per-cell
    fudge) and reports each cell the same way; the variant calibrates within 5% on every figure
    through test_calibration_meets_pages_it_was_not_tuned_on. With the twin's own per-stream
    accounting forced, the C=2 per-request figures are the ones that fail."""
    from speedmatrix.sim import calibrate as cal

    page = spec_page("published-tool")
    cells = parse_report(page).cells
    decode = [c for c in cells if c["phase"] == "decode" and c["status"] == "valid"]
    for c in decode:
        assert c["per_request_tok_s"] == pytest.approx(
            c["total_tok_s"] / c["concurrency"], abs=0.06
        )
    longest = max(decode, key=lambda c: c["context_tokens"])
    assert longest["context_label"] == "64K" and longest["concurrency"] == 1
    assert [c["status"] for c in cells if c["context_label"] == "64K"][1:] == ["valid"] + [
        "over_capacity"
    ] * 3
    assert cal.page_accounting(cells) == "aggregate"
    assert cal.page_accounting(parse_report(spec_page("falling")).cells) == "per_stream"
    fitted, _ = calibrated_page("published-tool")
    _, bad = compare(fitted, page)
    assert not bad
    # the same fitted twin, reporting per stream: its C=2 streams look faster than total / 2
    c2 = [c for c in decode if c["concurrency"] == 2]
    worst = max(
        abs(
            predict_decode(fitted, c["context_tokens"], 2, window_s=10.0)["per_request_tok_s"]
            / c["per_request_tok_s"]
            - 1
        )
        for c in c2
    )
    assert worst > 0.05


def test_c2_per_request_is_total_over_two_and_the_longest_context_runs_alone():
    """The published tool's shapes the twin is held to: at C=2 per-request tok/s is total / 2
    to display rounding (0.05 tok/s each), and the longest context of two pages runs at C=1
    only (the eight-drafts page's at C=1 and 2)."""
    for variant, at_longest in (
        ("high-acceptance-long", [1]),
        ("very-long-c1", [1]),
        ("eight-drafts", [1, 2]),
    ):
        decode = _decode(spec_page(variant))
        assert any(c == 2 for _, c in decode)
        for (_, c), cell in decode.items():
            if c == 2:
                assert abs(cell["per_request_tok_s"] - cell["total_tok_s"] / 2) <= 0.0751
        longest = max(ctx for ctx, _ in decode)
        assert sorted(c for ctx, c in decode if ctx == longest) == at_longest, variant


def test_a_window_cut_inside_a_restarts_first_token_wait_is_not_counted():
    """The published tool divides a cell's tokens by the time from the window's start to its
    last token (llm_decode_bench.py's usage_measure_end), not by the window; and it opens the
    window at its readiness judgement, 3-4 s after the stream's first token
    (loadgen/published_window.py), where ours opens at it. On the very-long page the 507K
    request runs 27.4 s: in a 30 s window it finishes 3-4 s before the end and its restart's
    first token (3 s) comes inside, so the wait counts (before, the twin opened the window at
    the first token, the cut fell inside the wait and the cell read 149.7 tok/s: what the
    same twin measured over HTTP by the tool's definitions was 15% lower). In a 27 s window
    the cut falls inside the wait: it is left out, and the cell reads 9% above its total over
    the window (the 507K x 1 miss of issue #35)."""
    truth = truth_profile("very-long-c1")
    tool = predict_decode(truth, 519168, 1, window_s=30.0, accounting="aggregate")
    window = predict_decode(truth, 519168, 1, window_s=30.0, accounting="per_stream")
    assert tool["measured_s"] > 29.5 and tool["output_tokens"] < window["output_tokens"]
    assert tool["total_tok_s"] < 1000.0 / tool["tbt_ms"] * 0.95  # the restart's wait counted
    cut = predict_decode(truth, 519168, 1, window_s=27.0, accounting="aggregate")
    assert cut["measured_s"] < 26.0
    assert cut["total_tok_s"] / (cut["output_tokens"] / 27.0) - 1 > 0.08  # over the window
    assert cut["total_tok_s"] == pytest.approx(1000.0 / cut["tbt_ms"], rel=0.02)
    cell = _decode(spec_page("very-long-c1"))[(519168, 1)]
    assert cell["total_tok_s"] == pytest.approx(tool["total_tok_s"], abs=0.05)


def test_a_cells_streams_alike_but_one_or_evenly_spaced():
    """A calibrated cell's spread places its streams one of two ways: alike but one outlier (a
    cell without ``streams``, as every profile written before had) or, with ``streams: even``,
    evenly spaced end to end around the cell's mean; the key round-trips, and only even cells
    carry it. Which one a fit takes follows the page (``spec_cells.streams_even``): even only
    where the median is faster than C - 1 alike streams allow within the total."""
    from speedmatrix.sim import spec_cells
    from speedmatrix.sim.profile import ProfileError

    data = truth_profile().to_dict()
    data["spec_decode"]["acceptance_length"]["cells"] = [
        {"context": 2048, "concurrency": 8, "length": 5.0, "spread": 2.0},
        {"context": 4096, "concurrency": 8, "length": 5.0, "spread": 4.0, "streams": "even"},
    ]
    spec = Profile.from_dict(data).spec_decode
    outlier = spec.cell(2048, 8)
    even = spec.cell(4096, 8)
    assert outlier == (5.0, 2.0, False) and even == (5.0, 4.0, True)
    alike = [spec.cell_length(*outlier[:2], rank, 8, outlier[2]) for rank in range(8)]
    assert alike == pytest.approx([4.75] * 7 + [6.75])
    spaced = [spec.cell_length(*even[:2], rank, 8, even[2]) for rank in range(8)]
    assert spaced == pytest.approx([3.0 + 4.0 * j / 7 for j in range(8)])
    cells = Profile.from_dict(data).to_dict()["spec_decode"]["acceptance_length"]["cells"]
    assert "streams" not in cells[0] and cells[1]["streams"] == "even"
    data["spec_decode"]["acceptance_length"]["cells"][1]["streams"] = "spread"
    with pytest.raises(ProfileError, match="streams"):
        Profile.from_dict(data)
    # the seed-60 page's 1K x 8 cell (r = 0.85) is the one even cell of that page
    decode = _decode(spec_page("many-streams-apart"))
    assert [key for key, c in decode.items() if spec_cells.streams_even(c)] == [(1024, 8)]
    fitted, _ = calibrated_page("many-streams-apart")
    assert [conc for _, conc in fitted.spec_decode.even_cells] == [8]
    assert 1000 < fitted.spec_decode.even_cells[0][0] < 1100
    # the published-tool shapes of other seeds fit alike-but-one streams everywhere (seed 49's
    # 2K x 8 was even while the twin opened a published-tool window at the first token)
    variants = ("high-acceptance-long", "high-acceptance-51", "streams-apart-49", "eight-drafts")
    for variant in (*variants, "falling"):
        assert not any(spec_cells.streams_even(c) for c in _decode(spec_page(variant)).values())


def test_a_calibrated_cell_answers_wherever_its_label_reaches_and_between_labels_reads_smoothly():
    """Issue #43: a page's cells are keyed on the prompts it implies (64,000 for 64K, 16,236 for
    16K: the published tool's prompts fall short of their labels), and a user or a recipe
    measures the label's own tokens (65,536), or fewer to fit max_model_len. Each valid decode
    cell, measured at the implied length, at the label's tokens and at the first count the
    label names (records.label_span), with two sets of prompts (another client's): every
    figure within 5% of the page and the two sets within 1% of each other (a time between
    tokens within 1% and its display rounding: the median jumps). Before, 64K x 2 and
    x 4 at 65,536 tokens fell to a random draw (-4.9%, -4.8% on this page; -22% to +19% on
    the issue's unseen page). Between labels (8K, 32K: no cell) the two sets agree within 1%
    and the acceptance lies between the neighbouring cells'."""
    from speedmatrix.records import label_span

    variant = "short-prompts"
    fitted, _ = calibrated_page(variant)
    page = spec_page(variant)
    cells = [
        c for c in parse_report(page).cells if c["phase"] == "decode" and c["status"] == "valid"
    ]
    assert {c["context_label"]: c["context_tokens"] for c in cells}["64K"] < 64100  # implied

    def measure(ctx: int, conc: int, tag: int) -> dict:
        return predict_decode(
            fitted, ctx, conc, window_s=10.0, accounting="aggregate", prompt_tag=tag
        )

    problems = []
    for c in cells:
        conc = c["concurrency"]
        for ctx in {
            c["context_tokens"],
            parse_context(c["context_label"]),
            label_span(c["context_label"])[0],
        }:
            runs = [measure(ctx, conc, tag) for tag in (100, 700)]
            for key in ("total_tok_s", "per_request_tok_s", "tbt_ms"):
                for got in runs:
                    if abs(got[key] / c[key] - 1) > 0.05:
                        problems.append(f"{ctx} x{conc} {key}: {got[key]:.2f} vs {c[key]:.2f}")
                # the median time between tokens moves in jumps as a stream's restart falls in
                # or out of the window: held to 1% and the page's display rounding (0.05 ms),
                # as the calibration fits it
                slack = 0.05 if key == "tbt_ms" else 0.0
                if abs(runs[0][key] - runs[1][key]) > 0.01 * runs[1][key] + slack:
                    problems.append(f"{ctx} x{conc} {key} twice: {runs[0][key]} / {runs[1][key]}")
    assert problems == [], "\n".join(problems)

    acceptance = {
        (ctx, conc): [measure(ctx, conc, tag)["spec_acceptance_length"] for tag in (100, 700)]
        for ctx in (4096, 8192, 16384, 32768, 65536)
        for conc in (1, 2, 4)
    }
    for (ctx, conc), (a, b) in acceptance.items():
        assert a == pytest.approx(b, rel=0.01), (ctx, conc)
    for low, mid, high in ((4096, 8192, 16384), (16384, 32768, 65536)):
        for conc in (1, 2, 4):
            ends = sorted([acceptance[(low, conc)][0], acceptance[(high, conc)][0]])
            assert ends[0] * 0.99 <= acceptance[(mid, conc)][0] <= ends[1] * 1.01, (mid, conc)
