"""Planted regressions against the simulator's engine model (speedmatrix.sim.predict).

A history of "commits" is made from one simulator profile: from the planted commit on, one
decode cell's step-time correction is 1/0.9 of the base (its throughput 10% lower); every "run" also
varies by a seeded run-to-run factor plus per-cell jitter (~0.6% in all), the noise an unchanged
engine shows, so the between-run noise model has something real to estimate. Cells are driven
through the engine model directly (simulated time, no HTTP): deterministic and fast.
"""

from __future__ import annotations

import copy
import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from speedmatrix.analysis.baseline import select_baseline
from speedmatrix.analysis.bisection import bisect
from speedmatrix.analysis.noise import NoiseModel
from speedmatrix.analysis.verdict import compare_runs, summarize
from speedmatrix.sim.predict import predict_decode, predict_prefill
from speedmatrix.sim.profile import Profile, load_profile

pytestmark = pytest.mark.integration

BASE_PROFILE = {
    "name": "planted-base",
    "max_model_len": 131072,
    "kv": {"block_size": 16, "num_gpu_blocks": 20000},
    "prefill": {"points": [[8192, 1.3], [65536, 12.5]]},
    "decode": {"base_s": 0.018, "per_seq_s": 0.0015, "per_kv_token_s": 2e-8},
}
PREFILL = (8192, 65536)
CONTEXTS = (8192, 65536)
CONCURRENCIES = (1, 2, 4, 16)
WINDOW_S, MAX_OUT = 10.0, 1024
# The top of its row (64Kx16 is over capacity): no other cell ramps up through its batch size,
# so the planted step-time change reaches this cell alone (TTFT included).
PLANTED_CELL = (65536, 4)
SMALL_CELL = (8192, 4)
COMMITS = [f"{i:040x}" for i in range(17)]  # COMMITS[0] is the known-good one
RUN_SD, CELL_SD = 0.0045, 0.004
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def log2_bound(n: int) -> int:
    """ceil(log2(n)): the measurements a bisection of n candidates may take without skips."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def profile_at(
    commit: int,
    seed: int,
    planted_at: int,
    planted: dict,
    base: dict | None = None,
    grid: tuple[tuple[int, ...], tuple[int, ...]] = (CONTEXTS, CONCURRENCIES),
) -> Profile:
    """The profile one run at COMMITS[commit] sees, as plain profile data.

    From `planted_at` on, the planted cells' decode correction factor is multiplied (the
    engine looks corrections up at the batch's prompt length and size, i.e. exactly at a
    cell); every run also draws a run-wide speed factor and per-cell jitter from `seed`.
    """
    rng = np.random.default_rng(seed)
    run_factor = 1.0 + rng.normal(0.0, RUN_SD)
    data = copy.deepcopy(base or BASE_PROFILE)
    data["name"] = f"planted-{commit}-{seed}"
    data["decode"]["base_s"] *= run_factor
    data["decode"]["per_seq_s"] *= run_factor
    data["decode"]["per_kv_token_s"] *= run_factor
    data["prefill"]["points"] = [[n, t * run_factor] for n, t in data["prefill"]["points"]]
    factors = planted if commit >= planted_at else {}
    data["decode"]["correction"] = [
        {
            "context": ctx,
            "batch": c,
            "factor": (1.0 + rng.normal(0.0, CELL_SD)) * factors.get((ctx, c), 1.0),
        }
        for ctx in grid[0]
        for c in grid[1]
    ]
    return load_profile(data)


def run_at(commit, seed, *, planted_at=9, planted=None, cells=None):
    """(run row, cell rows) of one simulated run at COMMITS[commit]."""
    planted = {PLANTED_CELL: 1 / 0.9} if planted is None else planted
    prof = profile_at(commit, seed, planted_at, planted)
    run_id = f"run-{commit:02d}-{seed}"
    rows = []
    if cells is None:
        rows += [predict_prefill(prof, ctx, tag=i + 1) for i, ctx in enumerate(PREFILL)]
        cells = [(ctx, c) for ctx in CONTEXTS for c in CONCURRENCIES]
    for ctx, c in cells:
        rows.append(predict_decode(prof, ctx, c, window_s=WINDOW_S, max_output=MAX_OUT))
    run = {
        "run_id": run_id,
        "recipe_id": "sim/planted",
        "host": "local",
        "status": "success",
        "engine_commit": COMMITS[commit],
        "engine_repository": "github.com/vllm-project/vllm",
        "kv_cache_tokens": prof.kv_cache_tokens,
        "started_at": T0 + timedelta(hours=commit * 100 + seed),
    }
    return run, [dict(r, run_id=run_id) for r in rows]


@pytest.fixture(scope="module")
def history():
    """Five runs of the unchanged, known-good commit: the between-run noise."""
    runs, cells = [], []
    for seed in range(5):
        run, rows = run_at(0, seed)
        runs.append(run)
        cells += rows
    return runs, cells


def test_noise_model_recovers_the_planted_run_to_run_spread(history):
    noise = NoiseModel.from_history(*history)
    sd, source = noise.lookup("sim/planted", "local", "decode", 8192, 16, "total_tok_s")
    assert source == "cell"
    true_sd = math.hypot(RUN_SD, CELL_SD)
    assert true_sd / 3 < sd < true_sd * 3  # 4 dof: the right order of magnitude


def test_planted_10pct_regression_is_flagged_and_unchanged_cells_are_noise(history):
    runs, cells = history
    noise = NoiseModel.from_history(runs, cells)
    run, rows = run_at(16, 100)
    baseline = select_baseline(runs, run)
    assert baseline["run_id"] == "run-00-4"
    base_cells = [c for c in cells if c["run_id"] == baseline["run_id"]]
    result = compare_runs(run, rows, baseline, base_cells, noise=noise)

    flagged = {(r["context_tokens"], r["concurrency"]) for r in result if r["verdict"] != "noise"}
    assert flagged == {PLANTED_CELL}
    planted = {
        r["metric"]: r for r in result if (r["context_tokens"], r["concurrency"]) == PLANTED_CELL
    }
    assert planted["total_tok_s"]["verdict"] == "regression"
    assert planted["tbt_ms"]["verdict"] == "regression"  # lower is better: it went up
    assert -13.0 < planted["total_tok_s"]["change_pct"] < -7.0
    assert planted["total_tok_s"]["noise_source"].startswith("between-cell")
    unchanged = [r for r in result if (r["context_tokens"], r["concurrency"]) != PLANTED_CELL]
    assert len(unchanged) > 20 and all(r["verdict"] == "noise" for r in unchanged)
    assert all(r["noise_pct"] > 0 for r in unchanged if r["metric"] == "total_tok_s")

    text = summarize(result, run, baseline, commits=COMMITS[1:17])
    assert "64Kx4: total_tok_s" in text and "baseline run-00-4" in text
    assert "commits between (16)" in text and COMMITS[9][:12] in text


def test_planted_1pct_change_inside_the_noise_is_not_flagged(history):
    runs, cells = history
    noise = NoiseModel.from_history(runs, cells)
    run, rows = run_at(16, 200, planted={SMALL_CELL: 1 / 0.99})
    baseline = select_baseline(runs, run)
    base_cells = [c for c in cells if c["run_id"] == baseline["run_id"]]
    result = compare_runs(run, rows, baseline, base_cells, noise=noise)
    assert [r for r in result if r["verdict"] != "noise"] == []
    small = next(
        r
        for r in result
        if (r["context_tokens"], r["concurrency"]) == SMALL_CELL and r["metric"] == "total_tok_s"
    )
    assert small["noise_pct"] > 1.0  # the planted change lies inside the estimated noise
    # The noise alone (no threshold) still separates the 10% plant from the run-to-run spread.
    run10, rows10 = run_at(16, 201)
    flagged = compare_runs(run10, rows10, baseline, base_cells, noise=noise, threshold=0.0)
    planted = next(
        r
        for r in flagged
        if r["metric"] == "total_tok_s" and (r["context_tokens"], r["concurrency"]) == PLANTED_CELL
    )
    assert planted["verdict"] == "regression" and planted["threshold_pct"] == 0.0


@pytest.mark.parametrize("planted_at", [1, 6, 9, 16])
def test_bisection_finds_the_planted_commit_in_log2_n_runs(history, planted_at):
    runs, cells = history
    noise = NoiseModel.from_history(runs, cells)
    baseline = runs[-1]
    base_cells = [c for c in cells if c["run_id"] == baseline["run_id"]]
    measured = []

    def measure(commit: str) -> str:
        """Run only the regressed cell at `commit` and compare it with the good baseline."""
        i = COMMITS.index(commit)
        run, rows = run_at(i, 1000 + i, planted_at=planted_at, cells=[PLANTED_CELL])
        measured.append(i)
        result = compare_runs(run, rows, baseline, base_cells, noise=noise)
        cell = [r for r in result if (r["context_tokens"], r["concurrency"]) == PLANTED_CELL]
        return "regression" if any(r["verdict"] == "regression" for r in cell) else "noise"

    candidates = COMMITS[1:]
    result = bisect(candidates, measure)
    assert result.first_bad == COMMITS[planted_at]
    assert len(measured) == result.measurements <= log2_bound(len(candidates)) == 4


def test_bisection_skips_commits_without_wheels(history):
    runs, cells = history
    noise = NoiseModel.from_history(runs, cells)
    baseline = runs[-1]
    base_cells = [c for c in cells if c["run_id"] == baseline["run_id"]]
    no_wheel = {COMMITS[8], COMMITS[9]}

    def measure(commit: str) -> str:
        assert commit not in no_wheel
        i = COMMITS.index(commit)
        run, rows = run_at(i, 2000 + i, cells=[PLANTED_CELL])
        result = compare_runs(run, rows, baseline, base_cells, noise=noise)
        return "regression" if any(r["verdict"] == "regression" for r in result) else "noise"

    result = bisect(COMMITS[1:], measure, has_wheel=lambda c: c not in no_wheel)
    assert result.first_bad == COMMITS[10]  # first measurable bad commit
    assert result.suspects == [COMMITS[8], COMMITS[9], COMMITS[10]]  # 9, the true one, included
