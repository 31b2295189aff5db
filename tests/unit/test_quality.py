"""Great Expectations suites: good rows land, each broken rule quarantines exactly its row."""

from __future__ import annotations

import json

import factories
import pytest

from speedmatrix.quality import validate_run
from speedmatrix.records import empty_cell

SECRET = "sk-test-Zx81qq"


def decode(ctx=8192, c=1, **over):
    # The published 8K x 1 cell, scaled to C.
    values = dict(
        phase="decode",
        context_tokens=ctx,
        context_label=f"{ctx // 1024}K",
        concurrency=c,
        status="valid",
        total_tok_s=54.9 * c,
        per_request_tok_s=54.9,
        ttft_ms=87.0,
        tbt_ms=18.2,
        avg_active_requests=float(c),
        completed_requests=0,
        output_tokens=1647 * c,
        measured_s=30.0,
        window_s=30.0,
        max_output_tokens=4096,
        prompt_mode="distinct",
    )
    values.update(over)
    return empty_cell(**values)


def prefill(ctx=8192, **over):
    values = dict(
        phase="prefill",
        context_tokens=ctx,
        context_label=f"{ctx // 1024}K",
        concurrency=1,
        status="valid",
        total_tok_s=6206.0,
        ttft_ms=1320.0,
        completed_requests=1,
        max_output_tokens=1,
    )
    values.update(over)
    return empty_cell(**values)


def run_row(**over):
    values = {
        "started_at": "2026-11-29T20:30:00Z",
        "served_model": "Kimi-K2.7-Code-NVFP4",
        "launch_command": "vllm serve m --port 8000 --api-key <redacted>",
    }
    return factories.run_row("kimi.main.manual.20261129T2030Z", **{**values, **over})


def good_cells():
    over = empty_cell(
        phase="decode",
        context_tokens=8192,
        context_label="8K",
        concurrency=32,
        status="over_capacity",
        error="not run",
    )
    failed = decode(
        c=4, status="failed", error="server not healthy", total_tok_s=None, output_tokens=None
    )
    return [prefill(), decode(c=1), decode(c=2, avg_active_requests=1.95), over, failed]


def test_good_run_lands_whole():
    v = validate_run(run_row(), good_cells(), secrets=[SECRET])
    assert v.run_ok
    assert v.bad_cells == []
    assert len(v.good_cells) == 5
    assert v.cells.success and v.runs.success
    json.dumps(v.results_json, allow_nan=False)  # kept next to the report: strict JSON
    assert {e["expectation"] for e in v.results_json["cells"]["expectations"]} >= {
        "expect_column_values_to_be_between(active_ratio)",
        "expect_column_values_to_be_between(prefill_ratio)",
    }


