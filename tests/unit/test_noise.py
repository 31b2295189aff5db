"""Noise estimates: within-window bootstrap intervals and pooled between-run spread."""

from __future__ import annotations

import math

import numpy as np
import pytest

from speedmatrix.analysis.noise import (
    NoiseModel,
    between_run_noise,
    bootstrap_interval,
    within_window,
)


def _requests(n_streams: int, tokens: float, tbt: float, seed: int = 1, per_stream: int = 1):
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(n_streams):
        for j in range(per_stream):
            rows.append(
                {
                    "phase": "decode",
                    "context_tokens": 8192,
                    "concurrency": n_streams,
                    "request_index": s * per_stream + j,
                    "stream": s,
                    "window_tokens": int(rng.normal(tokens, tokens * 0.05)),
                    "tbt_ms": float(rng.normal(tbt, tbt * 0.05)),
                    "ttft_ms": float(rng.normal(200, 20)),
                }
            )
    return rows


def test_bootstrap_needs_two_samples_and_is_deterministic():
    assert bootstrap_interval([5.0], "median") is None
    assert bootstrap_interval([float("nan"), 3.0], "median") is None
    values = np.random.default_rng(0).normal(100, 5, 40)
    a = bootstrap_interval(values, "median", seed=3)
    b = bootstrap_interval(values, "median", seed=3)
    assert a == b
    assert a.low < a.estimate < a.high
    assert a.estimate == pytest.approx(float(np.median(values)))


def test_bootstrap_interval_narrows_with_more_samples():
    rng = np.random.default_rng(0)
    small = bootstrap_interval(rng.normal(100, 10, 8), "median")
    large = bootstrap_interval(rng.normal(100, 10, 400), "median")
    assert large.rel_halfwidth < small.rel_halfwidth / 2


def test_bootstrap_of_identical_values_has_zero_width():
    ci = bootstrap_interval([7.0, 7.0, 7.0], "sum", scale=0.5)
    assert (ci.low, ci.estimate, ci.high) == (10.5, 10.5, 10.5)
    assert ci.rel_halfwidth == 0


def test_bootstrap_rejects_unknown_statistic():
    with pytest.raises(ValueError, match="unknown statistic"):
        bootstrap_interval([1.0, 2.0], "mean")


def test_within_window_total_is_resampled_by_stream():
    rows = _requests(8, 900, 30.0, per_stream=2)
    out = within_window(rows, measured_s=30.0)
    total = out["total_tok_s"]
    assert total.samples == 8  # streams, not the 16 requests
    assert total.estimate == pytest.approx(sum(r["window_tokens"] for r in rows) / 30.0)
    assert total.low < total.estimate < total.high
    tbt = out["tbt_ms"]
    assert tbt.samples == 16
    per_req = out["per_request_tok_s"]
    assert per_req.estimate == pytest.approx(1000 / tbt.estimate)
    assert per_req.low == pytest.approx(1000 / tbt.high)
    assert per_req.high == pytest.approx(1000 / tbt.low)
    assert "ttft_ms" in out


def test_within_window_single_request_has_no_interval():
    assert within_window(_requests(1, 900, 30.0), measured_s=30.0) == {}
    assert within_window([], measured_s=30.0) == {}


def _run(run_id, commit, status="success", recipe="sim/x", host="local"):
    return {
        "run_id": run_id,
        "recipe_id": recipe,
        "host": host,
        "engine_commit": commit,
        "status": status,
    }


def _cell(run_id, value, conc=16, status="valid"):
    return {
        "run_id": run_id,
        "phase": "decode",
        "context_tokens": 65536,
        "concurrency": conc,
        "status": status,
        "total_tok_s": value,
    }


def _robust(values):
    d = np.abs(np.diff(np.log(values)))
    return 1.482602218505602 * np.median(d) / math.sqrt(2)


