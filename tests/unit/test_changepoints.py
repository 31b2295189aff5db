"""Change points over a cell's history (issue 40, item 5) and partial runs in the trend (item 6).

The histories are made here with a seeded noise of 0.5% (the simulator's between-run spread is
of that order: benchmarks/README.md, "Change points"), so every assertion is about the detector
and the trend, not the host."""

from __future__ import annotations

import json
import random
import re
from datetime import UTC, datetime, timedelta

import pytest

from speedmatrix.analysis.changepoints import change_points
from speedmatrix.analysis.trend import trend
from speedmatrix.records import empty_cell

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _nights(levels, *, seed=0, noise=0.005, statuses=None, workloads=None):
    """One run per night, each at a new engine commit (a main branch's nightly)."""
    rng = random.Random(seed)
    runs, cells = [], []
    for i, level in enumerate(levels):
        rid = f"n{i:02d}"
        runs.append(
            {
                "run_id": rid,
                "recipe_id": "sim/x",
                "host": "local",
                "status": (statuses or {}).get(i, "success"),
                "engine_commit": f"{i:02d}" + "c" * 38,
                "engine_version": "0.1",
                "started_at": T0 + timedelta(days=i),
            }
        )
        cell_status = "failed" if (statuses or {}).get(i) == "failed" else "valid"
        value = level * (1 + rng.gauss(0, noise))
        cells.append(
            empty_cell(
                phase="decode",
                context_tokens=8192,
                context_label="8K",
                concurrency=4,
                status=cell_status,
                total_tok_s=value if cell_status == "valid" else None,
                workload=(workloads or {}).get(i, "article"),
            )
            | {"run_id": rid}
        )
    return runs, cells


def _creep(before=10, after=10):
    """Five commits in a row, each 2% slower (-9.6% in all)."""
    return [1000.0] * before + [1000.0 * 0.98**k for k in range(1, 6)] + [1000 * 0.98**5] * after


def test_drift_of_five_commits_each_2pct_slower_is_a_change_point():
    runs, cells = _nights(_creep(), noise=0.003)
    pts = trend(runs, cells, recipe="sim/x", cell="8Kx4")
    # what the issue saw: one run against the one before, every step reads noise
    assert set(pts["verdict"][1:]) == {"noise"}
    marked = pts[pts["change_point"].notna()]
    assert len(marked) >= 1 and set(marked["change_point"]) == {"regression"}
    assert all(10 <= int(r[1:]) <= 15 for r in marked["run_id"])  # within the creep's commits
    # the steps found add up to the creep
    total = 1.0
    for pct in marked["change_point_pct"]:
        total *= 1 + pct / 100
    assert (total - 1) * 100 == pytest.approx(-9.6, abs=2.0)


def test_a_change_point_names_its_commit_range_and_size():
    runs, cells = _nights([1000.0] * 12 + [960.0] * 12, seed=3)
    pts = trend(runs, cells, recipe="sim/x", cell="8Kx4")
    found = change_points(pts, higher_is_better=True)
    assert len(found) == 1
    cp = found[0]
    assert (cp.before_run_id, cp.run_id) == ("n11", "n12")
    assert cp.commit_before.startswith("11c") and cp.commit_after.startswith("12c")
    assert cp.commit_range() == "11cccccccccc..12cccccccccc"  # 12 hex, as every commit shown
    assert cp.change_pct == pytest.approx(-4.0, abs=0.6) and cp.pvalue < 0.001
    assert cp.verdict == "regression"
    tbt = change_points(pts.assign(value=1000.0 / pts["value"]), higher_is_better=False)
    assert [c.verdict for c in tbt] == ["regression"]  # lower is better: the time went up


def test_a_regressed_run_that_became_the_baseline_does_not_hide_its_step():
    levels = [1000.0] * 12 + [900.0] * 3
    runs, cells = _nights(levels + [900.0] * 25, seed=5)
    pts = trend(runs, cells, recipe="sim/x", cell="8Kx4")
    # the runs after the slow one compare with it: every later verdict says noise
    assert set(pts["verdict"][13:]) == {"noise"}
    for n in (15, 25, 40):  # the step stays reported however long the history grows
        found = change_points(pts[:n], higher_is_better=True)
        assert [c.run_id for c in found] == ["n12"], n


def test_no_change_point_on_an_unchanged_engine():
    for seed in range(5):
        runs, cells = _nights([1000.0] * 40, seed=seed)
        pts = trend(runs, cells, recipe="sim/x", cell="8Kx4")
        assert pts["change_point"].isna().all(), seed


def test_a_change_of_what_is_measured_is_not_a_step():
    """A run measured otherwise (another workload) starts a new series: its level is not a step
    of the old one."""
    levels = [1000.0] * 12 + [700.0] * 12
    runs, cells = _nights(levels, workloads={i: "continuation" for i in range(12, 24)})
    pts = trend(runs, cells, recipe="sim/x", cell="8Kx4")
    assert pts.loc[12, "verdict"] == "not_comparable"
    assert pts["change_point"].isna().all()


def test_partial_runs_valid_cells_are_history_marked_in_the_trend():
    runs, cells = _nights([1000.0] * 6, statuses={2: "partial", 4: "failed"})
    pts = trend(runs, cells, recipe="sim/x", cell="8Kx4")
    assert list(pts["run_id"]) == ["n00", "n01", "n02", "n03", "n05"]
    assert list(pts["run_status"]) == ["success", "success", "partial", "success", "success"]
    assert pts.loc[2, "value"] == pytest.approx(cells[2]["total_tok_s"])
    assert pts.loc[2, "verdict"] == "noise"