BROKEN = {
    "status": (dict(status="weird"), "expect_column_values_to_be_in_set(status)"),
    "active": (dict(avg_active_requests=1.7), "expect_column_values_to_be_between(active_ratio)"),
    "window": (
        dict(measured_s=29.0, output_tokens=1592, total_tok_s=54.9 * 2 * 30 / 29 / 2),
        "window_ratio",
    ),
    "tokens": (dict(output_tokens=3000), "expect_column_values_to_be_between(tokens_ratio)"),
    "rate_vs_tbt": (dict(per_request_tok_s=40.0), "rate_tbt_product"),
    "null_tbt": (dict(tbt_ms=None), "expect_column_values_to_not_be_null(tbt_ms)"),
    "negative_ttft": (dict(ttft_ms=-1.0), "expect_column_values_to_be_between(ttft_ms)"),
    "workload": (dict(workload="poetry"), "expect_column_values_to_be_in_set(workload)"),
    "copy_share": (dict(copy_share=1.5), "expect_column_values_to_be_between(copy_share)"),
    "warmup": (dict(warmup_s=-0.5), "expect_column_values_to_be_between(warmup_s)"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_decode_cell_is_quarantined_alone(name):
    change, reason = BROKEN[name]
    cells = good_cells()
    cells[2] = decode(c=2, **change)
    v = validate_run(run_row(), cells)
    assert not v.cells.success
    assert [(c["phase"], c["concurrency"]) for c in v.bad_cells] == [("decode", 2)]
    assert any(reason in r for r in v.bad_cells[0]["quarantine_reasons"])
    assert len(v.good_cells) == 4
    assert v.run_ok


def test_a_published_cell_is_measured_up_to_its_window():
    """The published tool measures to the window's last token: 27.4 s of a 30 s window lands
    for a `published` cell (a restart's first-token wait after the last token is not measured)
    and is quarantined for a default one; over the window is quarantined for either."""
    short = dict(
        measured_s=27.4, output_tokens=1504, total_tok_s=1504 / 27.4, per_request_tok_s=1504 / 27.4
    )
    cells = good_cells()
    cells[1] = decode(c=1, measurement_profile="published", **short)
    assert validate_run(run_row(), cells).bad_cells == []
    cells[1] = decode(c=1, **short)
    assert [c["concurrency"] for c in validate_run(run_row(), cells).bad_cells] == [1]
    over = dict(measured_s=31.0, output_tokens=1702, total_tok_s=1702 / 31.0)
    cells[1] = decode(c=1, measurement_profile="published", **over)
    assert [c["concurrency"] for c in validate_run(run_row(), cells).bad_cells] == [1]


def test_an_adaptive_window_that_converged_lands_short_of_its_cap():
    """Issue #45: an adaptive window that converged stops before window_s (its cap) and lands;
    one that says it ran to its cap is held to the cap, like a fixed window."""
    short = dict(
        measured_s=11.2, output_tokens=615, total_tok_s=615 / 11.2, per_request_tok_s=615 / 11.2
    )
    adaptive = dict(window_mode="adaptive", adaptive_target_pct=1.0, **short)
    cells = good_cells()
    cells[1] = decode(c=1, window_stop="converged", **adaptive)
    assert validate_run(run_row(), cells).bad_cells == []
    cells[1] = decode(c=1, window_stop="cap_not_steady", **adaptive)
    assert [c["concurrency"] for c in validate_run(run_row(), cells).bad_cells] == [1]
    cells[1] = decode(c=1, window_stop="stopped whenever", **adaptive)
    bad = validate_run(run_row(), cells).bad_cells
    assert "expect_column_values_to_be_in_set(window_stop)" in bad[0]["quarantine_reasons"]


def test_warm_up_is_a_decode_figure():
    """warmup_s (issue #19): a decode cell's measured warm-up lands; a prefill cell has none
    (its cold request is the measurement), so a prefill row carrying one is quarantined."""
    cells = [prefill(), decode(warmup_s=3.2), decode(c=2, warmup_s=0.0)]
    assert validate_run(run_row(), cells).bad_cells == []
    v = validate_run(run_row(), [prefill(warmup_s=1.3), decode(warmup_s=3.2)])
    assert [c["phase"] for c in v.bad_cells] == ["prefill"]
    assert "expect_column_values_to_be_null(warmup_s)" in v.bad_cells[0]["quarantine_reasons"]


def test_prefill_inconsistent_with_ttft_is_quarantined():
    cells = [prefill(ttft_ms=2000.0), decode()]
    v = validate_run(run_row(), cells)
    assert [c["phase"] for c in v.bad_cells] == ["prefill"]
    assert (
        "expect_column_values_to_be_between(prefill_ratio)" in v.bad_cells[0]["quarantine_reasons"]
    )


def test_failed_cell_needs_a_reason_and_duplicates_are_caught():
    cells = [decode(c=1), decode(c=1), decode(c=4, status="failed", error=None)]
    v = validate_run(run_row(), cells)
    assert len(v.bad_cells) == 3
    reasons = {r for c in v.bad_cells for r in c["quarantine_reasons"]}
    assert "expect_column_values_to_not_be_null(error)" in reasons
    assert any(r.startswith("expect_compound_columns_to_be_unique") for r in reasons)


def test_the_stored_result_has_the_failing_rows_of_each_failed_expectation():
    """Two passes (BASIC for all, COMPLETE for the failed ones): the stored GX result still
    names every failing row of a failed expectation, in the place GX puts it, and keeps the
    counts of the met ones; the suite's statistics are those of all its expectations."""
    cells = [decode(c=1), decode(c=1), decode(c=2, status="weird"), decode(c=4)]
    v = validate_run(run_row(), cells)
    gx = v.results_json["cells"]["gx"]
    by_kind: dict[str, list[dict]] = {}
    for res in gx["results"]:
        by_kind.setdefault(res["expectation_config"]["type"], []).append(res)
    (unique,) = by_kind["expect_compound_columns_to_be_unique"]
    assert not unique["success"]
    assert sorted(i["row"] for i in unique["result"]["unexpected_index_list"]) == [0, 1]
    status = next(
        r for r in by_kind["expect_column_values_to_be_in_set"]
        if r["expectation_config"]["kwargs"]["column"] == "status"
    )  # fmt: skip
    assert [i["row"] for i in status["result"]["unexpected_index_list"]] == [2]
    met = next(r for r in by_kind["expect_column_values_to_not_be_null"] if r["success"])
    assert met["result"]["element_count"] == 4 and "unexpected_index_list" not in met["result"]
    stats = gx["statistics"]
    assert stats["evaluated_expectations"] == len(gx["results"])
    assert stats["unsuccessful_expectations"] == sum(not r["success"] for r in gx["results"]) == 2
    assert sorted(c["concurrency"] for c in v.bad_cells) == [1, 1, 2]


def test_each_expectation_sees_the_rows_of_its_scope_and_says_which():
    """The cells suite runs scope by scope (quality.CELL_SCOPES, not GX row conditions): each
    stored result names its rows, and counted exactly those (good_cells: one valid prefill,
    two valid decode, one over capacity, one failed)."""
    v = validate_run(run_row(), good_cells())
    counts = {}
    for res in v.results_json["cells"]["gx"]["results"]:
        rows = res["expectation_config"]["meta"]["rows"]
        counts.setdefault(json.dumps(rows, sort_keys=True), set()).add(
            res["result"]["element_count"]
        )
    assert counts == {
        "{}": {5},
        '{"phase": ["prefill"]}': {1},
        '{"status": ["failed", "invalid"]}': {1},
        '{"status": ["over_capacity"]}': {1},
        '{"phase": ["decode"], "status": ["valid"]}': {2},
        '{"phase": ["prefill"], "status": ["valid"]}': {1},
        '{"phase": ["burst"]}': {0},
        '{"phase": ["burst"], "status": ["valid"]}': {0},
    }


@pytest.mark.parametrize(
    "command",
    [
        f"vllm serve m --api-key {SECRET}",
        "vllm serve m --api-key=abc123",
        "env HF_TOKEN=hf_abcdef vllm serve m",
        f"vllm serve m --note {SECRET}",
        "vllm serve m --hf-token hf_abcdef",  # a flag only the recipe checks knew
        'vllm serve m --api-key "abc123 two"',  # quoted: only the report parser knew
    ],
)
def test_secret_in_launch_command_fails_runs_suite_and_is_scrubbed(command):
    v = validate_run(run_row(launch_command=command), [decode()], secrets=[SECRET])
    assert not v.run_ok
    assert "expect_column_values_to_not_match_regex_list(launch_command)" in v.runs.failed_rows[0]
    text = json.dumps(v.results_json)
    for leaked in (SECRET, "abc123", "hf_abcdef"):
        assert leaked not in text


def test_runs_suite_requires_fields_and_known_trigger():
    v = validate_run(run_row(recipe_id=None, trigger="whenever"), [decode()])
    assert not v.run_ok
    failed = v.runs.failed_rows[0]
    assert "expect_column_values_to_not_be_null(recipe_id)" in failed
    assert "expect_column_values_to_be_in_set(trigger)" in failed


def burst(n=4, **over):
    """A valid burst of n requests of 128 tokens, as the reference twin measured 8K x 4."""
    values = dict(
        phase="burst", context_tokens=8192, context_label="8K", concurrency=n, status="valid",
        total_tok_s=n * 128 / 3.29, per_request_tok_s=41.3, ttft_ms=214.9, tbt_ms=24.2,
        latency_ms=3290.2, latency_p90_ms=3291.0, latency_p99_ms=3291.5,
        e2e_per_request_tok_s=128 / 3.2902, completed_requests=n, output_tokens=n * 128,
        measured_s=3.29, avg_active_requests=float(n), max_output_tokens=128,
        prompt_mode="distinct", warmup_s=5.2, requests_started=n, requests_failed=0,
    )  # fmt: skip
    values.update(over)
    return empty_cell(**values)


BROKEN_BURST = {
    "not_all_completed": (
        dict(completed_requests=3, output_tokens=384, total_tok_s=384 / 3.29),
        "expect_column_values_to_be_between(completed_ratio)",
    ),
    "a_window": (dict(window_s=30.0), "expect_column_values_to_be_null(window_s)"),
    "null_latency": (dict(latency_ms=None), "expect_column_values_to_not_be_null(latency_ms)"),
    "tail_below_median": (
        dict(latency_p90_ms=3000.0),
        "expect_column_values_to_be_between(latency_tail_ratio)",
    ),
    "e2e_vs_latency": (
        dict(e2e_per_request_tok_s=20.0),
        "expect_column_values_to_be_between(e2e_latency_product)",
    ),
    "tokens": (dict(output_tokens=600), "expect_column_values_to_be_between(tokens_ratio)"),
}


def test_a_valid_burst_cell_lands_with_its_own_checks():
    """Issue #43 item 12: a burst cell has its own expectations (its scope, `valid burst
    cells`): every request completed, no window, latencies and per-user e2e tok/s present and
    consistent; a decode cell's (a window of C streams) are not applied to it."""
    v = validate_run(run_row(), [*good_cells(), burst()])
    assert v.bad_cells == [], [c["quarantine_reasons"] for c in v.bad_cells]
    counts = {
        json.dumps(res["expectation_config"]["meta"]["rows"], sort_keys=True): res["result"][
            "element_count"
        ]
        for res in v.results_json["cells"]["gx"]["results"]
    }
    assert counts['{"phase": ["burst"], "status": ["valid"]}'] == 1
    assert counts['{"phase": ["burst"]}'] == 1


@pytest.mark.parametrize("name", sorted(BROKEN_BURST))
def test_a_broken_burst_cell_is_quarantined_alone(name):
    change, reason = BROKEN_BURST[name]
    v = validate_run(run_row(), [*good_cells(), burst(**change)])
    assert [(c["phase"], c["concurrency"]) for c in v.bad_cells] == [("burst", 4)]
    assert any(reason in r for r in v.bad_cells[0]["quarantine_reasons"]), v.bad_cells[0][
        "quarantine_reasons"
    ]
    assert len(v.good_cells) == 5
