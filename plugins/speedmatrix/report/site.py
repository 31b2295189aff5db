"""A static site over the warehouse: where users look for "did the last commit make it slower?".

One job, hence its length: building the site (what to rewrite, the pages, the manifest that
makes a refresh incremental); the run pages themselves are report.page's.

``build_site(warehouse, out)`` writes, under ``out``:

- ``index.html``: every recipe x host with its latest run, that run's status and verdict
  (regressions / improvements beyond noise against its baseline), then the latest runs;
- ``recipes/<recipe>.html``: per recipe (a section per host) every cell's trend across engine
  commits: its figure per run, the noise band (how far a point may move from the one before
  and still be noise: the larger of the recipe's threshold and the between-run noise, the rule
  ``analysis.trend`` judges with), regressions and improvements marked, each point a link to
  its run; then the recipe's runs;
- ``runs/<run>.html``: every run's page, rendered by ``report.page.render_page`` (the run
  page of the pipeline, not a copy of it), with the verdicts the `regressions` task landed,
  plus a line of navigation back to the site;
- ``site.css`` and ``_site.json`` (what was rendered from what: the incremental build's memory).

Why static files: the site must open from ``file://`` as well as any static host, so every link
is relative, nothing is fetched from elsewhere (no script, no CDN; charts are inline SVG), and
a refresh after each run is a plain rewrite of files.

Why incremental: a three-year warehouse holds tens of thousands of runs; after one run only
that run's page, its recipe's page and the index change. A page is rewritten when what it was
made from changed: for a run page the run's landing time, its verdicts and the renderer's own
code; for a recipe page the same of every run of the recipe. ``_site.json`` keeps those
fingerprints; a page whose file is missing is rendered again whatever it says.
"""

from __future__ import annotations

import fcntl
import hashlib
import html
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from speedmatrix.commits import commit_label
from speedmatrix.records import COMPARABILITY_FIELDS
from speedmatrix.report.slugs import slug
from speedmatrix.settings import settings

log = logging.getLogger("speedmatrix.site")

MANIFEST = "_site.json"
LOCK = ".site.lock"
MARKER = ".speedmatrix-site"
"""Says a folder is a site of ours: the build writes only into one that holds it (or
`MANIFEST`, which sites built before the marker hold) or is new or empty: a user's own files are never overwritten."""
SITE_FORMAT = 1  # bump when the site's own pages change shape: everything is rendered again
MAX_POINTS = 120  # points per trend chart: the most recent runs (the run table has them all)
LATEST_RUNS = 25  # runs listed on the index

RUN_COLUMNS = (
    "run_id",
    "recipe_id",
    "host",
    "trigger",
    "status",
    "started_at",
    "engine_commit",
    "engine_version",
    "engine_ref",
    "hardware_gpu",
    "hardware_gpu_count",
    "served_model",
    "model",
    "landed_at",
    "sim_profile",
)
CELL_COLUMNS = (
    "run_id",
    "phase",
    "context_tokens",
    "context_label",
    "concurrency",
    "status",
    "total_tok_s",
    *COMPARABILITY_FIELDS,  # the trends apply the verdicts' rule of what may be compared
)
COMPARISON_COLUMNS = (
    "run_id",
    "baseline_run_id",
    "phase",
    "context_tokens",
    "context_label",
    "concurrency",
    "metric",
    "change_pct",
    "verdict",
    "compared_at",
)


def run_page(run_id: str) -> str:
    """The run page's path relative to the site root (what links and the DAG's link use)."""
    return f"runs/{slug(run_id)}.html"


def recipe_page(recipe_id: str | None) -> str:
    return f"recipes/{slug(recipe_id or 'no-recipe')}.html"


def default_site_dir(warehouse_root: str) -> str:
    """``$SPEEDMATRIX_SITE_DIR``, else ``site/`` beside the warehouse directory (not inside
    it: the warehouse holds data, and its readers glob its directories)."""
    env = settings().site_dir
    if env:
        return env
    root = warehouse_root.rstrip("/")
    if "://" in root:
        raise ValueError(
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
            f"site {self.out}: {self.runs} runs, {self.recipes} recipes; run pages "
            f"{self.run_pages_written} written, {self.run_pages_kept} unchanged; recipe pages "
            f"{self.recipe_pages_written} written, {self.recipe_pages_kept} unchanged"
            + (f", {self.run_pages_deferred} left for later" if self.run_pages_deferred else "")
            + (f"; {len(self.failed)} failed" if self.failed else "")
            + f" ({self.seconds:.1f} s)"
        )