def test_between_run_noise_is_a_robust_scale_of_consecutive_differences_any_commit():
    """Issue #40: every run at a new commit (main, nightly) still gives noise; one outlier
    (the 150) moves the median of the differences little."""
    values = [100.0, 102.0, 98.0, 150.0, 101.0, 99.0]
    runs = [_run(f"r{i}", f"c{i}") for i in range(len(values))]
    cells = [_cell(f"r{i}", v) for i, v in enumerate(values)]
    table = between_run_noise(runs, cells, columns=["total_tok_s"])
    assert len(table) == 1
    row = table.iloc[0]
    assert row["rel_sd"] == pytest.approx(_robust(values))
    assert row["rel_sd"] < 0.05  # the outlier's +-40% differences are two of five
    assert row["dof"] == 5 and row["runs"] == 6 and row["engines"] == 5
    # a run's repeats are measurements too, in the order they were made
    repeats = [dict(_cell("r5", 99.5), repeat=1)]
    table = between_run_noise(runs, cells, repeats, columns=["total_tok_s"])
    assert table.iloc[0]["dof"] == 6


def test_between_run_noise_ignores_failed_runs_invalid_cells_and_later_runs():
    runs = [_run("a1", "aaa"), _run("b1", "bbb"), _run("c1", "ccc")]
    runs.append(_run("a2", "aaa", status="failed"))
    cells = [_cell("a1", 100.0), _cell("b1", 120.0), _cell("c1", 80.0), _cell("a2", 50.0)]
    runs.append(_run("a3", "aaa"))
    cells.append(_cell("a3", 50.0, status="invalid"))
    row = between_run_noise(runs, cells).iloc[0]
    assert row["rel_sd"] == pytest.approx(_robust([100.0, 120.0, 80.0])) and row["dof"] == 2
    # partial runs' valid cells count; runs at or after the candidate never do
    runs = [dict(r, started_at=f"2026-11-0{i + 1}T00:00:00Z") for i, r in enumerate(runs)]
    runs[1]["status"] = "partial"
    before = {"run_id": "c1", "started_at": runs[2]["started_at"]}
    assert between_run_noise(runs, cells, before=before).iloc[0]["dof"] == 1


def test_noise_model_falls_back_to_pooled_then_none():
    values = [100.0, 104.0, 101.0, 103.0]
    runs = [_run(f"a{i}", "aaa") for i in range(len(values))]
    cells = [_cell(f"a{i}", v) for i, v in enumerate(values)]
    model = NoiseModel.from_history(runs, cells)
    sd, src = model.lookup("sim/x", "local", "decode", 65536, 16, "total_tok_s")
    assert src == "cell" and sd == pytest.approx(_robust(values))
    sd2, src2 = model.lookup("sim/x", "local", "decode", 8192, 1, "total_tok_s")
    assert src2 == "pooled" and sd2 == pytest.approx(sd)
    assert model.lookup("sim/x", "other-host", "decode", 65536, 16, "total_tok_s") == (None, "none")
    assert NoiseModel.empty().lookup("sim/x", "local", "decode", 1, 1, "tbt_ms") == (None, "none")
    # two runs: one difference, too few for a cell's own spread or a pooled one
    short = NoiseModel.from_history(runs[:2], cells[:2])
    assert short.lookup("sim/x", "local", "decode", 65536, 16, "total_tok_s") == (None, "none")


def test_noise_rows_join_within_intervals_and_between_spread():
    from speedmatrix.analysis.noise import NOISE_SCHEMA, noise_rows, noise_table

    run = _run("a1", "aaa")
    cells = [
        dict(
            _cell("a1", 300.0, conc=8),
            context_tokens=8192,
            context_label="8K",
            measured_s=30.0,
            tbt_ms=27.0,
        ),
        dict(_cell("a1", 0.0, conc=1, status="over_capacity"), total_tok_s=None),
    ]
    model = NoiseModel.from_history(
        [_run(f"h{i}", "h") for i in range(4)],
        [
            dict(_cell(f"h{i}", v), context_tokens=8192, concurrency=8)
            for i, v in enumerate((100.0, 102.0, 99.0, 101.0))
        ],
    )
    rows = noise_rows(run, cells, _requests(8, 900, 27.0), model, n_resamples=300)
    by_metric = {r["metric"]: r for r in rows}
    assert set(by_metric) == {"total_tok_s", "tbt_ms"}  # only valid cells, only known figures
    total = by_metric["total_tok_s"]
    assert total["ci_low"] < total["ci_high"] and total["ci_samples"] == 8
    assert total["between_source"] == "cell" and total["between_rel_sd"] > 0
    assert by_metric["tbt_ms"]["between_source"] == "none"
    table = noise_table(rows)
    assert table.schema.equals(NOISE_SCHEMA) and table.num_rows == 2
