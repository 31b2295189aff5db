"""A cell over commits: parsing the cell, values in run order, verdicts, the chart."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from factories import decode_cell, prefill_cell, run_row

from speedmatrix.analysis.trend import trend, trends
from speedmatrix.records import empty_cell
from speedmatrix.report.charts import trend_chart_svg

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _history(values, recipe="sim/x", host="local", statuses=None):
    runs, cells = [], []
    for i, v in enumerate(values):
        rid = f"r{i}"
        runs.append(
            run_row(
                rid,
                recipe_id=recipe,
                host=host,
                engine_commit=f"c{i:07d}",
                engine_version="0.1",
                started_at=T0 + timedelta(days=i),
            )
        )
        status = (statuses or {}).get(i, "valid")
        cells.append(
            decode_cell(
                65536,
                16,
                status=status,
                total_tok_s=v if status == "valid" else None,
                tbt_ms=16000.0 / v if status == "valid" else None,
            )
            | {"run_id": rid}
        )
        cells.append(prefill_cell(65536, total_tok_s=5000.0 + i) | {"run_id": rid})
    return runs, cells


def test_trend_orders_runs_and_marks_the_step():
    runs, cells = _history([400, 402, 399, 360, 361, 362])
    runs.append(dict(runs[0], run_id="f", status="failed", started_at=T0 + timedelta(days=9)))
    runs.append(dict(runs[0], run_id="other", recipe_id="sim/y"))
    cells.append(dict(cells[0], run_id="other"))
    runs.reverse()
    pts = trend(runs, cells, recipe="sim/x", cell="64Kx16")
    assert list(pts["run_id"]) == [f"r{i}" for i in range(6)]
    assert list(pts["value"]) == [400, 402, 399, 360, 361, 362]
    assert list(pts["verdict"]) == ["first", "noise", "noise", "regression", "noise", "noise"]
    assert pts.loc[3, "change_pct"] == pytest.approx((360 - 399) / 399 * 100)
    tbt = trend(runs, cells, recipe="sim/x", cell="64Kx16", metric="tbt_ms")
    assert tbt.loc[3, "verdict"] == "regression"  # lower is better: tbt went up


def test_trend_skips_invalid_points_and_handles_prefill():
    runs, cells = _history([400, 400, 300], statuses={1: "failed"})
    pts = trend(runs, cells, recipe="sim/x", cell="64Kx16")
    assert list(pts["verdict"]) == ["first", "failed", "regression"]
    pre = trend(runs, cells, recipe="sim/x", cell="prefill 64K")
    assert list(pre["value"]) == [5000.0, 5001.0, 5002.0]
    assert list(pre["verdict"]) == ["first", "noise", "noise"]
    with pytest.raises(ValueError, match="does not apply"):
        trend(runs, cells, recipe="sim/x", cell="prefill 64K", metric="tbt_ms")
    with pytest.raises(ValueError, match="unknown metric"):
        trend(runs, cells, recipe="sim/x", cell="64Kx16", metric="speed")
    assert trend([], [], recipe="sim/x", cell="64Kx16").empty


def test_trend_prefers_stored_comparison_verdicts():
    runs, cells = _history([400, 390])
    stored = [
        {
            "run_id": "r1",
            "phase": "decode",
            "context_label": "64K",
            "concurrency": 16,
            "metric": "total_tok_s",
            "verdict": "noise",
            "change_pct": -2.5,
        }
    ]
    pts = trend(runs, cells, recipe="sim/x", cell="64Kx16", comparisons=stored, threshold=0.001)
    assert pts.loc[1, "verdict"] == "noise" and pts.loc[1, "change_pct"] == -2.5
    assert (
        trend(runs, cells, recipe="sim/x", cell="64Kx16", threshold=0.001).loc[1, "verdict"]
        == "regression"
    )


def test_every_cell_in_one_pass_is_each_cell_on_its_own():
    """trends() (one merge for a recipe page's cells) gives each cell the points trend() gives
    it alone: no cell's rows, order or verdicts leak into another's, ties in time included."""
    runs, cells = _history([400, 402, 360, 361], statuses={2: "failed"})
    runs[1]["started_at"] = runs[2]["started_at"]  # a tie: the runs table's order decides
    for i, run in enumerate(list(runs)):
        cells.append(
            empty_cell(
                phase="decode",
                context_tokens=8192,
                context_label="8K",
                concurrency=2,
                status="valid",
                total_tok_s=100.0 + 7 * (i % 2),
            )
            | {"run_id": run["run_id"]}
        )
    stored = [
        {
            "run_id": "r3",
            "phase": "decode",
            "context_label": "8K",
            "concurrency": 2,
            "metric": "total_tok_s",
            "verdict": "noise",
            "change_pct": -1.0,
        }
    ]
    runs.reverse()
    names = ["64Kx16", "prefill 64K", "8Kx2", "8Kx4"]
    together = trends(runs, cells, recipe="sim/x", names=names, comparisons=stored)
    assert list(together) == names
    for name in names:
        alone = trend(runs, cells, recipe="sim/x", cell=name, comparisons=stored)
        assert together[name].equals(alone), name
    # r1 ties r2 in time and comes after it in the (reversed) runs table
    assert list(together["8Kx2"]["run_id"]) == ["r0", "r2", "r1", "r3"]
    assert list(together["8Kx2"]["verdict"]) == ["first", "noise", "improvement", "noise"]
    assert list(together["64Kx16"]["verdict"]) == ["first", "failed", "noise", "regression"]
    assert together["8Kx4"].empty


def test_chart_is_svg_with_the_regression_marked():
    runs, cells = _history([400, 402, 360])
    svg = trend_chart_svg(
        trend(runs, cells, recipe="sim/x", cell="64Kx16"), title="64Kx16", ylabel="tok/s"
    )
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "regression" in svg  # the legend entry


def test_diff_heatmap_labels_the_regressed_cell():
    from speedmatrix.report.charts import diff_heatmap_svg

    rows = [
        {
            "phase": "decode",
            "context_tokens": 8192,
            "context_label": "8K",
            "concurrency": c,
            "metric": "total_tok_s",
            "change_pct": ch,
            "verdict": v,
        }
        for c, ch, v in [(1, 0.4, "noise"), (2, -10.0, "regression"), (4, 6.0, "improvement")]
    ]
    svg = diff_heatmap_svg(rows)
    assert "<svg" in svg
    assert "-10.0% ▼" in svg and "+6.0% ▲" in svg  # matplotlib keeps each text as a comment
    assert diff_heatmap_svg([]) is None
    assert diff_heatmap_svg(rows, metric="tbt_ms") is None


@pytest.mark.parametrize(("field", "value"), [("metric_version", 0), ("workload", "continuation")])
def test_a_trend_never_judges_across_the_comparability_rule(field, value):
    """Issue #33 item 3: an ingested page (another metric_version) showed as a +6.2%
    improvement over the measured run before it. The trend applies the verdicts' rule
    (records.not_comparable_reason): such a point is `not_comparable`, with no change, and the
    points after it are judged against it, not across it."""
    runs, cells = _history([400, 401, 426, 427, 380])
    for c in cells:
        if c["run_id"] in ("r2", "r3", "r4") and c["phase"] == "decode":
            c[field] = value
    pts = trend(runs, cells, recipe="sim/x", cell="64Kx16", threshold=0.03)
    assert pts["verdict"].tolist() == ["first", "noise", "not_comparable", "noise", "regression"]
    assert pts.loc[2, "change_pct"] is None or pts["change_pct"].isna()[2]


def test_the_site_reads_the_fields_of_the_comparability_rule():
    from speedmatrix.records import COMPARABILITY_FIELDS
    from speedmatrix.report.site_fleet import CELL_COLUMNS

    assert set(COMPARABILITY_FIELDS) <= set(CELL_COLUMNS)


def test_the_band_a_chart_draws_is_the_band_the_verdicts_judge_with():
    """analysis.trend.noise_band: the larger of the threshold and the between-run noise's
    half-width; a point just inside it is noise and one just outside a regression, by the
    trend's own verdicts (the site draws this band around each point's predecessor)."""
    import math

    import pandas as pd

    from speedmatrix.analysis.noise import Z_95, NoiseModel
    from speedmatrix.analysis.trend import noise_band

    row = {"recipe_id": "sim/x", "host": "local", "phase": "decode", "context_tokens": 65536}
    table = pd.DataFrame(
        [{**row, "concurrency": 16, "metric": "total_tok_s", "rel_sd": 0.02, "dof": 4}]
    )
    noise = NoiseModel(table.assign(runs=5, engines=1))
    band, source = noise_band(noise, 0.03, "sim/x", "local", "decode", 65536, 16, "total_tok_s")
    assert band == pytest.approx(math.sqrt(2) * Z_95 * 0.02) and source == "cell"
    assert noise_band(noise, 0.2, "sim/x", "local", "decode", 65536, 16, "total_tok_s") == (
        0.2,
        "threshold",
    )
    assert noise_band(NoiseModel.empty(), 0.03, "sim/x", "local", "decode", 65536, 16, "x") == (
        0.03,
        "threshold",
    )
    for factor, verdict in ((1 - band * 0.99, "noise"), (1 - band * 1.01, "regression")):
        runs, cells = _history([1000.0, 1000.0 * factor])
        pts = trend(runs, cells, recipe="sim/x", cell="64Kx16", threshold=0.03, noise=noise)
        assert pts["verdict"].tolist() == ["first", verdict]


def test_a_points_commit_is_labelled_by_the_longest_name_its_run_knows():
    """The recipe page's axis read `9fedd24fa…` where the run was asked for 9fedd24fa864 (its
    run id and the index show 12 hex): the trend keeps the run's engine ref for the label."""
    from speedmatrix.commits import commit_label

    runs, cells = _history([400, 401])
    for r in runs:
        r.update(engine_commit="9fedd24fa", engine_ref="9fedd24fa864")
    pts = trend(runs, cells, recipe="sim/x", cell="64Kx16")
    assert [commit_label(p) for p in pts.to_dict("records")] == ["9fedd24fa864"] * 2