# ---------------------------------------------------------------------------------------------
# reading the warehouse


def _query(wh: Any, table: str, columns: Sequence[str]) -> pd.DataFrame:
    cols = ", ".join(columns)
    return wh.query(f"SELECT {cols} FROM {table}")


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


def _clean(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if value is pd.NaT:
        return None
    return value


def _text(value: Any) -> str:
    value = _clean(value)
    return "" if value is None else str(value)


def _when(value: Any) -> str:
    value = _clean(value)
    if value is None:
        return "—"
    try:
        return pd.Timestamp(value).strftime("%Y-%m-%d %H:%M")
    except (ValueError, TypeError):
        return str(value)


def _engine(run: Mapping[str, Any]) -> str:
    commit = _text(run.get("engine_commit"))
    version = _text(run.get("engine_version"))
    if commit:
        return commit_label(run) + (f" ({version})" if version else "")
    return version or _text(run.get("engine_ref")) or "—"


@dataclass
class Verdict:
    """A run's verdict, as the index and the run tables show it."""

    word: str  # regressed / improved / mixed / clean / no baseline / failed / partial
    text: str
    baseline: str | None = None

    @property
    def css(self) -> str:
        return self.word.replace(" ", "-")


def run_verdict(
    run: Mapping[str, Any],
    rows: pd.DataFrame | None,
    *,
    compared: bool | None = None,
    baseline: str | None = None,
) -> Verdict:
    """From the run's landed comparisons (all metrics): regressions and improvements beyond
    noise, else clean; a run that failed says so first (its figures are not a verdict).

    ``rows`` is every comparison row of the run, or (the site's aggregate read, ``compared``
    given) only its rows with a regression or an improvement, ``compared`` saying whether
    the run has any comparison row at all and ``baseline`` against which run."""
    status = _text(run.get("status"))
    reg: list[str] = []
    imp: list[str] = []
    if rows is not None and not rows.empty:
        reg, imp = _cells_with(rows, "regression"), _cells_with(rows, "improvement")
        if compared is None:
            base = rows["baseline_run_id"].dropna()
            baseline = str(base.iloc[0]) if not base.empty else None
    if compared is None:
        compared = rows is not None and not rows.empty
    if status == "failed":
        return Verdict("failed", "run failed", baseline)
    if not compared:
        return Verdict("no baseline", "not compared (no baseline)", None)
    parts = []
    if reg:
        parts.append(f"{len(reg)} cell{'s' if len(reg) != 1 else ''} regressed ({_few(reg)})")
    if imp:
        parts.append(f"{len(imp)} cell{'s' if len(imp) != 1 else ''} improved ({_few(imp)})")
    word = "mixed" if reg and imp else "regressed" if reg else "improved" if imp else "clean"
    text = ", ".join(parts) if parts else "no change beyond noise"
    if status == "partial":
        text += " (partial run)"
    return Verdict(word, text, baseline)


def _cells_with(rows: pd.DataFrame, verdict: str) -> list[str]:
    """The cells (not metric rows: one slower cell moves tok/s and time between tokens
    together) with `verdict` on any metric, in page order."""
    from speedmatrix.records import cell_name

    hit = rows[rows["verdict"] == verdict]
    keys = {
        (
            0 if p == "run" else 1 if p == "prefill" else 2,
            int(_clean(t) or 0),
            int(_clean(c) or 0),
            p,
            lbl,
        )
        for p, lbl, t, c in zip(
            hit["phase"],
            hit["context_label"],
            hit.get("context_tokens", hit["concurrency"] * 0),
            hit["concurrency"],
            strict=True,
        )
    }
    return [cell_name(p, lbl if lbl is not None else t, c) for _o, t, c, p, lbl in sorted(keys)]


def _few(names: Sequence[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


# ---------------------------------------------------------------------------------------------
# the trend chart: inline SVG, small, every point a link

_W, _H, _L, _R, _T, _B = 360, 150, 46, 8, 10, 22
_REG, _IMP, _LINE, _BAND = "#d55e00", "#0072b2", "#444444", "#c6dbef"  # Okabe-Ito + blue band


def _fmt_value(v: float) -> str:
    if abs(v) >= 10_000:
        return f"{v / 1000:,.1f}K"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:,.1f}"


def trend_svg(
    points: pd.DataFrame, band: float, *, title: str, link: Mapping[str, str], total: int
) -> str:
    """One cell's trend: a line through the valid points in run order, the noise band (each
    point's predecessor x (1 ± band)), regressions (▼, vermillion) and improvements (▲, blue)
    marked by shape and colour (colour-blind safe), failed points as × on the axis. Every
    point links to its run page (`link`: run_id -> relative href)."""
    pts = points.reset_index(drop=True)
    n = len(pts)
    values = [_clean(v) for v in pts["value"]]
    good = [v for v in values if v is not None]
    esc = html.escape
    head = (
        f'<svg class="trend" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
        f'role="img" aria-label="{esc(title)}"><title>{esc(title)}</title>'
    )
    if not good:
        return (
            head
            + f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle">no valid point</text></svg>'
        )
    lo = min(good) * (1 - band)
    hi = max(good) * (1 + band)
    if hi <= lo:
        lo, hi = lo * 0.95, hi * 1.05 + 1e-9
    pw, ph = _W - _L - _R, _H - _T - _B

    def x(i: int) -> float:
        return _L + (pw * (i + 0.5) / n)

    def y(v: float) -> float:
        return _T + ph * (1 - (v - lo) / (hi - lo))

    out = [head]
    # axis: min / max labels and a baseline
    out.append(
        f'<line x1="{_L}" y1="{_T + ph}" x2="{_W - _R}" y2="{_T + ph}" class="axis"/>'
        f'<text x="{_L - 4}" y="{_T + 8}" class="tick" text-anchor="end">{_fmt_value(hi)}</text>'
        f'<text x="{_L - 4}" y="{_T + ph}" class="tick" text-anchor="end">{_fmt_value(lo)}</text>'
    )
    # noise band: around each point's predecessor
    upper, lower, prev = [], [], None
    for i, v in enumerate(values):
        if prev is not None:
            upper.append((x(i), y(prev * (1 + band))))
            lower.append((x(i), y(prev * (1 - band))))
        if v is not None:
            prev = v
    if len(upper) >= 1 and band > 0:
        poly = upper + lower[::-1]
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in poly)
        out.append(f'<polygon points="{coords}" class="band"/>')
    line = [(x(i), y(v)) for i, v in enumerate(values) if v is not None]
    if len(line) > 1:
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in line)
        out.append(f'<polyline points="{coords}" class="line"/>')
    for i, row in enumerate(pts.to_dict("records")):
        v, verdict = values[i], _text(row.get("verdict"))
        href = link.get(str(row["run_id"]))
        change = _clean(row.get("change_pct"))
        tip = (
            f"{row['run_id']} · {_engine(row)} · "
            + (_fmt_value(v) + " tok/s" if v is not None else _text(row.get("status")))
            + (f" · {change:+.1f}%" if change is not None else "")
            + (f" · {verdict}" if verdict else "")
        )
        if v is None:
            cx, cy = x(i), _T + ph
            mark = (
                f'<path d="M{cx - 3:.1f},{cy - 3:.1f}l6,6m0,-6l-6,6" class="failed"/>'
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" class="hit"/>'
            )
        elif verdict == "regression":
            cx, cy = x(i), y(v)
            mark = f'<path d="M{cx - 6:.1f},{cy - 5:.1f}h12l-6,10z" class="reg"/>'
        elif verdict == "improvement":
            cx, cy = x(i), y(v)
            mark = f'<path d="M{cx - 6:.1f},{cy + 5:.1f}h12l-6,-10z" class="imp"/>'
        else:
            cx, cy = x(i), y(v)
            mark = (
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" class="pt"/>'
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" class="hit"/>'
            )
        body = f"<title>{esc(tip)}</title>{mark}"
        out.append(f'<a href="{esc(href)}">{body}</a>' if href else f"<g>{body}</g>")
    first, last = pts.iloc[0], pts.iloc[-1]
    out.append(
        f'<text x="{_L}" y="{_H - 6}" class="tick">{esc(commit_label(first))}</text>'
        f'<text x="{_W - _R}" y="{_H - 6}" class="tick" text-anchor="end">'
        f"{esc(commit_label(last))}</text>"
    )
    if total > n:
        out.append(
            f'<text x="{_L + pw / 2}" y="{_H - 6}" class="tick" text-anchor="middle">'
            f"last {n} of {total} runs</text>"
        )
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# building


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


