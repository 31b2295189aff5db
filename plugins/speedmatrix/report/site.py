"""A static site over the warehouse: where users look for "did the last commit make it slower?".

This module builds it: which pages to write again, and the manifest that makes a refresh
incremental. The pages are report.site_pages' (the run pages themselves report.page's), the
trend charts report.site_trend's, what is read from the warehouse report.site_fleet's, and
the views across configurations report.site_views'.

``build_site(warehouse, out)`` writes, under ``out``:

- ``index.html``: every recipe x host with its latest run, that run's status and verdict
  (regressions / improvements beyond noise against its baseline), then the latest runs;
- ``recipes/<recipe>.html``: per recipe (a section per host) every cell's trend across engine
  commits: its figure per run, the noise band (how far a point may move from the one before
  and still be noise: the larger of the recipe's threshold and the between-run noise,
  ``analysis.trend.noise_band``, the rule its verdicts judge with), regressions and
  improvements marked, each point a link to its run; then the recipe's runs;
- ``runs/<run>.html``: every run's page, rendered by ``report.page.render_page`` (the run
  page of the pipeline, not a copy of it), with the verdicts the `regressions` task landed,
  plus a line of navigation back to the site;
- ``models/`` and ``compare/``: the views across configurations (report.site_views);
- ``site.css`` and ``_site.json`` (what was rendered from what: the incremental build's memory).

Why static files: the site must open from ``file://`` as well as any static host, so every link
is relative, nothing is fetched from elsewhere (no script, no CDN; charts are inline SVG), and
a refresh after each run is a plain rewrite of files.

Why incremental: a three-year warehouse holds tens of thousands of runs; after one run only
that run's page, its recipe's page and the index change. A page is rewritten when what it was
made from changed: for a run page the run's landing time, its verdicts and the renderer's own
code; for a recipe page the same of every run of the recipe. ``_site.json`` keeps those
fingerprints; a page whose file is missing is rendered again whatever it says. The runs'
fingerprints are one aggregate query (report.site_fleet): the part of a refresh that grows
with the fleet is that query and a dict lookup per run, not pandas rows or verdicts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedmatrix.errors import InputError
from speedmatrix.ownership import claim_dir, marker_name
from speedmatrix.report import site_pages
from speedmatrix.report.site_fleet import (
    Fleet,
    fleet_fingerprints,
    read_recipe,
    run_comparisons,
    verdicts_of,
)
from speedmatrix.report.site_pages import (
    index_rows,
    recipe_page,
    render_index,
    render_landed_run_page,
    render_recipe_page,
    run_page,
    site_run_page,
)
from speedmatrix.settings import settings
from speedmatrix.store.dictionary import dictionary
from speedmatrix.store.protocol import WarehouseReader
from speedmatrix.words import count

log = logging.getLogger("speedmatrix.site")

MANIFEST = "_site.json"
LOCK = ".site.lock"
MARKER = marker_name("site")  # ".speedmatrix-site"
"""Says a folder is a site of ours: the build writes only into one that holds it (or
`MANIFEST`, which sites built before the marker hold) or is new or empty: a user's own files are never overwritten."""
SITE_FORMAT = 1  # bump when the site's own pages change shape: everything is rendered again

__all__ = [
    "SiteResult",
    "build_site",
    "claim_site_dir",
    "default_site_dir",
    "recipe_page",
    "run_page",
]


def default_site_dir(warehouse_root: str) -> str:
    """``$SPEEDMATRIX_SITE_DIR``, else ``site/`` beside the warehouse directory (not inside
    it: the warehouse holds data, and its readers glob its directories)."""
    env = settings().site_dir
    if env:
        return env
    root = warehouse_root.rstrip("/")
    if "://" in root:
        raise InputError(
            "the warehouse is not a local path: set SPEEDMATRIX_SITE_DIR (or --out) to a "
            "local directory for the site"
        )
    return str(Path(root).resolve().parent / "site")


@dataclass
class SiteResult:
    """What a build did (logged by the DAG task, printed by the command, timed by the
    benchmark)."""

    out: str
    runs: int = 0
    recipes: int = 0
    run_pages_written: int = 0
    run_pages_kept: int = 0
    recipe_pages_written: int = 0
    recipe_pages_kept: int = 0
    run_pages_deferred: int = 0
    model_pages_written: int = 0  # models whose Pareto view and comparisons were written
    model_pages_kept: int = 0
    run_pages_seconds: float = 0.0  # of `seconds`, rendering run pages (the benchmark's split)
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"site {self.out}: {count(self.runs, 'run')}, {count(self.recipes, 'recipe')}; run pages "
            f"{self.run_pages_written} written, {self.run_pages_kept} unchanged; recipe pages "
            f"{self.recipe_pages_written} written, {self.recipe_pages_kept} unchanged"
            + (f", {self.run_pages_deferred} left for later" if self.run_pages_deferred else "")
            + (f"; {len(self.failed)} failed" if self.failed else "")
            + f" ({self.seconds:.1f} s)"
        )


