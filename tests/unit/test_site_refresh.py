"""The site's refresh after one run costs what its changed pages need, not the fleet (#44
item 8): the per-run work over every run (fingerprints for the manifest) is one aggregate in
the query engine, a verdict is made only for the runs a written page shows, and an
incremental build leaves every page exactly as a full build from scratch writes it."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_compare_warehouse import _land
from test_warehouse import make_cells, make_run

import speedmatrix.report.site_fleet as site_fleet
import speedmatrix.report.site_pages as site_pages
from speedmatrix.analysis.compare import judge_regressions
from speedmatrix.analysis.verdict import RegressionError
from speedmatrix.report.site import build_site, run_page
from speedmatrix.store.warehouse import Warehouse

OTHER = "sim/other-recipe"


def _judge(wh, run_id):
    with contextlib.suppress(RegressionError):
        judge_regressions(wh, run_id)


def _other(wh, i, host, model="other-model"):
    when = dt.datetime(2026, 3, 1 + i, 4, tzinfo=dt.UTC)
    run = make_run(
        f"o{i}-{host}",
        recipe_id=OTHER,
        host=host,
        model=model,
        started_at=when,
        finished_at=when,
    )
    wh.land_run(run, make_cells(1 + i / 100), [])


def _fleet(tmp_path):
    """Two recipes: sim/wh-test (judged, one regression) and OTHER on two hosts."""
    wh = Warehouse(str(tmp_path / "wh"))
    _land(wh, "r0", "a" * 40, 0, seed=0)
    _land(wh, "r1", "a" * 40, 1, seed=1)
    _judge(wh, "r1")
    for i in range(4):
        _other(wh, i, "h1")
        _other(wh, i, "h2")
    return wh


def _pages(root: Path) -> dict[str, str]:
    """Every file of the site but its manifest, the build's time masked."""
    return {
        str(p.relative_to(root)): re.sub(r"Built [^<]* by", "Built - by", p.read_text())
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in (".html", ".css")
    }


def test_an_incremental_build_writes_every_page_as_a_full_build_does(tmp_path):
    wh = _fleet(tmp_path)
    out = tmp_path / "site"
    build_site(wh, out, max_run_pages=3)  # a first build that fills in over several
    build_site(wh, out, max_run_pages=3)
    _land(wh, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    build_site(wh, out, max_run_pages=1)  # the new run before its verdicts...
    _judge(wh, "r2")
    build_site(wh, out)  # ...and after; every page now
    _other(wh, 9, "h1", model="third-model")
    (out / run_page("o0-h2")).unlink()  # a page removed by hand
    wh.delete_run("o1-h1")  # a run deleted from the warehouse
    build_site(wh, out)
    full = build_site(wh, tmp_path / "full")
    assert full.run_pages_written == 11  # 3 + 4 x 2 + 1, one deleted
    assert _pages(out) == _pages(tmp_path / "full")
    wh.close()


def test_a_refresh_reads_the_fleet_per_run_only_as_fingerprints(tmp_path, monkeypatch):
    """What a refresh asks the warehouse for every run of the fleet is one aggregate, the
    fingerprint of what each run's page is made from, and it comes back as Arrow (no
    DataFrame, no Python row per run); no other query returns a row for every run."""
    monkeypatch.setattr(site_pages, "LATEST_RUNS", 2)  # the index's few, fewer than the fleet
    wh = _fleet(tmp_path)
    out = tmp_path / "site"
    build_site(wh, out)
    _land(wh, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    _judge(wh, "r2")
    fleet = int(wh.query("SELECT count(*) AS n FROM runs")["n"][0])
    per_run: list[tuple[str, str, list[str]]] = []
    for name in ("query", "query_arrow"):
        real = getattr(wh, name)

        def recording(sql, params=None, _real=real, _name=name, **kw):
            result = _real(sql, params, **kw)
            names = list(getattr(result, "column_names", None) or result.columns)
            ids = result["run_id"] if "run_id" in names else []
            if len(set(ids.to_pylist() if hasattr(ids, "to_pylist") else ids)) >= fleet:
                per_run.append((_name, " ".join(sql.split()), names))  # a row for every run
            return result

        setattr(wh, name, recording)
    new = build_site(wh, out)
    assert (new.run_pages_written, new.recipe_pages_written) == (1, 1)
    assert "1 cell regressed (64Kx2): throughput" in (out / "index.html").read_text()
    assert len(per_run) == 1, per_run
    method, sql, columns = per_run[0]
    assert method == "query_arrow" and "fingerprint" in columns, per_run
    assert "GROUP BY run_id" in sql and "FROM comparisons" in sql  # the verdicts' inputs
    wh.close()


def test_a_refresh_makes_verdicts_only_for_the_runs_its_pages_show(tmp_path, monkeypatch):
    """After one run of sim/wh-test: its recipe page lists that recipe's runs, the index
    each recipe x host's latest run and the latest runs; OTHER's older runs are on no page
    written, so no verdict is made for them."""
    wh = _fleet(tmp_path)
    out = tmp_path / "site"
    monkeypatch.setattr(site_pages, "LATEST_RUNS", 2)
    build_site(wh, out)
    _land(wh, "r2", "b" * 40, 2, slow={(65536, 2): 0.9}, seed=2)
    _judge(wh, "r2")
    judged: list[str] = []
    real = site_fleet.run_verdict

    def recording(run, *args, **kw):
        judged.append(str(run["run_id"]))
        return real(run, *args, **kw)

    monkeypatch.setattr(site_fleet, "run_verdict", recording)
    new = build_site(wh, out)
    assert (new.run_pages_written, new.recipe_pages_written) == (1, 1)
    index = (out / "index.html").read_text()
    assert "1 cell regressed (64Kx2): throughput" in index
    shown = {"r0", "r1", "r2", "o3-h1", "o3-h2"}  # the recipe's runs; OTHER's latest per host
    assert set(judged) <= shown, sorted(set(judged) - shown)
    assert {"r0", "r1", "r2"} <= set(judged)
    wh.close()