def _nav(links: Iterable[tuple[str, str]]) -> str:
    items = " · ".join(f'<a href="{html.escape(h)}">{html.escape(t)}</a>' for h, t in links)
    return (
        '<nav class="site-nav" style="font-size:.9rem;margin:0 0 1rem 0;padding:.4rem .6rem;'
        f'background:#f5f5f7;border-radius:4px">{items}</nav>'
    )


_BODY = re.compile(r"<body[^>]*>", re.I)


def with_nav(page: str, nav: str) -> str:
    """The run page as render_html made it, with the site's navigation right after <body>
    (the page itself stays the renderer's: nothing else of it is touched)."""
    m = _BODY.search(page)
    if m is None:
        return nav + page
    return page[: m.end()] + "\n" + nav + page[m.end() :]


def render_run_page(wh: Any, run_id: str, recipe_id: str | None, rows: pd.DataFrame) -> str:
    """The run's page, the pipeline's own (report.page.render_page: verdict summary first),
    from the baseline and the verdicts the `regressions` task landed (read, not recomputed: a
    site build must stay cheap) and the diff heat map when the task drew one."""
    from speedmatrix.analysis.display import display_rows, notable
    from speedmatrix.report.charts import inline
    from speedmatrix.report.page import RunPage, deployment_prices, kept_charts, render_page

    run, cells, _ = wh.read_run(run_id, recipe_id)
    page = RunPage(run=run, cells=cells, prices=deployment_prices())
    if rows is not None and not rows.empty:
        base_ids = rows["baseline_run_id"].dropna()
        if not base_ids.empty:
            try:
                b_run, b_cells, _ = wh.read_run(str(base_ids.iloc[0]), recipe_id)
                page.baseline = (b_run, b_cells)
            except KeyError:  # the baseline was deleted since: the verdicts still stand
                page.baseline = None
        records = [{k: _clean(v) for k, v in r.items()} for r in rows.to_dict("records")]
        page.rows = records
        page.verdicts = display_rows(notable(records))
        try:
            svg = wh.read_artifact(run_id, "comparison.svg").decode("utf-8")
            page.figures = [
                {
                    "id": "diff-heatmap",
                    "title": "Total tok/s against the baseline",
                    "svg": inline(svg),
                }
            ]
        except (FileNotFoundError, OSError):
            page.figures = []
    page.charts = kept_charts(wh, page)  # the `report` task's, when drawn from these cells
    return render_page(page)


