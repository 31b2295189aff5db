"""Issue #40, the verdict core: noise from the past only, a robust spread one bad run cannot
poison, no verdict without evidence, a slower host at an unchanged commit, baselines that
match, headlines that count cells. Each test reproduces one failure the issue lists; they
run against a real (temporary, local) warehouse."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from speedmatrix.analysis.compare import comparison_for_run, judge_regressions
from speedmatrix.analysis.noise import NoiseModel
from speedmatrix.analysis.verdict import RegressionError, compare_runs, fail_on_regressions
from speedmatrix.cli import main
from speedmatrix.records import empty_cell, not_comparable_reason
from speedmatrix.store.extra import read_extra
from speedmatrix.store.warehouse import Warehouse

T0 = datetime(2026, 11, 1, tzinfo=UTC)
RECIPE = "sim/verdicts"
DECODE = [(8192, 1, 55.0), (8192, 4, 170.0), (65536, 2, 90.0)]


def _cells(rng, slow=None, *, sd=0.01, skip=(), prefill_samples=1, **extra):
    """A run's cells: a prefill and three decode cells, each figure moved by `sd` noise;
    `slow` maps a cell (ctx, conc) to a throughput factor (0.5: half the speed)."""
    cells, requests = [], []
    factor = (slow or {}).get((8192, 0), 1.0)
    cells.append(
        empty_cell(
            phase="prefill",
            context_tokens=8192,
            context_label="8K",
            concurrency=1,
            status="valid",
            total_tok_s=6000.0 * factor * (1 + rng.normal(0, sd)),
            ttft_ms=1365.0 / factor * (1 + rng.normal(0, sd)),
            samples=prefill_samples,
            ttft_samples=prefill_samples,
            **{k: v for k, v in extra.items() if k == "measurement_profile"},
        )
    )
    for ctx, conc, total in DECODE:
        if (ctx, conc) in skip:
            continue
        factor = (slow or {}).get((ctx, conc), 1.0)
        total *= factor * (1 + rng.normal(0, sd))
        tbt = 1000.0 * conc / total
        cell = dict(
            phase="decode",
            context_tokens=ctx,
            context_label=f"{ctx // 1024}K",
            concurrency=conc,
            status="valid",
            total_tok_s=total,
            per_request_tok_s=1000.0 / tbt,
            tbt_ms=tbt,
            ttft_ms=200.0 / factor * (1 + rng.normal(0, sd)),
            measured_s=30.0,
            output_tokens=int(total * 30),
            prompt_mode="distinct",
            max_output_tokens=1024,
            window_s=30.0,
        )
        cell.update(extra)
        cells.append(empty_cell(**cell))
    return cells, requests


def _land(wh, run_id, commit, day, *, slow=None, seed=0, status="success", **kw):
    rng = np.random.default_rng(seed)
    run = {
        "run_id": run_id,
        "recipe_id": RECIPE,
        "trigger": "nightly",
        "status": status,
        "host": "local",
        "engine_commit": commit,
        "engine_repository": "github.com/vllm-project/vllm",
        "kv_cache_tokens": 320000,
        "started_at": T0 + timedelta(days=day),
    }
    cells, requests = _cells(rng, slow, **kw)
    wh.land_run(run, cells, requests)
    return run


def quiet_noise(run, cells, sd=0.002, dof=9):
    """A noise model that knows every figure of `cells` on `run`'s recipe and host: a quiet
    host with a long history (a figure without any history is unverified)."""
    import pandas as pd

    rows = [
        {"recipe_id": run.get("recipe_id") or "", "host": run.get("host") or "",
         "phase": c["phase"], "context_tokens": c["context_tokens"],
         "concurrency": c["concurrency"], "metric": m, "rel_sd": sd, "dof": dof,
         "runs": dof + 1, "engines": dof + 1}
        for c in cells
        for m in ("total_tok_s", "per_request_tok_s", "ttft_ms", "tbt_ms", "spec_acceptance_length")
    ]  # fmt: skip
    return NoiseModel(pd.DataFrame(rows))


@pytest.fixture
def wh(tmp_path):
    w = Warehouse(str(tmp_path / "wh"))
    yield w
    w.close()


def _row(rows, ctx, conc, metric, phase="decode"):
    return next(
        r
        for r in rows
        if r["phase"] == phase
        and r["context_tokens"] == ctx
        and r["concurrency"] == conc
        and r["metric"] == metric
    )


# ------------------------------------------------------------------ 1. noise from the past


def test_a_slowdown_at_an_unchanged_commit_is_not_hidden_by_its_own_run(wh):
    """Today the history holds the candidate: its own 50% slowdown pools into its commit's
    spread (8K x 4: 165 -> 82.5 tok/s read "no change beyond noise")."""
    for i in range(6):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r6", "a" * 40, 6, seed=6, slow={(8192, 4): 0.5})
    rows = comparison_for_run(wh, "r6").rows
    total = _row(rows, 8192, 4, "total_tok_s")
    assert total["verdict"] == "regression", total
    assert total["noise_pct"] < 20.0, total


def test_a_landed_verdict_is_what_compare_shows_until_a_rejudgement_is_asked_for(wh, capsys):
    """Today a run that landed "1 regression" later read "0 regression" (the history grew)."""
    for i in range(4):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r4", "b" * 40, 4, seed=4, slow={(8192, 4): 0.7})
    with pytest.raises(RegressionError):
        judge_regressions(wh, "r4")
    landed = read_extra(wh, "comparisons", run_id="r4")
    assert "regression" in set(landed["verdict"])
    # later runs: slower still, at r4's commit; they may never enter r4's verdict
    for i in range(5, 9):
        _land(wh, f"r{i}", "b" * 40, i, seed=i, slow={(8192, 4): 0.3 + 0.2 * (i % 2)})
    again = comparison_for_run(wh, "r4")
    assert _row(again.rows, 8192, 4, "total_tok_s")["verdict"] == "regression"
    assert main(["compare", "r4", "--warehouse", wh.root]) == 0
    out = capsys.readouterr().out
    assert "stored verdict" in out and "▼ regression" in out and "8Kx4" in out
    assert main(["compare", "r4", "--warehouse", wh.root, "--rejudge"]) == 0
    assert "re-judged" in capsys.readouterr().out


# ------------------------------------------------------------------ 2. robust noise


def test_nightly_runs_each_at_a_new_commit_have_noise(wh):
    """Today groups of one commit give no between-run noise at all."""
    for i in range(6):
        _land(wh, f"r{i}", f"{i:040x}", i, seed=i)
    rows = comparison_for_run(wh, "r5").rows
    total = _row(rows, 8192, 4, "total_tok_s")
    assert "between" in total["noise_source"] and total["between_rel_sd"] > 0, total


def test_one_bad_run_does_not_widen_every_later_band(wh):
    """Today one slow outlier keeps a band at +-55-71% for good."""
    for i in range(8):
        slow = {(8192, 4): 0.5} if i == 3 else None
        _land(wh, f"r{i}", "a" * 40, i, seed=i, slow=slow)
    model = NoiseModel.from_history(
        *_history(wh), before={"run_id": "r8", "started_at": T0 + timedelta(days=8)}
    )
    sd, source = model.lookup(RECIPE, "local", "decode", 8192, 4, "total_tok_s")
    assert source == "cell" and sd < 0.03, sd  # the runs' own noise is 1%, the outlier 50%


def test_old_runs_age_out_of_the_noise_window(wh):
    for i in range(30):
        _land(wh, f"r{i}", "a" * 40, i, seed=i, sd=0.2 if i < 15 else 0.005)
    model = NoiseModel.from_history(
        *_history(wh), before={"run_id": "r30", "started_at": T0 + timedelta(days=30)}
    )
    sd, _ = model.lookup(RECIPE, "local", "decode", 8192, 4, "total_tok_s")
    assert sd < 0.02, sd


def _history(wh):
    runs = wh.query("SELECT * FROM runs")
    cells = wh.query("SELECT * FROM cells")
    return runs, cells


# ------------------------------------------------------------------ 3. no verdict without evidence


def test_a_figure_without_a_noise_estimate_is_unverified_and_never_gates(wh):
    """Today a single-request figure with no known noise is "regressed", noise "+-0.0%"."""
    _land(wh, "r0", "a" * 40, 0, seed=0)
    _land(wh, "r1", "a" * 40, 1, seed=1, slow={(8192, 0): 0.7, (8192, 1): 0.7})
    result = comparison_for_run(wh, "r1")
    ttft = _row(result.rows, 8192, 1, "ttft_ms")
    prefill = _row(result.rows, 8192, 1, "prefill_tok_s", phase="prefill")
    assert ttft["verdict"] == "unverified" and prefill["verdict"] == "unverified"
    assert prefill["change_pct"] < -20
    assert not [r for r in result.rows if r["verdict"] == "regression"]
    fail_on_regressions(result.rows, result.run, result.baseline)  # no raise
    assert judge_regressions(wh, "r1")["regressions"] == 0
    assert main(["compare", "r1", "--warehouse", wh.root]) == 0


def test_a_figure_measured_from_one_sample_is_unverified_even_with_history(wh):
    """Today a single-request figure on a loaded host (C=1 TTFT, a one-prompt prefill) is
    "regressed" (4 of 17 identical builds): one request cannot tell the host's noise apart."""
    for i in range(5):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r5", "a" * 40, 5, seed=5, slow={(8192, 0): 0.7})
    rows = comparison_for_run(wh, "r5").rows
    prefill = _row(rows, 8192, 1, "prefill_tok_s", phase="prefill")
    assert prefill["verdict"] == "unverified" and "one sample" in prefill["reason"], prefill
    assert prefill["change_pct"] < -20


