"""The comparison against a real (temporary, local) warehouse: the regressions task, the
`comparisons` and `noise` tables, and the `compare` / `trend` commands."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import duckdb
import numpy as np
import pytest
from factories import decode_cell, prefill_cell, run_row

from speedmatrix.analysis.compare import comparison_for_run, judge_regressions
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.cli import main
from speedmatrix.report.charts import write_comparison_charts
from speedmatrix.store.extra import read_extra
from speedmatrix.store.warehouse import Warehouse

T0 = datetime(2026, 11, 1, tzinfo=UTC)
CELLS = [(8192, 1, 55.0), (8192, 4, 170.0), (65536, 2, 90.0)]


def _land(wh, run_id, commit, day, *, slow=None, seed=0, **run_values):
    rng = np.random.default_rng(seed)
    run = run_row(
        run_id,
        recipe_id="sim/wh-test",
        trigger="commit",
        engine_commit=commit,
        engine_repository="github.com/vllm-project/vllm",
        kv_cache_tokens=320000,
        started_at=T0 + timedelta(days=day),
        **run_values,
    )
    cells, requests = [], []
    cells.append(
        prefill_cell(8192, total_tok_s=6000.0 * (1 + rng.normal(0, 0.003)), ttft_ms=1365.0)
    )
    for ctx, conc, total in CELLS:
        total *= (slow or {}).get((ctx, conc), 1.0) * (1 + rng.normal(0, 0.003))
        tbt = 1000.0 * conc / total
        tokens = total * 30.0 / conc
        for i in range(conc):
            requests.append(
                {
                    "phase": "decode",
                    "context_tokens": ctx,
                    "concurrency": conc,
                    "request_index": i,
                    "stream": i,
                    "window_tokens": int(tokens),
                    "tbt_ms": tbt * (1 + rng.normal(0, 0.002)),
                    "ttft_ms": 200.0,
                }
            )
        cells.append(
            decode_cell(
                ctx,
                conc,
                total_tok_s=total,
                per_request_tok_s=1000.0 / tbt,
                tbt_ms=tbt,
                ttft_ms=200.0,
                measured_s=30.0,
            )
        )
    wh.land_run(run, cells, requests)
    return run


def three_runs(root):
    """r0 and r1 at commit a…, then r2 at commit b… with 64Kx2 10% slower: the warehouse the
    comparison, run-page and hand-off tests share (yields it open, closes it after)."""
    w = Warehouse(str(root))
    _land(w, "r0", "a" * 40, 0, seed=0)
    _land(w, "r1", "a" * 40, 1, seed=1)
    _land(w, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    yield w
    w.close()


@pytest.fixture
def wh(tmp_path):
    yield from three_runs(tmp_path / "wh")


def test_comparison_for_run_uses_the_previous_run_and_its_requests(wh):
    result = comparison_for_run(wh, "r2")
    assert result.baseline["run_id"] == "r1"
    bad = {
        (r["context_tokens"], r["concurrency"], r["metric"])
        for r in result.rows
        if r["verdict"] == "regression"
    }
    assert (65536, 2, "total_tok_s") in bad and {k[:2] for k in bad} == {(65536, 2)}
    total = next(r for r in result.rows if r["metric"] == "total_tok_s" and r["concurrency"] == 2)
    assert total["ci_low"] is not None and "within" in total["noise_source"]
    assert "between" in total["noise_source"]  # r0 and r1 are repeats of commit a
    assert comparison_for_run(wh, "r0").baseline is None
    assert comparison_for_run(wh, "r2", baseline_ref="r0").baseline["run_id"] == "r0"
    with pytest.raises(ValueError, match="no baseline"):
        comparison_for_run(wh, "r2", baseline_ref="zzz")
    with pytest.raises(KeyError):
        comparison_for_run(wh, "nope")


def test_regressions_task_lands_verdicts_and_fails_with_a_summary(wh):
    assert judge_regressions(wh, "r1")["counts"]["regression"] == 0
    with pytest.raises(RegressionError) as err:
        judge_regressions(wh, "r2", commits=["c" * 40], charts=write_comparison_charts)
    text = str(err.value)
    assert "64Kx2" in text and "baseline r1" in text and "cccccccccccc" in text
    landed = read_extra(wh, "comparisons", run_id="r2")
    assert set(landed["baseline_run_id"]) == {"r1"}
    assert "regression" in set(landed["verdict"])
    with pytest.raises(RegressionError):  # landing again replaces, no duplicate rows
        judge_regressions(wh, "r2")
    again = read_extra(wh, "comparisons", run_id="r2")
    assert len(again) == len(landed)
    assert len(read_extra(wh, "comparisons", recipe_id="sim/wh-test")) == len(again) + len(
        read_extra(wh, "comparisons", run_id="r1")
    )
    noise = read_extra(wh, "noise", run_id="r2")
    assert set(noise["metric"]) >= {"total_tok_s", "tbt_ms"}
    assert noise["ci_low"].notna().any() and noise["between_rel_sd"].notna().any()
    assert b"## Comparison" in wh.read_artifact("r2", "comparison.md")
    assert b"<svg" in wh.read_artifact("r2", "comparison.svg")
    assert b"<svg" in wh.read_artifact("r2", "trend-64Kx2.svg")
    # readable without this package: plain DuckDB over the Delta table's Arrow dataset
    from deltalake import DeltaTable

    con = duckdb.connect()
    con.register("t", DeltaTable(wh.table_uri("comparisons")).to_pyarrow_dataset())
    n = con.execute("SELECT count(*) FROM t").fetchall()[0][0]
    assert n == len(read_extra(wh, "comparisons"))
    assert judge_regressions(wh, "r0")["baseline_run_id"] is None


def test_compare_command(wh, capsys):
    root = wh.root
    assert main(["compare", "r1", "r2", "--warehouse", root, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["baseline_run_id"] == "r1" and doc["counts"]["regression"] >= 1
    assert main(["compare", "r2", "--warehouse", root]) == 0
    out = capsys.readouterr().out
    assert "run r2 vs baseline r1" in out and "64Kx2" in out and "▼ regression" in out
    assert "8Kx1" not in out  # noise rows hidden by default
    assert main(["compare", "r2", "--warehouse", root, "--all", "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "## Comparison" in out and "8Kx1" in out
    assert main(["compare", "nope", "--warehouse", root]) == 2
    assert "not in the warehouse" in capsys.readouterr().err
    assert main(["compare", "r0", "--warehouse", root]) == 2
    assert "no baseline for run r0" in capsys.readouterr().err


def test_trend_command(wh, capsys, tmp_path):
    with pytest.raises(RegressionError):
        judge_regressions(wh, "r2")
    chart = tmp_path / "t.svg"
    rc = main(
        [
            "trend",
            "--recipe",
            "sim/wh-test",
            "--cell",
            "64Kx2",
            "--warehouse",
            wh.root,
            "--chart",
            str(chart),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in out[2:]] == ["first", "noise", "regression"]
    assert "<svg" in chart.read_text()
    assert main(["trend", "--recipe", "sim/none", "--cell", "64Kx2", "--warehouse", wh.root]) == 2
    assert main(["trend", "--recipe", "sim/wh-test", "--cell", "64K", "--warehouse", wh.root]) == 2


def test_the_run_page_gets_its_baseline_verdicts_and_figures(wh):
    from speedmatrix.report.page import load_run_page
    from speedmatrix.report.render import render_html, render_markdown

    data = load_run_page(wh, "r2")
    baseline, section = data.baseline, data.markdown
    assert baseline[0]["run_id"] == "r1" and len(baseline[1]) == 4
    assert section.startswith("## Comparison") and "▼ regression" in section and "64Kx2" in section
    assert any(r["verdict"] == "regression" for r in data.rows)
    assert any(v["Cell"] == "64Kx2" and "regression" in v["Verdict"] for v in data.verdicts)
    # the diff heat map and the regressed cell's trend over commits, inline SVG
    ids = [f["id"] for f in data.figures]
    assert ids[0] == "diff-heatmap" and "trend-64Kx2" in ids
    assert all(f["svg"].startswith("<svg") for f in data.figures)
    run, cells, _ = wh.read_run("r2")
    assert "Change against baseline r1" in render_markdown(run, cells, baseline)
    page = render_html(run, cells, baseline, verdicts=data.verdicts, figures=data.figures)
    assert "r1" in page and "Verdicts beyond noise" in page
    assert 'id="diff-heatmap"' in page and 'id="trend-64Kx2"' in page
    assert "<?xml" not in page
    first = load_run_page(wh, "r0")  # no earlier run: no baseline, no verdicts
    assert first.baseline is None and first.rows is None and not first.verdicts
    with pytest.raises(KeyError):
        load_run_page(wh, "missing")


def test_regressions_task_lists_the_commits_between_when_asked(wh, monkeypatch):
    import speedmatrix.upstream.github_commits

    calls = []

    def fake(repo, a, b):
        calls.append((repo, a, b))
        return ["d" * 40, "b" * 40]

    monkeypatch.setattr(speedmatrix.upstream.github_commits, "commits_between", fake)
    with pytest.raises(RegressionError) as err:
        judge_regressions(wh, "r2", fetch_commits=True)
    assert calls == [("vllm-project/vllm", "a" * 40, "b" * 40)]
    assert "commits between (2): dddddddddddd, bbbbbbbbbbbb" in str(err.value)

    def broken(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(speedmatrix.upstream.github_commits, "commits_between", broken)
    with pytest.raises(RegressionError) as err:
        judge_regressions(wh, "r2", fetch_commits=True)
    assert "commits between" not in str(err.value) and "/compare/" in str(err.value)


def test_an_extra_table_replaces_a_runs_rows_in_one_commit(tmp_path):
    """land_extra is one Delta commit per landing: the run's older rows go and its new ones
    arrive together (another run's rows stay), with no lock of ours (issue #32)."""
    from deltalake import DeltaTable

    from speedmatrix.analysis.noise import noise_table
    from speedmatrix.store.extra import land_extra

    wh = Warehouse(str(tmp_path / "wh"))
    row = {"run_id": "r1", "recipe_id": "sim/wh-test", "phase": "decode", "context_tokens": 1}
    row.update(concurrency=1, metric="ttft_ms", value=1.0)
    for run_id in ("r1", "r2"):
        run = {"run_id": run_id, "recipe_id": "sim/wh-test", "run_date": "2026-11-01"}
        land_extra(wh, "noise", run, noise_table([{**row, "run_id": run_id}]))
    table = DeltaTable(wh.table_uri("noise"))
    before = table.version()
    run = {"run_id": "r1", "recipe_id": "sim/wh-test", "run_date": "2026-11-01"}
    land_extra(wh, "noise", run, noise_table([{**row, "value": 2.0}, {**row, "metric": "x"}]))
    table.update_incremental()
    assert table.version() == before + 1
    got = wh.query("SELECT run_id, metric, value, run_month FROM noise ORDER BY 1, 2")
    assert got.values.tolist() == [
        ["r1", "ttft_ms", 2.0, "2026-11"],
        ["r1", "x", 1.0, "2026-11"],
        ["r2", "ttft_ms", 1.0, "2026-11"],
    ]
    wh.close()


def test_compare_takes_run_id_as_report_does(wh, capsys):
    """Issue #34 item 8: `compare --run-id` is not refused (`report` takes `--run-id`)."""
    root = wh.root
    assert main(["compare", "--run-id", "r2", "--warehouse", root, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["baseline_run_id"] == "r1"
    assert main(["compare", "r0", "--run-id", "r2", "--warehouse", root, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["baseline_run_id"] == "r0"
    assert main(["compare", "--warehouse", root]) == 2
    assert "name the run" in capsys.readouterr().err