# ---------------------------------------------------------------------------------------------
# the manifest


def _code_fingerprint() -> str:
    """The renderer's own code: a new page design renders every page again, once."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha1(str(SITE_FORMAT).encode())
    analysis = here.parent / "analysis"
    pages = [*here.glob("*.py"), analysis / "cost.py", analysis / "pareto.py"]
    for path in sorted([*pages, *here.glob("templates/*")]):
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _env():
    from speedmatrix.report.jinja import environment

    return environment()


def _write(path: Path, text: str) -> None:
    """Atomically (aside, then rename): a reader of the site never sees half a page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, default=str, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class _Build:
    """One build: where it writes, what the last build left (its manifest, emptied when the
    code or the prices changed), and what this one has written so far."""

    wh: WarehouseReader
    root: Path
    code: str  # the renderer's code and the deployment's prices: part of every fingerprint
    prices: Any
    old: dict[str, Any]
    result: SiteResult
    env: Any = None
    runs: dict[str, str] = field(default_factory=dict)  # run id -> its page's fingerprint
    recipes: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)
    view_pages: set[str] = field(default_factory=set)


def claim_site_dir(root: Path) -> None:
    """Make `root` ours, or refuse: a site rewrites `index.html`, `site.css`, `runs/`… and must
    never overwrite a user's files of those names (`--out` pointed at the wrong folder). A new
    or empty folder gets the marker; one that holds it (or a manifest) is ours; anything else
    is a ValueError naming the path, and nothing in it is touched."""
    claim_dir(root, "site", also_ours=(MANIFEST,))  # the one marker rule (speedmatrix.ownership)