def _load(wh: Any) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """What every build needs, from aggregate queries rather than every comparison row of the
    fleet (the site refreshes after every run of a fleet): the runs (the index and the pages' list), per run the count, the newest
    time and the baseline of its comparison rows, and only the comparison rows with a
    regression or an improvement (the verdicts). A run's own rows and a recipe's are read
    when its page is written (:func:`_run_comparisons`, :func:`_recipe_rows`)."""
    runs = _query(wh, "runs", RUN_COLUMNS)
    summary = wh.query(
        "SELECT run_id, count(*) AS n, max(compared_at) AS compared_at, "
        "min(baseline_run_id) AS baseline_run_id FROM comparisons GROUP BY run_id"
    )
    cols = ", ".join(COMPARISON_COLUMNS)
    hits = wh.query(
        f"SELECT {cols} FROM comparisons WHERE verdict IN ('regression', 'improvement')"
    )
    runs = runs.sort_values("started_at", kind="stable").reset_index(drop=True)
    return runs, summary, hits


def _run_comparisons(wh: Any, run_id: str) -> pd.DataFrame | None:
    """One run's comparison rows (None when it has none), for its page."""
    cols = ", ".join(COMPARISON_COLUMNS)
    rows = wh.query(f"SELECT {cols} FROM comparisons WHERE run_id = ?", [run_id])
    return rows if len(rows) else None


def _recipe_comparisons(wh: Any, recipe: str | None) -> pd.DataFrame:
    """One recipe's comparison rows (its partition), for its page's trends."""
    cols = ", ".join(COMPARISON_COLUMNS)
    return wh.query(
        f"SELECT {cols} FROM comparisons WHERE recipe_id IS NOT DISTINCT FROM ?", [recipe]
    )