def test_unknown_noise_reads_unknown_never_zero(wh, capsys):
    _land(wh, "r0", "a" * 40, 0, seed=0)
    _land(wh, "r1", "a" * 40, 1, seed=1, slow={(8192, 1): 0.7})
    assert main(["compare", "r1", "--warehouse", wh.root]) == 0
    out = capsys.readouterr().out
    assert "±0.0%" not in out and "unknown" in out


# ------------------------------------------------------------------ 4. same engine, slower host


def test_a_slowdown_at_the_same_commit_says_the_host_got_slower(wh):
    for i in range(5):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r5", "a" * 40, 5, seed=5, slow={(65536, 2): 0.8})
    result = comparison_for_run(wh, "r5")
    total = _row(result.rows, 65536, 2, "total_tok_s")
    assert total["verdict"] == "regression"
    assert "same engine commit: the host or its environment got slower" in total["reason"]
    with pytest.raises(RegressionError, match="same engine commit"):
        fail_on_regressions(result.rows, result.run, result.baseline)


# ------------------------------------------------------------------ 6. baselines that match


def test_prompt_mode_output_tokens_and_window_are_in_the_one_comparability_rule():
    a = empty_cell(phase="decode", prompt_mode="distinct", max_output_tokens=1024, window_s=30.0)
    assert not_comparable_reason(a, {**a, "prompt_mode": "shared"}) is not None
    assert not_comparable_reason(a, {**a, "max_output_tokens": 256}) is not None
    assert not_comparable_reason(a, {**a, "window_s": 10.0}) is not None
    assert not_comparable_reason(a, dict(a)) is None
    # a side that did not record one (a cell landed before, an ingested page) is not told apart
    assert not_comparable_reason(a, {**a, "prompt_mode": None, "window_s": float("nan")}) is None


