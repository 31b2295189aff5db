"""The speed_matrix DAG's `site` task: refresh the static site after the run, and link to it.

Deployment settings (environment of the workers; never a run's conf, which anyone who may
trigger a run writes):

- ``SPEEDMATRIX_SITE_DIR``: where the site is written (a local path every worker mounts);
  default ``site/`` beside the warehouse directory (speedmatrix.report.site.default_site_dir).
  A warehouse on ``s3://`` needs it set.
- ``SPEEDMATRIX_SITE_URL``: where that directory is published (any static web server, e.g.
  ``https://perf.example.com/speedmatrix``); the run's link is ``<url>/runs/<run>.html``.
  Without it the link is the page's ``file://`` URL (right for a browser on a machine that
  mounts the directory).
- ``SPEEDMATRIX_SITE_MAX_RUN_PAGES`` (default 200): run pages one task renders at most, newest
  first; the first refresh over a long history fills the rest in over the next runs instead of
  holding a worker for hours. This run's page is always among them (it is the newest).

The link: the task carries an operator extra link, "Speed matrix site", which Airflow 3 shows
as a button on the task's page of the run. The worker computes it when the task ends and keeps
it in the task's XCom (``_link_SiteLink``), where the API server reads it: no plugin is needed
on the API server, and the link is there even when the build failed (it names where the page
will be once a later run's build succeeds).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator, BaseOperatorLink

from speedmatrix.flows.fresh_stack import on_fresh_stack
from speedmatrix.settings import settings

log = logging.getLogger("speedmatrix.site")

LINK_NAME = "Speed matrix site"


def site_dir(resolved: Mapping[str, Any]) -> str:
    from speedmatrix.flows.matrix import warehouse_of
    from speedmatrix.report.site import default_site_dir

    return default_site_dir(warehouse_of(resolved).root)


def site_url(resolved: Mapping[str, Any], out: str | None = None) -> str:
    """The run's page on the site: under SPEEDMATRIX_SITE_URL, else its file:// URL."""
    from speedmatrix.report.site import run_page

    page = run_page(resolved["run_id"])
    base = settings().site_url
    if base:
        return f"{base.rstrip('/')}/{page}"
    return (Path(out or site_dir(resolved)).resolve() / page).as_uri()


@on_fresh_stack  # the work after the host's stop, whatever executor runs it
def refresh(resolved: Mapping[str, Any], out: str | None = None) -> dict[str, Any]:
    """Build (incrementally) the site of the run's warehouse; a run page that could not be
    rendered fails the task (after everything else was written)."""
    from speedmatrix.flows.matrix import warehouse_of
    from speedmatrix.report.site import build_site

    out = out or site_dir(resolved)
    wh = warehouse_of(resolved)
    try:
        limit = settings().site_max_run_pages
        result = build_site(wh, out, max_run_pages=limit)
    finally:
        wh.close()
    log.info("%s", result.summary())
    if result.failed:
        raise RuntimeError("site: pages not rendered: " + "; ".join(result.failed))
    return {
        "site": result.out,
        "index": str(Path(result.out) / "index.html"),
        "url": site_url(resolved, out),
        "run_pages_written": result.run_pages_written,
        "run_pages_kept": result.run_pages_kept,
        "seconds": round(result.seconds, 2),
    }


class SiteLink(BaseOperatorLink):
    """The run's page on the site, from the task's page in the Airflow UI."""

    name = LINK_NAME

    def get_link(self, operator: BaseOperator, *, ti_key: Any) -> str:
        # Called on the worker when the task ends (Airflow 3 keeps the result in XCom for the
        # API server); execute() set it before building, so a failed build still links.
        return getattr(operator, "site_url", "") or ""


class SiteOperator(BaseOperator):
    """Refresh the site after a run (see the module docstring); `resolved` is resolve's XCom."""

    template_fields = ("resolved",)
    operator_extra_links = (SiteLink(),)
    ui_color = "#dcebf7"

    def __init__(self, *, resolved: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.resolved = resolved
        self.site_url = ""

    def execute(self, context: Any) -> dict[str, Any]:
        out = site_dir(self.resolved)
        self.site_url = site_url(self.resolved, out)
        return refresh(self.resolved, out)