def test_trend_command_marks_each_change_point_with_its_commit_range(tmp_path, capsys):
    from speedmatrix.cli import main
    from speedmatrix.store.warehouse import Warehouse

    runs, cells = _nights([1000.0] * 8 + [950.0] * 8, seed=2, statuses={3: "partial"})
    wh = Warehouse(str(tmp_path / "wh"))
    for run, cell in zip(runs, cells, strict=True):
        row = run | {"trigger": "nightly", "engine_repository": "github.com/vllm-project/vllm"}
        wh.land_run(row, [{k: v for k, v in cell.items() if k != "run_id"}], [])
    wh.close()
    args = ["trend", "--recipe", "sim/x", "--cell", "8Kx4", "--warehouse", str(tmp_path / "wh")]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    step = [line for line in lines if "▼" in line]
    assert len(step) == 1 and "n08" in step[0] and "07cccccccccc..08cccccccccc" in step[0]
    assert re.search(r"▼ -[456]\.\d%", step[0])
    assert "(partial run)" in next(line for line in lines if "n03" in line)
    assert main([*args, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["change_point"] for r in doc if r["change_point"]] == ["regression"]


def _stepped_points():
    runs, cells = _nights([1000.0] * 10 + [950.0] * 10, seed=4, statuses={5: "partial"})
    return trend(runs, cells, recipe="sim/x", cell="8Kx4")


def test_the_site_chart_marks_the_change_point_its_range_and_partial_runs():
    from speedmatrix.report.site_trend import trend_svg

    pts = _stepped_points()
    svg = trend_svg(pts, 0.03, title="8Kx4", link={}, total=len(pts))
    assert svg.count('class="cp"') == 1
    tip = re.search(r'<g class="cp-mark"><title>([^<]*)</title>', svg).group(1)
    assert "change point" in tip and "09cccccccccc..10cccccccccc" in tip and "-5." in tip
    assert svg.count('class="pt partial"') == 1
    quiet = trend_svg(trend(*_nights([1000.0] * 20), recipe="sim/x", cell="8Kx4"), 0.03,
                      title="8Kx4", link={}, total=20)  # fmt: skip
    assert 'class="cp"' not in quiet and "partial" not in quiet


def test_the_report_chart_marks_the_change_point():
    from speedmatrix.report.charts import trend_chart_svg

    svg = trend_chart_svg(_stepped_points(), title="8Kx4", ylabel="tok/s")
    assert "change point 09cccccccccc..10cccccccccc" in svg
    assert "partial run" in svg  # its legend entry


def test_the_recipe_page_names_each_change_point_and_shows_partial_runs(tmp_path):
    from speedmatrix.report.site import build_site, recipe_page
    from speedmatrix.store.warehouse import Warehouse

    runs, cells = _nights([1000.0] * 8 + [950.0] * 8, seed=2, statuses={3: "partial"})
    wh = Warehouse(str(tmp_path / "wh"))
    for run, cell in zip(runs, cells, strict=True):
        row = run | {"trigger": "nightly", "engine_repository": "github.com/vllm-project/vllm"}
        wh.land_run(row, [{k: v for k, v in cell.items() if k != "run_id"}], [])
    build_site(wh, tmp_path / "site", max_run_pages=0)
    wh.close()
    page = (tmp_path / "site" / recipe_page("sim/x")).read_text()
    chart = re.search(r'<figure class="cell" id="cell-8Kx4">(.*?)</figure>', page, re.S).group(1)
    assert chart.count('class="cp"') == 1 and chart.count('class="pt partial"') == 1
    caption = re.search(r"<figcaption>(.*?)</figcaption>", chart, re.S).group(1)
    assert re.search(r"change point ▼ -[456]\.\d% 07cccccccccc\.\.08cccccccccc", caption)


def _landed_nights(root, levels, **kw):
    from speedmatrix.store.warehouse import Warehouse

    runs, cells = _nights(levels, **kw)
    wh = Warehouse(str(root))
    for run, cell in zip(runs, cells, strict=True):
        row = run | {"trigger": "nightly", "engine_repository": "github.com/vllm-project/vllm"}
        wh.land_run(row, [{k: v for k, v in cell.items() if k != "run_id"}], [])
    return wh


def test_the_run_that_makes_a_change_point_detectable_alerts_once(tmp_path):
    """Nightly: 10 nights at one level, then 3% slower for good. No single run regressed
    beyond the threshold against the run before; the run with which the step becomes
    significant says so (a new change point), the runs after it do not say it again."""
    from speedmatrix.flows.notify import message_text, subject, summarize_run

    wh = _landed_nights(tmp_path / "wh", [1000.0] * 10 + [970.0] * 10, seed=1, noise=0.003)
    alerts = {}
    for i in range(20):
        s = summarize_run(wh, f"n{i:02d}")
        if s.change_points:
            alerts[i] = s
    wh.close()
    assert len(alerts) == 1, sorted(alerts)
    ((night, s),) = alerts.items()
    assert 12 <= night <= 16 and s.alarming  # three nights at the new level at least
    cp = s.change_points[0]
    assert cp["cell"] == "8Kx4" and cp["run_id"] == "n10" and cp["verdict"] == "regression"
    text = message_text(s)
    assert "New change point" in text and "8Kx4" in text
    assert "09cccccccccc..10cccccccccc" in text and "-3." in text
    assert "new change point" in subject(s)