def test_each_cell_is_judged_against_its_latest_comparable_cell(wh):
    """Today a baseline that measured a smaller matrix read "no change"."""
    for i in range(4):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r4", "a" * 40, 4, seed=4, skip={(65536, 2)})  # a smaller matrix
    _land(wh, "r5", "b" * 40, 5, seed=5, slow={(65536, 2): 0.6})
    rows = comparison_for_run(wh, "r5").rows
    total = _row(rows, 65536, 2, "total_tok_s")
    assert total["verdict"] == "regression" and total["baseline_run_id"] == "r3", total
    assert _row(rows, 8192, 4, "total_tok_s")["baseline_run_id"] == "r4"


def test_partial_runs_cells_are_baselines_and_noise(wh):
    for i in range(4):
        _land(wh, f"r{i}", "a" * 40, i, seed=i, status="partial")
    _land(wh, "r4", "b" * 40, 4, seed=4, slow={(8192, 4): 0.6})
    result = comparison_for_run(wh, "r4")
    assert result.baseline is not None and result.baseline["run_id"] == "r3"
    assert _row(result.rows, 8192, 4, "total_tok_s")["verdict"] == "regression"


def test_no_comparable_baseline_reads_not_compared_and_exits_0(wh):
    """Today a --profile published run after a default one: every cell not_comparable, yet
    "verdict: no change beyond noise"."""
    from speedmatrix.cli.verdict import run_verdict, verdict_text

    for i in range(3):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r3", "a" * 40, 3, seed=3, prompt_mode="shared", slow={(8192, 4): 0.5})
    status = _row(comparison_for_run(wh, "r3").rows, 8192, 4, "status")
    assert status["verdict"] == "not_comparable", status
    assert status["reason"].startswith("not compared: prompt_mode")
    # a --profile published run after default ones: no cell compared at all
    _land(wh, "r4", "a" * 40, 4, seed=4, measurement_profile="published", slow={(8192, 4): 0.5})
    rows = comparison_for_run(wh, "r4").rows
    assert {r["verdict"] for r in rows if r["phase"] != "run"} == {"not_comparable"}
    assert judge_regressions(wh, "r4")["regressions"] == 0
    text = verdict_text(run_verdict(wh, "r4"))
    assert "no change beyond noise" not in text.splitlines()[0]
    assert "not compared" in text.splitlines()[0]