def _recipe_rows(wh: Any, table: str, recipe: str | None) -> pd.DataFrame:
    """One recipe's rows of `table` (the recipe_id partition: DuckDB reads only its files)."""
    cols = ", ".join(CELL_COLUMNS)
    return wh.query(f"SELECT {cols} FROM {table} WHERE recipe_id IS NOT DISTINCT FROM ?", [recipe])


def claim_site_dir(root: Path) -> None:
    """Make `root` ours, or refuse: a site rewrites `index.html`, `site.css`, `runs/`… and must
    never overwrite a user's files of those names (`--out` pointed at the wrong folder). A new
    or empty folder gets the marker; one that holds it (or a manifest) is ours; anything else
    is a ValueError naming the path, and nothing in it is touched."""
    root.mkdir(parents=True, exist_ok=True)
    if (root / MARKER).exists() or (root / MANIFEST).exists():
        return
    if any(root.iterdir()):
        raise ValueError(
            f"{root} is not a speedmatrix site (no {MARKER} in it) and is not empty: "
            "the site is written only into an empty folder or its own"
        )
    (root / MARKER).write_text("speedmatrix site: the site command writes here\n")


def build_site(
    warehouse: Any,
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
    warehouse: Any, root: Path, *, force: bool, max_run_pages: int | None, t0: float
) -> SiteResult:
    from speedmatrix.analysis.baseline import recipe_threshold
    from speedmatrix.analysis.noise import Z_95, NoiseModel, between_run_noise
    from speedmatrix.analysis.trend import trends
    from speedmatrix.records import cell_name

    result = SiteResult(out=str(root))
    manifest_path = root / MANIFEST
    try:
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        old = {}
    from speedmatrix.report.page import deployment_prices

    prices = deployment_prices()
    # the deployment's prices are part of what every page is made from (their cost column)
    code = _code_fingerprint() + (prices.digest() if prices is not None else "")
    if force or old.get("code") != code:
        old = {}
    old_runs: dict[str, str] = old.get("runs", {})
    old_recipes: dict[str, str] = old.get("recipes", {})
    env = _env()

    runs, summary, hits = _load(wh := warehouse)
    result.runs = len(runs)
    hits_of = {k: g for k, g in hits.groupby("run_id", sort=False)}
    summary_of = {str(r["run_id"]): r for r in summary.to_dict("records")}
    run_fp: dict[str, str] = {}
    verdicts: dict[str, Verdict] = {}
    records = runs.to_dict("records")  # once: every pass below walks all the fleet's runs
    for r in records:
        rid = str(r["run_id"])
        agg = summary_of.get(rid)
        verdicts[rid] = run_verdict(
            r,
            hits_of.get(rid),
            compared=agg is not None,
            baseline=_clean(agg["baseline_run_id"]) if agg is not None else None,
        )
        cmp_fp = (
            None if agg is None else (int(agg["n"]), _text(agg["compared_at"]), verdicts[rid].text)
        )
        run_fp[rid] = _fingerprint(_text(r.get("landed_at")), cmp_fp)

    # run pages
    new_runs: dict[str, str] = {}
    budget = math.inf if max_run_pages is None else max_run_pages
    for r in reversed(records):  # newest first: they matter most
        rid, recipe = str(r["run_id"]), _clean(r.get("recipe_id"))
        path = root / run_page(rid)
        if old_runs.get(rid) == run_fp[rid] and path.exists():
            new_runs[rid] = run_fp[rid]
            result.run_pages_kept += 1
            continue
        if result.run_pages_written >= budget:
            # left for a later build; an older page of the run stays (and is linked) meanwhile
            result.run_pages_deferred += 1
            if path.exists() and rid in old_runs:
                new_runs[rid] = old_runs[rid]
            continue
        started = time.monotonic()
        try:
            page = render_run_page(wh, rid, recipe, _run_comparisons(wh, rid))
        except Exception as exc:  # one run's page must not cost the site
            log.warning("site: no page for run %s: %s", rid, exc)
            result.failed.append(f"{rid}: {exc}")
            continue
        nav = _nav(
            [
                ("../index.html", "All recipes"),
                ("../" + recipe_page(recipe), f"Trends of {recipe or 'no recipe'}"),
            ]
        )
        _write(path, with_nav(page, nav))
        new_runs[rid] = run_fp[rid]
        result.run_pages_written += 1
        result.run_pages_seconds += time.monotonic() - started
    link_from_recipe = {rid: "../" + run_page(rid) for rid in new_runs}

    # recipe pages (one section per host)
    new_recipes: dict[str, str] = {}
    groups = runs.groupby(runs["recipe_id"].fillna(""), sort=True)
    result.recipes = groups.ngroups
    index_rows: list[dict[str, Any]] = []
    template = env.get_template("site_recipe.html.j2")
    for recipe_key, rruns in groups:
        recipe = recipe_key or None
        page = recipe_page(recipe)
        for host_key, hruns in rruns.groupby(rruns["host"].fillna(""), sort=True):
            latest = hruns.iloc[-1].to_dict()
            index_rows.append(
                {
                    "recipe": recipe or "(none)",
                    "recipe_href": page,
                    "host": host_key or "—",
                    "gpu": _gpu(latest),
                    "runs": len(hruns),
                    "latest": latest,
                    "latest_href": run_page(str(latest["run_id"])),
                    "when": _when(latest.get("started_at")),
                    "engine": _engine(latest),
                    "verdict": verdicts[str(latest["run_id"])],
                }
            )
        fp = _fingerprint(code, sorted(new_runs.get(str(i), "-") + str(i) for i in rruns["run_id"]))
        if old_recipes.get(recipe_key) == fp and (root / page).exists():
            new_recipes[recipe_key] = fp
            result.recipe_pages_kept += 1
            continue
        ids = set(rruns["run_id"])
        rcells = _recipe_rows(wh, "cells", recipe)
        rcells = rcells[rcells["run_id"].isin(ids)]
        rcmp = _recipe_comparisons(wh, recipe)
        rcmp = rcmp[rcmp["run_id"].isin(ids)]
        rrep = _recipe_rows(wh, "cell_repeats", recipe)
        noise = NoiseModel(between_run_noise(rruns, rcells, rrep, columns=("total_tok_s",)))
        threshold = recipe_threshold(recipe)
        sections = []
        for host_key, hruns in rruns.groupby(rruns["host"].fillna(""), sort=True):
            host = host_key or None
            # The charts show the last MAX_POINTS successful runs: their trend is computed
            # over those and the one before (which judges the first shown point), not over
            # years of history (the cost of a recipe page stays flat as history grows).
            ok = hruns[hruns["status"] == "success"]
            window = ok.tail(MAX_POINTS + 1)
            hcells = rcells[rcells["run_id"].isin(set(hruns["run_id"]))]
            wcells = hcells[hcells["run_id"].isin(set(window["run_id"]))]
            charts = []
            keys = (
                hcells[["phase", "context_tokens", "context_label", "concurrency"]]
                .drop_duplicates()
                .to_dict("records")
            )
            keys.sort(
                key=lambda k: (
                    0 if k["phase"] == "prefill" else 1,
                    int(k["context_tokens"]),
                    int(k["concurrency"]),
                )
            )
            named: dict[str, dict[str, Any]] = {}
            for k in keys:
                name = cell_name(k["phase"], k["context_label"], k["concurrency"])
                if k["phase"] in ("prefill", "decode"):
                    named.setdefault(name, k)
            by_cell = trends(
                window,
                wcells,
                recipe=recipe,
                names=list(named),
                host=host,
                comparisons=rcmp,
                threshold=threshold,
                noise=noise,
            )
            for name, k in named.items():
                pts = by_cell[name]
                if pts.empty or pts["value"].notna().sum() == 0:
                    continue  # never valid (e.g. always over capacity): no trend to draw
                metric = "total_tok_s"
                rel_sd, source = noise.lookup(
                    recipe,
                    host,
                    k["phase"],
                    int(k["context_tokens"]),
                    int(k["concurrency"]),
                    metric,
                )
                noise_half = math.sqrt(2) * Z_95 * rel_sd if rel_sd is not None else 0.0
                band = max(threshold, noise_half)
                total = len(ok)
                shown = pts.tail(MAX_POINTS)
                last = shown.iloc[-1].to_dict()
                charts.append(
                    {
                        "name": name,
                        "id": "cell-" + slug(name.replace(" ", "-")),
                        "svg": trend_svg(
                            shown,
                            band,
                            title=f"{name}: {'prompt' if k['phase'] == 'prefill' else 'total'} tok/s",
                            link=link_from_recipe,
                            total=total,
                        ),
                        "band": f"±{band * 100:.1f}%",
                        "band_source": (
                            "threshold" if band == threshold else f"between-run noise ({source})"
                        ),
                        "last": _fmt_value(last["value"]) if _clean(last["value"]) else "—",
                        "last_verdict": _text(last.get("verdict")),
                        "regressions": int((pts["verdict"] == "regression").sum()),
                        "improvements": int((pts["verdict"] == "improvement").sum()),
                    }
                )
            table = [
                {
                    "run_id": str(r["run_id"]),
                    "href": "../" + run_page(str(r["run_id"])),
                    "when": _when(r.get("started_at")),
                    "trigger": _text(r.get("trigger")),
                    "engine": _engine(r),
                    "status": _text(r.get("status")),
                    "verdict": verdicts[str(r["run_id"])],
                }
                for r in hruns.iloc[::-1].to_dict("records")
                if str(r["run_id"]) in new_runs
            ]
            sections.append(
                {
                    "host": host_key or "—",
                    "gpu": _gpu(hruns.iloc[-1].to_dict()),
                    "charts": charts,
                    "runs": table,
                }
            )
        html_text = template.render(
            recipe=recipe or "(no recipe)",
            sections=sections,
            threshold=f"{threshold * 100:.1f}%",
            max_points=MAX_POINTS,
        )
        _write(root / page, html_text)
        new_recipes[recipe_key] = fp
        result.recipe_pages_written += 1

    # per model: the Pareto view and the comparison pages of its configurations
    from speedmatrix.report.site_views import write_views

    run_rows = [{k: _clean(v) for k, v in r.items()} for r in records]
    views = write_views(
        wh,
        root,
        run_rows,
        prices=prices,
        fingerprint=lambda *parts: _fingerprint(code, *parts),  # page -> what it is made from
        run_fp=new_runs,
        old=old.get("models", {}),
        write=_write,
        run_pages={rid: run_page(rid) for rid in new_runs},
    )
    result.model_pages_written, result.model_pages_kept = views.written, views.kept

    latest_runs = [
        {
            "run_id": str(r["run_id"]),
            "href": run_page(str(r["run_id"])),
            "recipe": _text(r.get("recipe_id")) or "(none)",
            "recipe_href": recipe_page(_clean(r.get("recipe_id"))),
            "host": _text(r.get("host")) or "—",
            "when": _when(r.get("started_at")),
            "engine": _engine(r),
            "status": _text(r.get("status")),
            "verdict": verdicts[str(r["run_id"])],
        }
        for r in records[::-1][:LATEST_RUNS]
        if str(r["run_id"]) in new_runs
    ]
    for row in index_rows:
        if str(row["latest"]["run_id"]) not in new_runs:
            row["latest_href"] = None
    _write(
        root / "index.html",
        env.get_template("site_index.html.j2").render(
            rows=index_rows,
            latest=latest_runs,
            models=views.entries,
            runs=len(runs),
            built=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        ),
    )
    _write(root / "site.css", env.get_template("site.css").render())
    # pages of runs no longer in the warehouse (deleted runs) go: the site mirrors it
    for stale in set(old_runs) - set(new_runs):
        (root / run_page(stale)).unlink(missing_ok=True)
    for stale in set(old_recipes) - set(new_recipes):
        (root / recipe_page(stale or None)).unlink(missing_ok=True)
    for folder in ("models", "compare"):  # views of configurations no longer there
        for path in (root / folder).glob("*.html") if (root / folder).is_dir() else ():
            if f"{folder}/{path.name}" not in views.pages:
                path.unlink(missing_ok=True)
    _write(
        manifest_path,
        json.dumps(
            {"code": code, "runs": new_runs, "recipes": new_recipes, "models": views.fingerprints},
            indent=0,
        ),
    )
    result.seconds = time.monotonic() - t0
    log.info("%s", result.summary())
    return result


def _gpu(run: Mapping[str, Any]) -> str:
    """The hardware column: what the run ran on, `simulated engine (profile …)` for a
    simulated run, `hardware not known` for a server whose hardware was not read."""
    from speedmatrix.report.render import measured_on

    said = measured_on({k: _clean(v) for k, v in run.items()})
    gpu = _text(run.get("hardware_gpu"))
    count = _clean(run.get("hardware_gpu_count"))
    if said and _clean(run.get("sim_profile")) is None:
        return said
    if not gpu:
        return "—"
    shown = f"{gpu} ×{int(count)}" if count else gpu
    return f"{said}: {shown}" if said else shown
