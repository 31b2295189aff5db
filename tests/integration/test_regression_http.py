"""Planted regressions measured for real: the load generator (in-process) against the simulator
served over loopback HTTP (speedmatrix.sim.runner.run_in_thread), landed in a warehouse.

Same plant as test_regression_sim.py (one cell 10% slower from one commit on; seeded run-to-run
variation), but every figure now comes through HTTP streaming and the wall clock, with per-request
rows, so the comparison uses both noise sources: within-window bootstrap intervals and the
between-run spread of repeated runs of the unchanged engine. Windows are short (3 s) to keep
the test near a minute.
"""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime, timedelta

import pytest
from test_regression_sim import profile_at

from speedmatrix.analysis.baseline import read_history
from speedmatrix.analysis.bisection import bisect
from speedmatrix.analysis.compare import comparison_for_run, judge_regressions
from speedmatrix.analysis.verdict import RegressionError, compare_runs
from speedmatrix.loadgen import DecodeConfig, PrefillConfig, run_decode, run_prefill
from speedmatrix.sim.runner import run_in_thread
from speedmatrix.store.extra import read_extra
from speedmatrix.store.warehouse import Warehouse

# One worker takes the module in `make test`'s phase 3 (tests/conftest.py ONE_WORKER_MODULES):
# its warehouse fixture (four measured runs, ~55 s) is then measured once, not once per worker.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.timing,
    pytest.mark.long,
]

PROFILE = {
    "name": "planted-http",
    "served_model_name": "sim-model",
    "max_model_len": 16384,
    "kv": {"block_size": 16, "num_gpu_blocks": 4000},
    "prefill": {"points": [[8192, 0.2]]},
    "decode": {"base_s": 0.02, "per_seq_s": 0.002, "per_kv_token_s": 1e-7},
}
CONTEXTS, CONCURRENCIES = (2048, 8192), (2, 4)
CELLS = [(ctx, c) for ctx in CONTEXTS for c in CONCURRENCIES]
PLANTED = (8192, 4)  # top of its row: no other cell ramps up through its batch size
COMMITS = [f"{i:040x}" for i in range(9)]
WINDOW_S = 3.0
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def log2_bound(n: int) -> int:
    """ceil(log2(n)): the measurements a bisection of n candidates may take without skips."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def measure_run(commit: int, seed: int, *, planted_at=5, planted=None, cells=CELLS):
    """One run at COMMITS[commit]: serve that commit's profile, drive the cells over HTTP."""
    planted = {PLANTED: 1 / 0.9} if planted is None else planted
    prof = profile_at(commit, seed, planted_at, planted, PROFILE, (CONTEXTS, CONCURRENCIES))
    rows, requests = [], []
    with run_in_thread(prof) as sim:
        url = str(sim)
        if cells is CELLS:
            cell, reqs = asyncio.run(
                run_prefill(PrefillConfig(base_url=url, model="sim-model", context=8192))
            )
            rows.append(cell)
            requests += reqs
        for ctx, conc in cells:
            cfg = DecodeConfig(
                base_url=url,
                model="sim-model",
                context=ctx,
                concurrency=conc,
                window_s=WINDOW_S,
                max_output_tokens=512,
                # The simulator shares this process and two busy cores with the client: the
                # lag/CPU limits that protect real measurements would flag the machine, not the
                # engine. Timing jitter still reaches the figures, as noise.
                # A 3 s window holds ~250 tokens, so the /metrics sampling edge alone is ~2%.
                max_loop_lag_ms=500.0,
                max_client_cpu_pct=100.0,
                token_tolerance=0.05,
            )
            cell, reqs = asyncio.run(run_decode(cfg))
            assert cell["status"] == "valid", cell["error"]
            rows.append(cell)
            requests += reqs
    run = {
        "run_id": f"http-{commit:02d}-{seed}",
        "recipe_id": "sim/planted-http",
        "trigger": "commit",
        "status": "success",
        "host": "local",
        "engine_commit": COMMITS[commit],
        "engine_repository": "github.com/vllm-project/vllm",
        "kv_cache_tokens": prof.kv_cache_tokens,
        "started_at": T0 + timedelta(hours=commit * 100 + seed),
    }
    return run, rows, requests


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    """Three runs of the unchanged good commit and one at the last (bad) commit, landed."""
    wh = Warehouse(str(tmp_path_factory.mktemp("wh-http")))
    for seed in range(3):
        wh.land_run(*measure_run(0, seed))
    wh.land_run(*measure_run(8, 10))
    yield wh
    wh.close()


def test_planted_regression_is_flagged_over_http(warehouse):
    with pytest.raises(RegressionError) as err:
        judge_regressions(warehouse, "http-08-10", commits=COMMITS[1:9])
    assert "8Kx4" in str(err.value) and "baseline http-00-2" in str(err.value)
    rows = read_extra(warehouse, "comparisons", run_id="http-08-10").to_dict("records")
    flagged = {(r["context_tokens"], r["concurrency"]) for r in rows if r["verdict"] != "noise"}
    assert flagged == {PLANTED}
    total = next(
        r
        for r in rows
        if r["metric"] == "total_tok_s" and (r["context_tokens"], r["concurrency"]) == PLANTED
    )
    assert total["verdict"] == "regression" and -14.0 < total["change_pct"] < -6.0
    assert total["noise_source"].startswith("within+between")  # both noise sources were used
    noise = read_extra(warehouse, "noise", run_id="http-08-10")
    assert noise["ci_low"].notna().sum() >= len(CELLS)


def test_planted_1pct_change_over_http_is_noise(warehouse, tmp_path):
    wh = Warehouse(str(tmp_path / "wh"))
    for run_id in ("http-00-0", "http-00-1", "http-00-2"):
        wh.land_run(*warehouse.read_run(run_id))
    wh.land_run(*measure_run(8, 20, planted={(2048, 4): 1 / 0.99}))
    result = comparison_for_run(wh, "http-08-20")
    assert result.baseline["run_id"] == "http-00-2"
    assert [r for r in result.rows if r["verdict"] != "noise"] == []
    small = next(
        r
        for r in result.rows
        if r["metric"] == "total_tok_s" and r["context_tokens"] == 2048 and r["concurrency"] == 4
    )
    assert small["noise_pct"] > 1.0
    wh.close()


def test_bisection_over_http_finds_the_planted_commit(warehouse):
    good_run, good_cells, good_requests = warehouse.read_run("http-00-2")
    model = read_history(warehouse, "sim/planted-http", "local")[3]  # between-run noise
    measured = []

    def measure(commit: str) -> str:
        i = COMMITS.index(commit)
        measured.append(i)
        run, rows, reqs = measure_run(i, 100 + i, cells=[PLANTED])
        result = compare_runs(
            run,
            rows,
            good_run,
            good_cells,
            requests=reqs,
            baseline_requests=good_requests,
            noise=model,
        )
        mine = [r for r in result if (r["context_tokens"], r["concurrency"]) == PLANTED]
        return "regression" if any(r["verdict"] == "regression" for r in mine) else "noise"

    result = bisect(COMMITS[1:], measure)
    assert result.first_bad == COMMITS[5]
    assert len(measured) <= log2_bound(8) == 3