# ------------------------------------------------------------------ 7. headlines that count cells


def _judged(wh, slow):
    for i in range(5):
        _land(wh, f"r{i}", "a" * 40, i, seed=i)
    _land(wh, "r5", "b" * 40, 5, seed=5, slow=slow)
    return comparison_for_run(wh, "r5")


def test_one_cell_with_several_figures_moved_is_one_regression(wh):
    """Today one decode slowdown of one cell = three "regressions" (total tok/s, per-request
    tok/s and TBT: per-request is 1000/TBT)."""
    from speedmatrix.report.summary import build_summary

    result = _judged(wh, {(65536, 2): 0.8})
    _, cells, _ = wh.read_run("r5")
    summary = build_summary(result.run, cells, result.baseline, result.rows)
    assert "1 cell" in summary.headline and "3 regression" not in summary.headline
    assert "64Kx2" in summary.headline and "throughput" in summary.headline.lower()


def test_a_ttft_only_change_says_so_and_throughput_unchanged(wh):
    from speedmatrix.analysis.display import headline

    rows = []
    for ctx, conc in ((8192, 1), (8192, 4)):
        for metric, change in (("ttft_ms", 34.7 if conc == 1 else 5.7), ("total_tok_s", 0.1)):
            rows.append(
                {
                    "phase": "decode",
                    "context_tokens": ctx,
                    "context_label": "8K",
                    "concurrency": conc,
                    "metric": metric,
                    "change_pct": change,
                    "verdict": "regression" if metric == "ttft_ms" else "noise",
                }
            )
    text = headline(rows)
    assert text == "TTFT up in 2 cells (8Kx1 +34.7%, 8Kx4 +5.7%); throughput unchanged", text


def test_no_mark_on_an_unchanged_figure(wh):
    from speedmatrix.report.cellchange import from_comparison

    result = _judged(wh, {(65536, 2): 0.8})
    changes = from_comparison(result.rows)
    marked = {k for k, c in changes.items() if c.mark}
    assert marked == {("decode", "64K", 2)}, marked
    # a TTFT-only change: the throughput figure shown unchanged carries no down mark
    rows = [
        {"phase": "decode", "context_label": "8K", "context_tokens": 8192, "concurrency": 1,
         "metric": "total_tok_s", "change_pct": 0.0, "verdict": "noise"},
        {"phase": "decode", "context_label": "8K", "context_tokens": 8192, "concurrency": 1,
         "metric": "ttft_ms", "change_pct": 30.0, "verdict": "regression"},
    ]  # fmt: skip
    change = from_comparison(rows)[("decode", "8K", 1)]
    assert "▼ +0.0%" not in change.label and "TTFT" in change.label


def test_compare_runs_shows_the_interval_it_relies_on():
    from speedmatrix.analysis.display import display_rows

    rows = [
        {"phase": "decode", "context_label": "8K", "context_tokens": 8192, "concurrency": 1,
         "metric": "ttft_ms", "change_pct": 12.3, "noise_pct": 7.1, "threshold_pct": 3.0,
         "verdict": "regression", "value": 1.0, "baseline_value": 1.0},
    ]  # fmt: skip
    shown = display_rows(rows)[0]
    assert shown["Interval"] == "[+5.2%, +19.4%]", shown


def test_compare_runs_without_history_is_unverified_in_the_pure_rule():
    run = {"run_id": "b", "engine_commit": "b"}
    base = {"run_id": "a", "engine_commit": "a"}
    rng = np.random.default_rng(0)
    new, _ = _cells(rng, {(8192, 4): 0.5})
    old, _ = _cells(rng)
    rows = compare_runs(run, new, base, old)
    assert {r["verdict"] for r in rows if r["phase"] != "run"} <= {"unverified", "noise"}


def test_the_runs_own_repeats_are_noise_but_the_step_to_it_is_not(wh):
    """A first run with repeats has noise of its own (its repeats measure the host at its
    time); the step from the history to the run is never one of the differences."""
    from speedmatrix.store.extra import land_extra
    from speedmatrix.store.schemas import CELL_REPEATS_SCHEMA

    _land(wh, "r0", "a" * 40, 0, seed=0)
    run = _land(wh, "r1", "a" * 40, 1, seed=1, slow={(8192, 4): 0.5})
    _, cells, _ = wh.read_run("r1")
    primary = next(c for c in cells if c["concurrency"] == 4)
    reps = [
        {**primary, "repeat": k, "total_tok_s": primary["total_tok_s"] * f}
        for k, f in ((1, 1.01), (2, 0.99), (3, 1.005))
    ]
    import pyarrow as pa

    table = pa.Table.from_pylist(
        [{n: r.get(n) for n in CELL_REPEATS_SCHEMA.names} for r in reps],
        schema=CELL_REPEATS_SCHEMA,
    )
    land_extra(wh, "cell_repeats", run, table)
    total = _row(comparison_for_run(wh, "r1").rows, 8192, 4, "total_tok_s")
    assert "between-cell" in total["noise_source"], total
    assert total["between_rel_sd"] < 0.03 and total["verdict"] == "regression", total


