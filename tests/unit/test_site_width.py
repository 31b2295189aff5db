"""Site tables readable at 1280 px (#44 item 7), checked in Chromium by what is visible: each
table of the index, a recipe page and a run page ends inside the window (no column pushed
off-screen), long run ids shortened with the whole id on hover; screenshots at 1280 px kept
for a person to look at (SPEEDMATRIX_SCREENSHOTS=DIR)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_warehouse import make_cells
from test_warehouse_readme import RECIPE, TINY, demo_run

from speedmatrix.report.site import build_site, recipe_page, run_page
from speedmatrix.store.warehouse import Warehouse

WIDTH = 1280
MEASURE = """<script>
(function () {
  var view = document.documentElement.clientWidth, out = [];
  document.querySelectorAll('table').forEach(function (t, i) {
    var r = t.getBoundingClientRect();
    out.push({i: i, cls: t.className, right: Math.round(r.right), view: view});
  });
  document.body.setAttribute('data-widths', JSON.stringify(out));
})();
</script>"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A site over demo-like runs (ids as the DAG makes them, ~80 characters)."""
    root = tmp_path_factory.mktemp("widths")
    wh = Warehouse(root / "warehouse")
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    for i, recipe in enumerate((RECIPE, RECIPE, TINY)):
        wh.land_run(demo_run(recipe, now - dt.timedelta(hours=3 - i)), make_cells(), [])
    # the demo's own first run: the simulated engine's long hardware text, a dev version
    # beside its commit, and "not compared (no baseline)" (its index row overflowed 1280 px)
    first = demo_run("sim/another-recipe", now - dt.timedelta(minutes=30))
    first.update(sim_profile="kimi-k2.7-nvfp4-rtxpro6k-x8", engine_version="0.1.dev1+g9fedd24fa")
    wh.land_run(first, make_cells(), [])
    build_site(wh, root / "site")
    runs = wh.query("SELECT run_id, recipe_id FROM runs ORDER BY started_at")
    return root / "site", runs["run_id"][0], RECIPE


def widths(browser, page: Path) -> list[dict]:
    """Each table's right edge in a 1280 px window, from a copy of the page that measures."""
    html = page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>")
    probe = page.with_name(page.stem + ".measure.html")
    probe.write_text(html, encoding="utf-8")
    try:
        dom = browser.open_page(probe, width=WIDTH, height=900).dom
    finally:
        probe.unlink()
    found = re.search(r"data-widths=\"(.*?)\"", dom)
    assert found, "the measuring script did not run"
    return json.loads(found.group(1).replace("&quot;", '"'))


def pages(site):
    root, run_id, recipe = site
    return {
        "index": root / "index.html",
        "recipe": root / recipe_page(recipe),
        "run": root / run_page(run_id),
    }


@pytest.mark.parametrize("which", ["index", "recipe", "run"])
def test_every_table_fits_a_1280px_window(site, browser, which):
    page = pages(site)[which]
    measured = widths(browser, page)
    assert measured, "no table measured"
    over = [w for w in measured if w["right"] > w["view"]]
    assert not over, over


def test_long_run_ids_are_shortened_with_the_whole_id_on_hover(site):
    root, run_id, _recipe = site
    index = (root / "index.html").read_text(encoding="utf-8")
    assert len(run_id) > 60
    assert f'title="{run_id}"' in index
    assert f">{run_id}</a>" not in index


def test_screenshots_at_1280px(site, browser, tmp_path):
    out = Path(os.environ.get("SPEEDMATRIX_SCREENSHOTS") or tmp_path)
    for name, page in pages(site).items():
        shot = browser.open_page(page, screenshot=out / f"{name}-1280.png", width=WIDTH).screenshot
        assert shot is not None and shot.stat().st_size > 10_000, name
