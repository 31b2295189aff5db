"""Whole prefill and decode cells against the ideal server (a separate process, exact timing).

Truth comes from the server's configuration (rate, per-token interval) and from its own
measurements (/truth: TTFT from body received to first write). Windows are short (3-4 s) to
keep the suite quick; the long-window figures are in benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest
from loadgen_ideal import ideal_server, truth

from speedmatrix.loadgen import (
    CellNotAttempted,
    DecodeConfig,
    PrefillConfig,
    run_decode,
    run_prefill,
)
from speedmatrix.records import CELL_FIELDS, REQUEST_FIELDS

pytestmark = pytest.mark.timing  # run alone: see pyproject's markers

CELL_KEYS = [f.name for f in CELL_FIELDS]
REQUEST_KEYS = [f.name for f in REQUEST_FIELDS]


# The assertions below hold every figure to the server's truth directly. The saturation
# guard and the counter cross-check judge the wall clock of this shared 2-core box (load
# average 13-30 during the session), so they are loosened here (3%, 50 ms); their verdicts
# have their own tests (the 5% over-count fault below, tests/unit/test_loadgen_guards.py).
GUARDS = {"max_loop_lag_ms": 50.0, "max_client_cpu_pct": 100.0, "token_tolerance": 0.03}


def decode(url: str, **kw: object) -> tuple[dict, list[dict]]:
    cfg = DecodeConfig(base_url=url, model="ideal", **{**GUARDS, **kw})  # type: ignore[arg-type]
    return asyncio.run(run_decode(cfg))


def prefill(url: str, **kw: object) -> tuple[dict, list[dict]]:
    cfg = PrefillConfig(base_url=url, model="ideal", **kw)  # type: ignore[arg-type]
    return asyncio.run(run_prefill(cfg))


def server_ttft_ms(url: str) -> float:
    values = [r["ttft_s"] for r in truth(url)["requests"] if r["ttft_s"] is not None]
    return 1000 * statistics.median(values)


@pytest.mark.parametrize(
    ("concurrency", "interval_s", "per_chunk", "coalesce", "context"),
    [
        (1, 0.020, 1, 1, 8192),
        (16, 0.020, 1, 1, 16384),
        (64, 0.020, 4, 1, 2048),  # speculative-decoding-like chunks of 4 tokens
        (128, 0.025, 1, 2, 1024),  # two chunks per socket write (a busy API server)
    ],
)
def test_decode_matches_the_ideal_servers_truth(
    concurrency: int, interval_s: float, per_chunk: int, coalesce: int, context: int
) -> None:
    with ideal_server(
        ttft_s=0.030, interval_s=interval_s, tokens_per_chunk=per_chunk, coalesce=coalesce
    ) as url:
        cell, rows = decode(
            url,
            context=context,
            concurrency=concurrency,
            window_s=4.0,
            max_output_tokens=100_000,  # no restarts: the true rate is exactly C * k / interval
        )
        ttft_truth = server_ttft_ms(url)
    assert sorted(cell) == sorted(CELL_KEYS)
    assert cell["status"] == "valid", cell["error"]
    true_tbt_ms = 1000 * interval_s / per_chunk
    true_total = concurrency * per_chunk / interval_s
    assert cell["tbt_ms"] == pytest.approx(true_tbt_ms, rel=0.01)
    # The rate is the window's count over its 4.0 s, so it is held to the count's bound below
    # (one chunk per stream at each edge): 1% in every case here but C=128 with two chunks per
    # write, 1.25%, where the streams run in lockstep and the window's end falls either side of
    # a write of all 128 (5064.5 vs 5120 tok/s seen once on a quiet box, a 1% bound failing).
    assert abs(cell["total_tok_s"] - true_total) <= 2 * concurrency * per_chunk / 4.0
    assert cell["per_request_tok_s"] == pytest.approx(1000 / true_tbt_ms, rel=0.01)
    assert cell["tokens_per_chunk"] == pytest.approx(per_chunk, rel=0.01)
    # Within half a token interval of the server's own TTFT: any mistake of definition (timing
    # to the second token, from connection set-up, ...) is a whole interval or more, whereas
    # what the client cannot help is the time the shared box takes to deliver bytes both ways
    # (seen up to 5.8 ms on a loaded CI machine). At 64-128 simultaneous starts the server
    # reads the requests over several ms (its receive queue is in the client's TTFT, not in
    # the server's), hence 15 ms there. The 2 ms target is a benchmark (benchmarks/README.md).
    bound = 15.0 if concurrency > 16 else 500 * interval_s
    assert abs(cell["ttft_ms"] - ttft_truth) < bound, (cell["ttft_ms"], ttft_truth)
    assert cell["context_tokens"] == context
    assert cell["concurrency"] == concurrency
    assert cell["avg_active_requests"] == pytest.approx(concurrency)
    assert cell["active_source"] == "server"
    assert cell["measured_s"] == pytest.approx(4.0)
    assert cell["samples"] == concurrency
    # Client and server counts agree within what the cell's own cross-check allows (status
    # "valid" above: the two /metrics round trips make rate x their spans ambiguous; a loaded
    # CI box saw 405 vs 400 here). The client's own count is held to the truth exactly:
    # C x k tokens per interval over the 4.0 s window, within one chunk per stream per edge.
    assert cell["server_generation_tokens"] is not None
    assert abs(cell["output_tokens"] - true_total * 4.0) <= 2 * concurrency * per_chunk
    assert all(sorted(r) == sorted(REQUEST_KEYS) for r in rows)
    assert {r["prompt_tokens"] for r in rows} == {context}


def test_restarted_streams_count_completed_requests_and_cached_ttft() -> None:
    with ideal_server(ttft_s=0.020, interval_s=0.020) as url:
        cell, rows = decode(url, context=4096, concurrency=8, window_s=3.0, max_output_tokens=20)
        ttft_truth = server_ttft_ms(url)
    assert cell["status"] == "valid", cell["error"]
    # each request: 20 ms to the first token + 19 intervals of 20 ms = 0.40 s
    assert cell["completed_requests"] >= 8 * 6
    assert cell["requests_started"] == len(rows) > cell["completed_requests"]
    assert cell["tbt_ms"] == pytest.approx(20.0, rel=0.01)
    # half an interval: see test_decode_matches_the_ideal_servers_truth (5.8 ms seen in CI
    # against a 2 ms bound; a wrong definition is off by 20 ms or more)
    assert abs(cell["ttft_ms"] - ttft_truth) < 10.0
    # the true rate includes the restart gaps: 20 tokens per 0.40 s per stream
    assert cell["total_tok_s"] == pytest.approx(8 * 20 / 0.40, rel=0.03)
    finished = [r for r in rows if r["finished"]]
    assert all(r["output_tokens"] == 20 for r in finished)
    assert sum(r["window_tokens"] for r in rows) == cell["output_tokens"]


def test_shared_prompt_mode_is_recorded_and_exact() -> None:
    with ideal_server(ttft_s=0.01, interval_s=0.01) as url:
        cell, rows = decode(
            url,
            context=3000,
            concurrency=4,
            window_s=1.5,
            max_output_tokens=64,
            prompt_mode="shared",
        )
    assert cell["status"] == "valid", cell["error"]
    assert cell["prompt_mode"] == "shared"
    assert {r["prompt_tokens"] for r in rows} == {3000}


def test_prefill_is_exact_and_prompt_tok_s_is_tokens_over_ttft() -> None:
    with ideal_server(ttft_s=0.010, prefill_tok_s=200_000.0) as url:
        cell, rows = prefill(url, context=131072)
        ttft_truth = server_ttft_ms(url)
    assert sorted(cell) == sorted(CELL_KEYS)
    assert cell["status"] == "valid", cell["error"]
    assert cell["context_tokens"] == 131072
    assert cell["context_label"] == "128K"
    true_ttft = 10.0 + 1000 * 131072 / 200_000
    # The server kept its schedule: never early; late only by its own sleep's overshoot (6.7 ms
    # on the loaded CI box), while a schedule mistake (a missing or doubled term) is >= 10 ms
    # early or 600 ms late.
    assert true_ttft - 1.0 <= ttft_truth <= true_ttft + 25.0
    # The client's TTFT also holds the upload of the ~650 KB body, which the server's truth
    # (from the body received) does not: 7.7 ms (1.15%) of it on a loaded CI machine. 3% is
    # 20 ms; what the figure must not be is the configured schedule's double or a decode step.
    assert cell["ttft_ms"] == pytest.approx(ttft_truth, rel=0.03)
    assert cell["ttft_ms"] >= ttft_truth
    assert cell["total_tok_s"] == pytest.approx(131072 / (cell["ttft_ms"] / 1000))
    # three cold prompts by default (issue 40): the figures are their medians
    assert cell["completed_requests"] == 3 == cell["samples"] == cell["ttft_samples"]
    assert len(rows) == 3 and all(r["prompt_tokens"] == 131072 for r in rows)


def test_512k_context_prefill_and_decode() -> None:
    with ideal_server(ttft_s=0.02, interval_s=0.02) as url:
        pcell, _ = prefill(url, context=524288, run_tag="big")
        dcell, _ = decode(
            url,
            context=524288,
            concurrency=2,
            window_s=3.0,
            max_output_tokens=1000,
            run_tag="big",
        )
    assert pcell["status"] == "valid", pcell["error"]
    assert pcell["context_tokens"] == 524288 and pcell["context_label"] == "512K"
    assert dcell["status"] == "valid", dcell["error"]
    assert dcell["context_tokens"] == 524288
    assert dcell["tbt_ms"] == pytest.approx(20.0, rel=0.01)


@pytest.mark.parametrize(
    ("fault", "status", "reason"),
    [
        ({"http_500_every": 6}, "failed", "HTTP 500: injected internal error"),
        ({"disconnect_every": 6}, "failed", "connection closed by server after 5 tokens"),
        ({"short_every": 6, "short_by": 3}, "failed", "short output: 37 of 40 tokens"),
        ({"report_waiting": 2}, "invalid", "requests queued on the server during the window"),
        ({"metrics_count_scale": 1.05}, "invalid", "(vllm:generation_tokens_total); over"),
    ],
)
def test_injected_faults_give_status_and_reason(
    fault: dict[str, object], status: str, reason: str
) -> None:
    with ideal_server(ttft_s=0.01, interval_s=0.005, **fault) as url:
        cell, rows = decode(url, context=1024, concurrency=4, window_s=2.0, max_output_tokens=40)
    assert cell["status"] == status
    assert reason in cell["error"], cell["error"]
    assert sorted(cell) == sorted(CELL_KEYS)
    if status == "failed":
        assert cell["requests_failed"] >= 1
        assert any(r["error"] for r in rows)


def test_queueing_server_never_opens_the_window() -> None:
    with ideal_server(ttft_s=0.01, interval_s=0.005, max_running=3) as url:
        cell, _ = decode(
            url,
            context=1024,
            concurrency=4,
            window_s=1.0,
            max_output_tokens=100_000,
            first_token_timeout_s=1.0,
            first_token_s_per_1k=0.01,
        )
    assert cell["status"] == "failed"
    assert "only 3 of 4 streams started" in cell["error"]


def test_unreachable_server_is_not_attempted() -> None:
    with pytest.raises(CellNotAttempted, match="unreachable"):
        decode("http://127.0.0.1:9", context=1024, concurrency=1, window_s=1)


def test_unknown_model_is_not_attempted() -> None:
    with ideal_server() as url, pytest.raises(CellNotAttempted, match="not served"):
        asyncio.run(run_prefill(PrefillConfig(base_url=url, model="nope", context=1024)))


def test_api_key_is_sent_and_required() -> None:
    with ideal_server(api_key="s3cret") as url:
        with pytest.raises(CellNotAttempted, match="refused the API key"):
            prefill(url, context=1024)
        cell, _ = prefill(url, context=1024, api_key="s3cret")
    assert cell["status"] == "valid", cell["error"]


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        decode("http://127.0.0.1:1", context=1024, concurrency=0)
    with pytest.raises(ValueError, match="prompt_mode"):
        decode("http://127.0.0.1:1", context=1024, concurrency=1, prompt_mode="both")


def test_an_adaptive_window_stops_at_its_minimum_on_a_steady_server() -> None:
    """A steady stream is tight long before its cap: the window ends at the first checkpoint
    past its minimum, the figures are the truth over what it measured, and the cell says why."""
    with ideal_server(ttft_s=0.02, interval_s=0.010) as url:
        cell, _ = decode(
            url, context=1024, concurrency=4, window_s=8.0, max_output_tokens=100_000,
            adaptive=True, adaptive_min_s=2.0, adaptive_target_pct=1.0,
        )  # fmt: skip
    assert cell["status"] == "valid", cell["error"]
    assert cell["window_mode"] == "adaptive"
    assert cell["window_stop"] == "converged", cell["window_note"]
    assert 2.0 <= cell["measured_s"] < 3.0  # the minimum, then at most a few checkpoints
    assert cell["window_s"] == 8.0  # the cap asked for, as a fixed window records its length
    assert cell["adaptive_target_pct"] == 1.0
    assert cell["window_halfwidth_pct"] <= 1.0
    assert cell["window_note"].startswith("converged: throughput ±")
    true_total = 4 / 0.010
    # the window's count over its own length: one chunk per stream at each edge
    assert abs(cell["total_tok_s"] - true_total) <= 2 * 4 / cell["measured_s"]
    assert cell["tbt_ms"] == pytest.approx(10.0, rel=0.01)
    assert cell["avg_active_requests"] == pytest.approx(4)


def test_a_fixed_window_records_its_interval_and_runs_its_length() -> None:
    with ideal_server(ttft_s=0.02, interval_s=0.010) as url:
        cell, _ = decode(url, context=1024, concurrency=2, window_s=3.0, max_output_tokens=100_000)
    assert cell["status"] == "valid", cell["error"]
    assert (cell["window_mode"], cell["window_stop"]) == ("fixed", "cap")
    assert cell["measured_s"] == pytest.approx(3.0)
    assert cell["window_halfwidth_pct"] is not None and cell["window_halfwidth_pct"] < 5
    assert cell["adaptive_target_pct"] is None and cell["window_note"] is None


def test_an_adaptive_window_on_a_queueing_server_runs_to_its_cap() -> None:
    """Queueing inside the window is not a steady state: no early stop, whatever the interval."""
    with ideal_server(ttft_s=0.02, interval_s=0.010, report_waiting=1) as url:
        cell, _ = decode(
            url, context=1024, concurrency=2, window_s=3.0, max_output_tokens=100_000,
            adaptive=True, adaptive_min_s=1.0,
        )  # fmt: skip
    assert cell["measured_s"] == pytest.approx(3.0)
    assert cell["window_stop"] == "cap_not_steady"
    assert "requests queued on the server" in cell["window_note"]
    assert cell["status"] == "invalid"  # and the cell's own check says so, as before


def test_bad_adaptive_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="at most the window's cap"):
        decode("http://127.0.0.1:1", context=1024, adaptive=True, window_s=5.0, adaptive_min_s=9.0)
    with pytest.raises(ValueError, match="not the published tool's"):
        decode("http://127.0.0.1:1", context=1024, adaptive=True, measurement_profile="published")