def test_a_prefill_whose_samples_disagree_is_judged_with_that_spread(wh):
    """On a loaded host one run's three cold prompts disagree by 20% and its median is 6%
    slower: a false alarm today (6 of 60 identical-build verdicts in verdict_bench)."""
    for i in range(5):
        _land(wh, f"r{i}", "a" * 40, i, seed=i, sd=0.002, prefill_samples=3)
    rng = np.random.default_rng(5)
    cells, requests = _cells(rng, {(8192, 0): 0.94}, sd=0.002, prefill_samples=3)
    cells[0]["ttft_spread_pct"] = 20.0
    run = {"run_id": "r5", "recipe_id": RECIPE, "trigger": "nightly", "status": "success",
           "host": "local", "engine_commit": "a" * 40, "started_at": T0 + timedelta(days=5)}  # fmt: skip
    wh.land_run(run, cells, requests)
    prefill = _row(comparison_for_run(wh, "r5").rows, 8192, 1, "prefill_tok_s", phase="prefill")
    assert prefill["verdict"] == "noise" and "spread" in prefill["noise_source"], prefill
    assert prefill["noise_pct"] >= 10.0


def test_a_burst_is_judged_against_the_earlier_burst_never_a_decode_cell():
    """Issue #43 item 12: a burst cell has its own figures and is compared with the same burst
    of the baseline (its latency and per-user e2e tok/s, lower and higher better), never with
    the decode cell of the same context and N: their phases differ, and so do their keys."""
    import copy
    import sys
    from pathlib import Path

    import pandas as pd

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_warehouse import make_cells, make_run

    def burst(latency_ms, total):
        return empty_cell(
            phase="burst", context_tokens=8192, context_label="8K", concurrency=4,
            status="valid", total_tok_s=total, per_request_tok_s=41.3, ttft_ms=215.0,
            tbt_ms=24.2, latency_ms=latency_ms, e2e_per_request_tok_s=128_000 / latency_ms,
            completed_requests=4, output_tokens=512, measured_s=512 / total,
            max_output_tokens=128, prompt_mode="distinct", workload="article",
        )  # fmt: skip

    base_run, run = make_run(run_id="b", day=13), make_run(run_id="n", day=14)
    decode = [c for c in make_cells() if c["phase"] == "decode" and c["concurrency"] == 4]
    base = [*copy.deepcopy(decode), burst(3290.0, 155.6)]
    new = [*copy.deepcopy(decode), burst(4277.0, 119.7)]  # the burst 30% slower

    figures = ("total_tok_s", "per_request_tok_s", "ttft_ms", "tbt_ms", "latency_ms")
    quiet = {"rel_sd": 0.002, "dof": 9, "runs": 10, "engines": 10}
    where = {"recipe_id": run.get("recipe_id") or "", "host": run.get("host") or ""}
    where |= {"context_tokens": 8192, "concurrency": 4}
    noise = NoiseModel(
        pd.DataFrame(
            [
                {**where, "phase": c["phase"], "metric": m, **quiet}
                for c in new
                for m in (*figures, "e2e_per_request_tok_s")
            ]
        )
    )
    rows = compare_runs(run, new, base_run, base, noise=noise, threshold=0.03)
    burst_rows = {r["metric"]: r for r in rows if r["phase"] == "burst"}
    assert burst_rows["latency_ms"]["verdict"] == "regression"
    assert burst_rows["latency_ms"]["baseline_value"] == 3290.0
    assert burst_rows["e2e_per_request_tok_s"]["verdict"] == "regression"
    assert burst_rows["total_tok_s"]["verdict"] == "regression"
    # the decode 8K x 4 is unchanged and judged against the decode 8K x 4 only
    decode_rows = [r for r in rows if r["phase"] == "decode"]
    assert decode_rows and {r["verdict"] for r in decode_rows} == {"noise"}
    assert not any(r["metric"] == "latency_ms" for r in decode_rows)
    # the one comparability rule refuses a burst against a decode cell outright
    assert not_comparable_reason(new[-1], decode[0]) == "phase decode -> burst"
