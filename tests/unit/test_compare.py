"""Cell-by-cell comparison: noise-aware, direction-aware verdicts; baselines; the summary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from factories import decode_cell, prefill_cell, run_row

from speedmatrix.analysis.baseline import select_baseline
from speedmatrix.analysis.noise import NoiseModel
from speedmatrix.analysis.verdict import (
    RegressionError,
    compare_runs,
    compare_url,
    comparisons_table,
    fail_on_regressions,
    summarize,
    verdict_for,
)
from speedmatrix.store.schemas import COMPARISONS_SCHEMA


def _run(run_id="new", commit="bbbbbbb", kv=1_000_000, started="2026-11-02T00:00:00Z", **kw):
    values = {
        "recipe_id": "sim/x",
        "engine_commit": commit,
        "engine_repository": "github.com/vllm-project/vllm",
        "kv_cache_tokens": kv,
        "started_at": datetime.fromisoformat(started.replace("Z", "+00:00")),
    }
    return run_row(run_id, **{**values, **kw})


def _decode(ctx, conc, total, status="valid", tbt=None, ttft=200.0, **kw):
    tbt = tbt if tbt is not None else (1000.0 * conc / total if total else 1.0)
    return decode_cell(
        ctx,
        conc,
        status=status,
        total_tok_s=total if status == "valid" else None,
        per_request_tok_s=1000.0 / tbt if status == "valid" else None,
        tbt_ms=tbt if status == "valid" else None,
        ttft_ms=ttft if status == "valid" else None,
        measured_s=30.0,
        **kw,
    )


def _prefill(ctx, tok_s):
    return prefill_cell(ctx, total_tok_s=tok_s, ttft_ms=1000.0 * ctx / tok_s)


def _matrix(scale=None):
    scale = scale or {}
    cells = [_prefill(8192, 6000.0), _prefill(65536, 5000.0)]
    for ctx, conc, total in [
        (8192, 1, 55.0),
        (8192, 16, 364.0),
        (65536, 1, 49.0),
        (65536, 2, 81.0),
    ]:
        f = scale.get((ctx, conc), 1.0)
        cells.append(_decode(ctx, conc, total * f))
    return cells


def _quiet(sd=0.002, dof=9):
    """A noise model that knows every cell of _matrix: a quiet host with a long history
    (a figure without any history is unverified, issue #40)."""
    import pandas as pd

    rows = [
        {"recipe_id": "sim/x", "host": "local", "phase": c["phase"],
         "context_tokens": c["context_tokens"], "concurrency": c["concurrency"], "metric": m,
         "rel_sd": sd, "dof": dof, "runs": dof + 1, "engines": dof + 1}
        for c in _matrix()
        for m in ("total_tok_s", "per_request_tok_s", "ttft_ms", "tbt_ms", "spec_acceptance_length")
    ]  # fmt: skip
    return NoiseModel(pd.DataFrame(rows))


QUIET = _quiet()


def _request_8k_x16(i, **figures):
    """One request row of the 8K x 16 decode cell (the within-window interval tests)."""
    key = {"phase": "decode", "context_tokens": 8192, "concurrency": 16}
    return {**key, "request_index": i, "stream": i, **figures}


def _by(rows, metric=None, conc=None, ctx=None, phase=None):
    return [
        r
        for r in rows
        if (metric is None or r["metric"] == metric)
        and (conc is None or r["concurrency"] == conc)
        and (ctx is None or r["context_tokens"] == ctx)
        and (phase is None or r["phase"] == phase)
    ]


def test_verdict_is_direction_aware_and_needs_both_threshold_and_noise():
    assert verdict_for(90, 100, True, 0.03, 0.0)[0] == "regression"
    assert verdict_for(110, 100, True, 0.03, 0.0)[0] == "improvement"
    assert verdict_for(90, 100, False, 0.03, 0.0)[0] == "improvement"  # lower TTFT is better
    assert verdict_for(110, 100, False, 0.03, 0.0)[0] == "regression"
    assert verdict_for(98, 100, True, 0.03, 0.0)[0] == "noise"  # inside the threshold
    assert verdict_for(95, 100, True, 0.03, 0.08)[0] == "noise"  # inside the noise
    assert verdict_for(90, 100, True, 0.03, 0.08)[0] == "regression"
    _v, change = verdict_for(90, 100, True, 0.03, 0.0)
    assert change == pytest.approx(-0.10)


def test_planted_slower_cell_is_the_only_regression():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    rows = compare_runs(new, _matrix({(65536, 2): 0.90}), base, _matrix(), noise=QUIET)
    bad = [r for r in rows if r["verdict"] == "regression"]
    assert {(r["context_tokens"], r["concurrency"]) for r in bad} == {(65536, 2)}
    assert {r["metric"] for r in bad} == {"total_tok_s", "per_request_tok_s", "tbt_ms"}
    total = _by(bad, "total_tok_s")[0]
    assert total["change_pct"] == pytest.approx(-10.0)
    assert total["baseline_value"] == 81.0 and total["threshold_pct"] == 3.0
    others = [r for r in rows if r["verdict"] != "regression"]
    assert others and all(r["verdict"] == "noise" for r in others)
    assert {r["metric"] for r in _by(rows, phase="prefill")} == {"prefill_tok_s"}


def test_improvement_and_threshold_are_configurable():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    rows = compare_runs(new, _matrix({(8192, 16): 1.05}), base, _matrix(), noise=QUIET)
    assert _by(rows, "total_tok_s", 16)[0]["verdict"] == "improvement"
    rows = compare_runs(
        new, _matrix({(8192, 16): 1.05}), base, _matrix(), threshold=0.10, noise=QUIET
    )
    assert _by(rows, "total_tok_s", 16)[0]["verdict"] == "noise"
    per_metric = {"default": 0.10, "total_tok_s": 0.02}
    rows = compare_runs(
        new, _matrix({(8192, 16): 1.05}), base, _matrix(), threshold=per_metric, noise=QUIET
    )
    assert _by(rows, "total_tok_s", 16)[0]["verdict"] == "improvement"
    assert _by(rows, "tbt_ms", 16)[0]["verdict"] == "noise"


def test_between_run_noise_turns_a_change_into_noise():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    factors = [1.0, 1.05, 0.95, 1.04, 0.96, 1.05]
    hist_runs = [
        _run(f"h{i}", f"c{i}", started=f"2026-10-0{i + 1}T00:00:00Z") for i in range(len(factors))
    ]
    hist_cells = []
    for i, f in enumerate(factors):
        for c in _matrix({(65536, 2): f}):
            hist_cells.append(dict(c, run_id=f"h{i}"))
    noise = NoiseModel.from_history(hist_runs, hist_cells)
    rows = compare_runs(new, _matrix({(65536, 2): 0.94}), base, _matrix(), noise=noise)
    r = _by(rows, "total_tok_s", 2, 65536)[0]
    assert r["verdict"] == "noise"
    assert r["noise_pct"] > 6.0 and 0.03 < r["between_rel_sd"] < 0.15
    assert r["noise_source"] == "between-cell"
    # the same 6% drop without any history is unverified (never a regression)
    rows = compare_runs(new, _matrix({(65536, 2): 0.94}), base, _matrix())
    assert _by(rows, "total_tok_s", 2, 65536)[0]["verdict"] == "unverified"
    # and on a quiet host's history, a regression
    rows = compare_runs(new, _matrix({(65536, 2): 0.94}), base, _matrix(), noise=QUIET)
    assert _by(rows, "total_tok_s", 2, 65536)[0]["verdict"] == "regression"


def test_within_window_intervals_from_requests_are_used():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    import numpy as np

    def reqs(scale, seed):
        rng = np.random.default_rng(seed)
        return [
            _request_8k_x16(
                i,
                window_tokens=int(rng.normal(680 * scale, 120)),
                tbt_ms=float(rng.normal(44, 8)),
                ttft_ms=float(rng.normal(400, 80)),
            )
            for i in range(16)
        ]

    rows = compare_runs(
        new,
        _matrix({(8192, 16): 0.96}),
        base,
        _matrix(),
        requests=reqs(0.96, 1),
        baseline_requests=reqs(1.0, 2),
    )
    r = _by(rows, "total_tok_s", 16, 8192)[0]
    assert r["noise_source"] == "within"
    assert r["ci_low"] < r["ci_high"] and r["baseline_ci_low"] < r["baseline_ci_high"]
    assert r["noise_pct"] > 4.0  # 16 streams with a 120-token spread: wider than the 4% change
    assert r["verdict"] == "noise"


def test_capacity_change_turns_cells_over_capacity_and_back():
    base, new = (
        _run("base", "aaaaaaa", kv=1_000_000, started="2026-11-01T00:00:00Z"),
        _run(kv=600_000),
    )
    shrunk = _matrix()
    shrunk[-1] = _decode(65536, 2, 0, status="over_capacity")
    rows = compare_runs(new, shrunk, base, _matrix())
    kv = _by(rows, "kv_cache_tokens")[0]
    assert (
        kv["verdict"] == "regression"
        and kv["phase"] == "run"
        and kv["change_pct"] == pytest.approx(-40.0)
    )
    st = _by(rows, "status", 2, 65536)[0]
    assert st["verdict"] == "regression"
    assert "now over capacity" in st["reason"] and "1,000,000 -> 600,000" in st["reason"]
    back = compare_runs(base, _matrix(), new, shrunk)
    assert _by(back, "status", 2, 65536)[0]["verdict"] == "improvement"
    assert _by(back, "kv_cache_tokens")[0]["verdict"] == "improvement"


def test_failed_missing_and_version_changed_cells_are_not_comparable():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    cells = _matrix()
    cells[2] = _decode(8192, 1, 0, status="failed", error="HTTP 500")
    cells[3] = dict(cells[3], metric_version=99)
    cells.pop()  # 64Kx2 missing from this run
    cells.append(_decode(131072, 1, 40.0))  # new cell
    rows = compare_runs(new, cells, base, _matrix())
    reasons = {(r["context_tokens"], r["concurrency"]): r for r in _by(rows, "status")}
    assert (
        reasons[(8192, 1)]["verdict"] == "not_comparable"
        and "HTTP 500" in reasons[(8192, 1)]["reason"]
    )
    assert "metric_version" in reasons[(8192, 16)]["reason"]
    assert reasons[(65536, 2)]["reason"] == "cell not in this run"
    assert reasons[(131072, 1)]["reason"] == "cell not in the baseline"
    assert not [r for r in rows if r["verdict"] == "regression"]


def test_spec_acceptance_drop_is_a_regression():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    old = [dict(c, spec_acceptance_length=3.2) if c["phase"] == "decode" else c for c in _matrix()]
    cur = [dict(c, spec_acceptance_length=2.6) if c["phase"] == "decode" else c for c in _matrix()]
    rows = compare_runs(new, cur, base, old, noise=QUIET)
    assert {r["verdict"] for r in _by(rows, "spec_acceptance_length")} == {"regression"}


def test_comparisons_table_has_the_schema():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    rows = compare_runs(
        new,
        _matrix({(65536, 2): 0.9}),
        base,
        _matrix(),
        compared_at=datetime(2026, 11, 2, tzinfo=UTC),
    )
    table = comparisons_table(rows)
    assert table.schema.equals(COMPARISONS_SCHEMA)
    assert table.num_rows == len(rows)
    assert set(table.column("verdict").to_pylist()) <= {
        "regression",
        "improvement",
        "noise",
        "unverified",
        "not_comparable",
    }
    assert comparisons_table([]).num_rows == 0
    assert isinstance(table, pa.Table)


def test_select_baseline_picks_previous_success_of_same_recipe_and_host():
    runs = [
        _run("r1", "c1", started="2026-11-01T00:00:00Z"),
        _run("r2", "c2", started="2026-11-02T00:00:00Z"),
        _run("r3", "c3", started="2026-11-03T00:00:00Z", status="failed"),
        _run("r4", "c4", started="2026-11-03T12:00:00Z", host="gpu-2"),
        _run("r5", "c5", started="2026-11-03T18:00:00Z", recipe_id="sim/y"),
        _run("r6", "c6", started="2026-11-04T00:00:00Z"),
        _run("r7", "c7", started="2026-11-05T00:00:00Z"),
    ]
    current = runs[5]
    assert select_baseline(runs, current)["run_id"] == "r2"
    assert select_baseline(runs, runs[0]) is None
    assert select_baseline(runs, current, ref="r4")["run_id"] == "r4"  # a named run, any host
    assert select_baseline(runs, current, ref="c1")["run_id"] == "r1"  # a commit prefix
    assert select_baseline(runs, current, ref="nope") is None
    assert select_baseline([], current) is None
    # a scheduled run skips manual (e.g. bisection) runs when choosing its baseline
    sched = [dict(r, trigger="commit") for r in runs]
    sched[4] = dict(
        sched[1],
        run_id="bisect",
        trigger="manual",
        started_at=sched[5]["started_at"] - timedelta(hours=1),
    )
    assert select_baseline(sched, sched[6])["run_id"] == "r6"
    assert select_baseline(sched, dict(sched[5], run_id="x"))["run_id"] == "r2"
    assert (
        select_baseline(sched, dict(sched[5], run_id="x", trigger="manual"))["run_id"] == "bisect"
    )


def test_summary_names_cells_baseline_and_commits():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    rows = compare_runs(new, _matrix({(65536, 2): 0.9}), base, _matrix(), noise=QUIET)
    text = summarize(rows, new, base, commits=["a1" * 20, "b2" * 20])
    assert text.startswith("3 regressions in run new")
    assert "against baseline base" in text
    assert "64Kx2: total_tok_s 81.0 -> 72.9 (-10.0%" in text
    assert "aaaaaaa… -> this run bbbbbbb…" in text  # 7 hex known: marked abbreviated
    assert "commits between (2): a1a1a1a1a1a1, b2b2b2b2b2b2" in text
    assert "https://github.com/vllm-project/vllm/compare/aaaaaaa...bbbbbbb" in text
    with pytest.raises(RegressionError, match="64Kx2"):
        fail_on_regressions(rows, new, base)
    fail_on_regressions(compare_runs(new, _matrix(), base, _matrix()), new, base)


def test_compare_url_needs_both_commits_and_a_github_repository():
    assert compare_url({"engine_commit": None}, {"engine_commit": "b"}) is None
    assert (
        compare_url(
            {"engine_commit": "a"}, {"engine_commit": "b", "engine_repository": "gitlab.com/x/y"}
        )
        is None
    )


def test_counting_resolution_is_a_floor_on_total_tok_s_noise():
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    old = [dict(c, output_tokens=440) if c["phase"] == "decode" else c for c in _matrix()]
    cur = [dict(c, output_tokens=436) if c["phase"] == "decode" else c for c in _matrix()]
    rows = compare_runs(new, cur, base, old, threshold=0.0)
    r = _by(rows, "total_tok_s", 16, 8192)[0]
    # C=16 streams over ~440 tokens: +-3.6% per side, so an equal total is noise at any threshold
    assert r["noise_source"] == "resolution"
    assert r["noise_pct"] == pytest.approx(100 * ((16 / 436) ** 2 + (16 / 440) ** 2) ** 0.5)
    assert _by(rows, "tbt_ms", 16, 8192)[0]["noise_source"] == "none"


def test_a_value_inside_the_other_sides_interval_is_noise():
    """Seen over HTTP against the simulator: a 2Kx4 cell's median TTFT over 8 restarted
    requests, some served in one step (~1.4 ms) and some after a 40 ms wait. Baseline 23.3 ms
    [1.41, 23.30], new 42.9 ms [1.35, 42.91]: +84% against a symmetric combined half-width of
    67% would be a regression, but the baseline's value lies inside the new interval."""
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()

    def reqs(ttfts):
        return [
            _request_8k_x16(i, window_tokens=680, tbt_ms=44.0, ttft_ms=t)
            for i, t in enumerate(ttfts)
        ]

    fast = [1.35, 1.4, 1.45]
    old_cells, new_cells = _matrix(), _matrix()
    for cells, ttft in ((old_cells, 23.3), (new_cells, 42.9)):
        next(c for c in cells if c["concurrency"] == 16)["ttft_ms"] = ttft
    rows = compare_runs(
        new,
        new_cells,
        base,
        old_cells,
        requests=reqs(fast + [42.9] * 5),
        baseline_requests=reqs(fast + [23.3] * 5),
        noise=QUIET,
    )
    r = _by(rows, "ttft_ms", 16, 8192)[0]
    assert r["change_pct"] > r["noise_pct"] > r["threshold_pct"]  # the half-width alone says so
    assert r["ci_low"] <= r["baseline_value"] <= r["ci_high"]
    assert r["verdict"] == "noise"
    assert "inside the other's confidence interval" in r["reason"]

    # Disjoint intervals still make a regression.
    rows = compare_runs(
        new,
        new_cells,
        base,
        old_cells,
        requests=reqs([42.9] * 8),
        baseline_requests=reqs([23.3] * 8),
        noise=QUIET,
    )
    assert _by(rows, "ttft_ms", 16, 8192)[0]["verdict"] == "regression"


def test_cells_of_another_workload_are_not_comparable():
    """A continuation cell against an article baseline: a speculative decoder's figures differ
    for the prompt's sake, not the engine's (docs/measurement.md rule 11)."""
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    old = [dict(c, workload="article") for c in _matrix()]
    cells = [dict(c, workload="article") for c in _matrix()]
    cells[3] = dict(cells[3], workload="continuation")
    rows = compare_runs(new, cells, base, old)
    status = {(r["context_tokens"], r["concurrency"]): r for r in _by(rows, "status")}
    key = (cells[3]["context_tokens"], cells[3]["concurrency"])
    assert status[key]["verdict"] == "not_comparable"
    assert status[key]["reason"] == "not compared: workload article -> continuation"
    assert not [r for r in rows if r.get("context_tokens") == key[0]
                and r.get("concurrency") == key[1] and r["verdict"] == "regression"]  # fmt: skip


def test_cells_of_another_measurement_profile_are_not_comparable():
    """Issue #35: a cell measured by the published tool's definitions against one measured by
    ours is never a regression or an improvement; a cell landed before the profile was
    recorded (null) is ours (default) and stays comparable with a default one."""
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    old = [dict(c, measurement_profile=None) for c in _matrix()]
    cells = [dict(c, measurement_profile="default") for c in _matrix(scale={(65536, 2): 0.5})]
    cells[3] = dict(cells[3], measurement_profile="published")
    rows = compare_runs(new, cells, base, old, noise=QUIET)
    status = {(r["context_tokens"], r["concurrency"]): r for r in _by(rows, "status")}
    key = (cells[3]["context_tokens"], cells[3]["concurrency"])
    assert status[key]["verdict"] == "not_comparable"
    assert status[key]["reason"] == "not compared: measurement_profile default -> published"
    others = [r for r in _by(rows, "total_tok_s") if r["verdict"] == "regression"]
    assert [(r["context_tokens"], r["concurrency"]) for r in others] == [(65536, 2)]


def _adaptive(cells, measured_s=11.0, cap=30.0):
    """The same matrix measured with adaptive windows: each decode window stopped at
    `measured_s` (converged) of a `cap` second cap."""
    out = []
    for c in cells:
        if c["phase"] == "decode":
            c = {**c, "window_s": cap, "measured_s": measured_s, "window_mode": "adaptive",
                 "window_stop": "converged", "adaptive_target_pct": 1.0}  # fmt: skip
        out.append(c)
    return out


def test_an_adaptive_window_is_judged_against_a_fixed_one_of_its_cap():
    """Issue #45 item 3: an adaptive cell's rates mean what a fixed window's do, so a run with
    adaptive windows is judged against a fixed-window baseline of its cap (a 10% slowdown is a
    regression, an unchanged cell noise), while a cap that differs is another window length."""
    from speedmatrix.analysis.verdict import METRICS
    from speedmatrix.records import WINDOW_LENGTH_FIGURES, not_comparable_reason

    fixed = [{**c, "window_s": 30.0} if c["phase"] == "decode" else c for c in _matrix()]
    base, new = _run("base", "aaaaaaa", started="2026-11-01T00:00:00Z"), _run()
    adaptive = _adaptive(_matrix({(65536, 2): 0.90}))
    rows = compare_runs(new, adaptive, base, fixed, noise=QUIET)
    bad = [r for r in rows if r["verdict"] == "regression"]
    assert {(r["context_tokens"], r["concurrency"]) for r in bad} == {(65536, 2)}
    decode = [
        r
        for r in rows
        if r["phase"] == "decode" and (r["context_tokens"], r["concurrency"]) != (65536, 2)
    ]
    assert decode and all(r["verdict"] == "noise" for r in decode)
    # another cap is another window: not compared, and the reason says so
    assert (
        not_comparable_reason(_adaptive(_matrix(), cap=10.0)[2], fixed[2])
        == "window_s 30.0 -> 10.0"
    )
    # no judged figure is one whose definition grows with the window
    assert not {m.column for m in METRICS} & set(WINDOW_LENGTH_FIGURES)