def build_site(
    warehouse: WarehouseReader,
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    max_run_pages: int | None = None,
) -> SiteResult:
    """Write (or refresh) the site of `warehouse` under `out`; see the module docstring.

    `max_run_pages` bounds the run pages rendered in this build, newest runs first (None: all):
    a first build over years of history fills in over several builds, while the newest runs,
    the trends and the index are there at once (a run page takes ~0.3-1 s: see benchmarks).

    A run page that cannot be rendered is logged and listed in the result (the others, the
    index and the trends are still written: one bad run must not hide every other)."""
    t0 = time.monotonic()
    root = Path(out)
    claim_site_dir(root)
    # runs on several workers finish side by side: one build at a time per site directory
    # (each page is replaced atomically anyway; the lock keeps the manifest whole)
    with open(root / LOCK, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(warehouse, root, force=force, max_run_pages=max_run_pages, t0=t0)


def _build(
    warehouse: WarehouseReader, root: Path, *, force: bool, max_run_pages: int | None, t0: float
) -> SiteResult:
    b = _start(warehouse, root, force=force)
    # one aggregate query: per run its page's fingerprint (compared with the manifest) and
    # the columns the few runs a page shows need; no Python runs over every run's row
    fleet = Fleet(fleet_fingerprints(warehouse))
    b.result.runs = len(fleet)
    _write_run_pages(b, fleet, max_run_pages)
    _write_recipe_pages(b, fleet)
    views = _write_views(b, fleet)
    latest = fleet.latest(site_pages.LATEST_RUNS)
    hosts = fleet.latest_per_host()
    verdicts = verdicts_of(warehouse, [*hosts, *(r for r in latest if str(r["run_id"]) in b.runs)])
    _write(
        root / "index.html",
        render_index(
            b.env,
            index_rows(hosts, verdicts),
            latest,
            len(fleet),
            verdicts,
            b.runs,
            models=views.entries,
            built=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        ),
    )
    _write(root / "site.css", b.env.get_template("site.css").render())
    _write(
        root / "data-dictionary.html",
        b.env.get_template("data_dictionary.html.j2").render(tables=dictionary()),
    )
    _remove_stale(b)
    _write(
        root / MANIFEST,
        json.dumps(
            {"code": b.code, "runs": b.runs, "recipes": b.recipes, "models": b.models},
            indent=0,
        ),
    )
    b.result.seconds = time.monotonic() - t0
    log.info("%s", b.result.summary())
    return b.result


def _start(warehouse: WarehouseReader, root: Path, *, force: bool) -> _Build:
    """The build's state: the last manifest, kept only when the code and prices are the
    same (else every page is rendered again)."""
    from speedmatrix.report.page import deployment_prices

    try:
        old = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        old = {}
    prices = deployment_prices()
    # the deployment's prices are part of what every page is made from (their cost column)
    code = _code_fingerprint() + (prices.digest() if prices is not None else "")
    if force or old.get("code") != code:
        old = {}
    return _Build(warehouse, root, code, prices, old, SiteResult(out=str(root)), env=_env())


def _write_run_pages(b: _Build, fleet: Fleet, max_run_pages: int | None) -> None:
    """Every run's page whose fingerprint changed (or whose file is gone), newest first,
    at most `max_run_pages` of them; `b.runs` ends as the runs that have a page."""
    old_runs: dict[str, str] = b.old.get("runs", {})
    result = b.result
    budget = math.inf if max_run_pages is None else max_run_pages
    folder = b.root / "runs"
    on_disk = set(os.listdir(folder)) if folder.is_dir() else set()  # one listing, not a stat a run
    run_fp = fleet.fingerprints
    newest_first = zip(reversed(fleet.run_ids), reversed(fleet.recipes), strict=True)
    for rid, recipe_key in newest_first:
        # only a page the last build listed can be kept (and only then is its file looked for)
        old_fp = old_runs.get(rid)
        there = old_fp is not None and run_page(rid).removeprefix("runs/") in on_disk
        if old_fp == run_fp[rid] and there:
            b.runs[rid] = run_fp[rid]
            result.run_pages_kept += 1
            continue
        if result.run_pages_written >= budget:
            # left for a later build; an older page of the run stays (and is linked) meanwhile
            result.run_pages_deferred += 1
            if there:
                b.runs[rid] = old_fp
            continue
        started = time.monotonic()
        recipe = recipe_key or None
        try:
            html_page = render_landed_run_page(b.wh, rid, recipe, run_comparisons(b.wh, rid))
        except Exception as exc:  # one run's page must not cost the site
            log.warning("site: no page for run %s: %s", rid, exc)
            result.failed.append(f"{rid}: {exc}")
            continue
        _write(b.root / run_page(rid), site_run_page(html_page, recipe))
        b.runs[rid] = run_fp[rid]
        result.run_pages_written += 1
        result.run_pages_seconds += time.monotonic() - started


def _write_recipe_pages(b: _Build, fleet: Fleet) -> None:
    """Every recipe's page whose runs' pages changed: only such a recipe's runs are read whole,
    and verdicts made for those of them its page lists."""
    old_recipes: dict[str, str] = b.old.get("recipes", {})
    of_recipe: dict[str, list[str]] = {}
    for rid, recipe_key in zip(fleet.run_ids, fleet.recipes, strict=True):
        of_recipe.setdefault(recipe_key, []).append(rid)
    b.result.recipes = len(of_recipe)
    for recipe_key in sorted(of_recipe):
        recipe = recipe_key or None
        page = recipe_page(recipe)
        fp = _fingerprint(b.code, sorted(b.runs.get(i, "-") + i for i in of_recipe[recipe_key]))
        if old_recipes.get(recipe_key) == fp and (b.root / page).exists():
            b.recipes[recipe_key] = fp
            b.result.recipe_pages_kept += 1
            continue
        rruns = fleet.recipe_runs(recipe_key)
        shown = rruns[[str(rid) in b.runs for rid in rruns["run_id"]]].to_dict("records")
        # the trends' window (site_pages.MAX_POINTS, read now: a test narrows it)
        history = read_recipe(b.wh, recipe, rruns, window=site_pages.MAX_POINTS + 1)
        html_text = render_recipe_page(
            b.env, recipe, rruns, history, verdicts_of(b.wh, shown), b.runs
        )
        _write(b.root / page, html_text)
        b.recipes[recipe_key] = fp
        b.result.recipe_pages_written += 1


def _write_views(b: _Build, fleet: Fleet) -> Any:
    """Per model: the Pareto view and the comparison pages of its configurations."""
    from speedmatrix.report.site_views import write_views

    candidates = fleet.series_candidates()
    views = write_views(
        b.wh,
        b.root,
        candidates,
        prices=b.prices,
        fingerprint=lambda *parts: _fingerprint(b.code, *parts),  # page -> what it is made from
        run_fp=b.runs,
        old=b.old.get("models", {}),
        write=_write,
        # a view links the runs of its series only: those with a page, not every page's run
        run_pages={rid: run_page(rid) for r in candidates if (rid := str(r["run_id"])) in b.runs},
    )
    b.result.model_pages_written, b.result.model_pages_kept = views.written, views.kept
    b.models, b.view_pages = views.fingerprints, views.pages
    return views


def _remove_stale(b: _Build) -> None:
    """Pages of runs no longer in the warehouse (deleted runs) go: the site mirrors it."""
    for stale in set(b.old.get("runs", {})) - set(b.runs):
        (b.root / run_page(stale)).unlink(missing_ok=True)
    for stale in set(b.old.get("recipes", {})) - set(b.recipes):
        (b.root / recipe_page(stale or None)).unlink(missing_ok=True)
    for folder in ("models", "compare"):  # views of configurations no longer there
        for path in (b.root / folder).glob("*.html") if (b.root / folder).is_dir() else ():
            if f"{folder}/{path.name}" not in b.view_pages:
                path.unlink(missing_ok=True)
