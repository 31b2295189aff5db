"""A burst cell over HTTP against the simulator (issue #43 item 12): N requests sent at once and
measured to completion, as the published tool's request-count ("Burst / E2E") mode measures.

Ground truth twice over: the simulator's performance model driven in simulated time with no
HTTP at all (`sim.predict.predict_burst`: the latency a request of this burst must see), and
the simulator's own record of every token it emitted for the burst's requests
(`/sim/requests?detail=1`: arrival and token times on its clock).
"""

from __future__ import annotations

import statistics

import pytest
from replay import REFERENCE_PROFILE
from test_loadgen_sim import _get

from speedmatrix.loadgen import BurstConfig, run_cell
from speedmatrix.records import CELL_FIELDS, REQUEST_FIELDS, cell_name, parse_cell
from speedmatrix.sim.predict import predict_burst
from speedmatrix.sim.profile import load_profile
from speedmatrix.sim.runner import run_in_process as sim

pytestmark = [pytest.mark.integration]

MAX_OUT = 128
CONTEXT = 8192


def _cfg(url: str, n: int, **kw: object) -> BurstConfig:
    return BurstConfig(
        base_url=url,
        model="Kimi-K2.7-Code-NVFP4",
        context=CONTEXT,
        concurrency=n,
        max_output_tokens=MAX_OUT,
        progress=False,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.timing
@pytest.mark.parametrize("n", [1, 4])
def test_a_burst_measures_its_requests_to_completion_as_the_model_says(n: int) -> None:
    profile = load_profile(REFERENCE_PROFILE)
    want = predict_burst(profile, CONTEXT, n, max_output=MAX_OUT)
    with sim(REFERENCE_PROFILE) as url:
        cell, rows = run_cell(_cfg(url, n))
        truth = [
            r
            for r in _get(url + "/sim/requests?detail=1")  # type: ignore[union-attr]
            if r["max_tokens"] == MAX_OUT
        ]
    assert set(cell) == {f.name for f in CELL_FIELDS}
    assert cell["status"] == "valid", cell["error"]
    assert (cell["phase"], cell["concurrency"], cell["context_tokens"]) == ("burst", n, CONTEXT)
    assert cell["window_s"] is None and cell["max_output_tokens"] == MAX_OUT
    # every request completed with all its tokens, and nothing else was counted
    assert cell["completed_requests"] == cell["requests_started"] == n
    assert cell["output_tokens"] == n * MAX_OUT
    assert cell["requests_failed"] == 0
    assert len(truth) == n and all(t["output_tokens"] == MAX_OUT for t in truth)
    # the model's completed-request latency (arrival to the last token), and the client's
    sim_latency = statistics.median(t["token_times"][-1] - t["arrival"] for t in truth)
    assert cell["latency_ms"] == pytest.approx(want["latency_ms"], rel=0.05)
    assert cell["latency_ms"] == pytest.approx(sim_latency * 1000, rel=0.03)
    assert cell["latency_ms"] <= cell["latency_p90_ms"] <= cell["latency_p99_ms"]
    # per-user end-to-end tok/s: a request's tokens over its latency, the first-token wait in
    assert cell["e2e_per_request_tok_s"] == pytest.approx(want["e2e_per_request_tok_s"], rel=0.05)
    assert cell["e2e_per_request_tok_s"] == pytest.approx(
        statistics.median(MAX_OUT / (t["token_times"][-1] - t["arrival"]) for t in truth),
        rel=0.03,
    )
    # total over the burst: every completed token over first request sent to last token
    assert cell["measured_s"] == pytest.approx(want["measured_s"], rel=0.05)
    assert cell["total_tok_s"] == pytest.approx(n * MAX_OUT / cell["measured_s"], rel=1e-9)
    assert cell["total_tok_s"] == pytest.approx(want["total_tok_s"], rel=0.05)
    # the decode figures of its requests are there too, as the model has them
    assert cell["tbt_ms"] == pytest.approx(want["tbt_ms"], rel=0.05)
    assert cell["ttft_ms"] is not None and cell["ttst_ms"] is not None
    # the server's counter agrees with the client's count (the check a valid cell passed)
    assert cell["server_generation_tokens"] == n * MAX_OUT
    # one row per request, a burst's own
    assert len(rows) == n and {r["phase"] for r in rows} == {"burst"}
    assert set(rows[0]) == {f.name for f in REQUEST_FIELDS}
    assert all(r["finished"] and r["output_tokens"] == MAX_OUT for r in rows)


def test_a_burst_cell_has_its_own_name_and_key_beside_the_decode_cell() -> None:
    assert cell_name("burst", 8192, 4) == "burst 8Kx4"
    assert parse_cell("burst 8Kx4") == ("burst", "8K", 4)
    assert parse_cell("8Kx4") == ("decode", "8K", 4)


def test_a_burst_that_outlives_its_limit_fails_with_the_reason() -> None:
    with sim(REFERENCE_PROFILE, time_scale=4.0) as url:
        cell, _ = run_cell(_cfg(url, 2, max_burst_s=0.5, time_scale=4.0))
    assert cell["status"] == "failed"
    assert "burst not complete within 0.5 s" in cell["error"]
    assert cell["completed_requests"] == 0
