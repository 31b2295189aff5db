"""A recipe page reads its window, not its history (#44 item 8): the trends and their noise
band are drawn from each host's last MAX_POINTS + 1 runs, so the page's read stays flat as the
fleet's history grows."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells, make_run

from speedmatrix.report.site_fleet import read_recipe, recipe_runs
from speedmatrix.store.warehouse import Warehouse

RECIPE = "sim/kimi-k2.7-nvfp4-rtxpro6k-x8"


def test_read_recipe_reads_each_hosts_window_only(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    for month in range(1, 7):  # a run a month on two hosts: history across six partitions
        for host in ("a", "b"):
            when = dt.datetime(2026, month, 3, 2, tzinfo=dt.UTC)
            run = make_run(f"{host}-{month}", host=host, started_at=when, finished_at=when)
            wh.land_run(run, make_cells(1 + month / 100), [])
    runs = recipe_runs(wh, RECIPE)
    history = read_recipe(wh, RECIPE, runs, window=2)
    assert set(history.cells["run_id"]) == {"a-5", "a-6", "b-5", "b-6"}
    whole = read_recipe(wh, RECIPE, runs)
    assert set(whole.cells["run_id"]) == {f"{h}-{m}" for h in "ab" for m in range(1, 7)}
